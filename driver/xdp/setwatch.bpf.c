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
 * Anything else looking like an ipset message (a false positive) only costs a resynchronisation. Loaded once per
 * host (`hf_xdp watch`). x86_64 (struct msghdr layout); kernel structures by CO-RE (the running kernel's BTF). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "hf_fastpath.h"

#define SUBSYS_IPSET 6
#define MAX_MSGS 8 /* netlink messages looked at per buffer */

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
	__uint(max_entries, 65536);
	__type(key, __u64);   /* pid_tgid of a thread inside an ipset-changing send */
	__type(value, __u32); /* the namespace it counted in */
} hfx_setpending SEC(".maps");

/* A record per command that returned (its namespace), forcing a wake-up of every reader (the policy sync services
 * poll this map's descriptor instead of the counts). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} hfx_setwake SEC(".maps");

static __always_inline struct hfx_setcount *counts(__u32 netns)
{
	struct hfx_setcount *c = bpf_map_lookup_elem(&hfx_setseq, &netns), zero = {};

	if (c)
		return c;
	bpf_map_update_elem(&hfx_setseq, &netns, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&hfx_setseq, &netns);
}

/* Whether cmd (the low byte of nlmsg_type) changes a set: everything but protocol, list, save, test, header, type
 * and the name/index look-ups. */
static __always_inline int changes(__u8 cmd)
{
	return !(cmd == 1 || (cmd >= 7 && cmd <= 8) || (cmd >= 11 && cmd <= 15));
}

/* Whether a user buffer of netlink messages holds an ipset command that changes a set. */
static __always_inline int ipset_change(const __u8 *buf, __u64 len)
{
	__u64 off = 0;

	for (int i = 0; i < MAX_MSGS; i++) {
		struct {
			__u32 len;
			__u16 type;
		} h;

		if (off + 16 > len)
			return 0;
		if (bpf_probe_read_user(&h, sizeof(h), buf + off))
			return 0;
		if ((h.type >> 8) == SUBSYS_IPSET && changes(h.type & 0xFF))
			return 1;
		if (h.len < 16)
			return 0;
		off += (h.len + 3) & ~3U;
	}
	return 0;
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

/* The syscalls/sys_enter_* tracepoints' record (tracefs events/syscalls/sys_enter_sendto/format): the common
 * fields, the syscall number, then the arguments as 8-byte words. */
/* The syscalls/sys_enter_* tracepoints' record (tracefs events/syscalls/sys_enter_sendto/format): the common fields,
 * the syscall number, then the arguments as 8-byte words. */
struct sys_enter_ctx {
	__u64 common;
	long nr;
	unsigned long args[6];
};

/* Entry of a send of buffer buf (len bytes) on descriptor fd. */
static __always_inline int enter(int fd, const __u8 *buf, __u64 len)
{
	struct hfx_setcount *c;
	__u64 key;
	__u32 netns;

	if (!buf || !ipset_change(buf, len))
		return 0;
	netns = fd_netns(fd);
	c = counts(netns);
	if (!c)
		return 0; /* HFX_SETSEQ_MAX namespaces counted already: see docs/sets.md */
	__sync_fetch_and_add(&c->started, 1);
	key = bpf_get_current_pid_tgid();
	/* Should the thread not fit, its end is never counted: started stays ahead of finished and the fast path keeps
	 * leaving frames to the stack (the service says so), never deciding by tables read before the change was done. */
	bpf_map_update_elem(&hfx_setpending, &key, &netns, BPF_ANY);
	return 0;
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

/* Return of a send: counted as finished when its entry counted as started. */
static __always_inline int leave(void)
{
	__u64 key = bpf_get_current_pid_tgid();
	__u32 *netns = bpf_map_lookup_elem(&hfx_setpending, &key);
	struct hfx_setcount *c;

	if (!netns)
		return 0;
	c = bpf_map_lookup_elem(&hfx_setseq, netns);
	if (c)
		__sync_fetch_and_add(&c->finished, 1);
	bpf_ringbuf_output(&hfx_setwake, netns, sizeof(*netns), BPF_RB_FORCE_WAKEUP);
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
