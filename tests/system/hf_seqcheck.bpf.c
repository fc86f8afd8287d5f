/* hf_seqcheck: the receiving end of tests/system/test_bench_senders.py. Every test frame carries its index in the
 * frames file (a big-endian u32 right after the Ethernet header) and has the length the test gave that index
 * (len_of below); the program checks each arriving frame against the one that must follow the previous one in a
 * sender's cyclic order over state[N] frames, counts, and drops it (so it is also the sink: nothing reaches a stack
 * that could fall behind). state: [ARRIVED] frames seen, [NEXT] the index expected next, [BAD_ORDER] frames that were
 * not the expected one, [BAD_LEN] frames whose length is not their index's, [FIRST] the first index seen + 1, [N] the
 * file's frame count (written by the test before sending). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

enum { ARRIVED, NEXT, BAD_ORDER, BAD_LEN, FIRST, N, SLOTS };

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, SLOTS);
	__type(key, __u32);
	__type(value, __u64);
} w7seq_state SEC(".maps");

static __always_inline __u64 *slot(__u32 k)
{
	return bpf_map_lookup_elem(&w7seq_state, &k);
}

/* The length the test gives frame i (tests/system/test_bench_senders.py, frame()). */
static __always_inline __u32 len_of(__u32 i)
{
	return 60 + (i * 37) % 965;
}

SEC("xdp")
int hf_seqcheck(struct xdp_md *ctx)
{
	unsigned char *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
	__u64 *arrived = slot(ARRIVED), *next = slot(NEXT), *bad_order = slot(BAD_ORDER), *bad_len = slot(BAD_LEN);
	__u64 *first = slot(FIRST), *n = slot(N);
	if (!arrived || !next || !bad_order || !bad_len || !first || !n)
		return XDP_ABORTED;
	if (data + 18 > end || data[12] != 0x88 || data[13] != 0xb5)
		return XDP_PASS; /* not a test frame: left to the stack, not counted */
	__u32 i = ((__u32)data[14] << 24) | ((__u32)data[15] << 16) | ((__u32)data[16] << 8) | data[17];
	*arrived += 1;
	if (*first == 0)
		*first = (__u64)i + 1;
	else if (i != *next)
		*bad_order += 1;
	if ((__u64)(end - data) != len_of(i))
		*bad_len += 1;
	*next = *n ? ((__u64)i + 1) % *n : 0;
	return XDP_DROP;
}

char _license[] SEC("license") = "GPL";
