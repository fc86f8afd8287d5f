/* shim.bpf.c: the host-side shim: XDP pops the hardware's in-band tag and turns its metadata into a mark value
 * carried in XDP metadata; TC ingress copies that value into skb->mark under the configured mask.
 *
 * Why two programs (ARCHITECTURE §4, "known trap"): a TC program cannot remove the tag (bpf_skb_adjust_room
 * refuses while skb->protocol is 0x88B5, and skb->protocol would stay wrong for br_netfilter), and an XDP program
 * cannot write skb->mark. XDP pops and computes; the value rides in the metadata area in front of the frame to
 * TC, which owns the skb.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "hypafilter_shared.h"

_Static_assert((HF_MARK_MIRROR & (HF_ACTION_ACCEPT | HF_ACTION_DROP)) == 0 && HF_MARK_MIRROR < (1 << HF_MARK_K_SHIFT),
	       "the mirror bit sits in the mark's action nibble, apart from the action codes");
_Static_assert(HF_MARK_DECIDED_ACCEPT == ((HF_K_NONE << HF_MARK_K_SHIFT) | HF_ACTION_ACCEPT),
	       "the decided-ACCEPT mark value is k = 0 with action ACCEPT");

/* Layout of hf_config[0]; field order follows HF_CFG_* in the shared header. */
struct hf_config {
	__u32 generation;
	__u32 mark_mask;
	__u32 mark_shift;
	__u32 num_entries; /* valid entries of hf_intervals (n + 1: hardware entries plus the policy entry) */
	__u32 control;	   /* HF_SHIM_CONTROL_* */
};

/* What XDP leaves in front of the frame for TC. The cookie tells our metadata from anybody else's. */
struct hf_xdp_meta {
	__u32 value;
	__u32 cookie;
};
#define HF_META_COOKIE 0x48465348 /* "HFSH" */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, HF_MAX_ENTRIES);
	__type(key, __u32);
	__type(value, __u32);
} hf_intervals SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct hf_config);
} hf_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, HF_STAT_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} hf_stats SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&hf_stats, &which);

	if (c)
		*c += 1;
}

/* Mark value for a tagged frame's metadata, 0 (k = 0) whenever the metadata cannot be trusted. A mirror copy
 * (reason 4) gets (k << HF_MARK_K_SHIFT) | HF_MARK_MIRROR | action; one with untrusted metadata sets *drop: a copy is
 * never handed to netfilter as an ordinary frame (k = 0 would run the whole policy and could forward it). */
static __always_inline __u32 mark_value(__u64 m, int ipv4, int *drop)
{
	__u32 zero = 0, index, k, *kp, action, reason;
	struct hf_config *cfg = bpf_map_lookup_elem(&hf_config, &zero);

	reason = (m >> HF_META_REASON_SHIFT) & HF_META_REASON_MASK;
	action = (m >> HF_META_ACTION_SHIFT) & HF_META_ACTION_MASK;
	*drop = reason == HF_REASON_MIRROR; /* cleared below once the copy's metadata is trusted */
	if (!cfg)
		return 0;
	if (((m >> HF_META_MAGIC_SHIFT) & 0xFFFF) != HF_META_MAGIC) {
		count(HF_STAT_BAD_MAGIC);
		return 0;
	}
	if (((m >> HF_META_GEN_SHIFT) & HF_META_GEN_MASK) != (cfg->generation & HF_META_GEN_MASK)) {
		count(HF_STAT_STALE_GEN);
		return 0;
	}
	if (reason == HF_REASON_UNPARSED) {
		count(HF_STAT_UNPARSED);
		/* The live K0 tree (strategy tree): an IPv4 frame the core judged unparsed while it vouched for its tables
		 * (match_index n); one it did not judge (CONTROL bit 0 clear, its lease expired) has HF_META_NO_INDEX. */
		index = (m >> HF_META_INDEX_SHIFT) & HF_META_INDEX_MASK;
		if (ipv4 && (cfg->control & HF_SHIM_CONTROL_K0_TREE) && index < cfg->num_entries)
			return HF_MARK_K0_TREE;
		return 0;
	}
	/* Host mode: the hardware's ACCEPT is final; only the value itself is needed, no interval. */
	if (reason == HF_REASON_DECIDED)
		return action == HF_ACTION_ACCEPT ? HF_MARK_DECIDED_ACCEPT : 0;
	index = (m >> HF_META_INDEX_SHIFT) & HF_META_INDEX_MASK;
	if (index >= cfg->num_entries)
		return 0;
	kp = bpf_map_lookup_elem(&hf_intervals, &index);
	if (!kp || *kp == HF_K_NONE)
		return 0;
	k = *kp;
	if (reason == HF_REASON_MIRROR) {
		if (action != HF_ACTION_ACCEPT && action != HF_ACTION_DROP)
			return 0; /* *drop stays set */
		*drop = 0;
		return (k << HF_MARK_K_SHIFT) | HF_MARK_MIRROR | action;
	}
	return (k << HF_MARK_K_SHIFT) | action;
}

SEC("xdp")
int hf_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct hf_xdp_meta *meta;
	__u32 value = 0;
	__u8 *p = data;
	int drop = 0;

	if (p + 2 * ETH_ALEN + HF_TAG_LEN + 2 <= (__u8 *)end &&
	    *(__be16 *)(p + 2 * ETH_ALEN) == bpf_htons(HF_TAG_ETHERTYPE)) {
		__u64 m = 0;
		int i, ipv4;

		count(HF_STAT_TAGGED);
#pragma unroll
		for (i = 0; i < 8; i++)
			m = (m << 8) | p[2 * ETH_ALEN + 2 + i];
		/* the frame's own ethertype, after the tag: only iptables' frames (IPv4) may walk the K0 tree */
		ipv4 = p + 2 * ETH_ALEN + HF_TAG_LEN + 2 <= (__u8 *)end &&
		       *(__be16 *)(p + 2 * ETH_ALEN + HF_TAG_LEN) == bpf_htons(ETH_P_IP);
		value = mark_value(m, ipv4, &drop);
		if (drop) {
			count(HF_STAT_MIRROR_DROPPED);
			return XDP_DROP;
		}
		/* Slide the MAC addresses over the tag, then drop the tag's bytes from the front. */
#pragma unroll
		for (i = 2 * ETH_ALEN - 1; i >= 0; i--)
			p[i + HF_TAG_LEN] = p[i];
		if (bpf_xdp_adjust_head(ctx, HF_TAG_LEN))
			return XDP_DROP; /* cannot happen for a frame this long; never pass a half-popped frame */
	} else {
		count(HF_STAT_UNTAGGED);
	}

	if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(*meta)))
		return XDP_PASS; /* no metadata room: TC treats the frame as k = 0, the safe answer */
	meta = (void *)(long)ctx->data_meta;
	if ((void *)(meta + 1) > (void *)(long)ctx->data)
		return XDP_PASS;
	meta->value = value;
	meta->cookie = HF_META_COOKIE;
	return XDP_PASS;
}

/* The mirrored ACCEPT of the XDP fast path in bridge mode (docs/xdp.md "Log mirroring"): XDP cannot clone, so the
 * frame passed with the mirror value (k << 4) | HF_MARK_MIRROR | ACCEPT and the paired port's ifindex after M. The
 * frame itself goes out of that port here, once, before this program writes any mark; what continues into
 * netfilter is the copy, which its chains log and drop. Should the clone fail, the mirror bit is cleared: the frame
 * is then an ordinary shunt of its interval and netfilter forwards it. Without the peer (the NIC's copies, which
 * the shim's XDP program tags; host mode) nothing is cloned. */
static __always_inline __u32 mirror_clone(struct __sk_buff *skb, __u32 value)
{
	__u8 *meta = (void *)(long)skb->data_meta;
	__u32 *peer = (__u32 *)(meta + HF_XDP_META_PEER_OFFSET);

	if ((value & HF_MARK_ACTION_MASK) != (HF_MARK_MIRROR | HF_ACTION_ACCEPT) || !(value >> HF_MARK_K_SHIFT))
		return value;
	if (meta + HF_XDP_META_EXT_LEN > (__u8 *)(long)skb->data || (void *)(peer + 1) > (void *)(long)skb->data ||
	    !*peer)
		return value;
	if (bpf_clone_redirect(skb, *peer, 0))
		return value & ~HF_MARK_MIRROR;
	return value;
}

SEC("tc")
int hf_tc(struct __sk_buff *skb)
{
	struct hf_xdp_meta *meta = (void *)(long)skb->data_meta;
	__u32 zero = 0, value = 0, mask, shift;
	struct hf_config *cfg;

	if ((void *)(meta + 1) <= (void *)(long)skb->data && meta->cookie == HF_META_COOKIE)
		value = meta->value;
	cfg = bpf_map_lookup_elem(&hf_config, &zero);
	if (!cfg)
		return TC_ACT_OK;
	mask = cfg->mark_mask;
	shift = cfg->mark_shift & 31;
	value = mirror_clone(skb, value); /* before the mark: the frame leaves as it came */
	skb->mark = (skb->mark & ~mask) | ((value << shift) & mask);
	if (value >> HF_MARK_K_SHIFT)
		count(HF_STAT_MARKED);
	if ((value >> HF_MARK_K_SHIFT) && (value & HF_MARK_MIRROR))
		count(HF_STAT_MIRROR);
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
