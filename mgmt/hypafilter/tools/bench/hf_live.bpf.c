/* hf_live: the XDP program of the live-frame sender (hf_live.c). BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES
 * runs it on page-pool frames; it writes the next pre-built frame (map `frames`, cyclic order, state[0] = frames
 * built so far, state[1] = how many there are) into the frame and returns XDP_TX, which the test run turns into a
 * redirect to the device of the context's ingress_ifindex: the sender's veth, whose ndo_xdp_xmit puts the frame as
 * an xdp_frame into its peer's NAPI ring. A frame it cannot build counts in state[2] and is aborted (the sender
 * then fails). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define HF_FRAME_MAX 1024

struct hf_frame {
	__u32 len;
	__u8 data[HF_FRAME_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* set to the number of frames before the load */
	__type(key, __u32);
	__type(value, struct hf_frame);
} frames SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 3);
	__type(key, __u32);
	__type(value, __u64);
} state SEC(".maps");

SEC("xdp")
int hf_live(struct xdp_md *ctx)
{
	__u32 k_next = 0, k_count = 1, k_err = 2;
	__u64 *next = bpf_map_lookup_elem(&state, &k_next);
	__u64 *count = bpf_map_lookup_elem(&state, &k_count);
	__u64 *err = bpf_map_lookup_elem(&state, &k_err);
	if (!next || !count || !err)
		return XDP_ABORTED;
	if (*count == 0)
		goto bad;
	__u32 i = (__u32)(*next % *count);
	struct hf_frame *f = bpf_map_lookup_elem(&frames, &i);
	if (!f)
		goto bad;
	__u32 len = f->len;
	if (len < 14 || len > HF_FRAME_MAX)
		goto bad;
	int have = (int)bpf_xdp_get_buff_len(ctx);
	if (bpf_xdp_adjust_tail(ctx, (int)len - have))
		goto bad;
	if (bpf_xdp_store_bytes(ctx, 0, f->data, len))
		goto bad;
	*next += 1;
	return XDP_TX;
bad:
	*err += 1;
	return XDP_ABORTED;
}

char _license[] SEC("license") = "GPL";
