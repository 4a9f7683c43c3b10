// SPDX-License-Identifier: Apache-2.0
/*
 * rw-nccl-workload: a stand-in for NCCL on machines without GPUs. It loads the profiler
 * plugin the way NCCL does (dlopen of $NCCL_PROFILER_PLUGIN, dlsym of ncclProfiler_v6, else
 * v5, else v4 — or only the one --version N names) and drives its entry points as NCCL
 * would, for N rank processes:
 *
 *   init per communicator ("world": all ranks; with --p2p also "pipeline"), then per op k:
 *   startEvent(Coll) -> stopEvent (enqueued) -> per channel startEvent(KernelCh, parent =
 *   the op, GPU timer) -> recordEventState(KernelChStop, GPU timer) -> stopEvent(KernelCh);
 *   with --p2p, a Send to rank+1 and a Recv from rank-1 on "pipeline", same shape.
 *
 * With --ce CUDA_LIB (v6 only) the all-reduces become copy-engine all-gathers as NCCL
 * 2.29+ reports them: startEvent(CeColl, stream) -> CeSync start/stop -> CeBatch start/stop
 * -> CeSync start/stop -> stopEvent(CeColl), all at enqueue time. CUDA_LIB is the stand-in
 * driver (fake_cuda.c, soname libcuda.so.1), loaded before the plugin as CUDA is; each
 * rank's stream is a struct rw_fake_stream whose recorded events this program completes in
 * order, as the GPU would: the op's start when its copies begin, its stop once every rank
 * is in (the final barrier). A fault leaves the stream where it stands.
 *
 * With --proxy-steps N (and RINGWATCH_PROXY_STEPS=1 set for the shim), each all-reduce also
 * has a proxy op (a send to rank+1 on channel 0) with N steps, each recording its bytes,
 * as NCCL's proxy thread reports network transfers: the shim's RDMA bulk frames.
 *
 * A collective's kernels end only when every rank's kernel started (as on a GPU: an
 * all-reduce needs everyone); a rank that waits longer than --hold-ms stays inside its
 * kernel (never ends it), keeps enqueuing a few more ops (the host runs ahead), then idles.
 *
 * Faults (--fault KIND:RANK:OP, repeatable):
 *   nostart   the rank's GPU never starts op OP (its host keeps enqueuing OP..OP+5);
 *   notjoin   the rank's process stops issuing at OP and stays alive for --hold-ms;
 *   exit      the rank's process exits with status 3 before OP;
 *   chnoend   one channel of OP never ends on the rank (the others do); with --ce: the
 *             rank's copies of OP start and never finish.
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

#include "fake_cuda.h"
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

static int g_ranks = 4, g_ops = 20, g_p2p = 0, g_period_ms = 20, g_hold_ms = 3000, g_tail_ms = 1500, g_version = 0;
static const char *g_ce_cuda; /* --ce: the stand-in CUDA driver */
static int g_proxy_steps;     /* --proxy-steps: steps per all-reduce's proxy op */
static struct rw_fake_stream g_stream; /* this rank's stream (after fork: one per rank) */
static struct fault g_faults[MAX_FAULTS];
static int g_nfaults;
static struct shared *g_shared;

/* The plugin: the one version this rank drives. */
static const ncclProfiler_v6_t *g_v6;
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
	int rc = g_v6	? g_v6->init(&ctx, id, &mask, name, 1, g_ranks, rank, logfn)
		 : g_v5 ? g_v5->init(&ctx, id, &mask, name, 1, g_ranks, rank, logfn)
			: g_v4->init(&ctx, &mask, name, id, 1, g_ranks, rank, logfn);
	if (rc != 0 || !(mask & ncclProfileKernelCh)) {
		fprintf(stderr, "rank %d: plugin init failed (%d) or no kernel-channel events (mask %#x)\n", rank, rc,
			mask);
		exit(2);
	}
	if (g_ce_cuda && !(mask & ncclProfileCeColl)) {
		fprintf(stderr, "rank %d: --ce but the plugin did not ask for copy-engine events (mask %#x)\n", rank, mask);
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
	if (g_v6) {
		ncclProfilerEventDescr_v6_t d;
		FILL_DESCR(d, type, rank, parent, func, peer, channel, seq);
		g_v6->startEvent(ctx, &h, &d);
	} else if (g_v5) {
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
	if (g_v6)
		g_v6->stopEvent(h);
	else if (g_v5)
		g_v5->stopEvent(h);
	else
		g_v4->stopEvent(h);
}

static void channel_stop(void *h)
{
	if (g_v6) {
		ncclProfilerEventStateArgs_v6_t a = { .kernelCh = { now_ns(CLOCK_REALTIME) } };
		g_v6->recordEventState(h, RW_NCCL_KERNEL_CH_STOP, &a);
	} else if (g_v5) {
		ncclProfilerEventStateArgs_v5_t a = { .kernelCh = { now_ns(CLOCK_REALTIME) } };
		g_v5->recordEventState(h, RW_NCCL_KERNEL_CH_STOP, &a);
	} else {
		ncclProfilerEventStateArgs_v4_t a = { .kernelCh = { now_ns(CLOCK_REALTIME) } };
		g_v4->recordEventState(h, RW_NCCL_KERNEL_CH_STOP, &a);
	}
	stop(h);
}

/* A proxy op or step descriptor of any version (the arms share their names). */
#define FILL_PROXY(d, type_, rank_, parent_, peer_, step_)                                         \
	do {                                                                                       \
		memset(&(d), 0, sizeof(d));                                                        \
		(d).type = (type_);                                                                \
		(d).parentObj = (parent_);                                                         \
		(d).rank = (rank_);                                                                \
		if ((type_) == ncclProfileProxyOp) {                                               \
			(d).proxyOp.pid = getpid();                                                \
			(d).proxyOp.channelId = 0;                                                 \
			(d).proxyOp.peer = (peer_);                                                \
			(d).proxyOp.nSteps = g_proxy_steps;                                        \
			(d).proxyOp.chunkSize = 1 << 19;                                           \
			(d).proxyOp.isSend = 1;                                                    \
		} else {                                                                           \
			(d).proxyStep.step = (step_);                                              \
		}                                                                                  \
	} while (0)

static void *proxy_start(void *ctx, uint64_t type, int rank, void *parent, int peer, int step)
{
	void *h = NULL;
	if (g_v6) {
		ncclProfilerEventDescr_v6_t d;
		FILL_PROXY(d, type, rank, parent, peer, step);
		g_v6->startEvent(ctx, &h, &d);
	} else if (g_v5) {
		ncclProfilerEventDescr_v5_t d;
		FILL_PROXY(d, type, rank, parent, peer, step);
		g_v5->startEvent(ctx, &h, &d);
	} else {
		ncclProfilerEventDescr_v4_t d;
		FILL_PROXY(d, (uint8_t)type, rank, parent, peer, step);
		g_v4->startEvent(ctx, &h, &d);
	}
	return h;
}

/* A step's state with the bytes moved (ncclProfilerProxyStepSendWait = 10). */
static void proxy_step_bytes(void *h, size_t bytes)
{
	ncclProfilerEventStateArgs_v5_t a = { .proxyStep = { bytes } };
	if (g_v6)
		g_v6->recordEventState(h, 10, &a);
	else if (g_v5)
		g_v5->recordEventState(h, 10, &a);
	else
		g_v4->recordEventState(h, 10, (ncclProfilerEventStateArgs_v4_t *)&a);
}

/* The all-reduce's network part as NCCL's proxy thread reports it: a send to rank+1. */
static void proxy_op(void *ctx, int rank, void *coll)
{
	void *op = proxy_start(ctx, ncclProfileProxyOp, rank, coll, (rank + 1) % g_ranks, 0);
	for (int st = 0; st < g_proxy_steps; st++) {
		void *h = proxy_start(ctx, ncclProfileProxyStep, rank, op, 0, st);
		proxy_step_bytes(h, (size_t)1 << 18);
		proxy_step_bytes(h, (size_t)1 << 19);
		stop(h);
	}
	stop(op);
}

/* A P2P op with one channel that runs to the end. */
static void p2p(void *ctx, int rank, const char *func, int peer)
{
	void *h = start(ctx, ncclProfileP2p, rank, NULL, func, peer, 0, 0);
	stop(h);
	void *ch = start(ctx, ncclProfileKernelCh, rank, h, NULL, 0, 0, 0);
	channel_stop(ch);
}

/* A v6 child event of a copy-engine collective (CeSync or CeBatch): start and stop. */
static void ce_child(void *ctx, int rank, void *parent, uint64_t type)
{
	ncclProfilerEventDescr_v6_t d;
	memset(&d, 0, sizeof(d));
	d.type = type;
	d.parentObj = parent;
	d.rank = rank;
	if (type == ncclProfileCeSync) {
		d.ceCollSync.nRanks = g_ranks;
	} else {
		d.ceCollBatch.numOps = g_ranks;
		d.ceCollBatch.totalBytes = (size_t)g_ranks << 22;
	}
	void *h = NULL;
	g_v6->startEvent(ctx, &h, &d);
	g_v6->stopEvent(h);
}

/* A copy-engine all-gather as NCCL 2.29+ launches it: every event at enqueue time. */
static void *ce_collective(void *ctx, int rank, uint64_t barrier_seq)
{
	ncclProfilerEventDescr_v6_t d;
	memset(&d, 0, sizeof(d));
	d.type = ncclProfileCeColl;
	d.rank = rank;
	d.ceColl.seqNumber = barrier_seq;
	d.ceColl.func = "AllGather";
	d.ceColl.count = 1 << 20;
	d.ceColl.root = -1;
	d.ceColl.datatype = "ncclFloat32";
	d.ceColl.syncStrategy = "UC";
	d.ceColl.ceSeqNum = (uint32_t)barrier_seq;
	d.ceColl.stream = &g_stream;
	void *h = NULL;
	g_v6->startEvent(ctx, &h, &d);
	ce_child(ctx, rank, h, ncclProfileCeSync);  /* the ready barrier */
	ce_child(ctx, rank, h, ncclProfileCeBatch); /* the copies */
	ce_child(ctx, rank, h, ncclProfileCeSync);  /* the final barrier */
	g_v6->stopEvent(h);
	return h;
}

/* The "GPU" finishes the next recorded event on this rank's stream. */
static void gpu_complete_next(void)
{
	atomic_fetch_add(&g_stream.done, 1);
}

static void run_rank(int rank, const char *plugin)
{
	char uuid[64];
	snprintf(uuid, sizeof(uuid), "52570000-0000-0000-0000-0000000000%02x", rank);
	setenv("RINGWATCH_GPU_UUID", uuid, 1);
	if (g_proxy_steps)
		setenv("RINGWATCH_PROXY_STEPS", "1", 1);
	if (g_ce_cuda && !dlopen(g_ce_cuda, RTLD_NOW | RTLD_GLOBAL)) {
		fprintf(stderr, "rank %d: dlopen %s: %s\n", rank, g_ce_cuda, dlerror());
		exit(2);
	}
	void *lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		fprintf(stderr, "rank %d: dlopen %s: %s\n", rank, plugin, dlerror());
		exit(2);
	}
	/* As NCCL's loader: the newest symbol first (or only the one asked for). */
	if (!g_version || g_version == 6)
		g_v6 = dlsym(lib, "ncclProfiler_v6");
	if ((!g_version && !g_v6) || g_version == 5)
		g_v5 = dlsym(lib, "ncclProfiler_v5");
	if ((!g_version && !g_v6 && !g_v5) || g_version == 4)
		g_v4 = dlsym(lib, "ncclProfiler_v4");
	if (!g_v6 && !g_v5 && !g_v4) {
		fprintf(stderr, "rank %d: %s exports no ncclProfiler_v%d\n", rank, plugin, g_version ? g_version : 6);
		exit(2);
	}
	if (g_ce_cuda && !g_v6) {
		fprintf(stderr, "rank %d: --ce needs ncclProfiler_v6\n", rank);
		exit(2);
	}
	if (rank == 0)
		printf("driving ncclProfiler_v%d%s\n", g_v6 ? 6 : g_v5 ? 5 : 4, g_ce_cuda ? " (copy-engine collectives)" : "");
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
		if (g_ce_cuda) {
			/* Every event at enqueue; then the stream runs (or not) as a GPU's would. */
			ce_collective(world, rank, (uint64_t)(2 * k));
			if (gpu_blocked_at || fault_at(F_NOSTART, rank, k)) {
				gpu_blocked_at = gpu_blocked_at ? gpu_blocked_at : k;
				sleep_ms(g_period_ms);
				continue;
			}
			gpu_complete_next(); /* the copies begin */
			atomic_fetch_add(&g_shared->started[k], 1);
			uint64_t give_up = now_ns(CLOCK_MONOTONIC) + (uint64_t)g_hold_ms * 1000000ull;
			while (atomic_load(&g_shared->started[k]) < g_ranks && now_ns(CLOCK_MONOTONIC) < give_up)
				sleep_ms(1);
			if (atomic_load(&g_shared->started[k]) < g_ranks || fault_at(F_CHNOEND, rank, k)) {
				gpu_blocked_at = k; /* inside the copies or the final barrier */
				continue;
			}
			gpu_complete_next(); /* the final barrier passed: the stop event */
			sleep_ms(g_period_ms);
			continue;
		}
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
		if (g_proxy_steps)
			proxy_op(world, rank, op);
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
		else if (strcmp(a, "--version") == 0)
			g_version = atoi(v);
		else if (strcmp(a, "--ce") == 0)
			g_ce_cuda = v;
		else if (strcmp(a, "--proxy-steps") == 0)
			g_proxy_steps = atoi(v);
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
	if (g_ranks < 1 || g_ranks > 64 || g_ops < 1 || g_ops > MAX_OPS || (g_version && (g_version < 4 || g_version > 6)) ||
	    g_proxy_steps < 0 || g_proxy_steps > 64)
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
		"                        [--version 4|5|6] [--ce CUDA_LIB] [--proxy-steps N] [--fault nostart|notjoin|exit|chnoend:RANK:OP]...\n");
	return 2;
}
