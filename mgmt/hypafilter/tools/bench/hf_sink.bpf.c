/* hf_sink: drops every frame in XDP. `bench rate` attaches it, for its rate pass only, to the receiver's interfaces
 * (so that what the paths deliver costs the receiver the least the veth allows, and the same on every path) and to
 * the far end of its sink pair (the sender's own cost). The veth still counts every frame in its rx counters. */
#include <linux/bpf.h>

__attribute__((section("xdp"), used)) int hf_sink(struct xdp_md *ctx)
{
	return XDP_DROP;
}

char _license[] __attribute__((section("license"), used)) = "GPL";
