/* hf_live: sends a file of prebuilt Ethernet frames into one veth as xdp_frames (no skb), for a while.
 *
 * Usage: hf_live BPF_OBJ IFACE FRAMES_FILE SECONDS [BATCH [CPU]]
 *        hf_live BPF_OBJ IFACE FRAMES_FILE once [BATCH [CPU]]
 * The same interface as hf_blast.c (FRAMES_FILE records, "once" with the allowance from stdin, the JSON line), but
 * the frames do not come from a socket: BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (Linux >= 5.18) runs
 * BPF_OBJ's program (hf_live.bpf.c) `repeat` times on page-pool frames, in batches of BATCH (at most 256, default
 * 64); the program writes the next frame of the file into each and returns XDP_TX, which the test run redirects to
 * IFACE (the context's ingress_ifindex). On a veth, ndo_xdp_xmit hands the xdp_frame to the peer's NAPI ring (the
 * peer needs an XDP program or GRO, else every frame is dropped); the peer's XDP program or stack runs in this
 * process's softirq context when each batch ends, on CPU (>= 0: pinned), as with hf_blast. Frames sent = the
 * program's own count of frames built; a frame it could not build fails the run. A frame the veth drops (a full
 * ring) is not seen here: the caller checks the delivered counts.
 * Prints one JSON line: {"sent": N, "seconds": T, "errors": E, "frames": F, "cpu_seconds": C}.
 */
#define _GNU_SOURCE
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <linux/if_link.h>
#include <net/if.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hf_sender.h"

#define HF_FRAME_MAX 1024 /* as in hf_live.bpf.c */
#define CHUNK 65536	  /* frames per BPF_PROG_TEST_RUN call in the timed mode */

struct hf_frame {
	uint32_t len;
	uint8_t data[HF_FRAME_MAX];
};

static int state_fd;

static uint64_t state(uint32_t key)
{
	uint64_t v = 0;
	if (bpf_map_lookup_elem(state_fd, &key, &v)) {
		perror("state map");
		exit(1);
	}
	return v;
}

int main(int argc, char **argv)
{
	struct sender_args a;
	int status = sender_setup(argc, argv, 2, "BPF_OBJ IFACE FRAMES_FILE SECONDS|once [BATCH [CPU]]", 64, 256, &a);
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
	size_t n = 0, maxlen = 14;
	for (size_t off = 0; off + 2 <= size; n++) {
		unsigned len = buf[off] | (buf[off + 1] << 8);
		if (len < 14 || len > HF_FRAME_MAX || off + 2 + len > size) {
			fprintf(stderr, "%s: bad record at offset %zu (length %u, 14..%d)\n", a.frames_path, off, len,
				HF_FRAME_MAX);
			return 1;
		}
		if (len > maxlen)
			maxlen = len;
		off += 2 + len;
	}
	if (n == 0) {
		fprintf(stderr, "%s: no frames\n", a.frames_path);
		return 1;
	}

	libbpf_set_strict_mode(LIBBPF_STRICT_ALL);
	struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
	if (!obj) {
		fprintf(stderr, "%s: cannot open: %s\n", argv[1], strerror(errno));
		return 1;
	}
	struct bpf_map *frames_map = bpf_object__find_map_by_name(obj, "frames");
	struct bpf_map *state_map = bpf_object__find_map_by_name(obj, "state");
	struct bpf_program *prog = bpf_object__find_program_by_name(obj, "hf_live");
	if (!frames_map || !state_map || !prog) {
		fprintf(stderr, "%s: no map frames/state or program hf_live\n", argv[1]);
		return 1;
	}
	bpf_map__set_max_entries(frames_map, (uint32_t)n);
	if (bpf_object__load(obj)) {
		fprintf(stderr, "%s: load failed: %s\n", argv[1], strerror(errno));
		return 1;
	}
	int frames_fd = bpf_map__fd(frames_map), prog_fd = bpf_program__fd(prog);
	state_fd = bpf_map__fd(state_map);
	struct hf_frame *fr = calloc(1, sizeof(*fr));
	size_t off = 0;
	for (uint32_t i = 0; i < n; i++) {
		unsigned len = buf[off] | (buf[off + 1] << 8);
		memset(fr, 0, sizeof(*fr));
		fr->len = len;
		memcpy(fr->data, buf + off + 2, len);
		if (bpf_map_update_elem(frames_fd, &i, fr, BPF_ANY)) {
			perror("frames map");
			return 1;
		}
		off += 2 + len;
	}
	uint64_t count = n;
	uint32_t key = 1;
	if (bpf_map_update_elem(state_fd, &key, &count, BPF_ANY)) {
		perror("state map");
		return 1;
	}
	/* The template every page-pool frame starts from: the program overwrites it and sets its length. */
	unsigned char *tmpl = calloc(1, maxlen);
	memcpy(tmpl, buf + 2, buf[0] | (buf[1] << 8));

	struct xdp_md md = {0};
	md.ingress_ifindex = ifindex;
	md.data_end = (uint32_t)maxlen;
	unsigned long long sent = 0, errors = 0;
	double t0 = now(), t = t0, c0 = cpu_seconds();
	unsigned long long allowed = 0;
	int eof = 0;
	if (a.once)
		start_once(&t0, &c0);
	for (;;) {
		unsigned long long k;
		if (a.once) {
			if (sent >= n)
				break;
			allowed = allowance(allowed, sent, &eof);
			k = allowed - sent;
			if (k > n - sent)
				k = n - sent;
		} else {
			if (t - t0 >= a.seconds)
				break;
			k = CHUNK;
		}
		LIBBPF_OPTS(bpf_test_run_opts, opts, .data_in = tmpl, .data_size_in = (uint32_t)maxlen, .ctx_in = &md,
			    .ctx_size_in = sizeof(md), .repeat = (uint32_t)k, .flags = BPF_F_TEST_XDP_LIVE_FRAMES,
			    .batch_size = a.batch);
		int r = bpf_prog_test_run_opts(prog_fd, &opts);
		if (r && errno != EINTR) {
			fprintf(stderr, "BPF_PROG_TEST_RUN (live frames) on %s: %s (errno %d)\n", a.ifname,
				strerror(errno), errno);
			return 1;
		}
		sent = state(0);
		errors = state(2);
		if (errors) {
			fprintf(stderr, "hf_live: the program could not build %llu frames\n", errors);
			return 1;
		}
		t = now();
	}
	print_result(sent, t - t0, errors, n, cpu_seconds() - c0);
	return 0;
}
