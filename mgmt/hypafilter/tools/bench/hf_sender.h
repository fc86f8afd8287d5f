/* What the bench's frame senders (hf_blast.c, hf_live.c) share: the allowance read from stdin in "once" mode and
 * their clocks. Static functions: each sender includes it once. */
#ifndef HF_SENDER_H
#define HF_SENDER_H
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

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

#endif
