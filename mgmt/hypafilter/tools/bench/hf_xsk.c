/* hf_xsk: sends a file of prebuilt Ethernet frames out of one interface through an AF_XDP socket's TX ring, for a
 * while. Kept to measure the AF_XDP way against hf_blast.c and hf_live.c (docs/results.md, "Which sender is cheapest
 * on veth"); `bench rate` does not use it.
 *
 * Usage: hf_xsk IFACE FRAMES_FILE SECONDS|once [BATCH [CPU]]
 * The interface of hf_blast.c (hf_sender.h: FRAMES_FILE records, "once" with the allowance from stdin, the JSON line).
 * Every frame of the file sits in its own 2 KiB chunk of the socket's UMEM from the start; the TX ring gets the
 * descriptors of the next frames in cyclic order, up to BATCH (1..2048, default 256) between two kicks (sendto). A
 * veth has no zero-copy AF_XDP: copy mode, where the kernel builds an skb per descriptor and hands it to the
 * driver's xmit (as AF_PACKET with the qdisc bypassed does), at most 32 per kick. Frames sent = completions (the
 * kernel freed the skb); a frame the driver refused is still a completion, so the caller checks the delivered
 * counts, as with the other senders. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "hf_sender.h"

#ifndef AF_XDP
#define AF_XDP 44
#endif
#ifndef SOL_XDP
#define SOL_XDP 283
#endif

#define CHUNK 2048u /* UMEM chunk: one frame each */
#define RING 2048u  /* TX and completion ring entries (a power of two) */

struct ring {
	uint32_t *producer, *consumer;
	void *desc;
};

static int map_ring(int fd, const struct xdp_ring_offset *off, size_t entry, off_t pgoff, struct ring *r)
{
	size_t len = off->desc + RING * entry;
	char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, pgoff);
	if (m == MAP_FAILED)
		return -1;
	r->producer = (uint32_t *)(m + off->producer);
	r->consumer = (uint32_t *)(m + off->consumer);
	r->desc = m + off->desc;
	return 0;
}

int main(int argc, char **argv)
{
	struct sender_args a;
	int status = sender_setup(argc, argv, 1, "IFACE FRAMES_FILE SECONDS|once [BATCH [CPU]]", 256, RING, &a);
	if (status)
		return status;
	unsigned ifindex = if_nametoindex(a.ifname);
	if (!ifindex) {
		fprintf(stderr, "%s: no such interface\n", a.ifname);
		return 1;
	}
	size_t size;
	unsigned char *buf = read_file(a.frames_path, &size);
	if (!buf)
		return 1;
	size_t n = 0;
	for (size_t off = 0; off + 2 <= size; n++) {
		unsigned len = buf[off] | (buf[off + 1] << 8);
		if (len < 14 || len > CHUNK || off + 2 + len > size) {
			fprintf(stderr, "%s: bad record at offset %zu (length %u, 14..%u)\n", a.frames_path, off, len,
				CHUNK);
			return 1;
		}
		off += 2 + len;
	}
	if (n == 0) {
		fprintf(stderr, "%s: no frames\n", a.frames_path);
		return 1;
	}
	size_t umem_len = n * CHUNK;
	unsigned char *umem = mmap(NULL, umem_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint32_t *lens = calloc(n, sizeof(*lens));
	if (umem == MAP_FAILED || !lens) {
		perror("umem");
		return 1;
	}
	for (size_t i = 0, off = 0; i < n; i++) {
		lens[i] = buf[off] | (buf[off + 1] << 8);
		memcpy(umem + i * CHUNK, buf + off + 2, lens[i]);
		off += 2 + lens[i];
	}

	int fd = socket(AF_XDP, SOCK_RAW, 0);
	if (fd < 0) {
		perror("socket(AF_XDP)");
		return 1;
	}
	struct xdp_umem_reg reg = {.addr = (uintptr_t)umem, .len = umem_len, .chunk_size = CHUNK, .headroom = 0};
	unsigned ring = RING;
	struct xdp_mmap_offsets off;
	socklen_t optlen = sizeof(off);
	if (setsockopt(fd, SOL_XDP, XDP_UMEM_REG, &reg, sizeof(reg)) ||
	    setsockopt(fd, SOL_XDP, XDP_UMEM_FILL_RING, &ring, sizeof(ring)) ||
	    setsockopt(fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &ring, sizeof(ring)) ||
	    setsockopt(fd, SOL_XDP, XDP_TX_RING, &ring, sizeof(ring)) ||
	    getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &optlen)) {
		perror("AF_XDP socket options");
		return 1;
	}
	struct ring tx, cq;
	if (map_ring(fd, &off.tx, sizeof(struct xdp_desc), XDP_PGOFF_TX_RING, &tx) ||
	    map_ring(fd, &off.cr, sizeof(uint64_t), XDP_UMEM_PGOFF_COMPLETION_RING, &cq)) {
		perror("AF_XDP rings");
		return 1;
	}
	struct sockaddr_xdp sxdp = {.sxdp_family = AF_XDP, .sxdp_ifindex = ifindex, .sxdp_queue_id = 0,
				    .sxdp_flags = XDP_COPY};
	if (bind(fd, (struct sockaddr *)&sxdp, sizeof(sxdp))) {
		fprintf(stderr, "bind AF_XDP to %s queue 0 (copy mode): %s\n", a.ifname, strerror(errno));
		return 1;
	}

	struct xdp_desc *descs = tx.desc;
	uint32_t tx_prod = *tx.producer, cq_cons = *cq.consumer;
	unsigned long long queued = 0, sent = 0, errors = 0, allowed = 0, limit;
	int eof = 0;
	double t0 = now(), t = t0, c0 = cpu_seconds();
	if (a.once)
		start_once(&t0, &c0);
	for (unsigned long long spins = 0;; spins++) {
		uint32_t done = __atomic_load_n(cq.producer, __ATOMIC_ACQUIRE) - cq_cons;
		if (done) {
			cq_cons += done;
			__atomic_store_n(cq.consumer, cq_cons, __ATOMIC_RELEASE);
			sent += done;
		}
		if (a.once) {
			if (sent >= n)
				break;
			allowed = allowance(allowed, queued, &eof);
			limit = allowed < n ? allowed : n;
		} else {
			if ((spins & 63) == 0)
				t = now();
			if (t - t0 >= a.seconds) {
				if (sent == queued)
					break;
				limit = queued; /* stop queueing; wait for the completions */
			} else {
				limit = ~0ULL;
			}
		}
		/* At most RING in flight: the completion ring never overflows. */
		unsigned long long room = RING - (queued - sent), k = limit > queued ? limit - queued : 0;
		if (k > room)
			k = room;
		if (k > a.batch)
			k = a.batch;
		for (unsigned long long j = 0; j < k; j++) {
			size_t i = (size_t)((queued + j) % n);
			struct xdp_desc *d = &descs[(tx_prod + j) & (RING - 1)];
			d->addr = (uint64_t)i * CHUNK;
			d->len = lens[i];
			d->options = 0;
		}
		if (k) {
			tx_prod += (uint32_t)k;
			__atomic_store_n(tx.producer, tx_prod, __ATOMIC_RELEASE);
			queued += k;
		}
		if (queued > sent && sendto(fd, NULL, 0, MSG_DONTWAIT, NULL, 0) < 0 && errno != EAGAIN &&
		    errno != EBUSY && errno != ENOBUFS && errno != EINTR) {
			fprintf(stderr, "sendto (AF_XDP kick) on %s: %s\n", a.ifname, strerror(errno));
			return 1;
		}
	}
	if (!a.once)
		t = now();
	print_result(sent, t - t0, errors, n, cpu_seconds() - c0);
	return 0;
}
