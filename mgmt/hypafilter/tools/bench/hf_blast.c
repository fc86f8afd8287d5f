/* hf_blast: sends a file of prebuilt Ethernet frames out of one interface as fast as AF_PACKET allows, for a while.
 *
 * Usage: hf_blast IFACE FRAMES_FILE SECONDS [BATCH [CPU]]
 *        hf_blast IFACE FRAMES_FILE once [BATCH [CPU]]
 * FRAMES_FILE is a sequence of records: 2-byte little-endian length, then the frame. Frames are sent cyclically in file
 * order with sendmmsg() batches of BATCH frames (1..1024, default 256), bypassing the qdisc, so the only limit is the
 * CPU cost of the path behind the interface. A bad argument is an error (exit status 2). A frame the device refused
 * (ENOBUFS: a full ring or backlog) is sent again, never skipped, so the frames that went are always a prefix of the
 * cyclic sequence. CPU (>= 0) pins the sender to that CPU: on veth the path behind the interface (bridge, netfilter,
 * XDP, the receiver's stack) runs in the sender's softirq context on the same CPU. Prints one JSON line: {"sent": N,
 * "seconds": T, "errors": E, "frames": F, "cpu_seconds": C} (C: the sender's user + system time, which includes softirq
 * work done in its context; TICK accounting here).
 * With "once", every frame is sent exactly once, in order, and never beyond an allowance read from stdin (decimal
 * lines: "frames 0..N-1 may go"; end of input lifts the limit): the caller's flow control (`bench rate`), so that a
 * slower path behind the interface is never overrun and no frame is lost to the measurement.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hf_sender.h"

int main(int argc, char **argv)
{
	struct sender_args a;
	int status = sender_setup(argc, argv, 1, "IFACE FRAMES_FILE SECONDS|once [BATCH [CPU]]", 256, 1024, &a);
	if (status)
		return status;

	size_t size;
	unsigned char *buf = read_file(a.frames_path, &size);
	if (!buf)
		return 1;

	/* Index the records once; the send loop only walks pointers. */
	size_t cap = 1024, n = 0;
	struct iovec *frames = malloc(cap * sizeof(*frames));
	for (size_t off = 0; off + 2 <= size;) {
		unsigned len = buf[off] | (buf[off + 1] << 8);
		off += 2;
		if (len < 14 || off + len > size) {
			fprintf(stderr, "%s: bad record at offset %zu\n", a.frames_path, off - 2);
			return 1;
		}
		if (n == cap) {
			cap *= 2;
			frames = realloc(frames, cap * sizeof(*frames));
		}
		frames[n].iov_base = buf + off;
		frames[n].iov_len = len;
		n++;
		off += len;
	}
	if (n == 0) {
		fprintf(stderr, "%s: no frames\n", a.frames_path);
		return 1;
	}

	int fd = socket(AF_PACKET, SOCK_RAW, 0);
	if (fd < 0) {
		perror("socket");
		return 1;
	}
	int one = 1;
	/* Without the qdisc, a full device returns an error instead of queueing: the rate is what the path absorbs. */
	setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof(one));
	struct sockaddr_ll sll = {0};
	sll.sll_family = AF_PACKET;
	sll.sll_ifindex = if_nametoindex(a.ifname);
	sll.sll_protocol = 0;
	if (!sll.sll_ifindex) {
		fprintf(stderr, "%s: no such interface\n", a.ifname);
		return 1;
	}
	if (bind(fd, (struct sockaddr *)&sll, sizeof(sll)) < 0) {
		perror("bind");
		return 1;
	}

	struct mmsghdr *msgs = calloc(a.batch, sizeof(*msgs));
	unsigned long long sent = 0, errors = 0;
	size_t next = 0;
	double t0 = now(), t = t0, c0 = cpu_seconds();
	if (a.once) {
		start_once(&t0, &c0);
		unsigned long long allowed = 0;
		int eof = 0;
		while (sent < n) {
			allowed = allowance(allowed, sent, &eof);
			unsigned long long k = allowed - sent;
			if (k > a.batch)
				k = a.batch;
			if (k > n - sent)
				k = n - sent;
			for (unsigned i = 0; i < k; i++) {
				memset(&msgs[i], 0, sizeof(msgs[i]));
				msgs[i].msg_hdr.msg_iov = &frames[sent + i];
				msgs[i].msg_hdr.msg_iovlen = 1;
			}
			int r = sendmmsg(fd, msgs, (unsigned)k, 0);
			if (r < 0) {
				/* Nothing went: try the same frames again (a full device), never skip one. */
				errors++;
				if (errno != ENOBUFS && errno != EAGAIN) {
					perror("sendmmsg");
					return 1;
				}
				continue;
			}
			sent += (unsigned long long)r;
		}
		t = now();
		print_result(sent, t - t0, errors, n, cpu_seconds() - c0);
		return 0;
	}
	while (t - t0 < a.seconds) {
		for (unsigned i = 0; i < a.batch; i++) {
			size_t j = (next + i) % n;
			msgs[i].msg_hdr.msg_iov = &frames[j];
			msgs[i].msg_hdr.msg_iovlen = 1;
		}
		int r = sendmmsg(fd, msgs, a.batch, 0);
		if (r < 0) {
			errors++;
			if (errno != ENOBUFS && errno != EAGAIN) {
				perror("sendmmsg");
				return 1;
			}
		} else {
			/* A short send: the next batch starts at the first frame that did not go. */
			sent += r;
			next = (next + (size_t)r) % n;
		}
		t = now();
	}
	print_result(sent, t - t0, errors, n, cpu_seconds() - c0);
	return 0;
}
