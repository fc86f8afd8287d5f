/* hf_xdp.c: loader and map tool for the XDP fast path (a fastpath.bpf.o rendered and built per Plan shape).
 *
 *   hf_xdp run    --obj OBJ --tables FILE --frames FILE [--port IF=IPORT[:PAIRED]]... [--repeat N] [--netns NS]
 *                 load the program unattached, fill its maps, run every frame through BPF_PROG_TEST_RUN; prints a
 *                 JSON line {verified_insns, xlated_insns, jited_bytes}, then one line per frame:
 *                 "retval value cookie m_hex ns_per_run peer_ifindex", then the counters as JSON.
 *   hf_xdp run    --pin DIR --frames FILE [--repeat N] [--netns NS]
 *                 the same through a started program with the maps it has (its ports from hfx_ports)
 *   hf_xdp start  --obj OBJ --pin DIR [--netns NS] --port IF=IPORT[:PAIRED]...
 *                 load, pin the program (DIR/prog) and its maps, fill the port tables; not attached
 *   hf_xdp attach --pin DIR --links LDIR [--netns NS] [--generic] IF...
 *                 the pinned program onto each IF through a bpf_link pinned as LDIR/link_<IF>; an existing link
 *                 gets the program replaced atomically (make-before-break)
 *   hf_xdp update --pin DIR --tables FILE          write tables into the pinned maps (CONTROL 0 meanwhile)
 *   hf_xdp overlay --pin DIR [--tables FILE]       write the update buffer and valid mask (and rows) of FILE into a
 *                 running program, each frame deciding throughout (docs/xdp.md "Update buffer (SFL)"); prints what
 *                 changed as JSON. Without --tables: prints them as JSON (valid words, slot rows in hex).
 *   hf_xdp control --pin DIR --value V             rewrite CONTROL
 *   hf_xdp stats  --pin DIR [--reset] [--no-hits]  counters and per-entry hits (--no-hits: counters only) as JSON
 *   hf_xdp links  [--pin DIR] --links LDIR         the pinned program's id and each link's program id
 *   hf_xdp stop   --pin DIR [--links LDIR] [--fallback DIR2]
 *                 links running this program get DIR2's program back (or are detached); its pins removed
 *   hf_xdp detach --pin LDIR                       detach every link of LDIR (undeploy)
 *   hf_xdp watch  --obj OBJ --pin DIR              load the ipset watcher (setwatch.bpf.c): its map hfx_setseq
 *                                                  pinned as DIR/hfx_setseq, each tracepoint link as DIR/link_<prog>;
 *                                                  nothing done when DIR/hfx_setseq and every link exist
 *
 * Tables file: records {u32 name_len, name, u32 value_size, u32 count, count * value_size bytes}, keys 0..count-1,
 * written by hypafilter.targets.xdp.tables. Enters only the network namespace (as hf_shim does).
 */
#define _GNU_SOURCE
#include <dirent.h>
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
#include <time.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/if_link.h>

#include "hypafilter_shared.h"
#include "hf_fastpath.h"

#define HF_LOADER_NAME "hf_xdp"
#include "hf_loader.h"

#define MAX_PORTS 4
#define PROG_NAME "hfx_fastpath"

/* hf_xdp's own options (see the header), after the loaders' common ones (parse_loader_args); xdp_option takes
 * them. */
static const struct option options[] = {
	{"tables", required_argument, 0, 't'}, {"frames", required_argument, 0, 'f'},
	{"port", required_argument, 0, 'P'},   {"repeat", required_argument, 0, 'R'},
	{"reset", no_argument, 0, 'r'},	       {"links", required_argument, 0, 'L'},
	{"value", required_argument, 0, 'V'},  {"fallback", required_argument, 0, 'F'},
	{"no-hits", no_argument, 0, 'H'},
	{0, 0, 0, 0},
};

static const char *cnt_names[HFX_CNT_COUNT] = {
	"PKTIN", "PKTOUT", "CNT_FORWARDED", "CNT_DROPPED", "CNT_SHUNT_OVERRULE", "CNT_SHUNT_POLICY",
	"CNT_SHUNT_UNPARSED", "CNT_FROM_HOST", "CNT_SHUNT_FORCED", "CNT_DROP_UNFILTERABLE", "UNKNOWN_PORT",
	"CNT_SHUNT_STATE", "CNT_MIRROR", "CNT_SETS_UNKNOWN"};

struct port {
	char name[IF_NAMESIZE];
	char paired[IF_NAMESIZE];
	__u32 iport;
};

static void parse_port(const char *arg, struct port *p)
{
	const char *eq = strchr(arg, '='), *colon;
	char *end;
	long v;

	memset(p, 0, sizeof(*p));
	if (!eq || eq == arg || (size_t)(eq - arg) >= IF_NAMESIZE)
		die("arguments", "--port %s: expected IF=IPORT[:PAIRED]", arg);
	memcpy(p->name, arg, eq - arg);
	v = strtol(eq + 1, &end, 10);
	if (end == eq + 1 || v < 0 || v > 3 || (*end && *end != ':'))
		die("arguments", "--port %s: IPORT must be 0..3", arg);
	p->iport = (__u32)v;
	if (*end == ':') {
		colon = end + 1;
		if (!*colon || strlen(colon) >= IF_NAMESIZE)
			die("arguments", "--port %s: bad paired interface", arg);
		strcpy(p->paired, colon);
	}
}

/* --- maps ------------------------------------------------------------------------------------------------------ */

typedef int (*map_fd_fn)(void *ctx, const char *name);

static int obj_map_fd(void *ctx, const char *name)
{
	struct bpf_map *m = bpf_object__find_map_by_name(ctx, name);

	if (!m)
		die("tables", "the program has no map %s (a table for another shape?)", name);
	return bpf_map__fd(m);
}

static int pin_map_fd(void *ctx, const char *name)
{
	char path[PATH_MAX];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", (const char *)ctx, name);
	fd = bpf_obj_get(path);
	if (fd < 0)
		die("map", "%s: %s (is the fast path loaded?)", path, strerror(errno));
	return fd;
}

static void read_exact(FILE *f, void *buf, size_t n, const char *what)
{
	if (n && fread(buf, 1, n, f) != n)
		die("tables", "truncated file (%s)", what);
}

static struct bpf_map_info map_info(int fd, const char *name)
{
	struct bpf_map_info info = {};
	__u32 len = sizeof(info);

	if (bpf_obj_get_info_by_fd(fd, &info, &len))
		die("map", "%s: %s", name, strerror(errno));
	return info;
}

/* Rows keys[0..count) of map `fd` from `vals` (vsize bytes each): one batch syscall where the kernel has it. */
static void update_rows(int fd, __u32 *keys, void *vals, __u32 count, __u32 vsize, const char *name)
{
	__u32 done = count;
	int err = count ? bpf_map_update_batch(fd, keys, vals, &done, NULL) : 0;

	if (err == -EINVAL || err == -ENOTSUP || err == -EOPNOTSUPP) {
		for (__u32 i = 0; i < count; i++)
			if (bpf_map_update_elem(fd, &keys[i], (char *)vals + (size_t)i * vsize, BPF_ANY))
				die("tables", "%s[%u]: %s", name, keys[i], strerror(errno));
	} else if (err) {
		die("tables", "%s: batch update of %u rows: %s", name, count, strerror(-err));
	}
}

/* Rows 0..count) of array map `fd` into `vals`: batch lookups where the kernel has them (a row per syscall costs
 * about a microsecond, and an overlay write reads every hfx_ent row and hfx_box twice). */
static void read_rows(int fd, __u32 count, __u32 vsize, void *vals, const char *name)
{
	__u32 *keys = calloc(count ? count : 1, sizeof(*keys)), done = 0, out = 0;
	int err = 0;

	if (!keys)
		die("map", "out of memory for %s", name);
	while (done < count && !err) {
		__u32 n = count - done;
		LIBBPF_OPTS(bpf_map_batch_opts, opts);

		err = bpf_map_lookup_batch(fd, done ? &out : NULL, &out, keys + done, (char *)vals + (size_t)done * vsize,
					   &n, &opts);
		done += n;
		if (err == -ENOENT) /* the last rows of the map */
			err = 0;
		if (!n)
			break;
	}
	if (err == -EINVAL || err == -ENOTSUP || err == -EOPNOTSUPP || done < count) {
		for (__u32 i = done; i < count; i++)
			if (bpf_map_lookup_elem(fd, &i, (char *)vals + (size_t)i * vsize))
				die("map", "%s[%u]: %s", name, i, strerror(errno));
	} else if (err) {
		die("map", "%s: batch lookup of %u rows: %s", name, count, strerror(-err));
	}
	free(keys);
}

/* The valid mask over the boxes (hfx_vbox's row): bit b set when box b's entry (box[b], hfx_box) is valid in
 * `valid` (hfx_valid's words). */
static void vbox_of(const __u64 *valid, __u32 words, const __u32 *box, __u32 boxes, __u64 *row)
{
	for (__u32 b = 0; b < boxes; b++) {
		__u32 e = box[b] & ~HFX_BOX_WILD;

		if (e / 64 < words && (valid[e / 64] >> (e % 64) & 1))
			row[b / 64] |= 1ULL << (b % 64);
	}
}

/* hfx_vbox (map `ofd`) for the valid words `valid` and the boxes' entries `box` (hfx_box's first `boxes` rows). */
static void write_vbox(int ofd, const __u64 *valid, __u32 words, const __u32 *box, __u32 boxes)
{
	struct bpf_map_info oi = map_info(ofd, "hfx_vbox");
	__u64 *row = calloc(1, oi.value_size);
	__u32 zero = 0;

	if (!row)
		die("tables", "out of memory for hfx_vbox");
	if ((__u64)boxes > (__u64)oi.value_size * 8)
		die("tables", "%u boxes for an hfx_vbox of %u bits", boxes, oi.value_size * 8);
	vbox_of(valid, words, box, boxes, row);
	if (bpf_map_update_elem(ofd, &zero, row, BPF_ANY))
		die("tables", "hfx_vbox: %s", strerror(errno));
	free(row);
}

/* hfx_vbox from hfx_valid (entries) and hfx_box (box -> entry), for the first `boxes` boxes. The program ANDs this
 * row into the lookup, so an invalid entry never matches. */
static void project_valid(map_fd_fn fdof, void *ctx, __u32 boxes, int close_fds)
{
	int vfd = fdof(ctx, "hfx_valid"), bfd = fdof(ctx, "hfx_box"), ofd = fdof(ctx, "hfx_vbox");
	struct bpf_map_info vi = map_info(vfd, "hfx_valid");
	__u64 *valid = calloc(vi.max_entries, 8);
	__u32 *box = calloc(boxes ? boxes : 1, 4);

	if (!valid || !box)
		die("tables", "out of memory for hfx_vbox");
	read_rows(vfd, vi.max_entries, 8, valid, "hfx_valid");
	read_rows(bfd, boxes, 4, box, "hfx_box");
	write_vbox(ofd, valid, vi.max_entries, box, boxes);
	if (close_fds) {
		close(vfd);
		close(bfd);
		close(ofd);
	}
	free(valid);
	free(box);
}

/* Every record of the tables file into its map; hfx_cfg last, so the counts it holds never cover rows not yet
 * written, and hfx_vbox (the valid mask over the boxes) just before it. Returns the number of records. */
static int write_tables(const char *path, map_fd_fn fdof, void *ctx, int close_fds)
{
	FILE *f = fopen(path, "rb");
	void *cfg_val = NULL;
	__u32 cfg_size = 0;
	int records = 0;

	if (!f)
		die("tables", "%s: %s", path, strerror(errno));
	if (close_fds) {
		/* A running program: while rows change it must not mix old and new ones. CONTROL 0 (not enabled)
		 * shunts every frame as unparsed (value 0: the full policy in software) until hfx_cfg is rewritten. */
		struct hfx_config cur;
		__u32 zero = 0;
		int fd = fdof(ctx, "hfx_cfg");

		if (bpf_map_lookup_elem(fd, &zero, &cur))
			die("tables", "hfx_cfg: %s", strerror(errno));
		cur.control = 0;
		if (bpf_map_update_elem(fd, &zero, &cur, BPF_ANY))
			die("tables", "hfx_cfg: %s", strerror(errno));
		close(fd);
	}
	for (;;) {
		__u32 name_len, vsize, count, *keys;
		char name[64];
		void *vals;
		int fd;

		if (fread(&name_len, 4, 1, f) != 1)
			break;
		if (!name_len || name_len >= sizeof(name))
			die("tables", "%s: bad record name length %u", path, name_len);
		read_exact(f, name, name_len, "name");
		name[name_len] = 0;
		read_exact(f, &vsize, 4, "value size");
		read_exact(f, &count, 4, "count");
		if (!vsize || vsize > (1 << 20))
			die("tables", "%s: %s: bad value size %u", path, name, vsize);
		vals = malloc((size_t)vsize * (count ? count : 1));
		keys = malloc(sizeof(*keys) * (count ? count : 1));
		if (!vals || !keys)
			die("tables", "out of memory for %s", name);
		read_exact(f, vals, (size_t)vsize * count, name);
		records++;
		if (!strcmp(name, "hfx_cfg")) {
			free(cfg_val);
			cfg_val = vals;
			cfg_size = vsize;
			free(keys);
			continue;
		}
		fd = fdof(ctx, name);
		for (__u32 i = 0; i < count; i++)
			keys[i] = i;
		update_rows(fd, keys, vals, count, vsize, name);
		if (close_fds)
			close(fd);
		free(vals);
		free(keys);
	}
	fclose(f);
	if (cfg_val) {
		__u32 zero = 0;
		int fd = fdof(ctx, "hfx_cfg");

		if (cfg_size != sizeof(struct hfx_config))
			die("tables", "%s: hfx_cfg of %u bytes, this loader's is %zu", path, cfg_size,
			    sizeof(struct hfx_config));
		project_valid(fdof, ctx, ((struct hfx_config *)cfg_val)->num_boxes, close_fds);
		if (close_fds) {
			/* The program reads the row while it is copied in (no lock): first every new field under
			 * CONTROL 0, then the same row with its CONTROL, so a frame sees either "not enabled" or the
			 * new row whole, never an enabled mix of the old row and the new. */
			struct hfx_config off = *(struct hfx_config *)cfg_val;

			off.control = 0;
			if (bpf_map_update_elem(fd, &zero, &off, BPF_ANY))
				die("tables", "hfx_cfg: %s", strerror(errno));
		}
		if (bpf_map_update_elem(fd, &zero, cfg_val, BPF_ANY))
			die("tables", "hfx_cfg: %s", strerror(errno));
		if (close_fds)
			close(fd);
		free(cfg_val);
	}
	return records;
}

static void write_ports(struct port *ports, int np, map_fd_fn fdof, void *ctx)
{
	int pfd = fdof(ctx, "hfx_ports"), tfd = fdof(ctx, "hfx_tx");
	struct hfx_port_table pt = {};
	__u32 zero = 0;

	for (int i = 0; i < np; i++) {
		pt.ifindex[ports[i].iport] = ifindex_of(ports[i].name);
		if (ports[i].paired[0]) {
			__u32 out = ifindex_of(ports[i].paired);

			if (bpf_map_update_elem(tfd, &ports[i].iport, &out, BPF_ANY))
				die("ports", "%s -> %s: devmap: %s", ports[i].name, ports[i].paired, strerror(errno));
		}
	}
	if (bpf_map_update_elem(pfd, &zero, &pt, BPF_ANY))
		die("ports", "hfx_ports: %s", strerror(errno));
}

/* `run`'s program object with an IPv6 table set: print_counters adds "HITS6", the sum of hfx6_hits over every
 * IPv6 local index (the frames the IPv6 path matched, times the runs of each; -1: no IPv6 table set). */
static struct bpf_map *hits6_map = NULL;

static void print_counters(map_fd_fn fdof, void *ctx, int reset, int hits)
{
	int ncpu, cfd = fdof(ctx, "hfx_cnt"), hfd = fdof(ctx, "hfx_hits"), gfd = fdof(ctx, "hfx_cfg");
	struct hfx_config cfg;
	__u64 *vals = percpu_room(&ncpu);
	__u32 zero = 0;

	if (bpf_map_lookup_elem(gfd, &zero, &cfg))
		die("stats", "hfx_cfg: %s", strerror(errno));
	printf("{\"config\": {\"control\": %u, \"generation\": %u, \"num_entries\": %u, \"num_words\": %u, "
	       "\"armed\": %u, \"num_boxes\": %u, \"buf_depth\": %u, \"buf_scan\": %u}",
	       cfg.control, cfg.generation, cfg.num_entries, cfg.num_words, cfg.armed, cfg.num_boxes, cfg.buf_depth,
	       cfg.buf_scan);
	for (__u32 s = 0; s < HFX_CNT_COUNT; s++)
		printf(", \"%s\": %llu", cnt_names[s], percpu_sum(cfd, s, vals, ncpu, reset, "hfx_cnt"));
	if (hits) {
		printf(", \"HITS\": [");
		/* every hardware index: static entries, the policy entry, the buffer's slots */
		for (__u32 i = 0; i <= cfg.num_entries + cfg.buf_depth; i++)
			printf("%s%llu", i ? ", " : "", percpu_sum(hfd, i, vals, ncpu, reset, "hfx_hits"));
		printf("]");
	}
	if (hits6_map) {
		unsigned long long sum = 0;

		for (__u32 i = 0; i < bpf_map__max_entries(hits6_map); i++)
			sum += percpu_sum(bpf_map__fd(hits6_map), i, vals, ncpu, 0, "hfx6_hits");
		printf(", \"HITS6\": %llu", sum);
	}
	printf("}\n");
	free(vals);
}

static void print_prog_info(int prog_fd)
{
	struct bpf_prog_info info = {};
	__u32 len = sizeof(info);

	if (bpf_obj_get_info_by_fd(prog_fd, &info, &len))
		die("info", "%s", strerror(errno));
	printf("{\"verified_insns\": %u, \"xlated_insns\": %u, \"jited_bytes\": %u}\n", info.verified_insns,
	       info.xlated_prog_len / 8, info.jited_prog_len);
}


/* --- commands -------------------------------------------------------------------------------------------------- */

/* Every frame of the frames file (records {u32 iport, u32 len, len bytes}) through program `pfd` by
 * BPF_PROG_TEST_RUN, `repeat` times each; one line per frame (see the header). */
static void run_frames(int pfd, const char *frames, const __u32 *ifindex_of_iport, int repeat)
{
	unsigned char in[4096], out[4096 + 256];
	FILE *f = fopen(frames, "rb");

	if (!f)
		die("frames", "%s: %s", frames, strerror(errno));
	for (;;) {
		__u32 hdr[2];
		struct xdp_md ctx_in = {}, ctx_out = {};
		LIBBPF_OPTS(bpf_test_run_opts, opts);
		__u32 value = 0, cookie = 0, peer = 0;
		__u64 m = 0;
		int err;

		if (fread(hdr, 4, 2, f) != 2)
			break;
		if (hdr[0] >= MAX_PORTS || hdr[1] > sizeof(in) || hdr[1] < 14)
			die("frames", "bad record (iport %u, length %u)", hdr[0], hdr[1]);
		read_exact(f, in, hdr[1], "frame");
		ctx_in.data_end = hdr[1];
		ctx_in.ingress_ifindex = ifindex_of_iport[hdr[0]];
		opts.data_in = in;
		opts.data_size_in = hdr[1];
		opts.data_out = out;
		opts.data_size_out = sizeof(out);
		opts.ctx_in = &ctx_in;
		opts.ctx_size_in = sizeof(ctx_in);
		opts.ctx_out = &ctx_out;
		opts.ctx_size_out = sizeof(ctx_out);
		opts.repeat = repeat;
		err = bpf_prog_test_run_opts(pfd, &opts);
		if (err)
			die("run", "BPF_PROG_TEST_RUN: %s", strerror(-err));
		if (ctx_out.data - ctx_out.data_meta >= HFX_META_LEN) {
			struct hfx_meta meta;

			memcpy(&meta, out + ctx_out.data - HFX_META_LEN, sizeof(meta));
			value = meta.value;
			cookie = meta.cookie;
			m = meta.m;
			peer = meta.peer;
		}
		printf("%u %u %u %llx %u %u\n", opts.retval, value, cookie, (unsigned long long)m, opts.duration, peer);
	}
	fclose(f);
}

static int cmd_run(const char *obj_path, const char *tables, const char *frames, struct port *ports, int np,
		   int repeat)
{
	struct bpf_object *obj = open_load(obj_path, NULL);
	struct bpf_program *prog = bpf_object__find_program_by_name(obj, PROG_NAME);
	__u32 ifindex_of_iport[MAX_PORTS] = {0};
	int pfd;

	if (!prog)
		die("load", "%s lacks %s", obj_path, PROG_NAME);
	pfd = bpf_program__fd(prog);
	write_ports(ports, np, obj_map_fd, obj);
	for (int i = 0; i < np; i++)
		ifindex_of_iport[ports[i].iport] = ifindex_of(ports[i].name);
	write_tables(tables, obj_map_fd, obj, 0);
	print_prog_info(pfd);
	run_frames(pfd, frames, ifindex_of_iport, repeat);
	hits6_map = bpf_object__find_map_by_name(obj, "hfx6_hits");
	print_counters(obj_map_fd, obj, 0, 1);
	bpf_object__close(obj);
	return 0;
}

static int pinned_prog(const char *pin);

/* The frames through a started program as its maps are (a deployment's, or one a test wrote overlays into); the
 * counters printed are the program's, frames before these included. */
static int cmd_run_pinned(const char *pin, const char *frames, int repeat)
{
	int pfd = pinned_prog(pin), fd = pin_map_fd((void *)pin, "hfx_ports");
	struct hfx_port_table pt;
	__u32 zero = 0;

	if (bpf_map_lookup_elem(fd, &zero, &pt))
		die("ports", "hfx_ports: %s", strerror(errno));
	close(fd);
	print_prog_info(pfd);
	run_frames(pfd, frames, pt.ifindex, repeat);
	print_counters(pin_map_fd, (void *)pin, 0, 1);
	return 0;
}

/* --- the update buffer ------------------------------------------------------------------------------------------ */

struct record {
	__u32 vsize, count;
	void *vals;
};

/* The records of an overlay file (tables-file format): n_static (the static entries it is for), hfx_valid, hfx_buf
 * and hfx_ent; others refused. */
static void read_overlay_file(const char *path, struct record *n, struct record *valid, struct record *buf,
			      struct record *ent)
{
	FILE *f = fopen(path, "rb");

	if (!f)
		die("overlay", "%s: %s", path, strerror(errno));
	for (;;) {
		__u32 name_len;
		char name[64];
		struct record r, *into;

		if (fread(&name_len, 4, 1, f) != 1)
			break;
		if (!name_len || name_len >= sizeof(name))
			die("overlay", "%s: bad record name length %u", path, name_len);
		read_exact(f, name, name_len, "name");
		name[name_len] = 0;
		read_exact(f, &r.vsize, 4, "value size");
		read_exact(f, &r.count, 4, "count");
		into = !strcmp(name, "n_static")    ? n
		       : !strcmp(name, "hfx_valid") ? valid
		       : !strcmp(name, "hfx_buf")   ? buf
		       : !strcmp(name, "hfx_ent")   ? ent
						    : 0;
		if (!into)
			die("overlay", "%s: record %s is not part of an overlay", path, name);
		if (!r.vsize || r.vsize > (1 << 20) || r.count > (1 << 24))
			die("overlay", "%s: %s: bad size", path, name);
		r.vals = malloc((size_t)r.vsize * (r.count ? r.count : 1));
		if (!r.vals)
			die("overlay", "out of memory for %s", name);
		read_exact(f, r.vals, (size_t)r.vsize * r.count, name);
		*into = r;
	}
	fclose(f);
}

/* Rows of `r` that differ from the map's (read into `cur`), written to map `fd` in one batch: their number. */
static __u32 write_changed(int fd, struct record *r, void *cur, __u32 *keys, const char *name)
{
	__u32 k = 0;
	char *vals = malloc((size_t)r->vsize * (r->count ? r->count : 1));

	if (!vals)
		die("overlay", "out of memory for %s", name);
	for (__u32 i = 0; i < r->count; i++) {
		if (!memcmp((char *)r->vals + (size_t)i * r->vsize, (char *)cur + (size_t)i * r->vsize, r->vsize))
			continue;
		memcpy(vals + (size_t)k * r->vsize, (char *)r->vals + (size_t)i * r->vsize, r->vsize);
		keys[k++] = i;
	}
	update_rows(fd, keys, vals, k, r->vsize, name);
	free(vals);
	return k;
}

/* hfx_vbox's fd in *ofd and hfx_box's first `boxes` rows in *box: read once, the first time the valid mask changes. */
static void open_vbox(const char *pin, int *ofd, __u32 **box, __u32 boxes)
{
	if (*ofd >= 0)
		return;
	*box = calloc(boxes ? boxes : 1, 4);
	if (!*box)
		die("overlay", "out of memory");
	read_rows(pin_map_fd((void *)pin, "hfx_box"), boxes, 4, *box, "hfx_box");
	*ofd = pin_map_fd((void *)pin, "hfx_vbox");
}

static void write_scan(int fd, struct hfx_config *cfg, __u32 scan)
{
	__u32 zero = 0;

	/* The row is copied in without a lock: the other fields are rewritten with the values they hold, so a frame
	 * reads either bound, whole. */
	if (cfg->buf_scan == scan)
		return;
	cfg->buf_scan = scan;
	if (bpf_map_update_elem(fd, &zero, cfg, BPF_ANY))
		die("overlay", "hfx_cfg: %s", strerror(errno));
}

/* The overlay of `path` into the running program of `pin`, every frame deciding throughout (no CONTROL 0):
 *   1. slots whose row changes are disabled (their old fields, enable 0);
 *   2. their new fields written, still disabled, and every hfx_ent row that changes (a slot's rows while it is
 *      disabled; a static entry's row is one 8-byte copy);
 *   3. the valid mask becomes old | new (an entry that comes back is valid before the slot that stood in for it
 *      goes), the scan bound the larger of the old and the new;
 *   4. the changed slots that the overlay enables are enabled;
 *   5. the valid mask becomes the new one (an entry leaves only once the slots placed for its successor are on),
 *      the scan bound the new one.
 * Enabled slots stay sorted by position at every step (the program's scan relies on it). Prints what it wrote. */
static int cmd_overlay_write(const char *pin, const char *path)
{
	struct record n = {}, valid = {}, buf = {}, ent = {};
	struct hfx_config cfg;
	struct timespec t0, t1;
	int cfd = pin_map_fd((void *)pin, "hfx_cfg"), vfd = pin_map_fd((void *)pin, "hfx_valid"), bfd = -1, efd;
	__u32 zero = 0, depth = 0, scan = 0, changed = 0, rows = 0, *keys;
	__u64 *cur_valid, *mixed;
	struct hfx_slot *cur = NULL, *want;
	unsigned char *chg = NULL; /* per slot: its row changes */
	__u32 *box = NULL;	   /* hfx_box's rows, read when the valid mask changes (open_vbox) */
	int ofd = -1;
	struct bpf_map_info vi = map_info(vfd, "hfx_valid");

	clock_gettime(CLOCK_MONOTONIC, &t0);
	read_overlay_file(path, &n, &valid, &buf, &ent);
	if (bpf_map_lookup_elem(cfd, &zero, &cfg))
		die("overlay", "hfx_cfg: %s", strerror(errno));
	if (!(cfg.armed & HFX_CONTROL_ENABLE))
		die("overlay", "%s: no tables written yet (hf_xdp update first)", pin);
	if (n.vsize != 4 || n.count != 1 || *(__u32 *)n.vals != cfg.num_entries)
		die("overlay", "%s: an overlay for %u static entries, the program has %u", path,
		    n.count ? *(__u32 *)n.vals : 0, cfg.num_entries);
	if (ent.count && ent.count != cfg.num_entries + 1 + cfg.buf_depth)
		die("overlay", "%s: %u rows, the program has %u", path, ent.count, cfg.num_entries + 1 + cfg.buf_depth);
	if (valid.vsize != 8 || valid.count != vi.max_entries)
		die("overlay", "%s: hfx_valid of %u words, the program has %u", path, valid.count, vi.max_entries);
	if (buf.count) {
		bfd = pin_map_fd((void *)pin, "hfx_buf");
		depth = map_info(bfd, "hfx_buf").max_entries;
	}
	if (buf.count != depth || buf.count != cfg.buf_depth || (buf.count && buf.vsize != sizeof(struct hfx_slot)))
		die("overlay", "%s: %u buffer slots, the program has %u", path, buf.count, cfg.buf_depth);
	keys = calloc(vi.max_entries + depth + (ent.count ? ent.count : 1), sizeof(*keys));
	cur_valid = calloc(vi.max_entries, 8);
	mixed = calloc(vi.max_entries, 8);
	if (!keys || !cur_valid || !mixed)
		die("overlay", "out of memory");
	read_rows(vfd, vi.max_entries, 8, cur_valid, "hfx_valid");
	want = buf.vals;
	if (depth) {
		cur = calloc(depth, sizeof(*cur));
		chg = calloc(depth, 1);
		if (!cur || !chg)
			die("overlay", "out of memory");
		read_rows(bfd, depth, sizeof(*cur), cur, "hfx_buf");
	}
	for (__u32 b = 0; b < depth; b++) {
		if (want[b].enable)
			scan = b + 1;
		chg[b] = memcmp(&want[b], &cur[b], sizeof(*cur)) != 0;
		changed += chg[b];
		if (chg[b] && cur[b].enable) { /* 1. */
			cur[b].enable = 0;
			if (bpf_map_update_elem(bfd, &b, &cur[b], BPF_ANY))
				die("overlay", "hfx_buf[%u]: %s", b, strerror(errno));
		}
	}
	if (depth) { /* 2. the changing slots' new fields, disabled; every other slot as it is */
		struct hfx_slot *off = malloc(depth * sizeof(*off));
		struct record r = {sizeof(*off), depth, off};

		if (!off)
			die("overlay", "out of memory");
		for (__u32 b = 0; b < depth; b++) {
			off[b] = chg[b] ? want[b] : cur[b];
			if (chg[b])
				off[b].enable = 0;
		}
		write_changed(bfd, &r, cur, keys, "hfx_buf");
		free(off);
	}
	if (ent.count) {
		struct bpf_map_info ei;
		void *cur_ent;

		efd = pin_map_fd((void *)pin, "hfx_ent");
		ei = map_info(efd, "hfx_ent");
		if (ent.vsize != ei.value_size || ent.count > ei.max_entries)
			die("overlay", "%s: %u rows of %u bytes for hfx_ent", path, ent.count, ent.vsize);
		cur_ent = malloc((size_t)ent.vsize * ent.count);
		if (!cur_ent)
			die("overlay", "out of memory");
		read_rows(efd, ent.count, ent.vsize, cur_ent, "hfx_ent");
		rows = write_changed(efd, &ent, cur_ent, keys, "hfx_ent");
		free(cur_ent);
		close(efd);
	}
	for (__u32 w = 0; w < vi.max_entries; w++) /* 3. */
		mixed[w] = cur_valid[w] | ((__u64 *)valid.vals)[w];
	{
		struct record r = {8, vi.max_entries, mixed};

		if (write_changed(vfd, &r, cur_valid, keys, "hfx_valid")) {
			open_vbox(pin, &ofd, &box, cfg.num_boxes);
			write_vbox(ofd, mixed, vi.max_entries, box, cfg.num_boxes);
		}
	}
	write_scan(cfd, &cfg, scan > cfg.buf_scan ? scan : cfg.buf_scan);
	for (__u32 b = 0; b < depth; b++) /* 4. */
		if (chg[b] && want[b].enable && bpf_map_update_elem(bfd, &b, &want[b], BPF_ANY))
			die("overlay", "hfx_buf[%u]: %s", b, strerror(errno));
	if (write_changed(vfd, &valid, mixed, keys, "hfx_valid")) { /* 5. */
		open_vbox(pin, &ofd, &box, cfg.num_boxes);
		write_vbox(ofd, valid.vals, vi.max_entries, box, cfg.num_boxes);
	}
	write_scan(cfd, &cfg, scan);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	free(keys);
	free(cur_valid);
	free(mixed);
	free(cur);
	free(chg);
	free(box);
	printf("{\"slots_changed\": %u, \"rows_changed\": %u, \"buf_scan\": %u, \"us\": %.1f}\n", changed, rows, scan,
	       (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3);
	return 0;
}

/* What the program's buffer and valid mask hold, as JSON: valid words, slot rows (hex of struct hfx_slot), and
 * whether hfx_vbox is the projection of hfx_valid the loader writes. */
static int cmd_overlay_read(const char *pin)
{
	int cfd = pin_map_fd((void *)pin, "hfx_cfg"), vfd = pin_map_fd((void *)pin, "hfx_valid");
	int ofd = pin_map_fd((void *)pin, "hfx_vbox"), bfd = pin_map_fd((void *)pin, "hfx_box");
	struct bpf_map_info vi = map_info(vfd, "hfx_valid"), oi = map_info(ofd, "hfx_vbox");
	__u64 *valid = calloc(vi.max_entries, 8), *vbox = calloc(1, oi.value_size), *want = calloc(1, oi.value_size);
	struct hfx_config cfg;
	__u32 zero = 0, *box;

	if (!valid || !vbox || !want)
		die("overlay", "out of memory");
	if (bpf_map_lookup_elem(cfd, &zero, &cfg))
		die("overlay", "hfx_cfg: %s", strerror(errno));
	if ((__u64)cfg.num_boxes > (__u64)oi.value_size * 8)
		die("overlay", "%u boxes for an hfx_vbox of %u bits", cfg.num_boxes, oi.value_size * 8);
	box = calloc(cfg.num_boxes ? cfg.num_boxes : 1, 4);
	if (!box)
		die("overlay", "out of memory");
	read_rows(vfd, vi.max_entries, 8, valid, "hfx_valid");
	read_rows(ofd, 1, oi.value_size, vbox, "hfx_vbox");
	read_rows(bfd, cfg.num_boxes, 4, box, "hfx_box");
	vbox_of(valid, vi.max_entries, box, cfg.num_boxes, want);
	printf("{\"num_entries\": %u, \"buf_depth\": %u, \"buf_scan\": %u, \"vbox_ok\": %s, \"valid\": [",
	       cfg.num_entries, cfg.buf_depth, cfg.buf_scan, memcmp(vbox, want, oi.value_size) ? "false" : "true");
	for (__u32 w = 0; w < vi.max_entries; w++)
		printf("%s%llu", w ? ", " : "", (unsigned long long)valid[w]);
	printf("], \"slots\": [");
	if (cfg.buf_depth) {
		int sfd = pin_map_fd((void *)pin, "hfx_buf");

		for (__u32 b = 0; b < cfg.buf_depth; b++) {
			struct hfx_slot s;

			if (bpf_map_lookup_elem(sfd, &b, &s))
				die("overlay", "hfx_buf[%u]: %s", b, strerror(errno));
			printf("%s\"", b ? ", " : "");
			for (size_t i = 0; i < sizeof(s); i++)
				printf("%02x", ((unsigned char *)&s)[i]);
			printf("\"");
		}
	}
	printf("]}\n");
	return 0;
}

static void link_path(char *buf, size_t n, const char *dir, const char *ifname)
{
	snprintf(buf, n, "%s/link_%s", dir, ifname);
}

static __u32 prog_id_of_fd(int fd)
{
	struct bpf_prog_info info = {};
	__u32 len = sizeof(info);

	if (bpf_obj_get_info_by_fd(fd, &info, &len))
		die("info", "%s", strerror(errno));
	return info.id;
}

static int pinned_prog(const char *pin)
{
	char path[PATH_MAX];
	int fd;

	snprintf(path, sizeof(path), "%s/prog", pin);
	fd = bpf_obj_get(path);
	if (fd < 0)
		die("prog", "%s: %s (was the fast path started?)", path, strerror(errno));
	return fd;
}

/* Load the program, pin it (DIR/prog) and its maps (DIR/<map>), fill the port tables; attached by `attach`. Until
 * `update` writes hfx_cfg, CONTROL is 0: every frame is passed with value 0 (the full policy in software). */
static int cmd_start(const char *obj_path, const char *pin, struct port *ports, int np)
{
	struct bpf_object *obj;
	struct bpf_program *prog;
	char path[PATH_MAX];

	ensure_bpffs();
	mkdirs(pin);
	obj = open_load(obj_path, pin);
	prog = bpf_object__find_program_by_name(obj, PROG_NAME);
	if (!prog)
		die("load", "%s lacks %s", obj_path, PROG_NAME);
	write_ports(ports, np, obj_map_fd, obj);
	snprintf(path, sizeof(path), "%s/prog", pin);
	unlink(path);
	if (bpf_program__pin(prog, path))
		die("pin", "%s: %s", path, strerror(errno));
	bpf_object__close(obj);
	return 0;
}

/* The pinned program onto every interface through a bpf_link pinned as LINKS/link_<IF>; where our link exists,
 * its program is replaced in one step (frames see the old program or the new one, never none). A program attached
 * the old way (netlink, e.g. the shim's hf_xdp) is detached first: in that instant frames reach TC without
 * metadata, value 0, the full policy in software. */
static int cmd_attach(const char *pin, const char *links, int generic, char **ifaces, int n)
{
	int pfd = pinned_prog(pin);
	char path[PATH_MAX];

	ensure_bpffs();
	mkdirs(links);
	for (int i = 0; i < n; i++) {
		int idx = ifindex_of(ifaces[i]), lfd;
		LIBBPF_OPTS(bpf_link_create_opts, lo, .flags = generic ? XDP_FLAGS_SKB_MODE : XDP_FLAGS_DRV_MODE);

		link_path(path, sizeof(path), links, ifaces[i]);
		lfd = bpf_obj_get(path);
		if (lfd >= 0) {
			if (bpf_link_update(lfd, pfd, NULL))
				die("xdp", "%s: replace program: %s", ifaces[i], strerror(errno));
			close(lfd);
			continue;
		}
		bpf_xdp_detach(idx, XDP_FLAGS_DRV_MODE, NULL);
		bpf_xdp_detach(idx, XDP_FLAGS_SKB_MODE, NULL);
		lfd = bpf_link_create(pfd, idx, BPF_XDP, &lo);
		if (lfd < 0)
			die("xdp", "%s: attach (%s mode): %s", ifaces[i], generic ? "generic" : "native", strerror(errno));
		if (bpf_obj_pin(lfd, path))
			die("xdp", "pin %s: %s", path, strerror(errno));
		close(lfd);
	}
	return 0;
}

/* The next link pinned in directory `d` (`links`), by its "link_IF" name: an fd (its path in `path`, its name in
 * `*name`), or -1 when there is none left. */
static int next_link(DIR *d, const char *links, char *path, size_t size, const char **name)
{
	struct dirent *e;

	while ((e = readdir(d))) {
		int lfd;

		if (strncmp(e->d_name, "link_", 5))
			continue;
		snprintf(path, size, "%s/%s", links, e->d_name);
		lfd = bpf_obj_get(path);
		if (lfd < 0)
			continue;
		*name = e->d_name;
		return lfd;
	}
	return -1;
}

/* Unlinks each entry of the open directory `d` (path `dir`) whose name starts with `prefix` ("": each one), dot
 * names left alone, then closes it: 1 when one could not be removed (printed), else 0. */
static int unlink_entries(DIR *d, const char *dir, const char *prefix)
{
	char path[PATH_MAX];
	struct dirent *e;
	int failed = 0;

	while ((e = readdir(d))) {
		if (e->d_name[0] == '.' || strncmp(e->d_name, prefix, strlen(prefix)))
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		if (unlink(path)) {
			fprintf(stderr, "hf_xdp: unlink %s: %s\n", path, strerror(errno));
			failed = 1;
		}
	}
	closedir(d);
	return failed;
}

/* Remove a started program: links that still run it get the --fallback program back (a rolled-back update: the
 * previous program) or, without one, are unpinned (detached); then its pins go. Links running another program (the
 * one that replaced it) stay. */
static int cmd_stop(const char *pin, const char *links, const char *fallback)
{
	char path[PATH_MAX];
	const char *name;
	__u32 id = 0;
	int failed = 0, ffd = fallback ? pinned_prog(fallback) : -1, lfd;
	DIR *d;

	snprintf(path, sizeof(path), "%s/prog", pin);
	{
		int pfd = bpf_obj_get(path);

		if (pfd >= 0) {
			id = prog_id_of_fd(pfd);
			close(pfd);
		}
	}
	if (links && id && (d = opendir(links))) {
		while ((lfd = next_link(d, links, path, sizeof(path), &name)) >= 0) {
			struct bpf_link_info info = {};
			__u32 len = sizeof(info);

			if (!bpf_obj_get_info_by_fd(lfd, &info, &len) && info.prog_id == id) {
				if (ffd >= 0) {
					if (bpf_link_update(lfd, ffd, NULL)) {
						fprintf(stderr, "hf_xdp: %s: back to the fallback: %s\n", path, strerror(errno));
						failed = 1;
					}
				} else if (unlink(path)) {
					fprintf(stderr, "hf_xdp: unlink %s: %s\n", path, strerror(errno));
					failed = 1;
				}
			}
			close(lfd);
		}
		closedir(d);
	}
	d = opendir(pin);
	if (!d)
		return errno == ENOENT ? failed : (die("stop", "%s: %s", pin, strerror(errno)), 1);
	failed |= unlink_entries(d, pin, "");
	if (rmdir(pin) && errno != ENOENT)
		fprintf(stderr, "hf_xdp: rmdir %s: %s\n", pin, strerror(errno));
	return failed;
}

/* Which program each pinned link runs: "IF prog_id" lines, and the id of the pinned program of --pin. */
static int cmd_links(const char *pin, const char *links)
{
	char path[PATH_MAX];
	const char *name;
	int lfd;
	DIR *d;

	if (pin) {
		int pfd = pinned_prog(pin);

		printf("prog %u\n", prog_id_of_fd(pfd));
		close(pfd);
	}
	d = opendir(links);
	if (!d)
		return 0;
	while ((lfd = next_link(d, links, path, sizeof(path), &name)) >= 0) {
		struct bpf_link_info info = {};
		__u32 len = sizeof(info);

		if (!bpf_obj_get_info_by_fd(lfd, &info, &len))
			printf("%s %u %u\n", name + 5, info.prog_id, info.xdp.ifindex);
		close(lfd);
	}
	closedir(d);
	return 0;
}

static int cmd_control(const char *pin, long value)
{
	struct hfx_config cfg;
	__u32 zero = 0;
	int fd = pin_map_fd((void *)pin, "hfx_cfg");

	if (bpf_map_lookup_elem(fd, &zero, &cfg))
		die("control", "hfx_cfg: %s", strerror(errno));
	cfg.control = (__u32)value;
	if (bpf_map_update_elem(fd, &zero, &cfg, BPF_ANY))
		die("control", "hfx_cfg: %s", strerror(errno));
	return 0;
}

/* Detach every link of LINKS (undeploy), then remove the directory. */
static int cmd_detach(const char *links)
{
	DIR *d = opendir(links);
	int failed;

	if (!d)
		return 0;
	failed = unlink_entries(d, links, "link_");
	rmdir(links);
	return failed;
}

/* What hf_xdp's own options say (NULL, 0: not given; value -1, repeat 1). */
struct xdp_args {
	const char *tables, *frames, *links, *fallback;
	long value;
	struct port ports[MAX_PORTS];
	int np, repeat, reset, no_hits;
};

static void xdp_option(int c, const char *arg, void *ctx)
{
	struct xdp_args *x = ctx;

	switch (c) {
	case 't': x->tables = arg; break;
	case 'f': x->frames = arg; break;
	case 'P':
		if (x->np == MAX_PORTS)
			die("usage", "at most %d --port", MAX_PORTS);
		parse_port(arg, &x->ports[x->np]);
		for (int i = 0; i < x->np; i++)
			if (x->ports[i].iport == x->ports[x->np].iport)
				die("usage", "--port %s: port %u is %s already", arg, x->ports[x->np].iport,
				    x->ports[i].name);
		x->np++;
		break;
	case 'R':
		x->repeat = atoi(arg);
		if (x->repeat < 1)
			die("usage", "--repeat must be >= 1");
		break;
	case 'r': x->reset = 1; break;
	case 'H': x->no_hits = 1; break;
	case 'L': x->links = arg; break;
	case 'F': x->fallback = arg; break;
	case 'V':
		x->value = strtol(arg, NULL, 0);
		if (x->value < 0 || x->value > 0xFF)
			die("usage", "--value must be a CONTROL value 0..255");
		break;
	default: die("usage", "unknown option");
	}
}

/* The ipset watcher (setwatch.bpf.c), loaded once per host: its counts map pinned in `pin` (reused when there), each
 * program attached as its section says and the link pinned beside it, so it outlives this process. */
static int cmd_watch(const char *obj_path, const char *pin)
{
	struct bpf_object *obj;
	struct bpf_program *prog;
	char path[PATH_MAX];
	int missing = 0;

	ensure_bpffs();
	mkdirs(pin);
	obj = bpf_object__open_file(obj_path, NULL);
	if (!obj)
		die("open", "%s: %s", obj_path, strerror(errno));
	bpf_object__for_each_program(prog, obj) {
		snprintf(path, sizeof(path), "%s/link_%s", pin, bpf_program__name(prog));
		if (access(path, F_OK))
			missing++;
	}
	snprintf(path, sizeof(path), "%s/hfx_setseq", pin);
	if (!missing && !access(path, F_OK)) {
		bpf_object__close(obj);
		return 0;
	}
	bpf_object__close(obj);
	/* libbpf reads a tracepoint's id from tracefs: without it the attach fails with a bare ENOENT */
	if (access("/sys/kernel/tracing/events", F_OK) && access("/sys/kernel/debug/tracing/events", F_OK))
		die("watch", "tracefs is not mounted (the set watcher's tracepoints need it): "
			     "mount -t tracefs tracefs /sys/kernel/tracing, or run scripts/setup.sh system");
	obj = open_load(obj_path, pin);
	bpf_object__for_each_program(prog, obj) {
		struct bpf_link *link;

		snprintf(path, sizeof(path), "%s/link_%s", pin, bpf_program__name(prog));
		if (!access(path, F_OK))
			continue;
		link = bpf_program__attach(prog);
		if (!link)
			die("watch", "attach %s: %s", bpf_program__name(prog), strerror(errno));
		if (bpf_link__pin(link, path))
			die("watch", "pin %s: %s", path, strerror(errno));
		bpf_link__disconnect(link);
		bpf_link__destroy(link);
	}
	bpf_object__close(obj);
	return 0;
}

int main(int argc, char **argv)
{
	struct xdp_args x = {.value = -1, .repeat = 1};
	struct loader_args a;
	const char *cmd = parse_loader_args(
		argc, argv, "hf_xdp run|start|attach|update|overlay|control|stats|links|stop|detach|watch [options] (see the source's header)",
		options, &a, xdp_option, &x);

	if (optind != argc && strcmp(cmd, "attach"))
		die("usage", "unexpected argument '%s'", argv[optind]);
	if (!strcmp(cmd, "run") && a.pin && !a.obj) {
		if (!x.frames || x.tables || x.np)
			die("usage", "run --pin takes --frames (the program's own tables and ports)");
		enter_netns(a.netns);
		return cmd_run_pinned(a.pin, x.frames, x.repeat);
	}
	if (!strcmp(cmd, "run")) {
		if (!a.obj || !x.tables || !x.frames)
			die("usage", "run needs --obj, --tables and --frames");
		enter_netns(a.netns);
		return cmd_run(a.obj, x.tables, x.frames, x.ports, x.np, x.repeat);
	}
	if (!strcmp(cmd, "links") && x.links)
		return cmd_links(a.pin, x.links);
	if (!a.pin)
		die("usage", "--pin DIR is required");
	if (!strcmp(cmd, "watch")) {
		if (!a.obj)
			die("usage", "watch needs --obj");
		return cmd_watch(a.obj, a.pin);
	}
	if (!strcmp(cmd, "start")) {
		if (!a.obj)
			die("usage", "start needs --obj");
		enter_netns(a.netns);
		return cmd_start(a.obj, a.pin, x.ports, x.np);
	}
	if (!strcmp(cmd, "attach")) {
		if (!x.links || optind >= argc)
			die("usage", "attach needs --links DIR and at least one interface");
		enter_netns(a.netns);
		return cmd_attach(a.pin, x.links, a.generic, argv + optind, argc - optind);
	}
	if (!strcmp(cmd, "stop"))
		return cmd_stop(a.pin, x.links, x.fallback);
	if (!strcmp(cmd, "links"))
		return cmd_links(a.pin, x.links ? x.links : a.pin);
	if (!strcmp(cmd, "control")) {
		if (x.value < 0)
			die("usage", "control needs --value");
		return cmd_control(a.pin, x.value);
	}
	if (!strcmp(cmd, "update")) {
		if (!x.tables)
			die("usage", "update needs --tables");
		write_tables(x.tables, pin_map_fd, (void *)a.pin, 1);
		return 0;
	}
	if (!strcmp(cmd, "overlay"))
		return x.tables ? cmd_overlay_write(a.pin, x.tables) : cmd_overlay_read(a.pin);
	if (!strcmp(cmd, "stats")) {
		print_counters(pin_map_fd, (void *)a.pin, x.reset, !x.no_hits);
		return 0;
	}
	if (!strcmp(cmd, "detach"))
		return cmd_detach(a.pin);
	die("usage", "unknown command '%s'", cmd);
	return 2;
}
