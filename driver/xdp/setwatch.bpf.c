/* setwatch.bpf.c: the kernel's ipset changes as they happen (docs/sets.md "Following the kernel's sets").
 *
 * ipset sends no netlink events, and this kernel lets no kprobe or fentry program attach (no kprobe PMU; tracing
 * programs are refused), so the watcher sits on the raw syscall tracepoints: a sendto/sendmsg/sendmmsg whose netlink
 * payload holds an ipset command that changes a set (NFNL_SUBSYS_IPSET, any command but the read-only ones) counts
 * into hfx_setseq[HFX_SETSEQ_STARTED] on syscall entry — before the kernel has parsed the message, let alone changed
 * the set (nfnetlink runs the command inside that very syscall) — and into [HFX_SETSEQ_FINISHED] when that syscall
 * returns, by which time the change is done. The XDP fast path shares the map (pinned) and decides nothing by its
 * set tables while STARTED differs from the count its tables were read at (hfx_setsync); the policy sync service
 * re-reads the sets once STARTED == FINISHED and releases with the STARTED it read before reading them.
 *
 * Anything else looking like an ipset message (a false positive) only costs a resynchronisation. Loaded once per
 * host (`hf_xdp watch`) for every network namespace. x86_64 syscall numbers and pt_regs. */
#include <linux/bpf.h>
#include <asm/ptrace.h>
#include <bpf/bpf_helpers.h>

#include "hf_fastpath.h"

#define NR_SENDTO 44
#define NR_SENDMSG 46
#define NR_SENDMMSG 307
#define SUBSYS_IPSET 6
#define MAX_MSGS 8 /* netlink messages looked at per buffer */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, HFX_SETSEQ_LEN);
	__type(key, __u32);
	__type(value, __u64);
} hfx_setseq SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);  /* pid_tgid of a thread inside an ipset-changing send */
	__type(value, __u8);
} hfx_setpending SEC(".maps");

static __always_inline void bump(__u32 k)
{
	__u64 *v = bpf_map_lookup_elem(&hfx_setseq, &k);

	if (v)
		__sync_fetch_and_add(v, 1);
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

SEC("raw_tp/sys_enter")
int hfx_setwatch_enter(struct bpf_raw_tracepoint_args *ctx)
{
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	long id = (long)ctx->args[1];
	unsigned long a1 = 0, a2 = 0;
	const __u8 *buf = 0;
	__u64 len = 0, key;
	__u8 one = 1;

	if (id != NR_SENDTO && id != NR_SENDMSG && id != NR_SENDMMSG)
		return 0;
	bpf_probe_read_kernel(&a1, sizeof(a1), &regs->rsi);
	bpf_probe_read_kernel(&a2, sizeof(a2), &regs->rdx);
	if (id == NR_SENDTO) {
		buf = (const __u8 *)a1;
		len = a2;
	} else {
		/* struct msghdr (sendmsg) or the first struct mmsghdr's (sendmmsg): msg_iov at 16, its first iovec */
		struct {
			void *base;
			__u64 len;
		} iov;
		void *iovp = 0;

		if (bpf_probe_read_user(&iovp, sizeof(iovp), (const __u8 *)a1 + 16) || !iovp)
			return 0;
		if (bpf_probe_read_user(&iov, sizeof(iov), iovp))
			return 0;
		buf = iov.base;
		len = iov.len;
	}
	if (!buf || !ipset_change(buf, len))
		return 0;
	key = bpf_get_current_pid_tgid();
	bump(HFX_SETSEQ_STARTED);
	/* Should the thread not fit, its end is never counted: STARTED stays ahead of FINISHED and the fast path keeps
	 * shunting by its sets (the service says so), never deciding by tables read before the change was done. */
	bpf_map_update_elem(&hfx_setpending, &key, &one, BPF_ANY);
	return 0;
}

SEC("raw_tp/sys_exit")
int hfx_setwatch_exit(struct bpf_raw_tracepoint_args *ctx)
{
	__u64 key = bpf_get_current_pid_tgid();

	if (bpf_map_lookup_elem(&hfx_setpending, &key)) {
		bpf_map_delete_elem(&hfx_setpending, &key);
		bump(HFX_SETSEQ_FINISHED);
	}
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
