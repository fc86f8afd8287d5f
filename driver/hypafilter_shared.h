/* hypafilter_shared.h: the one definition of the shunt tag, metadata, mark layout and shim map names,
 * included by the eBPF shim, the C tools and the emulated NIC, and parsed by the Python package
 * (hypafilter.shared). Plain #defines with integer or string literals only, so every consumer can read it.
 * Contract: ../shared/ARCHITECTURE.md sections 4 and 5.
 */
#ifndef HYPAFILTER_SHARED_H
#define HYPAFILTER_SHARED_H

/* In-band tag right after the source MAC: ethertype, then M big-endian (8 bytes), then the original ethertype. */
#define HF_TAG_ETHERTYPE 0x88B5
#define HF_TAG_LEN 10

/* 64-bit shunt metadata M. */
#define HF_META_INDEX_SHIFT 0
#define HF_META_INDEX_MASK 0xFFFFFF
#define HF_META_ACTION_SHIFT 24
#define HF_META_ACTION_MASK 0xF
#define HF_META_REASON_SHIFT 28
#define HF_META_REASON_MASK 0xF
#define HF_META_GEN_SHIFT 32
#define HF_META_GEN_MASK 0xFFFF
#define HF_META_MAGIC_SHIFT 48
#define HF_META_MAGIC 0x4846

/* Shunt reasons (M[31:28]). */
#define HF_REASON_OVERRULE 0
#define HF_REASON_POLICY 1
#define HF_REASON_UNPARSED 2
/* Miss forcing (CONTROL bits 4/5 MISS_SHUNT_ACCEPT/DROP): a frame the flow cache does not know (ct = 0) whose hardware
 * verdict would be ACCEPT (DROP) goes to the host instead; match_index and action as for an overrule. */
#define HF_REASON_STATE 3
/* Log mirroring: a COPY of a frame the fast path decided (M[27:24] = its action, ACCEPT or DROP, without the mirror
 * bit), sent to the host so that netfilter runs the observing rules (LOG, NFLOG, no target) above the entry's
 * interval on it; the shim marks it (k << HF_MARK_K_SHIFT) | HF_MARK_MIRROR | action, and the tool's chains
 * discard it after those rules (in host mode the copy of an ACCEPT is the frame itself and is accepted). A copy
 * whose metadata cannot be trusted (bad magic, stale generation, k = 0) is dropped by the shim. */
#define HF_REASON_MIRROR 4
/* Host mode (CONTROL bit 3 HOST_MODE): the hardware's verdict ACCEPT is final; the frame reaches the host only to
 * be delivered locally (INPUT). The shim gives it the mark value HF_MARK_DECIDED_ACCEPT. */
#define HF_REASON_DECIDED 5

/* Action codes (M[27:24] and the low 4 bits of the mark value). */
#define HF_ACTION_NONE 0
#define HF_ACTION_ACCEPT 1
#define HF_ACTION_DROP 2
/* ACTION table word = action code | HF_ACTION_MIRROR_BIT when the entry's decided frames are mirrored (reason 4). */
#define HF_ACTION_MIRROR_BIT 0x8

/* Mark value = (k << HF_MARK_K_SHIFT) | action; k = 0: no valid hardware metadata (full policy in software).
 * The value is placed into skb->mark under a configurable mask: mark = (mark & ~mask) | ((value << shift) & mask). */
#define HF_MARK_K_SHIFT 4
#define HF_MARK_ACTION_MASK 0xF
#define HF_K_NONE 0
/* "Decided ACCEPT" (host mode, reason 5): (HF_K_NONE << HF_MARK_K_SHIFT) | HF_ACTION_ACCEPT, i.e. k = 0 with
 * action ACCEPT. k = 0 with action 0 keeps meaning "no valid metadata"; in host mode the tool's MAIN chain accepts
 * this value first (giving back the mark bits), before any dispatch. */
#define HF_MARK_DECIDED_ACCEPT 0x1
/* Mirror copies (reason 4): mark value (k << HF_MARK_K_SHIFT) | HF_MARK_MIRROR | action: 0x5 = copy of an ACCEPT,
 * 0x6 = copy of a DROP. A mark whose action nibble has this bit is never forwarded (bridge mode: MAIN drops it). */
#define HF_MARK_MIRROR 0x4
/* "K0 tree" (strategy tree, a live deployment on xdp): k = 0 with action 3, a frame the fast path passes unparsed
 * while it trusts its tables (CONTROL enabled, the policy sync lease held, CONTROL bit HFX_CONTROL_K0_TREE set). The
 * tool's MAIN chain sends this value to the K0 tree of the deployed policy (chain K0T) before the k = 0 test; every
 * other k = 0 frame (no tag, bad magic, stale generation, shunt-everything, an expired lease) keeps action 0 and the
 * live rules. A chain set without K0T reads this value as k = 0 (its k = 0 test compares the k bits only). */
#define HF_MARK_K0_TREE 0x3
/* The NIC's shim writes HF_MARK_K0_TREE for a tagged IPv4 frame the core judged unparsed (reason 2, valid magic and
 * generation, match_index < num_entries) while hf_config.control has HF_SHIM_CONTROL_K0_TREE (deploy: strategy tree,
 * live). A frame the core did not judge (CONTROL bit 0 clear, tables sweeping, its lease expired) carries reason 2 with
 * match_index HF_META_NO_INDEX and keeps value 0: the live rules. */
#define HF_SHIM_CONTROL_K0_TREE 1
#define HF_META_NO_INDEX 0xFFFFFF

/* Shim BPF maps (pinned under HF_PIN_DIR). */
#define HF_PIN_DIR "/sys/fs/bpf/hypafilter"
#define HF_MAP_INTERVALS "hf_intervals"   /* array: match_index -> k (u32) */
#define HF_MAP_CONFIG "hf_config"         /* array[1]: struct hf_config */
#define HF_MAP_STATS "hf_stats"           /* per-cpu array: HF_STAT_* counters (u64) */
#define HF_MAX_ENTRIES 1048576

/* hf_config fields (struct hf_config { u32 generation, mark_mask, mark_shift, num_entries, control; }). */
#define HF_CFG_GENERATION 0
#define HF_CFG_MARK_MASK 1
#define HF_CFG_MARK_SHIFT 2
#define HF_CFG_NUM_ENTRIES 3
#define HF_CFG_CONTROL 4 /* HF_SHIM_CONTROL_* bits; pins from before it (16-byte hf_config) have none */

/* XDP metadata in front of a frame for the shim's TC program: {u32 value, u32 cookie} (struct hf_xdp_meta). The XDP
 * fast path (driver/xdp) leaves more: M (u64) at offset 8 and, at HF_XDP_META_PEER_OFFSET, the ifindex of the port
 * paired with the ingress port when the frame is a mirrored ACCEPT in bridge mode (0 otherwise): TC sends the frame
 * there unchanged (bpf_clone_redirect) before it goes on to netfilter as the copy (docs/xdp.md "Log mirroring"). */
#define HF_XDP_META_PEER_OFFSET 16
#define HF_XDP_META_EXT_LEN 24

/* Shim counters. */
#define HF_STAT_TAGGED 0
#define HF_STAT_UNTAGGED 1
#define HF_STAT_BAD_MAGIC 2
#define HF_STAT_STALE_GEN 3
#define HF_STAT_UNPARSED 4
#define HF_STAT_MARKED 5
#define HF_STAT_MIRROR 6         /* mirror copies (reason 4) marked */
#define HF_STAT_MIRROR_DROPPED 7 /* mirror copies with untrusted metadata, dropped in XDP */
#define HF_STAT_COUNT 8

#endif
