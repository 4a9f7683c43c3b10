// SPDX-License-Identifier: Apache-2.0
/*
 * check-layout SHIM.so [CUDA_LIB] [--chain PLUGIN]: loads the shim as NCCL would and checks, from outside,
 * every exported ncclProfiler_v* against NCCL's documented interface (LP64) — without the
 * shim's own header: the descriptors are written byte by byte at the documented offsets,
 * and the frames the shim emits are caught by interposing its probe functions (this
 * program exports rw_probe_*; build with -rdynamic).
 *
 * Checks per exported version: the symbol is 6 pointers (name + 5 entry points), each entry
 * point lies inside the shim, name is "ringwatch"; init with the documented argument order
 * asks for kernel-channel events; a collective, a P2P send and their kernel channels,
 * written at the documented offsets, come out as frames with the right fields: comm_op_seq
 * and p2p_seq from 1, NCCL's seqNumber, count, op, dtype, channel count, peer, rank,
 * nranks; the rank-level kernel_end only after the last channel. v6 without a CUDA driver
 * does not ask for copy-engine events; with CUDA_LIB (the workload's stand-in driver,
 * loaded first as CUDA is) it does, and a copy-engine collective written at the ceColl
 * offsets comes out as enqueue_start/enqueue_end at once and kernel_start/kernel_end only
 * as its stream completes the events the shim recorded. With --chain (the shim started with
 * RINGWATCH_PROFILER_CHAIN=PLUGIN, chain_test_plugin.c), every version's run also checks
 * what the second plugin got: its mask added to the shim's, each collective and kernel
 * channel it asked for with its own handle as parent, their stops and state records, its
 * finalize, and nothing it did not ask for (P2P, copy-engine). Prints one line per check; exit 0
 * when all hold, 1 otherwise, 2 when the shim does not load.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ringwatch.h"

static int g_failed;
#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		int ok_ = (cond);                                                                  \
		printf("%s ", ok_ ? "ok  " : "FAIL");                                              \
		printf(__VA_ARGS__);                                                               \
		printf("\n");                                                                      \
		g_failed |= !ok_;                                                                  \
	} while (0)

/* The probe functions, interposed: the last frames the shim emitted. */
static struct rw_collective_frame g_coll[16];
static int g_ncoll;
static struct rw_p2p_frame g_p2p[16];
static int g_np2p;

__attribute__((visibility("default"))) void rw_probe_collective(const struct rw_collective_frame *f)
{
	/* The copy-engine poller thread emits too: publish the count after the frame. */
	int n = __atomic_load_n(&g_ncoll, __ATOMIC_ACQUIRE);
	if (n < 16) {
		g_coll[n] = *f;
		__atomic_store_n(&g_ncoll, n + 1, __ATOMIC_RELEASE);
	}
}

__attribute__((visibility("default"))) void rw_probe_p2p(const struct rw_p2p_frame *f)
{
	if (g_np2p < 16)
		g_p2p[g_np2p++] = *f;
}

static struct rw_bulk_proxy_frame g_proxy[4];
static int g_nproxy;

__attribute__((visibility("default"))) void rw_probe_proxy_step(const struct rw_bulk_proxy_frame *f)
{
	if (g_nproxy < 4)
		g_proxy[g_nproxy++] = *f;
}

__attribute__((visibility("default"))) void rw_probe_comm_init(const struct rw_progress_entry *e)
{
	(void)e;
}

/* The stand-in driver's stream (fake_cuda.h's layout: events recorded, events done). */
struct fake_stream {
	_Atomic uint64_t recorded, done;
};
static int g_have_cuda;
static void *g_chain_lib; /* --chain: the second plugin, as the shim loaded it */

/* The second plugin's counters (chain_test_plugin.c). */
struct chain_counts {
	unsigned long inits, finalizes, stops, records, bad_parents, ce_seen, coll, kernel_ch, p2p;
};
static struct chain_counts chain_counts(void)
{
	struct chain_counts c = { 0 };
	if (!g_chain_lib)
		return c;
#define RD(field, sym)                                                                             \
	do {                                                                                       \
		unsigned long *p_ = dlsym(g_chain_lib, sym);                                       \
		c.field = p_ ? __atomic_load_n(p_, __ATOMIC_ACQUIRE) : 0;                          \
	} while (0)
	RD(inits, "chain_inits");
	RD(finalizes, "chain_finalizes");
	RD(stops, "chain_stops");
	RD(records, "chain_records");
	RD(bad_parents, "chain_bad_parents");
	RD(ce_seen, "chain_ce_seen");
#undef RD
	unsigned long *starts = dlsym(g_chain_lib, "chain_starts");
	if (starts) {
		c.coll = starts[1];
		c.p2p = starts[2];
		c.kernel_ch = starts[6];
	}
	return c;
}

/* NCCL's documented event types, state and offsets (LP64). */
#define TYPE_COLL 2
#define TYPE_P2P 4
#define TYPE_PROXY_OP 8
#define TYPE_PROXY_STEP 16
#define TYPE_KERNEL_CH 64
#define TYPE_CE_COLL (1 << 12)
#define TYPE_CE_SYNC (1 << 13)
#define TYPE_CE_BATCH (1 << 14)
#define STATE_KERNEL_CH_STOP 22
#define PROFILER_STRUCT_SIZE 48

static void put64(unsigned char *d, size_t off, uint64_t v)
{
	memcpy(d + off, &v, 8);
}
static void put32(unsigned char *d, size_t off, int32_t v)
{
	memcpy(d + off, &v, 4);
}
static void putp(unsigned char *d, size_t off, const void *p)
{
	memcpy(d + off, &p, sizeof(p));
}

typedef int (*init_v4_fn)(void **, int *, const char *, uint64_t, int, int, int, void *);
typedef int (*init_v5_fn)(void **, uint64_t, int *, const char *, int, int, int, void *);
typedef int (*start_fn)(void *, void **, void *);
typedef int (*stop_fn)(void *);
typedef int (*record_fn)(void *, int, void *);
typedef int (*finalize_fn)(void *);

/* A zeroed descriptor of event `type`: a uint64_t at 0 from v5, a uint8_t in v4. */
static void descr_type(unsigned char *d, size_t n, int v, uint64_t type)
{
	memset(d, 0, n);
	if (v >= 5)
		put64(d, 0, type);
	else
		d[0] = (unsigned char)type;
}

/* A one-channel collective named `func` of type `dtype`, written at the documented
 * offsets (func 32, datatype 72, nChannels 80), started and stopped. */
static void one_channel_collective(void **p, void *ctx, int v, const char *func, const char *dtype)
{
	unsigned char d[128];
	descr_type(d, sizeof(d), v, TYPE_COLL);
	putp(d, 32, func);
	putp(d, 72, dtype);
	d[80] = 1;
	void *coll = NULL;
	((start_fn)p[2])(ctx, &coll, d);
	((stop_fn)p[3])(coll);
}

static void check_version(void *lib, int v)
{
	char sym[32];
	snprintf(sym, sizeof(sym), "ncclProfiler_v%d", v);
	void **p = dlsym(lib, sym);
	CHECK(p != NULL, "%s is exported", sym);
	if (!p)
		return;
	Dl_info info;
	const ElfW(Sym) *es = NULL;
	if (dladdr1(p, &info, (void **)&es, RTLD_DL_SYMENT) && es)
		CHECK(es->st_size == PROFILER_STRUCT_SIZE, "%s is %d bytes (name + 5 entry points): %lu", sym,
		      PROFILER_STRUCT_SIZE, (unsigned long)es->st_size);
	CHECK(p[0] && strcmp((const char *)p[0], "ringwatch") == 0, "%s.name = \"ringwatch\"", sym);
	for (int i = 1; i <= 5; i++) {
		Dl_info fi;
		int inside = p[i] && dladdr(p[i], &fi) && info.dli_fbase == fi.dli_fbase;
		CHECK(inside, "%s entry point %d is in the shim", sym, i);
	}

	g_ncoll = g_np2p = 0;
	struct chain_counts before = chain_counts();
	void *ctx = NULL;
	int mask = 0;
	uint64_t comm = 0x1234567800000000ull + (uint64_t)v;
	int rc = v >= 5 ? ((init_v5_fn)p[1])(&ctx, comm, &mask, "layout", 1, 8, 3, NULL)
			: ((init_v4_fn)p[1])(&ctx, &mask, "layout", comm, 1, 8, 3, NULL);
	CHECK(rc == 0 && ctx, "%s init succeeds with the documented argument order", sym);
	CHECK(mask & TYPE_KERNEL_CH, "%s asks for kernel-channel events (the completion source): mask %#x", sym, mask);
	if (v == 6)
		CHECK(!!(mask & TYPE_CE_COLL) == g_have_cuda,
		      "%s asks for copy-engine collectives exactly when a CUDA driver is loaded (driver %s, mask %#x)", sym,
		      g_have_cuda ? "loaded" : "absent", mask);
	else
		CHECK(!(mask & (TYPE_CE_COLL | TYPE_CE_SYNC | TYPE_CE_BATCH)), "%s asks for no copy-engine events", sym);

	unsigned char d[128];
	/* A collective: type, parentObj 8, rank 16, coll.seqNumber 24, func 32, sendBuff 40,
	 * recvBuff 48, count 56, root 64, datatype 72, nChannels 80, nWarps 81, algo 88,
	 * proto 96 (v5: parentGroup 104). */
	descr_type(d, sizeof(d), v, TYPE_COLL);
	put32(d, 16, 3);
	put64(d, 24, 41);
	putp(d, 32, "AllReduce");
	put64(d, 56, 12345);
	put32(d, 64, -1);
	putp(d, 72, "ncclBfloat16");
	d[80] = 3;
	void *coll = NULL;
	((start_fn)p[2])(ctx, &coll, d);
	((stop_fn)p[3])(coll);
	CHECK(g_ncoll == 2, "%s: a collective's start and stop give enqueue_start and enqueue_end (%d frames)", sym,
	      g_ncoll);
	if (g_ncoll >= 1) {
		const struct rw_collective_frame *f = &g_coll[0];
		CHECK(f->comm_hash == comm && f->comm_op_seq == 1 && f->nccl_seq == 41 && f->count == 12345 &&
			      f->op == RW_OP_ALL_REDUCE && f->dtype == RW_DTYPE_BFLOAT16 && f->n_channels == 3 &&
			      f->rank == 3 && f->nranks == 8 && f->phase == RW_PHASE_ENQUEUE_START,
		      "%s: collective fields read at the documented offsets (seq %llu, nccl %llu, count %llu, op %u, "
		      "dtype %u, channels %u)",
		      sym, (unsigned long long)f->comm_op_seq, (unsigned long long)f->nccl_seq,
		      (unsigned long long)f->count, f->op, f->dtype, f->n_channels);
	}
	/* Its kernel channels: type, parentObj 8, kernelCh.channelId 24, pTimer 32; the state
	 * args union's kernelCh.pTimer at 0. */
	void *ch[3];
	for (int c = 0; c < 3; c++) {
		descr_type(d, sizeof(d), v, TYPE_KERNEL_CH);
		putp(d, 8, coll);
		d[24] = (unsigned char)c;
		put64(d, 32, 1700000000000000000ull);
		((start_fn)p[2])(ctx, &ch[c], d);
	}
	CHECK(g_ncoll == 3 && g_coll[2].phase == RW_PHASE_KERNEL_START,
	      "%s: the first channel's start gives the rank-level kernel_start", sym);
	for (int c = 0; c < 3; c++) {
		unsigned char args[8];
		put64(args, 0, 1700000000000001000ull);
		((record_fn)p[4])(ch[c], STATE_KERNEL_CH_STOP, args);
		((stop_fn)p[3])(ch[c]);
		if (c < 2)
			CHECK(g_ncoll == 3, "%s: no kernel_end while channel %d of 3 has ended", sym, c);
	}
	CHECK(g_ncoll == 4 && g_coll[3].phase == RW_PHASE_KERNEL_END && g_coll[3].comm_op_seq == 1,
	      "%s: kernel_end only after the last channel", sym);

	/* A P2P send: p2p.func 24, buff 32, datatype 40, count 48, peer 56, nChannels 60. */
	descr_type(d, sizeof(d), v, TYPE_P2P);
	put32(d, 16, 3);
	putp(d, 24, "Send");
	putp(d, 40, "ncclFloat16");
	put64(d, 48, 777);
	put32(d, 56, 5);
	d[60] = 1;
	void *send = NULL;
	((start_fn)p[2])(ctx, &send, d);
	((stop_fn)p[3])(send);
	CHECK(g_np2p == 2, "%s: a send's start and stop give two P2P frames (%d)", sym, g_np2p);
	if (g_np2p >= 1) {
		const struct rw_p2p_frame *f = &g_p2p[0];
		CHECK(f->op == RW_OP_SEND && f->src == 3 && f->dst == 5 && f->count == 777 && f->p2p_seq == 1 &&
			      f->dtype == RW_DTYPE_FLOAT16 && f->local_op_seq > g_coll[0].local_op_seq,
		      "%s: P2P fields read at the documented offsets (dst %u, count %llu, p2p_seq %llu)", sym, f->dst,
		      (unsigned long long)f->count, (unsigned long long)f->p2p_seq);
	}
	/* A second collective on the same communicator: comm_op_seq 2 (P2P did not advance it). */
	one_channel_collective(p, ctx, v, "AllGather", NULL);
	CHECK(g_ncoll == 6 && g_coll[4].comm_op_seq == 2 && g_coll[4].op == RW_OP_ALL_GATHER,
	      "%s: comm_op_seq counts collectives only", sym);
	/* NCCL's own names: all-to-all is "AlltoAll"; a uint8 collective's type is "Unknown"
	 * (NCCL's lookup has no case for it): unknown, counted, never a wrong type. */
	_Atomic unsigned long *unknown = dlsym(lib, "rw_shim_unknown_names");
	unsigned long unknown_before = unknown ? *unknown : 0;
	one_channel_collective(p, ctx, v, "AlltoAll", "Unknown");
	CHECK(g_ncoll == 8 && g_coll[6].op == RW_OP_ALL_TO_ALL && g_coll[6].dtype == RW_DTYPE_UNKNOWN,
	      "%s: \"AlltoAll\" is all_to_all, type \"Unknown\" stays unknown (op %u, dtype %u)", sym,
	      g_ncoll > 6 ? g_coll[6].op : 0, g_ncoll > 6 ? g_coll[6].dtype : 0);
	CHECK(unknown && *unknown == unknown_before + 1, "%s: the unknown name is counted (rw_shim_unknown_names)", sym);
	CHECK(((finalize_fn)p[5])(ctx) == 0, "%s finalize", sym);
	if (g_chain_lib) {
		struct chain_counts after = chain_counts();
		CHECK(mask & (1 << 3), "%s chained: the second plugin's proxy-op bit added to the mask (%#x)", sym, mask);
		CHECK(after.inits == before.inits + 1 && after.finalizes == before.finalizes + 1,
		      "%s chained: the second plugin's init and finalize called once each", sym);
		CHECK(after.coll == before.coll + 3 && after.kernel_ch == before.kernel_ch + 3 &&
			      after.p2p == before.p2p && after.ce_seen == before.ce_seen,
		      "%s chained: it got the 3 collectives and 3 kernel channels it asked for, no P2P (coll +%lu, "
		      "channels +%lu, p2p +%lu)",
		      sym, after.coll - before.coll, after.kernel_ch - before.kernel_ch, after.p2p - before.p2p);
		CHECK(after.bad_parents == before.bad_parents,
		      "%s chained: each kernel channel's parent is the second plugin's own collective handle", sym);
		CHECK(after.stops == before.stops + 6 && after.records == before.records + 3,
		      "%s chained: 6 stops and 3 state records forwarded (+%lu, +%lu)", sym, after.stops - before.stops,
		      after.records - before.records);
	}
}

/* Waits (up to 10 s: the shim's poller runs every 200 us) until `n` collective frames came. */
static int wait_frames(int n)
{
	for (int i = 0; i < 100000 && __atomic_load_n(&g_ncoll, __ATOMIC_ACQUIRE) < n; i++) {
		struct timespec ts = { 0, 100000 };
		nanosleep(&ts, NULL);
	}
	return __atomic_load_n(&g_ncoll, __ATOMIC_ACQUIRE) >= n;
}

/* v6's copy-engine collective, written at the ceColl offsets: seqNumber 24, func 32,
 * sendBuff 40, recvBuff 48, count 56, root 64, datatype 72, syncStrategy 80,
 * intraBatchSync 88, batchSize 92, numBatches 96, ceSeqNum 100, stream 104; its CeSync
 * (isComplete 24, nRanks 28) and CeBatch (numOps 24, totalBytes 32, useIntraSync 40). */
static void check_copy_engine(void *lib)
{
	void **p = dlsym(lib, "ncclProfiler_v6");
	if (!p)
		return;
	g_ncoll = g_np2p = 0;
	void *ctx = NULL;
	int mask = 0;
	uint64_t comm = 0x1234567800000060ull;
	((init_v5_fn)p[1])(&ctx, comm, &mask, "layout-ce", 1, 8, 3, NULL);
	struct fake_stream stream = { 0, 0 };
	unsigned char d[128];
	descr_type(d, sizeof(d), 6, TYPE_CE_COLL);
	put32(d, 16, 3);
	put64(d, 24, 7);
	putp(d, 32, "AllGather");
	put64(d, 56, 4096);
	put32(d, 64, -1);
	putp(d, 72, "ncclFloat16");
	putp(d, 80, "UC");
	putp(d, 104, &stream);
	void *ce = NULL;
	((start_fn)p[2])(ctx, &ce, d);
	for (int child = 0; child < 3; child++) {
		descr_type(d, sizeof(d), 6, child == 1 ? TYPE_CE_BATCH : TYPE_CE_SYNC);
		putp(d, 8, ce);
		put32(d, 16, 3);
		if (child == 1) {
			put32(d, 24, 8);
			put64(d, 32, 8 * 4096 * 2);
		} else {
			put32(d, 28, 8);
		}
		void *h = NULL;
		((start_fn)p[2])(ctx, &h, d);
		((stop_fn)p[3])(h);
	}
	((stop_fn)p[3])(ce);
	CHECK(g_ncoll == 2 && g_coll[0].phase == RW_PHASE_ENQUEUE_START && g_coll[1].phase == RW_PHASE_ENQUEUE_END,
	      "ncclProfiler_v6: a copy-engine collective's start and stop give enqueue_start and enqueue_end, its "
	      "CeSync/CeBatch children nothing (%d frames)",
	      g_ncoll);
	if (g_ncoll >= 1) {
		const struct rw_collective_frame *f = &g_coll[0];
		CHECK(f->comm_hash == comm && f->comm_op_seq == 1 && f->nccl_seq == 7 && f->count == 4096 &&
			      f->op == RW_OP_ALL_GATHER && f->dtype == RW_DTYPE_FLOAT16 && f->n_channels == 1 &&
			      f->rank == 3 && f->nranks == 8,
		      "ncclProfiler_v6: copy-engine fields read at the ceColl offsets (nccl %llu, count %llu, op %u, dtype "
		      "%u, channels %u)",
		      (unsigned long long)f->nccl_seq, (unsigned long long)f->count, f->op, f->dtype, f->n_channels);
	}
	CHECK(atomic_load(&stream.recorded) == 2, "ncclProfiler_v6: the shim recorded 2 events on the op's stream (%llu)",
	      (unsigned long long)atomic_load(&stream.recorded));
	atomic_store(&stream.done, 1);
	CHECK(wait_frames(3) && g_coll[2].phase == RW_PHASE_KERNEL_START,
	      "ncclProfiler_v6: kernel_start once the stream reached the start event");
	CHECK(g_ncoll == 3, "ncclProfiler_v6: no kernel_end while the stop event is pending");
	atomic_store(&stream.done, 2);
	CHECK(wait_frames(4) && g_coll[3].phase == RW_PHASE_KERNEL_END && g_coll[3].comm_op_seq == 1,
	      "ncclProfiler_v6: kernel_end once the stream completed the stop event (after the final barrier)");
	CHECK(((finalize_fn)p[5])(ctx) == 0, "ncclProfiler_v6 finalize");
	if (g_chain_lib)
		CHECK(chain_counts().ce_seen == 0, "ncclProfiler_v6 chained to a v5 plugin: no copy-engine event reaches it");
}

/* RINGWATCH_PROXY_STEPS=1 (RDMA bulk telemetry): a proxy op written at the proxyOp offsets
 * (pid 24, channelId 28, peer 32, nSteps 36, chunkSize 40, isSend 44), parent the
 * collective; a step (proxyStep.step 24) under it; its states' transSize at 0 of the
 * state args: at the step's stop, one bulk proxy frame with the comm, rank, peer, channel,
 * step and the largest transSize. */
static void check_proxy_steps(void *lib, int v)
{
	char sym[32];
	snprintf(sym, sizeof(sym), "ncclProfiler_v%d", v);
	void **p = dlsym(lib, sym);
	if (!p)
		return;
	setenv("RINGWATCH_PROXY_STEPS", "1", 1);
	g_ncoll = g_nproxy = 0;
	void *ctx = NULL;
	int mask = 0;
	uint64_t comm = 0x1234567800000070ull + (uint64_t)v;
	int rc = v >= 5 ? ((init_v5_fn)p[1])(&ctx, comm, &mask, "layout-proxy", 1, 8, 3, NULL)
			: ((init_v4_fn)p[1])(&ctx, &mask, "layout-proxy", comm, 1, 8, 3, NULL);
	unsetenv("RINGWATCH_PROXY_STEPS");
	CHECK(rc == 0 && (mask & TYPE_PROXY_OP) && (mask & TYPE_PROXY_STEP),
	      "%s with RINGWATCH_PROXY_STEPS=1 asks for proxy ops and steps (mask %#x)", sym, mask);
	unsigned char d[128];
	descr_type(d, sizeof(d), v, TYPE_COLL);
	putp(d, 32, "AllReduce");
	d[80] = 1;
	void *coll = NULL;
	((start_fn)p[2])(ctx, &coll, d);
	descr_type(d, sizeof(d), v, TYPE_PROXY_OP);
	putp(d, 8, coll);
	put32(d, 24, 4242);
	d[28] = 5;
	put32(d, 32, 2);
	put32(d, 36, 1);
	put32(d, 40, 65536);
	put32(d, 44, 1);
	void *op = NULL;
	((start_fn)p[2])(ctx, &op, d);
	descr_type(d, sizeof(d), v, TYPE_PROXY_STEP);
	putp(d, 8, op);
	put32(d, 24, 7);
	void *step = NULL;
	((start_fn)p[2])(ctx, &step, d);
	unsigned char args[16];
	put64(args, 0, 4096);
	((record_fn)p[4])(step, 9, args);
	put64(args, 0, 65536);
	((record_fn)p[4])(step, 10, args);
	CHECK(g_nproxy == 0, "%s: no bulk frame before the step stops", sym);
	((stop_fn)p[3])(step);
	((stop_fn)p[3])(op);
	((stop_fn)p[3])(coll);
	CHECK(g_nproxy == 1, "%s: one bulk proxy frame per step (%d)", sym, g_nproxy);
	if (g_nproxy >= 1) {
		const struct rw_bulk_proxy_frame *f = &g_proxy[0];
		CHECK(f->hdr.kind == RW_FRAME_KIND_BULK_PROXY && f->hdr.length == sizeof(*f) && f->comm_hash == comm &&
			      f->rank == 3 && f->peer == 2 && f->channel == 5 && f->step == 7 && f->bytes == 65536,
		      "%s: the step's frame: comm, rank %u, peer %u, channel %u, step %llu, bytes %llu", sym, f->rank,
		      f->peer, f->channel, (unsigned long long)f->step, (unsigned long long)f->bytes);
	}
	CHECK(((finalize_fn)p[5])(ctx) == 0, "%s finalize (proxy steps)", sym);
}

int main(int argc, char **argv)
{
	const char *chain = NULL;
	for (int i = 2; i < argc; i++) {
		if (strcmp(argv[i], "--chain") == 0 && i + 1 < argc) {
			chain = argv[++i];
		} else if (!g_have_cuda && argv[i][0] != '-') {
			if (!dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL)) {
				fprintf(stderr, "dlopen %s: %s\n", argv[i], dlerror());
				return 2;
			}
			g_have_cuda = 1;
		} else {
			argc = 0;
		}
	}
	if (argc < 2) {
		fprintf(stderr, "usage: check-layout /full/path/libnccl-profiler-ringwatch.so [/full/path/fake/libcuda.so.1] "
				"[--chain /full/path/second-plugin.so]\n");
		return 2;
	}
	if (chain)
		setenv("RINGWATCH_PROFILER_CHAIN", chain, 1);
	void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
		return 2;
	}
	if (chain) {
		/* The shim loads it at the first init; the same handle then. */
		g_chain_lib = dlopen(chain, RTLD_NOW | RTLD_LOCAL);
		if (!g_chain_lib) {
			fprintf(stderr, "dlopen %s: %s\n", chain, dlerror());
			return 2;
		}
	}
	int found = 0;
	for (int v = 1; v <= 9; v++) {
		char sym[32];
		snprintf(sym, sizeof(sym), "ncclProfiler_v%d", v);
		if (dlsym(lib, sym)) {
			printf("exported: %s\n", sym);
			found++;
		}
	}
	CHECK(found >= 3, "the shim exports %d profiler versions", found);
	check_version(lib, 6);
	check_version(lib, 5);
	check_version(lib, 4);
	if (g_have_cuda)
		check_copy_engine(lib);
	for (int v = 6; v >= 4; v--)
		check_proxy_steps(lib, v);
	printf("%s\n", g_failed ? "LAYOUT CHECK FAILED" : "all layout checks hold");
	return g_failed ? 1 : 0;
}
