/* Helpers the user-space loaders share (driver/hf_shim.c, driver/xdp/hf_xdp.c): errors, libbpf's log, entering a
 * network namespace, the bpffs pin directory, interface indexes, per-CPU counters, the command line and its common
 * options. Each loader defines HF_LOADER_NAME (the prefix of its error messages) before including this file, after
 * the system headers it needs. */
#ifndef HF_LOADER_H
#define HF_LOADER_H

#ifndef HF_LOADER_NAME
#error "define HF_LOADER_NAME before including hf_loader.h"
#endif

#define BPF_FS_MAGIC_NUMBER 0xcafe4a11 /* statfs f_type of a bpffs (linux/magic.h) */

static void die(const char *step, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, HF_LOADER_NAME ": %s: ", step);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

static int libbpf_log(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	/* Verifier logs come at WARN level; they are what one needs when a load fails. */
	if (level == LIBBPF_DEBUG)
		return 0;
	return vfprintf(stderr, fmt, ap);
}

static void enter_netns(const char *name)
{
	char path[PATH_MAX];
	int fd;

	if (!name || !*name)
		return;
	snprintf(path, sizeof(path), "/run/netns/%s", name);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		die("netns", "%s: %s", path, strerror(errno));
	if (setns(fd, CLONE_NEWNET))
		die("netns", "setns %s: %s", name, strerror(errno));
	close(fd);
}

static void mkdirs(const char *dir)
{
	char buf[PATH_MAX];
	char *p;

	snprintf(buf, sizeof(buf), "%s", dir);
	for (p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = 0;
		if (mkdir(buf, 0700) && errno != EEXIST)
			die("pin", "mkdir %s: %s", buf, strerror(errno));
		*p = '/';
	}
	if (mkdir(buf, 0700) && errno != EEXIST)
		die("pin", "mkdir %s: %s", buf, strerror(errno));
}

/* The bpffs that holds HF_PIN_DIR, mounted if this boot has none yet. */
static void ensure_bpffs(void)
{
	struct statfs st;

	if (statfs("/sys/fs/bpf", &st) == 0 && (unsigned long)st.f_type == BPF_FS_MAGIC_NUMBER)
		return;
	if (mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700"))
		die("bpffs", "mount bpf on /sys/fs/bpf: %s", strerror(errno));
}

static int ifindex_of(const char *ifname)
{
	int idx = if_nametoindex(ifname);

	if (!idx)
		die("interface", "%s: no such interface in this namespace", ifname);
	return idx;
}

/* Open and load a BPF object; with `pin`, its maps are pinned (and reused by name) under that directory, so a
 * reload keeps tables and configuration. */
static struct bpf_object *open_load(const char *obj_path, const char *pin)
{
	struct bpf_object *obj = bpf_object__open_file(obj_path, NULL);
	struct bpf_map *map;
	char path[PATH_MAX];
	int err;

	if (!obj)
		die("open", "%s: %s", obj_path, strerror(errno));
	if (pin) {
		bpf_object__for_each_map(map, obj) {
			snprintf(path, sizeof(path), "%s/%s", pin, bpf_map__name(map));
			if (bpf_map__set_pin_path(map, path))
				die("pin", "%s", path);
		}
	}
	err = bpf_object__load(obj);
	if (err)
		die("load", "%s: %s", obj_path, strerror(-err));
	return obj;
}

/* Room for a per-CPU map value of every possible CPU (percpu_sum's `vals`); *ncpu: their count. */
static __u64 *percpu_room(int *ncpu)
{
	__u64 *vals;

	*ncpu = libbpf_num_possible_cpus();
	if (*ncpu <= 0)
		die("stats", "cannot count CPUs");
	vals = calloc(*ncpu, sizeof(*vals));
	if (!vals)
		die("stats", "out of memory");
	return vals;
}

/* The sum over CPUs of per-CPU map `fd`'s value at `key` (`vals`: room for `ncpu` values); zeroed after the read
 * with `reset`. */
static unsigned long long percpu_sum(int fd, __u32 key, __u64 *vals, int ncpu, int reset, const char *what)
{
	unsigned long long sum = 0;

	if (bpf_map_lookup_elem(fd, &key, vals))
		die("stats", "%s[%u]: %s", what, key, strerror(errno));
	for (int c = 0; c < ncpu; c++)
		sum += vals[c];
	if (reset && sum) {
		memset(vals, 0, ncpu * sizeof(*vals));
		if (bpf_map_update_elem(fd, &key, vals, BPF_ANY))
			die("stats", "%s[%u]: reset: %s", what, key, strerror(errno));
	}
	return sum;
}

/* The options every loader takes, before its own in the table getopt_long reads (parse_loader_args). */
static const struct option loader_options[] = {
	{"obj", required_argument, 0, 'o'},
	{"pin", required_argument, 0, 'p'},
	{"netns", required_argument, 0, 'n'},
	{"generic", no_argument, 0, 'G'},
};
#define LOADER_OPTIONS_MAX 32 /* the common and a loader's own options, with the table's end */

/* What those options say (NULL, 0: not given). */
struct loader_args {
	const char *obj, *pin, *netns;
	int generic;
};

/* The command line `loader COMMAND [options] [ARG...]`: returns COMMAND (none: dies with `usage`). getopt_long reads
 * loader_options, then the loader's own `opts` (ending with a zeroed entry); the common ones go into *la, each other
 * one to `other` (getopt_long's answer, its optarg, `ctx`), which dies with "unknown option" on one it does not know
 * ('?'). optind is then the first ARG. libbpf's messages go to libbpf_log from here on. */
static const char *parse_loader_args(int argc, char **argv, const char *usage, const struct option *opts,
				     struct loader_args *la, void (*other)(int opt, const char *arg, void *ctx),
				     void *ctx)
{
	struct option all[LOADER_OPTIONS_MAX] = {0}; /* zeroed: the entries after the last end the table */
	size_t n = sizeof(loader_options) / sizeof(loader_options[0]);
	int c;

	memcpy(all, loader_options, sizeof(loader_options));
	for (const struct option *o = opts; o->name; o++) {
		if (n == LOADER_OPTIONS_MAX - 1)
			die("usage", "more than %d options: raise LOADER_OPTIONS_MAX", LOADER_OPTIONS_MAX - 1);
		all[n++] = *o;
	}
	if (argc < 2)
		die("usage", "%s", usage);
	optind = 2;
	memset(la, 0, sizeof(*la));
	while ((c = getopt_long(argc, argv, "", all, NULL)) != -1) {
		switch (c) {
		case 'o': la->obj = optarg; break;
		case 'p': la->pin = optarg; break;
		case 'n': la->netns = optarg; break;
		case 'G': la->generic = 1; break;
		default: other(c, optarg, ctx);
		}
	}
	libbpf_set_print(libbpf_log);
	return argv[1];
}

#endif
