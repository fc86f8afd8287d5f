"""The flow sync service: the NIC's flow cache follows the firewall's conntrack (docs/flowsync.md).

A flow goes into the hardware flow cache when conntrack confirms it established (TCP: protoinfo state ESTABLISHED,
confirmed, seen a reply; UDP: confirmed and seen a reply; of an address family the table holds, without NAT,
helper or zone: the NIC's flow cache IPv4, and IPv6 on a dual-stack core, the xdp target's liberal marks IPv4 and
IPv6), and leaves it when conntrack destroys it or it stops being established. Before an insert the conntrack entry is put in TCP
window liberal mode, since conntrack stops seeing the flow's established frames. Every `interval` seconds the
hardware's per-flow hit counters are read: a flow that was hit since the last poll gets its conntrack timeout set
back to the protocol's established timeout (conntrack did not see those frames, so it would let the flow expire),
and a hardware flow conntrack no longer has is evicted. At start the table is reconciled with a full conntrack
dump. Conntrack is read through ctnetlink sockets of the service's own inside the firewall's namespace (events, dump,
get, entry updates); every conntrack message, event or reply, is decoded by `ctnetlink.parse_event`.

One module per part:

- `events`: a conntrack entry as events and dumps carry it (`CtEvent`) and which ones the hardware may decide
  (`offload_reason`);
- `ctnetlink`: conntrack's netlink codec and `Conntrack`, its sockets (on the generic `ops.netlink`);
- `syncer`: `Syncer`, which keeps a table equal to conntrack's offloadable entries (pure: the table and conntrack
  are parameters);
- `marks`: `LiberalMarks`, the table of the xdp target, which has no flow cache but looks frames up in conntrack's
  own table (mode "liberal": the service only sets the TCP entries it would offload liberal, and polls nothing);
- `service`: the service's process: `serve` runs the Syncer against the deployed NIC (NicClient's flow API) and the
  firewall namespace, `SERVICE` is its place in the generic runner (`ops.daemon`: files, start, stop, status,
  supervisor) and says deploy whether it runs for a deployment;
- `policy`: what the deployed policy and the firewall's sysctls say (`decides_established`, `read_timeouts`).
"""
