// SPDX-License-Identifier: Apache-2.0
/*
 * rw-nccl-workload: a stand-in for NCCL on machines without GPUs. It loads the profiler
 * plugin the way NCCL does (dlopen of $NCCL_PROFILER_PLUGIN, dlsym of ncclProfiler_v5, else
 * ncclProfiler_v4) and drives its entry points as NCCL would, for N rank processes:
 *
 *   init per communicator ("world": all ranks; with --p2p also "pipeline"), then per op k:
 *   startEvent(Coll) -> stopEvent (enqueued) -> per channel startEvent(KernelCh, parent =
 *   the op, GPU timer) -> recordEventState(KernelChStop, GPU timer) -> stopEvent(KernelCh);
 *   with --p2p, a Send to rank+1 and a Recv from rank-1 on "pipeline", same shape.
 *
 * A collective's kernels end only when every rank's kernel started (as on a GPU: an
 * all-reduce needs everyone); a rank that waits longer than --hold-ms stays inside its
 * kernel (never ends it), keeps enqueuing a few more ops (the host runs ahead), then idles.
 *
 * Faults (--fault KIND:RANK:OP, repeatable):
 *   nostart   the rank's GPU never starts op OP (its host keeps enqueuing OP..OP+5);
 *   notjoin   the rank's process stops issuing at OP and stays alive for --hold-ms;
 *   exit      the rank's process exits with status 3 before OP;
 *   chnoend   one channel of OP never ends on the rank (the others do).
 *
 * Each rank's GPU UUID is 52570000-0000-0000-0000-0000000000RR (RR = rank): the shim
 * reads it from RINGWATCH_GPU_UUID. The GPU timer is CLOCK_REALTIME (as a GPU's global
 * timer is). Exit status: 0, or 2 for bad arguments / a plugin that does not load.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl_profiler_api.h"

#define MAX_OPS 4096
#define MAX_FAULTS 16
#define N_CHANNELS 2

enum fault_kind { F_NONE, F_NOSTART, F_NOTJOIN, F_EXIT, F_CHNOEND };

struct fault {
	enum fault_kind kind;
	int rank, op;
};

struct shared {
	_Atomic int started[MAX_OPS + 1];
};

static int g_ranks = 4, g_ops = 20, g_p2p = 0, g_period_ms = 20, g_hold_ms = 3000, g_tail_ms = 1500;
static struct fault g_faults[MAX_FAULTS];
static int g_nfaults;
static struct shared *g_shared;

/* The plugin, normalised to v5's shape. */
static const ncclProfiler_v5_t *g_v5;
static const ncclProfiler_v4_t *g_v4;

static uint64_t now_ns(clockid_t c)
{
	struct timespec ts;
	clock_gettime(c, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
	nanosleep(&ts, NULL);
}

static int fault_at(enum fault_kind kind, int rank, int op)
{
	for (int i = 0; i < g_nfaults; i++)
		if (g_faults[i].kind == kind && g_faults[i].rank == rank && g_faults[i].op == op)
			return 1;
	return 0;
}

static void logfn(int level, unsigned long flags, const char *file, int line, const char *fmt, ...)
{
	(void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

static void *init_comm(uint64_t id, const char *name, int rank)
{
	void *ctx = NULL;
	int mask = 0;
	int rc = g_v5 ? g_v5->init(&ctx, id, &mask, name, 1, g_ranks, rank, logfn)
		      : g_v4->init(&ctx, &mask, name, id, 1, g_ranks, rank, logfn);
	if (rc != 0 || !(mask & ncclProfileKernelCh)) {
		fprintf(stderr, "rank %d: plugin init failed (%d) or no kernel-channel events (mask %#x)\n", rank, rc,
			mask);
		exit(2);
	}
	return ctx;
}

/* Fills a descriptor of either version (the fields NCCL sets for each event type). */
#define FILL_DESCR(d, type_, rank_, parent_, func_, peer_, channel_, seq_)                          \
	do {                                                                                       \
		memset(&(d), 0, sizeof(d));                                                        \
		(d).type = (type_);                                                                \
		(d).parentObj = (parent_);                                                         \
		(d).rank = (rank_);                                                                \
		if ((type_) == ncclProfileColl) {                                                  \
			(d).coll.seqNumber = (seq_);                                               \
			(d).coll.func = (func_);                                                   \
			(d).coll.count = 1 << 20;                                                  \
			(d).coll.root = -1;                                                        \
			(d).coll.datatype = "ncclFloat32";                                         \
			(d).coll.nChannels = N_CHANNELS;                                           \
			(d).coll.algo = "Ring";                                                    \
			(d).coll.proto = "Simple";                                                 \
		} else if ((type_) == ncclProfileP2p) {                                            \
			(d).p2p.func = (func_);                                                    \
			(d).p2p.count = 1 << 18;                                                   \
			(d).p2p.datatype = "ncclBfloat16";                                         \
			(d).p2p.peer = (peer_);                                                    \
			(d).p2p.nChannels = 1;                                                     \
		} else {                                                                           \
			(d).kernelCh.channelId = (uint8_t)(channel_);                              \
			(d).kernelCh.pTimer = now_ns(CLOCK_REALTIME);                              \
		}                                                                                  \
	} while (0)

/* startEvent for an op (Coll or P2p) or a kernel channel, either version. */
static void *start(void *ctx, uint64_t type, int rank, void *parent, const char *func, int peer, int channel,
		   uint64_t seq)
{
	void *h = NULL;
	if (g_v5) {
		ncclProfilerEventDescr_v5_t d;
		FILL_DESCR(d, type, rank, parent, func, peer, channel, seq);
		g_v5->startEvent(ctx, &h, &d);
	} else {
		ncclProfilerEventDescr_v4_t d;
		FILL_DESCR(d, (uint8_t)type, rank, parent, func, peer, channel, seq);
		g_v4->startEvent(ctx, &h, &d);
	}
	return h;
}

static void stop(void *h)
{
	if (g_v5)
		g_v5->stopEvent(h);
	else
		g_v4->stopEvent(h);
}

static void channel_stop(void *h)
{
	if (g_v5) {
		ncclProfilerEventStateArgs_v5_t a = { .kernelCh = { now_ns(CLOCK_REALTIME) } };
		g_v5->recordEventState(h, RW_NCCL_KERNEL_CH_STOP, &a);
	} else {
		ncclProfilerEventStateArgs_v4_t a = { .kernelCh = { now_ns(CLOCK_REALTIME) } };
		g_v4->recordEventState(h, RW_NCCL_KERNEL_CH_STOP, &a);
	}
	stop(h);
}

/* A P2P op with one channel that runs to the end. */
static void p2p(void *ctx, int rank, const char *func, int peer)
{
	void *h = start(ctx, ncclProfileP2p, rank, NULL, func, peer, 0, 0);
	stop(h);
	void *ch = start(ctx, ncclProfileKernelCh, rank, h, NULL, 0, 0, 0);
	channel_stop(ch);
}

static void run_rank(int rank, const char *plugin)
{
	char uuid[64];
	snprintf(uuid, sizeof(uuid), "52570000-0000-0000-0000-0000000000%02x", rank);
	setenv("RINGWATCH_GPU_UUID", uuid, 1);
	void *lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		fprintf(stderr, "rank %d: dlopen %s: %s\n", rank, plugin, dlerror());
		exit(2);
	}
	g_v5 = dlsym(lib, "ncclProfiler_v5");
	if (!g_v5)
		g_v4 = dlsym(lib, "ncclProfiler_v4");
	if (!g_v5 && !g_v4) {
		fprintf(stderr, "rank %d: %s exports neither ncclProfiler_v5 nor ncclProfiler_v4\n", rank, plugin);
		exit(2);
	}
	void *world = init_comm(0x5257574f524c4400ull, "world", rank);
	void *pipe = g_p2p ? init_comm(0x5257504950450000ull, "pipeline", rank) : NULL;
	int gpu_blocked_at = 0; /* the op the GPU is stuck in (0: none) */
	for (int k = 1; k <= g_ops && k <= MAX_OPS; k++) {
		if (fault_at(F_EXIT, rank, k))
			exit(3);
		if (fault_at(F_NOTJOIN, rank, k)) {
			sleep_ms(g_hold_ms + g_tail_ms);
			exit(0);
		}
		/* The host runs ahead of a stuck GPU by a few ops, then waits. */
		if (gpu_blocked_at && k > gpu_blocked_at + 5)
			break;
		void *op = start(world, ncclProfileColl, rank, NULL, "AllReduce", 0, 0, (uint64_t)(k - 1));
		stop(op); /* enqueued: NOT completed */
		if (gpu_blocked_at) {
			sleep_ms(g_period_ms);
			continue;
		}
		if (fault_at(F_NOSTART, rank, k)) {
			gpu_blocked_at = k;
			sleep_ms(g_period_ms);
			continue;
		}
		void *ch[N_CHANNELS];
		for (int c = 0; c < N_CHANNELS; c++)
			ch[c] = start(world, ncclProfileKernelCh, rank, op, NULL, 0, c, 0);
		atomic_fetch_add(&g_shared->started[k], 1);
		/* An all-reduce finishes only when every rank's kernel is in. */
		uint64_t give_up = now_ns(CLOCK_MONOTONIC) + (uint64_t)g_hold_ms * 1000000ull;
		while (atomic_load(&g_shared->started[k]) < g_ranks && now_ns(CLOCK_MONOTONIC) < give_up)
			sleep_ms(1);
		if (atomic_load(&g_shared->started[k]) < g_ranks) {
			gpu_blocked_at = k; /* inside kernel k, waiting on a peer */
			continue;
		}
		int chnoend = fault_at(F_CHNOEND, rank, k);
		for (int c = 0; c < N_CHANNELS; c++)
			if (!(chnoend && c == N_CHANNELS - 1))
				channel_stop(ch[c]);
		if (chnoend) {
			gpu_blocked_at = k;
			continue;
		}
		if (pipe) {
			if (rank + 1 < g_ranks)
				p2p(pipe, rank, "Send", rank + 1);
			if (rank > 0)
				p2p(pipe, rank, "Recv", rank - 1);
		}
		sleep_ms(g_period_ms);
	}
	sleep_ms(g_tail_ms + (gpu_blocked_at ? g_hold_ms : 0));
	exit(0);
}

static int parse_fault(const char *spec)
{
	char kind[16];
	int rank, op;
	if (g_nfaults >= MAX_FAULTS || sscanf(spec, "%15[a-z]:%d:%d", kind, &rank, &op) != 3)
		return -1;
	enum fault_kind k = strcmp(kind, "nostart") == 0   ? F_NOSTART
			    : strcmp(kind, "notjoin") == 0 ? F_NOTJOIN
			    : strcmp(kind, "exit") == 0    ? F_EXIT
			    : strcmp(kind, "chnoend") == 0 ? F_CHNOEND
							   : F_NONE;
	if (k == F_NONE)
		return -1;
	g_faults[g_nfaults++] = (struct fault){ k, rank, op };
	return 0;
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(a, "--p2p") == 0) {
			g_p2p = 1;
			continue;
		}
		if (!v)
			goto usage;
		i++;
		if (strcmp(a, "--ranks") == 0)
			g_ranks = atoi(v);
		else if (strcmp(a, "--ops") == 0)
			g_ops = atoi(v);
		else if (strcmp(a, "--period-ms") == 0)
			g_period_ms = atoi(v);
		else if (strcmp(a, "--hold-ms") == 0)
			g_hold_ms = atoi(v);
		else if (strcmp(a, "--tail-ms") == 0)
			g_tail_ms = atoi(v);
		else if (strcmp(a, "--fault") == 0) {
			if (parse_fault(v))
				goto usage;
		} else
			goto usage;
	}
	if (g_ranks < 1 || g_ranks > 64 || g_ops < 1 || g_ops > MAX_OPS)
		goto usage;
	const char *plugin = getenv("NCCL_PROFILER_PLUGIN");
	if (!plugin || !*plugin) {
		fprintf(stderr, "set NCCL_PROFILER_PLUGIN to the plugin's full path\n");
		return 2;
	}
	g_shared = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (g_shared == MAP_FAILED)
		return 2;
	for (int r = 0; r < g_ranks; r++) {
		fflush(stdout);
		pid_t pid = fork();
		if (pid == 0)
			run_rank(r, plugin);
		if (pid < 0)
			return 2;
		printf("rank %d pid %d\n", r, (int)pid);
	}
	fflush(stdout);
	int worst = 0;
	for (int r = 0; r < g_ranks; r++) {
		int st = 0;
		if (wait(&st) > 0 && WIFEXITED(st) && WEXITSTATUS(st) > worst)
			worst = WEXITSTATUS(st);
	}
	/* Rank exits are the script's, not failures of the workload. */
	return worst == 2 ? 2 : 0;
usage:
	fprintf(stderr,
		"usage: rw-nccl-workload [--ranks N] [--ops K] [--p2p] [--period-ms P] [--hold-ms H] [--tail-ms T]\n"
		"                        [--fault nostart|notjoin|exit|chnoend:RANK:OP]...\n");
	return 2;
}
