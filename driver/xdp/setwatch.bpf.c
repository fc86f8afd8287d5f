/* setwatch.bpf.c: the kernel's ipset changes as they happen (docs/sets.md "Following the kernel's sets").
 *
 * ipset sends no netlink events, and this kernel lets no kprobe, fentry/fexit or BPF LSM program attach (no kprobe
 * PMU; programs attached by trampoline are refused with EPERM), so the watcher sits on the per-syscall tracepoints
 * of sendto, sendmsg and sendmmsg (not the raw sys_enter/sys_exit tracepoints: a BPF program there runs for every
 * syscall of the host, see docs/sets.md "Its cost"): a send whose netlink payload holds an ipset command that
 * changes a set (NFNL_SUBSYS_IPSET, any command but the read-only ones) counts into hfx_setseq[netns].started on
 * syscall entry — before the kernel has parsed the message, let alone changed the set (nfnetlink runs the command
 * inside that very syscall) — and into .finished when that syscall returns, by which time the change is done. netns
 * is the network namespace of the socket the message goes through (the sets it changes are that namespace's). The
 * XDP fast path shares the map (pinned) and decides nothing by its set tables while its namespace's started count
 * differs from the one its tables were read at (hfx_setsync); the policy sync service re-reads the sets once
 * started == finished and releases with the started count it read before them.
 *
 * The same counts, in hfx_ctseq, for what can make a conntrack miss RELATED or UNTRACKED (docs/xdp.md "Following
 * the configuration"): a legacy xtables raw table replaced (setsockopt IPT_SO_SET_REPLACE / IP6T_SO_SET_REPLACE
 * naming "raw", the only table CT and NOTRACK can be in; the kernel replaces it inside that syscall) and an nf_tables
 * batch that adds a rule or an object (NFT_MSG_NEWRULE, NFT_MSG_NEWOBJ; nfnetlink commits the batch inside the
 * send). The XDP program decides no conntrack miss as NEW while its namespace's started count differs from the one
 * its permission (HFX_CT_NONE) was granted at (hfx_ctsync).
 *
 * Anything else looking like an ipset message (a false positive) only costs a resynchronisation. Loaded once per
 * host (`hf_xdp watch`). x86_64 (struct msghdr layout); kernel structures by CO-RE (the running kernel's BTF). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "hf_fastpath.h"

#define SUBSYS_IPSET 6
#define SUBSYS_NFTABLES 10
#define NFNL_MSG_BATCH_BEGIN 16
#define NFNL_MSG_BATCH_END 17
#define NFT_MSG_NEWRULE 6
#define NFT_MSG_NEWOBJ 18
#define MAX_MSGS 8	 /* netlink messages looked at per buffer */
#define MAX_BATCH_MSGS 32 /* ... inside an nf_tables batch (not seen to end within them: counted) */
#define SO_SET_REPLACE 64 /* IPT_SO_SET_REPLACE (level IPPROTO_IP) and IP6T_SO_SET_REPLACE (IPPROTO_IPV6) */
/* What a send or setsockopt counts as (hfx_setpending's value) */
#define CHANGE_SET 1
#define CHANGE_CT 2

/* Only the fields read, relocated to the running kernel's layout at load (CO-RE). */
struct ns_common {
	unsigned int inum;
} __attribute__((preserve_access_index));
struct net {
	struct ns_common ns;
} __attribute__((preserve_access_index));
typedef struct {
	struct net *net;
} __attribute__((preserve_access_index)) possible_net_t;
struct sock_common {
	possible_net_t skc_net;
} __attribute__((preserve_access_index));
struct sock {
	struct sock_common __sk_common;
} __attribute__((preserve_access_index));
struct socket {
	struct sock *sk;
} __attribute__((preserve_access_index));
struct file {
	void *private_data;
} __attribute__((preserve_access_index));
struct fdtable {
	unsigned int max_fds;
	struct file **fd;
} __attribute__((preserve_access_index));
struct files_struct {
	struct fdtable *fdt;
} __attribute__((preserve_access_index));
struct task_struct {
	struct files_struct *files;
} __attribute__((preserve_access_index));

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, HFX_SETSEQ_MAX);
	__type(key, __u32); /* network namespace inode number */
	__type(value, struct hfx_setcount);
} hfx_setseq SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, HFX_SETSEQ_MAX);
	__type(key, __u32); /* network namespace inode number */
	__type(value, struct hfx_setcount);
} hfx_ctseq SEC(".maps");

struct pending {
	__u32 netns; /* the namespace it counted in */
	__u32 kind;  /* CHANGE_SET: hfx_setseq, CHANGE_CT: hfx_ctseq */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64); /* pid_tgid of a thread inside a counted send or setsockopt */
	__type(value, struct pending);
} hfx_setpending SEC(".maps");

/* A record per command that returned (its namespace), forcing a wake-up of every reader (the policy sync services
 * poll this map's descriptor instead of the counts). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} hfx_setwake SEC(".maps");

static __always_inline struct hfx_setcount *counts(void *map, __u32 netns)
{
	struct hfx_setcount *c = bpf_map_lookup_elem(map, &netns), zero = {};

	if (c)
		return c;
	bpf_map_update_elem(map, &netns, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, &netns);
}

/* Whether cmd (the low byte of nlmsg_type) changes a set: everything but protocol, list, save, test, header, type
 * and the name/index look-ups. */
static __always_inline int changes(__u8 cmd)
{
	return !(cmd == 1 || (cmd >= 7 && cmd <= 8) || (cmd >= 11 && cmd <= 15));
}

/* What a user buffer of netlink messages holds: CHANGE_SET (an ipset command that changes a set), CHANGE_CT (an
 * nf_tables message that adds a rule or an object, or a batch for nf_tables not seen to end without one within the
 * messages looked at: the rest of it is in another buffer, or beyond them), or 0. Outside an nf_tables batch no more
 * messages are looked at than before (MAX_MSGS): other sends pay what they paid. */
static __always_inline int classify(const __u8 *buf, __u64 len)
{
	__u64 off = 0;
	int batch = 0;

	for (int i = 0; i < MAX_BATCH_MSGS; i++) {
		struct {
			__u32 len;
			__u16 type;
		} h;
		__u16 res_id;

		if (!batch && i >= MAX_MSGS)
			return 0;
		if (off + 16 > len)
			return batch ? CHANGE_CT : 0;
		if (bpf_probe_read_user(&h, sizeof(h), buf + off))
			return batch ? CHANGE_CT : 0;
		if ((h.type >> 8) == SUBSYS_IPSET && changes(h.type & 0xFF))
			return CHANGE_SET;
		if ((h.type >> 8) == SUBSYS_NFTABLES && ((h.type & 0xFF) == NFT_MSG_NEWRULE || (h.type & 0xFF) == NFT_MSG_NEWOBJ))
			return CHANGE_CT;
		if (h.type == NFNL_MSG_BATCH_BEGIN && off + 20 <= len &&
		    !bpf_probe_read_user(&res_id, sizeof(res_id), buf + off + 18) && res_id == __builtin_bswap16(SUBSYS_NFTABLES))
			batch = 1; /* struct nfgenmsg's res_id (big-endian): the subsystem the batch is for */
		if (h.type == NFNL_MSG_BATCH_END && batch)
			return 0;
		if (h.len < 16)
			return batch ? CHANGE_CT : 0;
		off += (h.len + 3) & ~3U;
	}
	return batch ? CHANGE_CT : 0;
}

/* The network namespace of socket descriptor `fd` of the current task (0 when it cannot be read). */
static __always_inline __u32 fd_netns(int fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	struct file **fds, *f = 0;
	struct socket *sock;

	if (!fdt || fd < 0 || (unsigned int)fd >= BPF_CORE_READ(fdt, max_fds))
		return 0;
	fds = BPF_CORE_READ(fdt, fd);
	if (!fds || bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]) || !f)
		return 0;
	sock = BPF_CORE_READ(f, private_data);
	if (!sock)
		return 0;
	return BPF_CORE_READ(sock, sk, __sk_common.skc_net.net, ns.inum);
}

/* The syscalls/sys_enter_* tracepoints' record (tracefs events/syscalls/sys_enter_sendto/format): the common fields,
 * the syscall number, then the arguments as 8-byte words. */
struct sys_enter_ctx {
	__u64 common;
	long nr;
	unsigned long args[6];
};

/* A change of `kind` entering the kernel through descriptor fd: counted as started in its namespace. */
static __always_inline int start(int fd, __u32 kind)
{
	struct pending p = {.netns = fd_netns(fd), .kind = kind};
	struct hfx_setcount *c = counts(kind == CHANGE_CT ? (void *)&hfx_ctseq : (void *)&hfx_setseq, p.netns);
	__u64 key;

	if (!c)
		return 0; /* HFX_SETSEQ_MAX namespaces counted already: see docs/sets.md */
	__sync_fetch_and_add(&c->started, 1);
	key = bpf_get_current_pid_tgid();
	/* Should the thread not fit, its end is never counted: started stays ahead of finished and the fast path keeps
	 * leaving frames to the stack (the service says so), never deciding by tables read before the change was done. */
	bpf_map_update_elem(&hfx_setpending, &key, &p, BPF_ANY);
	return 0;
}

/* Entry of a send of buffer buf (len bytes) on descriptor fd. */
static __always_inline int enter(int fd, const __u8 *buf, __u64 len)
{
	int kind;

	if (!buf)
		return 0;
	kind = classify(buf, len);
	return kind ? start(fd, kind) : 0;
}

/* struct msghdr (sendmsg) or the first struct mmsghdr's (sendmmsg): msg_iov at 16, its first iovec. */
static __always_inline int enter_msg(int fd, const void *msg)
{
	struct {
		void *base;
		__u64 len;
	} iov;
	void *iovp = 0;

	if (bpf_probe_read_user(&iovp, sizeof(iovp), (const __u8 *)msg + 16) || !iovp)
		return 0;
	if (bpf_probe_read_user(&iov, sizeof(iov), iovp))
		return 0;
	return enter(fd, iov.base, iov.len);
}

/* Return of a send or setsockopt: counted as finished when its entry counted as started. */
static __always_inline int leave(void)
{
	__u64 key = bpf_get_current_pid_tgid();
	struct pending *p = bpf_map_lookup_elem(&hfx_setpending, &key);
	struct hfx_setcount *c;
	__u32 netns;

	if (!p)
		return 0;
	netns = p->netns;
	c = bpf_map_lookup_elem(p->kind == CHANGE_CT ? (void *)&hfx_ctseq : (void *)&hfx_setseq, &netns);
	if (c)
		__sync_fetch_and_add(&c->finished, 1);
	bpf_ringbuf_output(&hfx_setwake, &netns, sizeof(netns), BPF_RB_FORCE_WAKEUP);
	bpf_map_delete_elem(&hfx_setpending, &key);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_sendto")
int hfx_setwatch_sendto(struct sys_enter_ctx *ctx)
{
	return enter((int)ctx->args[0], (const __u8 *)ctx->args[1], ctx->args[2]);
}

SEC("tracepoint/syscalls/sys_enter_sendmsg")
int hfx_setwatch_sendmsg(struct sys_enter_ctx *ctx)
{
	return enter_msg((int)ctx->args[0], (const void *)ctx->args[1]);
}

SEC("tracepoint/syscalls/sys_enter_sendmmsg")
int hfx_setwatch_sendmmsg(struct sys_enter_ctx *ctx)
{
	return enter_msg((int)ctx->args[0], (const void *)ctx->args[1]);
}

/* setsockopt(fd, level, optname, optval, optlen): a legacy xtables table replaced, if that table is "raw"
 * (struct ipt_replace and ip6t_replace begin with the table's name). Every other setsockopt returns after two
 * compares. */
SEC("tracepoint/syscalls/sys_enter_setsockopt")
int hfx_ctwatch_setsockopt(struct sys_enter_ctx *ctx)
{
	long level = (int)ctx->args[1];
	char name[4];

	if ((int)ctx->args[2] != SO_SET_REPLACE || (level != 0 && level != 41))
		return 0;
	if (bpf_probe_read_user(name, sizeof(name), (const void *)ctx->args[3]))
		return start((int)ctx->args[0], CHANGE_CT); /* unreadable: the kernel may still read it */
	if (name[0] != 'r' || name[1] != 'a' || name[2] != 'w' || name[3])
		return 0;
	return start((int)ctx->args[0], CHANGE_CT);
}

SEC("tracepoint/syscalls/sys_exit_setsockopt")
int hfx_ctwatch_setsockopt_ret(void *ctx)
{
	return leave();
}

SEC("tracepoint/syscalls/sys_exit_sendto")
int hfx_setwatch_sendto_ret(void *ctx)
{
	return leave();
}

SEC("tracepoint/syscalls/sys_exit_sendmsg")
int hfx_setwatch_sendmsg_ret(void *ctx)
{
	return leave();
}

SEC("tracepoint/syscalls/sys_exit_sendmmsg")
int hfx_setwatch_sendmmsg_ret(void *ctx)
{
	return leave();
}

char LICENSE[] SEC("license") = "GPL";
