/* hf_shim.c: loader and map tool for the eBPF shim (shim.bpf.o): load/unload on interfaces of a network namespace,
 * bulk map updates, statistics as JSON.
 *
 *   hf_shim load   --obj OBJ --pin DIR [--netns NAME] [--generic] [--tc-only] IFACE...
 *                  (--tc-only: TC ingress only; the XDP program is the fast path's own, docs/xdp.md)
 *   hf_shim unload --pin DIR [--netns NAME] IFACE...
 *   hf_shim update --pin DIR [--generation G] [--mask M] [--shift S] [--num-entries N] [--control C] [--intervals]
 *                  (--intervals: whitespace-separated k values for match_index 0, 1, ... on stdin)
 *   hf_shim stats  --pin DIR [--reset]
 *   hf_shim dump   --pin DIR --count N
 *
 * It enters only the network namespace (setns CLONE_NEWNET), never the mount namespace: `ip netns exec` remounts
 * /sys privately, which would hide the bpffs where the maps are pinned.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <net/if.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/if_link.h>

#include "hypafilter_shared.h"

#define HF_LOADER_NAME "hf_shim"
#include "hf_loader.h"

#define TC_HANDLE 0x4846
#define TC_PRIORITY 1

/* hf_shim's own options (see the header), after the loaders' common ones (parse_loader_args); shim_option takes
 * them. */
static const struct option options[] = {
	{"generation", required_argument, 0, 'g'}, {"mask", required_argument, 0, 'm'},
	{"shift", required_argument, 0, 's'},	    {"num-entries", required_argument, 0, 'e'},
	{"intervals", no_argument, 0, 'i'},	    {"reset", no_argument, 0, 'r'},
	{"count", required_argument, 0, 'c'},	    {"tc-only", no_argument, 0, 'T'},
	{"control", required_argument, 0, 'k'},
	{0, 0, 0, 0},
};

struct hf_config {
	__u32 generation, mark_mask, mark_shift, num_entries, control; /* control: not in pins from before it */
};

static const char *stat_names[HF_STAT_COUNT] = {"tagged", "untagged", "bad_magic", "stale_gen", "unparsed", "marked",
					       "mirror", "mirror_dropped"};

static int map_fd(const char *pin, const char *name)
{
	char path[PATH_MAX];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", pin, name);
	fd = bpf_obj_get(path);
	if (fd < 0)
		die("map", "%s: %s (is the shim loaded?)", path, strerror(errno));
	return fd;
}

static int cmd_load(const char *obj_path, const char *pin, int generic, int tc_only, char **ifaces, int n)
{
	struct bpf_object *obj;
	struct bpf_program *xdp, *tc;
	int i, err;

	ensure_bpffs();
	mkdirs(pin);
	obj = open_load(obj_path, pin);
	xdp = bpf_object__find_program_by_name(obj, "hf_xdp");
	tc = bpf_object__find_program_by_name(obj, "hf_tc");
	if (!xdp || !tc)
		die("load", "%s lacks hf_xdp or hf_tc", obj_path);

	for (i = 0; i < n; i++) {
		int idx = ifindex_of(ifaces[i]);
		__u32 flags = generic ? XDP_FLAGS_SKB_MODE : XDP_FLAGS_DRV_MODE;
		LIBBPF_OPTS(bpf_tc_hook, hook, .ifindex = idx, .attach_point = BPF_TC_INGRESS);
		LIBBPF_OPTS(bpf_tc_opts, opts, .handle = TC_HANDLE, .priority = TC_PRIORITY,
			    .prog_fd = bpf_program__fd(tc), .flags = BPF_TC_F_REPLACE);

		/* TC first: a frame popped by XDP but not yet marked would still get k = 0, which is safe. */
		err = bpf_tc_hook_create(&hook);
		if (err && err != -EEXIST)
			die("tc", "%s: clsact: %s", ifaces[i], strerror(-err));
		err = bpf_tc_attach(&hook, &opts);
		if (err)
			die("tc", "%s: attach: %s", ifaces[i], strerror(-err));
		if (tc_only)
			continue;
		err = bpf_xdp_attach(idx, bpf_program__fd(xdp), flags, NULL);
		if (err)
			die("xdp", "%s: attach (%s mode): %s", ifaces[i], generic ? "generic" : "native", strerror(-err));
	}
	bpf_object__close(obj);
	return 0;
}

static int cmd_unload(const char *pin, char **ifaces, int n)
{
	char path[PATH_MAX];
	int i, j, err, failed = 0;

	for (i = 0; i < n; i++) {
		int idx = if_nametoindex(ifaces[i]);
		LIBBPF_OPTS(bpf_tc_hook, hook, .ifindex = idx, .attach_point = BPF_TC_INGRESS);
		LIBBPF_OPTS(bpf_tc_opts, opts, .handle = TC_HANDLE, .priority = TC_PRIORITY);

		if (!idx)
			continue; /* interface gone: so are its programs */
		/* Only our XDP program and our TC filter: other users of the interface keep theirs. */
		err = bpf_xdp_detach(idx, XDP_FLAGS_DRV_MODE, NULL);
		if (err)
			err = bpf_xdp_detach(idx, XDP_FLAGS_SKB_MODE, NULL);
		err = bpf_tc_detach(&hook, &opts);
		if (err && err != -ENOENT && err != -EINVAL) {
			fprintf(stderr, "hf_shim: tc: %s: detach: %s\n", ifaces[i], strerror(-err));
			failed = 1;
		}
	}
	for (j = 0; j < 3; j++) {
		const char *names[] = {HF_MAP_INTERVALS, HF_MAP_CONFIG, HF_MAP_STATS};

		snprintf(path, sizeof(path), "%s/%s", pin, names[j]);
		if (unlink(path) && errno != ENOENT) {
			fprintf(stderr, "hf_shim: pin: unlink %s: %s\n", path, strerror(errno));
			failed = 1;
		}
	}
	if (rmdir(pin) && errno != ENOENT && errno != ENOTEMPTY)
		fprintf(stderr, "hf_shim: pin: rmdir %s: %s\n", pin, strerror(errno));
	return failed;
}

/* The pinned hf_config's value size (pins made before the control word have 16 bytes). */
static __u32 config_size(int fd)
{
	struct bpf_map_info info = {0};
	__u32 len = sizeof(info);

	if (bpf_obj_get_info_by_fd(fd, &info, &len))
		die("config", "map info: %s", strerror(errno));
	return info.value_size;
}

static int cmd_update(const char *pin, long long gen, long long mask, long long shift, long long nent, long long ctl,
		      int intervals)
{
	struct hf_config cfg = {0};
	__u32 zero = 0;
	int cfd, ifd;

	if (intervals) {
		size_t cap = 4096, n = 0;
		__u32 *vals = malloc(cap * sizeof(*vals)), *keys;
		unsigned long v;
		__u32 count;
		int err;

		ifd = map_fd(pin, HF_MAP_INTERVALS);
		while (vals && scanf("%lu", &v) == 1) {
			if (n == cap)
				vals = realloc(vals, (cap *= 2) * sizeof(*vals));
			if (!vals)
				break;
			if (n >= HF_MAX_ENTRIES)
				die("intervals", "more than %d values", HF_MAX_ENTRIES);
			vals[n++] = (__u32)v;
		}
		if (!vals)
			die("intervals", "out of memory");
		if (!feof(stdin))
			die("intervals", "bad value after %zu numbers on stdin", n);
		keys = malloc((n ? n : 1) * sizeof(*keys));
		if (!keys)
			die("intervals", "out of memory");
		for (size_t i = 0; i < n; i++)
			keys[i] = (__u32)i;
		count = (__u32)n;
		err = n ? bpf_map_update_batch(ifd, keys, vals, &count, NULL) : 0;
		if (err == -EINVAL || err == -ENOTSUP || err == -EOPNOTSUPP) {
			/* Kernels without batch ops on arrays: one syscall per entry is still fast for 1e5 entries. */
			for (size_t i = 0; i < n; i++)
				if (bpf_map_update_elem(ifd, &keys[i], &vals[i], BPF_ANY))
					die("intervals", "update %zu: %s", i, strerror(errno));
		} else if (err) {
			die("intervals", "batch update: %s", strerror(-err));
		}
		free(keys);
		free(vals);
		close(ifd);
	}
	if (gen < 0 && mask < 0 && shift < 0 && nent < 0 && ctl < 0)
		return 0;
	cfd = map_fd(pin, HF_MAP_CONFIG);
	if (ctl > 0 && config_size(cfd) < sizeof(cfg))
		die("config", "the pinned hf_config predates its control word: unload the shim and load it again");
	if (bpf_map_lookup_elem(cfd, &zero, &cfg))
		die("config", "read: %s", strerror(errno));
	if (gen >= 0)
		cfg.generation = (__u32)gen;
	if (mask >= 0)
		cfg.mark_mask = (__u32)mask;
	if (shift >= 0)
		cfg.mark_shift = (__u32)shift;
	if (nent >= 0)
		cfg.num_entries = (__u32)nent;
	if (ctl >= 0)
		cfg.control = (__u32)ctl;
	if (bpf_map_update_elem(cfd, &zero, &cfg, BPF_ANY))
		die("config", "write: %s", strerror(errno));
	close(cfd);
	return 0;
}

static int cmd_stats(const char *pin, int reset)
{
	int ncpu, sfd, cfd;
	struct hf_config cfg = {0};
	__u64 *vals = percpu_room(&ncpu);
	__u32 zero = 0;

	sfd = map_fd(pin, HF_MAP_STATS);
	cfd = map_fd(pin, HF_MAP_CONFIG);
	if (bpf_map_lookup_elem(cfd, &zero, &cfg))
		die("config", "read: %s", strerror(errno));
	printf("{\"config\": {\"generation\": %u, \"mark_mask\": %u, \"mark_shift\": %u, \"num_entries\": %u, "
	       "\"control\": %u}",
	       cfg.generation, cfg.mark_mask, cfg.mark_shift, cfg.num_entries, cfg.control);
	for (__u32 s = 0; s < HF_STAT_COUNT; s++)
		printf(", \"%s\": %llu", stat_names[s], percpu_sum(sfd, s, vals, ncpu, reset, HF_MAP_STATS));
	printf("}\n");
	free(vals);
	return 0;
}

static int cmd_dump(const char *pin, long long count)
{
	int fd = map_fd(pin, HF_MAP_INTERVALS);
	__u32 v;

	for (__u32 i = 0; i < (__u32)count; i++) {
		if (bpf_map_lookup_elem(fd, &i, &v))
			die("dump", "read %u: %s", i, strerror(errno));
		printf("%u\n", v);
	}
	return 0;
}

static long long num_arg(const char *opt, const char *s)
{
	char *end;
	long long v = strtoll(s, &end, 0);

	if (!*s || *end || v < 0 || v > 0xFFFFFFFFLL)
		die("arguments", "%s: not a 32-bit number: '%s'", opt, s);
	return v;
}

/* What hf_shim's own options say (-1, 0: not given). */
struct shim_args {
	long long gen, mask, shift, nent, ctl, count;
	int intervals, reset, tc_only;
};

static void shim_option(int c, const char *arg, void *ctx)
{
	struct shim_args *s = ctx;

	switch (c) {
	case 'g': s->gen = num_arg("--generation", arg); break;
	case 'm': s->mask = num_arg("--mask", arg); break;
	case 's': s->shift = num_arg("--shift", arg); break;
	case 'e': s->nent = num_arg("--num-entries", arg); break;
	case 'k': s->ctl = num_arg("--control", arg); break;
	case 'i': s->intervals = 1; break;
	case 'r': s->reset = 1; break;
	case 'c': s->count = num_arg("--count", arg); break;
	case 'T': s->tc_only = 1; break;
	default: die("usage", "unknown option");
	}
}

int main(int argc, char **argv)
{
	struct shim_args s = {.gen = -1, .mask = -1, .shift = -1, .nent = -1, .ctl = -1};
	struct loader_args a;
	const char *cmd = parse_loader_args(argc, argv,
					    "hf_shim load|unload|update|stats|dump [options] (see the source's header)",
					    options, &a, shim_option, &s);

	if (!a.pin)
		die("usage", "--pin DIR is required");
	if (!strcmp(cmd, "load")) {
		if (!a.obj || optind >= argc)
			die("usage", "load needs --obj OBJ and at least one interface");
		enter_netns(a.netns);
		return cmd_load(a.obj, a.pin, a.generic, s.tc_only, argv + optind, argc - optind);
	}
	if (!strcmp(cmd, "unload")) {
		enter_netns(a.netns);
		return cmd_unload(a.pin, argv + optind, argc - optind);
	}
	if (!strcmp(cmd, "update"))
		return cmd_update(a.pin, s.gen, s.mask, s.shift, s.nent, s.ctl, s.intervals);
	if (!strcmp(cmd, "stats"))
		return cmd_stats(a.pin, s.reset);
	if (!strcmp(cmd, "dump"))
		return cmd_dump(a.pin, s.count);
	die("usage", "unknown command '%s'", cmd);
	return 2;
}
