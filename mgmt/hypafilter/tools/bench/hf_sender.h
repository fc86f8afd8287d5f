/* What the bench's frame senders (hf_blast.c, hf_live.c) share: their command line's common part and CPU pinning,
 * the frames file, the allowance read from stdin in "once" mode, their clocks and the JSON line they end with. Static
 * functions: each sender includes it once. */
#ifndef HF_SENDER_H
#define HF_SENDER_H
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The arguments both senders take, in this order: IFACE FRAMES_FILE SECONDS|once [BATCH [CPU]]. */
struct sender_args {
	const char *ifname;
	const char *frames_path;
	int once;	/* "once": every frame exactly once, under the allowance from stdin */
	double seconds; /* otherwise: for this long (> 0) */
	unsigned batch; /* 1..batch_max; batch_default when absent */
	int cpu;	/* >= 0: pin to that CPU; absent or negative: no pinning */
};

/* The sender arguments from argv[first..argc-1] into *a; `usage` (the program's own, printed on an error) names the
 * arguments before `first`. 2 with a message naming the bad argument (the usage's exit status), else 0. */
static int parse_sender_args(int argc, char **argv, int first, const char *usage, unsigned batch_default,
			     unsigned batch_max, struct sender_args *a)
{
	int left = argc - first;
	if (left < 3 || left > 5) {
		fprintf(stderr, "usage: %s %s\n", argv[0], usage);
		return 2;
	}
	a->ifname = argv[first];
	a->frames_path = argv[first + 1];
	const char *what = argv[first + 2];
	a->once = strcmp(what, "once") == 0;
	a->seconds = 0;
	if (!a->once) {
		char *end;
		errno = 0;
		a->seconds = strtod(what, &end);
		if (errno || end == what || *end || !isfinite(a->seconds) || a->seconds <= 0) {
			fprintf(stderr, "%s: SECONDS: '%s' is neither 'once' nor a positive number\n", argv[0], what);
			return 2;
		}
	}
	a->batch = batch_default;
	a->cpu = -1;
	for (int i = 3; i < left; i++) {
		const char *arg = argv[first + i];
		char *end;
		errno = 0;
		long v = strtol(arg, &end, 10);
		if (errno || end == arg || *end) {
			fprintf(stderr, "%s: %s: '%s' is not an integer\n", argv[0], i == 3 ? "BATCH" : "CPU", arg);
			return 2;
		}
		if (i == 3) {
			if (v < 1 || v > (long)batch_max) {
				fprintf(stderr, "%s: BATCH: %ld is not in 1..%u\n", argv[0], v, batch_max);
				return 2;
			}
			a->batch = (unsigned)v;
		} else {
			a->cpu = v < 0 ? -1 : v > INT_MAX ? INT_MAX : (int)v;
		}
	}
	return 0;
}

/* The allowance from stdin: blocks only when nothing more may be sent. */
static unsigned long long allowance(unsigned long long have, unsigned long long sent, int *eof)
{
	static char line[64];
	static size_t used;
	while (!*eof && have <= sent) {
		ssize_t r = read(0, line + used, sizeof(line) - 1 - used);
		if (r <= 0) {
			*eof = 1;
			break;
		}
		used += (size_t)r;
		line[used] = 0;
		char *nl;
		while ((nl = strchr(line, '\n')) != NULL) {
			unsigned long long v = strtoull(line, NULL, 10);
			if (v > have)
				have = v;
			used -= (size_t)(nl + 1 - line);
			memmove(line, nl + 1, used + 1);
		}
	}
	return *eof ? ~0ULL : have;
}

static double cpu_seconds(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Pins the process to `cpu` (>= 0; below: nothing). -1 with the error printed when the kernel refuses. */
static int pin_cpu(int cpu)
{
	if (cpu < 0)
		return 0;
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof(set), &set) < 0) {
		perror("sched_setaffinity");
		return -1;
	}
	return 0;
}

/* The command line (parse_sender_args), then the CPU pinning (pin_cpu) of a sender's start: 0, or the exit status to
 * end with (2: a bad argument, 1: the kernel refused the pinning), the error printed. */
static int sender_setup(int argc, char **argv, int first, const char *usage, unsigned batch_default,
			unsigned batch_max, struct sender_args *a)
{
	int bad = parse_sender_args(argc, argv, first, usage, batch_default, batch_max, a);
	if (bad)
		return bad;
	return pin_cpu(a->cpu) < 0 ? 1 : 0;
}

/* "once" mode: tells the caller that sending starts now (its clock starts here, not at exec) and restarts the
 * sender's own clocks (*t0: now(), *c0: cpu_seconds()). */
static void start_once(double *t0, double *c0)
{
	printf("start\n");
	fflush(stdout);
	*t0 = now();
	*c0 = cpu_seconds();
}

/* The JSON line a sender ends with: frames sent, seconds, errors, frames in the file, CPU seconds. */
static void print_result(unsigned long long sent, double seconds, unsigned long long errors, size_t frames,
			 double cpu)
{
	printf("{\"sent\": %llu, \"seconds\": %.6f, \"errors\": %llu, \"frames\": %zu, \"cpu_seconds\": %.6f}\n", sent,
	       seconds, errors, frames, cpu);
}

/* The whole of file `path` in a malloc'ed buffer (its size in *size); NULL with the error printed. */
static unsigned char *read_file(const char *path, size_t *size)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		perror(path);
		return NULL;
	}
	struct stat st;
	fstat(fileno(f), &st);
	unsigned char *buf = malloc(st.st_size ? st.st_size : 1);
	if (!buf || fread(buf, 1, st.st_size, f) != (size_t)st.st_size) {
		fprintf(stderr, "%s: short read\n", path);
		fclose(f);
		return NULL;
	}
	fclose(f);
	*size = (size_t)st.st_size;
	return buf;
}

#endif
