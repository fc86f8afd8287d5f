/* hf_fastpath.h: layouts shared by the XDP fast path (fastpath.bpf.c.j2, rendered per Plan shape) and its loader
 * (hf_xdp.c). The Python side (hypafilter.targets.xdp) reads the #defines through hypafilter.shared's parser rules:
 * plain #defines with integer literals. Design: docs/xdp.md.
 */
#ifndef HF_FASTPATH_H
#define HF_FASTPATH_H

/* CONTROL bits, the same meanings as the NIC's CONTROL register (hw/regmap.txt). */
#define HFX_CONTROL_ENABLE 1
#define HFX_CONTROL_SHUNT_ALL 2
#define HFX_CONTROL_PASS_UNFILTERABLE 4
#define HFX_CONTROL_HOST_MODE 8
/* Miss forcing (Plan.miss_shunt): a frame with ct 0 (unknown) whose verdict would be ACCEPT (resp. DROP) passes to
 * software with reason 3 ("state unknown") instead, so that conntrack sees every frame it has to. */
#define HFX_CONTROL_MISS_SHUNT_ACCEPT 16
#define HFX_CONTROL_MISS_SHUNT_DROP 32
/* Strategy tree, live (docs/optimize.md "The live K0 tree"): an IPv4 frame passed unparsed while the program is
 * enabled and its lease holds carries the mark value HF_MARK_K0_TREE (the K0 tree) instead of 0 (the live rules). Not
 * a bit of the NIC's register: the emulated NIC leaves K0 on the live rules. */
#define HFX_CONTROL_K0_TREE 64
/* The same for an IPv6 frame the IPv6 program passes unparsed (its fail safe hfx6_hold aside): set only when the
 * deployment's ip6tables holds the tool's chains with an IPv6 K0 tree (HFv6_K0T), which give the mark back. */
#define HFX_CONTROL_K0_TREE6 128

/* hfx_config.ct_flags: conntrack state from the kernel's table (docs/xdp.md "Conntrack state from the kernel"). */
#define HFX_CT_LOOKUP 1	     /* look TCP/UDP frames up in conntrack (bpf_xdp_ct_lookup): ct 1/2 for established ones */
/* A lookup that finds no entry (-ENOENT) gives ct 3: the kernel reads the frame as NEW or INVALID. Set only where
 * nothing can make such a frame RELATED or UNTRACKED (no helper, expectation, notrack or zone: targets/xdp/newflows). */
#define HFX_CT_NONE 2

/* hfx_config.ct_hit[]: a conntrack hit in that direction matches this entry whatever its other fields (the set bit
 * marks the value valid; tables.build_tables). */
#define HFX_CT_HIT_SET 0x80000000u

/* Reason field of M for frames the fast path decided itself (forwarded in bridge mode, dropped): never seen by the
 * TC program (those frames do not reach the host stack); it only tells tests and tools "no shunt reason". */
#define HFX_REASON_FAST 15
/* hfx_box value bit: no address (src, dst) restricts the box (a conntrack hit's shortcut, fastpath.bpf.c.j2). */
#define HFX_BOX_WILD 0x80000000u
/* match_index field of M for frames that were not classified (dropped as unfilterable). */
#define HFX_INDEX_NONE 0xFFFFFF
/* The update buffer's slots (struct hfx_slot) hold one interval per header field, in hypafilter.ir.box FIELDS order:
 * src, dst, proto, sport, dport, icmp_type, icmp_code, iport, ct. */
#define HFX_NFIELDS 9

/* Counters (per-CPU array hfx_cnt), the same meanings as the NIC's registers of the same names. */
#define HFX_CNT_PKTIN 0
#define HFX_CNT_PKTOUT 1
#define HFX_CNT_FORWARDED 2
#define HFX_CNT_DROPPED 3
#define HFX_CNT_SHUNT_OVERRULE 4
#define HFX_CNT_SHUNT_POLICY 5
#define HFX_CNT_SHUNT_UNPARSED 6
#define HFX_CNT_FROM_HOST 7
#define HFX_CNT_SHUNT_FORCED 8
#define HFX_CNT_DROP_UNFILTERABLE 9
#define HFX_CNT_UNKNOWN_PORT 10 /* frames from an interface not in hfx_ports: shunted as unparsed */
#define HFX_CNT_SHUNT_STATE 11	/* shunted by miss forcing (reason 3) */
#define HFX_CNT_MIRROR 12	/* decided here and passed to software as a mirror copy (reason 4) */
#define HFX_CNT_COUNT 14

/* Metadata the program leaves in front of every frame (bpf_xdp_adjust_meta). The first two words are exactly the
 * shim's struct hf_xdp_meta (driver/shim.bpf.c), so the shim's TC program writes the mark from `value` unchanged;
 * M follows for tests and tools, then the paired port's ifindex for a mirrored ACCEPT in bridge mode, which the
 * shim's TC program clones the frame to (HF_XDP_META_PEER_OFFSET, HF_XDP_META_EXT_LEN in hypafilter_shared.h). */
/* Sets in the fast path (docs/sets.md). hfx_setseq (shared with setwatch.bpf.c, pinned once per host): per network
 * namespace (its inode number), the ipset commands that change a set entered and returned; hfx_setsync[]: the
 * STARTED count the set tables were read at, the writer's token, the namespace whose sets they follow. */
#define HFX_SETSEQ_MAX 4096 /* network namespaces the watcher counts for */
#define HFX_SETSYNC_SEQ 0
#define HFX_SETSYNC_TOKEN 1
#define HFX_SETSYNC_NETNS 2
#define HFX_SETSYNC_LEN 3
/* struct hfx_setval.flags */
#define HFX_SETVAL_PRESENT 1
#define HFX_SETVAL_NOMATCH 2
#define HFX_CNT_SETS_UNKNOWN 13 /* shunted (reason 3) because a set table was not known to equal the kernel's */
/* New flows (docs/xdp.md "Following the configuration"): hfx_ctseq (shared with setwatch.bpf.c like hfx_setseq): per
 * network namespace, the changes that can make a conntrack miss RELATED or UNTRACKED (a legacy xtables raw table
 * replaced, an nf_tables batch that adds a rule or an object) entered and returned (struct hfx_setcount);
 * hfx_ctsync[]: the STARTED count HFX_CT_NONE was granted at (the check that allowed it began after it), and the
 * namespace whose changes it follows. A conntrack miss is ct 3 only while the two are equal. */
#define HFX_CTSYNC_SEQ 0
#define HFX_CTSYNC_NETNS 1
#define HFX_CTSYNC_LEN 2

/* IPv6 (docs/ipv6.md "## xdp"): the extension headers the program walks before it calls a chain unparsed (hop-by-hop,
 * routing, destination options, AH), and the hop-by-hop options (TLVs) it checks as br_nf_check_hbh_len does. */
#define HFX6_EXT_MAX 8
#define HFX6_HBH_TLV_MAX 8

#define HFX_META_COOKIE 0x48465348 /* "HFSH", the shim's HF_META_COOKIE */
#define HFX_META_LEN 24

#ifndef HFX_NO_STRUCTS
struct hfx_config {
	__u32 control;	   /* HFX_CONTROL_* */
	__u32 generation;  /* M[47:32] */
	__u32 num_entries; /* n: match_index n is the policy entry */
	__u32 num_words;   /* 64-bit words of the box vectors in use (<= HFX_WORDS of the build) */
	__u32 nb_src;	   /* elementary intervals in hfx_f_src (binary search) */
	__u32 nb_dst;	   /* elementary intervals in hfx_f_dst */
	__u32 armed;	   /* the CONTROL these tables were written with: what ends a shunt-everything (control 0) */
	__u32 ct_tcp_ms;   /* conntrack's TCP ESTABLISHED timeout (the namespace's sysctl at deploy), ms */
	__u32 ct_udp_ms;   /* conntrack's UDP stream (replied) timeout, ms */
	__u32 ct_flags;	   /* HFX_CT_* */
	__u32 ct_udp_unreplied_ms; /* conntrack's UDP timeout before the stream timeout applies, ms */
	/* Per direction (ct 1 original, ct 2 reply): HFX_CT_HIT_SET | entry when the first box a conntrack hit in that
	 * direction can lie in restricts no other field (a conntrack-first policy's ESTABLISHED accept): a hit's answer
	 * without a lookup. 0: classify it. */
	__u32 ct_hit[2];
	__u32 num_boxes; /* boxes in use (hfx_box rows): what hfx_vbox is projected over */
	__u32 buf_depth; /* update-buffer slots of the program (hfx_buf rows; 0: no buffer) */
	__u32 buf_scan;	 /* slots the program reads, 0 .. buf_scan - 1 (every enabled one lies below it) */
	/* conntrack's TCP CLOSE_WAIT timeout, ms: what an ACK sets on an entry in FIN_WAIT or CLOSE_WAIT (both go to
	 * CLOSE_WAIT), the timeout a frame decided on such an entry refreshes it to (0: such entries not decided) */
	__u32 ct_tcp_cw_ms;
};

/* hfx_ports: the ifindex of each port 0..3 (0: no such port), one row written whole by the loader. */
struct hfx_port_table {
	__u32 ifindex[4];
};

/* One elementary interval of a 32-bit field: its first value and the id of its box vector in hfx_vec. */
struct hfx_span {
	__u32 start;
	__u32 vec;
};

/* IPv6's table set (a family-6 plan, docs/ipv6.md "## xdp"): the same scheme over the plan's ranked addresses, the
 * address fields searched over the 128-bit starts of their elementary intervals (most significant word first, each
 * in host order). CONTROL, generation and the conntrack settings are hfx_config's. */
struct hfx6_config {
	__u32 num_entries; /* n6: local match index n6 is the IPv6 policy entry */
	__u32 index_base;  /* M's match_index of local entry 0: after the IPv4 entries, policy entry and buffer slots */
	__u32 num_words;   /* 64-bit words of hfx6_vec in use */
	__u32 nb_src;	   /* rows in hfx6_f_src */
	__u32 nb_dst;	   /* rows in hfx6_f_dst */
	__u32 ct_hit[2];   /* as hfx_config.ct_hit, local entries */
	__u32 num_boxes;
	/* The IPv6 plan's own miss forcing (HFX_CONTROL_MISS_SHUNT_* from its Plan.miss_shunt) and conntrack lookup
	 * (HFX_CT_*, timeouts as hfx_config's): the two families' policies read conntrack independently. The rest of
	 * CONTROL (enable, shunt everything, host mode) is hfx_config's. */
	__u32 miss;
	__u32 ct_flags;
	__u32 ct_tcp_ms;
	__u32 ct_udp_ms;
	__u32 ct_udp_unreplied_ms;
	__u32 soft; /* HFX6_SOFT_*: what software does with the IPv6 frames the program passes */
	__u32 ct_tcp_cw_ms; /* as hfx_config's */
	__u32 buf_scan;	    /* IPv6 update-buffer slots the program reads, 0 .. buf_scan - 1 (hfx6_buf; 0: none) */
};

/* hfx6_config.soft: ip6tables holds the IPv6 policy verbatim (stage 1's deploy), no interval chains and no mark
 * give-back: every IPv6 frame passed to software carries value 0 (mark 0, as from the wire), a host-mode ACCEPT
 * included, and the plan's k are 0 (targets.xdp.tables.build_tables6). */
#define HFX6_SOFT_VERBATIM 1

struct hfx_span6 {
	__u32 start[4];
	__u32 vec;
};

/* One IPv6 update-buffer slot (docs/ipv6.md "The update buffer for IPv6"): as struct hfx_slot, with the addresses as
 * raw 128-bit closed intervals (four words each, most significant first, host order), not ranks: a slot needs no
 * elementary interval of the running table set, so a changed rule goes into the buffer whatever ranks it would add.
 * lo[0..1]/hi[0..1] (src, dst) are unused; lo[2..8]/hi[2..8] are proto .. ct as in struct hfx_slot. */
struct hfx6_slot {
	__u32 src_lo[4];
	__u32 src_hi[4];
	__u32 dst_lo[4];
	__u32 dst_hi[4];
	__u32 lo[HFX_NFIELDS];
	__u32 hi[HFX_NFIELDS];
	__u8 flags_mask;
	__u8 flags_value;
	__u8 sets_mask;
	__u8 sets_value;
	__u32 pos;    /* the static IPv6 entry it precedes (local, 0 .. n6) */
	__u32 enable; /* 0: never read as a match */
};

/* hfx_entry.shunt bits: the shunt bit for frames with ct 0, 1, 2 and the one for frames with ct 3 (Plan.shunt_none). */
#define HFX_SHUNT 1
#define HFX_SHUNT_NONE 2

/* What match_index selects: action code (| HF_ACTION_MIRROR_BIT: mirror the decided frames), shunt bits (HFX_SHUNT*),
 * interval k (the mark's k). */
struct hfx_entry {
	__u8 action;
	__u8 shunt;
	__u16 pad;
	__u32 k;
};

/* One update-buffer slot (docs/xdp.md "Update buffer (SFL)"): a box (closed intervals per field, TCP flags
 * ternary) and its insert position `pos` (the static entry it precedes, 0 .. n). An enabled slot b whose box holds
 * the header wins over the first valid static match i when pos <= i (the first such slot in slot order): hardware
 * index n + 1 + b. */
struct hfx_slot {
	__u32 lo[HFX_NFIELDS];
	__u32 hi[HFX_NFIELDS];
	__u8 flags_mask;
	__u8 flags_value;
	__u8 sets_mask; /* the set-slot ternary (ir.box sets_mask/sets_value) */
	__u8 sets_value;
	__u32 pos;
	__u32 enable; /* 0: never read as a match (written 0 before its fields change, 1 after) */
};

/* hfx_setseq's value: ipset commands of one network namespace that change a set, counted on syscall entry and exit. */
struct hfx_setcount {
	__u64 started;
	__u64 finished;
};

/* One element of a set slot's map (docs/sets.md): PRESENT (array maps: bitmap:port), NOMATCH (hash:net types), and
 * the CLOCK_MONOTONIC time (ns) from which the element may have expired in the kernel (0: no timeout): from then on
 * a frame whose lookup finds it goes to the stack (reason 3) until the policy sync service has removed it. */
struct hfx_setval {
	__u64 expire;
	__u32 flags;
	__u32 pad;
};

/* Keys: hash:ip a __u32 address (host order, masked by the set's netmask); hash:ip,port hfx_setkey_ipport (host
 * order); hash:net and hash:net,port LPM trie keys (prefix length, then big-endian data); bitmap:port the port. */
struct hfx_setkey_ipport {
	__u32 addr;
	__u16 port;
	__u8 proto;
	__u8 pad;
};
struct hfx_setkey_net {
	__u32 prefixlen; /* the net's prefix length */
	__u32 addr;	 /* big-endian */
};
struct hfx_setkey_netport {
	__u32 prefixlen; /* 32 + the net's prefix length */
	__u8 proto;
	__u8 pad;
	__u16 port; /* big-endian */
	__u32 addr; /* big-endian */
};
/* The IPv6 path's keys (docs/sets.md "IPv6 sets"): the address as its 16 bytes in network order; hash:ip,port's
 * port in host order as IPv4's; LPM trie keys as IPv4's with the 128-bit address last. */
struct hfx6_setkey_ip {
	__u8 addr[16];
};
struct hfx6_setkey_ipport {
	__u8 addr[16];
	__u16 port;
	__u8 proto;
	__u8 pad;
};
struct hfx6_setkey_net {
	__u32 prefixlen; /* the net's prefix length */
	__u8 addr[16];
};
struct hfx6_setkey_netport {
	__u32 prefixlen; /* 32 + the net's prefix length */
	__u8 proto;
	__u8 pad;
	__u16 port; /* big-endian */
	__u8 addr[16];
};

struct hfx_meta {
	__u32 value;  /* the shim's mark value: k << 4 | action, 0x1 decided ACCEPT (host mode), 0 full policy */
	__u32 cookie; /* HFX_META_COOKIE */
	__u64 m;      /* M (ARCHITECTURE section 4) */
	__u32 peer;   /* mirrored ACCEPT, bridge mode: ifindex of the port to clone the frame to; else 0 */
	__u32 pad;
};
#endif

#endif
