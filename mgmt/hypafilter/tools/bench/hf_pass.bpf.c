/* hf_pass: passes every frame to the stack. `bench rate --sender live` attaches it to the plain path's wire end
 * (the peer of the sender's veth) while it runs: a veth takes frames from its peer's ndo_xdp_xmit only while it has
 * NAPI, i.e. an XDP program (or GRO, which would merge frames); veth then builds the skb around the frame without a
 * copy, and GRO stays off (an XDP program elides it). */
#include <linux/bpf.h>

__attribute__((section("xdp"), used)) int hf_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char _license[] __attribute__((section("license"), used)) = "GPL";
