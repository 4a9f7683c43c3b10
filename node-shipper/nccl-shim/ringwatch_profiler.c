// SPDX-License-Identifier: Apache-2.0
/*
 * libnccl-profiler-ringwatch.so: ringwatch's NCCL profiler plugin.
 *
 * Use: NCCL_PROFILER_PLUGIN=/full/path/to/libnccl-profiler-ringwatch.so (a full path:
 * NCCL dlopens the name as given). Exports ncclProfiler_v5 and ncclProfiler_v4: NCCL 2.27
 * loads v4, 2.28 v5, 2.29.2 and later fall back to v5; 2.23-2.26 look only for v1-v3 and
 * run without it (README.md has the table).
 *
 * What it does, and nothing more: keeps the per-communicator counters ringwatch's keys need
 * and calls tiny probe functions (rw_probe_*) with a filled frame. The functions start
 * with a 5-byte NOP, so a uprobe on them is optimised into a call (26x cheaper than an
 * int3 uprobe here); the shipper's eBPF programs on those uprobes take the seq, update
 * the PROGRESS map and write the frame into the P0 ring. With no shipper attached the
 * calls cost a few nanoseconds and nothing is recorded.
 *
 *  - comm_op_seq: per communicator instance, collectives only, from 1 (P2P does not
 *    advance it: ranks do different numbers of P2P ops);
 *  - p2p_seq: per (communicator instance, peer, direction), from 1;
 *  - local_op_seq: per process, every op of every communicator, from 1;
 *  - comm key: NCCL's comm hash/id plus a disambiguator every rank computes alike (a hash
 *    of the communicator's name and size): a comm hash alone can collide;
 *  - comm instance: how many times this process initialised that key (a re-created
 *    communicator is a new instance);
 *  - the GPU's UUID at init (CUDA driver, if loadable; RINGWATCH_GPU_UUID for tests);
 *  - kernel events: NCCL reports one start and one stop per channel with the GPU's
 *    global timer; the rank-level kernel_start goes out with the first channel's start,
 *    kernel_end only after every channel of the op ended (per-channel frames are not
 *    emitted). GPU timer values become host CLOCK_MONOTONIC through a paired
 *    (CLOCK_REALTIME, CLOCK_MONOTONIC) read refreshed every second: the GPU's global timer
 *    runs in Unix-epoch nanoseconds (the driver keeps it on host real time).
 *  - copy-engine collectives (v6): NCCL reports only host-side enqueue events for them
 *    (CeColl start, then its stop once the copies and the final barrier are enqueued).
 *    The shim records a CUDA event on the collective's stream at each (driver API,
 *    through the already loaded libcuda), and a poller thread turns the start event's
 *    completion into kernel_start and the stop event's — everything enqueued before it,
 *    the final barrier included, done on the GPU — into kernel_end, at the poll's host
 *    time (every RINGWATCH_CE_POLL_US, default 200 us). Without the driver's event API
 *    the shim does not ask NCCL for CE events at all (counted in rw_shim_ce_unavailable).
 *  - chaining (opt-in, RINGWATCH_PROFILER_CHAIN): every call forwarded to a second plugin
 *    with its own context and handles (the section "chaining" below).
 *
 * Thread safety: NCCL calls from its user threads and its proxy thread; all counters are
 * under one mutex per communicator (events are short).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl_profiler_api.h"
#include "ringwatch.h"

#define RW_EXPORT __attribute__((visibility("default")))

/* ---- the probe functions the uprobes attach to ---- */

/* A 5-byte NOP first (nopl 0x0(%rax,%rax,1)), then return: Linux 6.18 turns a uprobe on
 * such a function into a call instead of an int3 trap. The argument stays in the first
 * argument register for the uprobe to read. */
#if defined(__x86_64__)
#define RW_PROBE(name, type)                                                                       \
	RW_EXPORT __attribute__((naked, noinline, used)) void name(__attribute__((unused)) const type *frame) \
	{                                                                                          \
		__asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n\tret\n");                   \
	}
#else
#define RW_PROBE(name, type)                                                                       \
	RW_EXPORT __attribute__((noinline, used)) void name(const type *frame)                     \
	{                                                                                          \
		__asm__ volatile("" : : "r"(frame) : "memory");                                    \
	}
#endif

RW_PROBE(rw_probe_collective, struct rw_collective_frame)
RW_PROBE(rw_probe_p2p, struct rw_p2p_frame)
/* One NCCL proxy step (RDMA clusters: bulk telemetry where XDP sees no data traffic). */
RW_PROBE(rw_probe_proxy_step, struct rw_bulk_proxy_frame)
/* A communicator's PROGRESS entry at init (the uprobe creates it in the map). */
RW_PROBE(rw_probe_comm_init, struct rw_progress_entry)

/* ---- clocks ---- */

static uint64_t clock_ns(clockid_t c)
{
	struct timespec ts;
	clock_gettime(c, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* realtime - monotonic, from a paired read (the read with the shortest bracket of 3). */
static _Atomic int64_t g_rt_minus_mono;
static _Atomic uint64_t g_pair_at_mono;

static void refresh_pair(void)
{
	int64_t best = 0;
	uint64_t best_width = UINT64_MAX;
	for (int i = 0; i < 3; i++) {
		uint64_t m0 = clock_ns(CLOCK_MONOTONIC);
		uint64_t rt = clock_ns(CLOCK_REALTIME);
		uint64_t m1 = clock_ns(CLOCK_MONOTONIC);
		if (m1 - m0 < best_width) {
			best_width = m1 - m0;
			best = (int64_t)rt - (int64_t)(m0 + (m1 - m0) / 2);
		}
	}
	atomic_store(&g_rt_minus_mono, best);
	atomic_store(&g_pair_at_mono, clock_ns(CLOCK_MONOTONIC));
}

/* GPU global timer (ns since the Unix epoch) to host CLOCK_MONOTONIC. */
static uint64_t gpu_to_mono(uint64_t gpu_ns)
{
	uint64_t now = clock_ns(CLOCK_MONOTONIC);
	if (now - atomic_load(&g_pair_at_mono) > 1000000000ull)
		refresh_pair();
	int64_t off = atomic_load(&g_rt_minus_mono);
	if (gpu_ns == 0 || (int64_t)gpu_ns <= off)
		return now; /* no timer value: the host's time of the callback */
	return (uint64_t)((int64_t)gpu_ns - off);
}

/* ---- identity ---- */

static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
	const unsigned char *p = data;
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

/* The GPU's UUID: RINGWATCH_GPU_UUID (32 hex digits, dashes allowed) if set, else the
 * CUDA driver's for the current context's device, else zeros. */
static void gpu_uuid(uint8_t out[16])
{
	memset(out, 0, 16);
	const char *env = getenv("RINGWATCH_GPU_UUID");
	if (env) {
		int n = 0;
		for (const char *c = env; *c && n < 32; c++) {
			int v;
			if (*c >= '0' && *c <= '9')
				v = *c - '0';
			else if (*c >= 'a' && *c <= 'f')
				v = *c - 'a' + 10;
			else if (*c >= 'A' && *c <= 'F')
				v = *c - 'A' + 10;
			else
				continue;
			out[n / 2] |= (uint8_t)(n % 2 ? v : v << 4);
			n++;
		}
		return;
	}
	void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (!cuda)
		return;
	int (*ctx_get_device)(int *) = (int (*)(int *))dlsym(cuda, "cuCtxGetDevice");
	int (*get_uuid)(uint8_t *, int) = (int (*)(uint8_t *, int))dlsym(cuda, "cuDeviceGetUuid_v2");
	if (!get_uuid)
		get_uuid = (int (*)(uint8_t *, int))dlsym(cuda, "cuDeviceGetUuid");
	int dev = 0;
	if (ctx_get_device && get_uuid && ctx_get_device(&dev) == 0)
		(void)get_uuid(out, dev);
	dlclose(cuda);
}

/* ---- state ---- */

static _Atomic uint64_t g_local_op_seq;

/* Instances per comm key in this process (a re-created communicator is a new instance). */
#define RW_MAX_KEYS 256
static struct {
	uint64_t hash, disambiguator, instances;
} g_keys[RW_MAX_KEYS];
static pthread_mutex_t g_keys_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t next_instance(uint64_t hash, uint64_t dis)
{
	pthread_mutex_lock(&g_keys_lock);
	uint64_t inst = 1;
	int i;
	for (i = 0; i < RW_MAX_KEYS && g_keys[i].instances; i++) {
		if (g_keys[i].hash == hash && g_keys[i].disambiguator == dis) {
			inst = ++g_keys[i].instances;
			break;
		}
	}
	if (i < RW_MAX_KEYS && !g_keys[i].instances) {
		g_keys[i].hash = hash;
		g_keys[i].disambiguator = dis;
		g_keys[i].instances = 1;
	}
	pthread_mutex_unlock(&g_keys_lock);
	return inst;
}

struct comm {
	pthread_mutex_t lock;
	uint64_t hash, disambiguator, instance;
	int rank, nranks;
	uint32_t pid;
	uint8_t uuid[16];
	uint64_t comm_op_seq;
	uint64_t *p2p_send, *p2p_recv; /* per peer */
	uint64_t mask; /* the event types the shim itself asked for (a chained plugin may ask for more) */
};

enum ev_kind { EV_GROUP = 1, EV_COLL, EV_P2P, EV_KERNEL_CH, EV_OTHER, EV_PROXY_OP, EV_PROXY_STEP };

struct event {
	enum ev_kind kind;
	struct comm *comm;
	struct event *parent; /* kernel channel: its op */
	_Atomic int refs;     /* op: NCCL's handle + one per channel it announced (CE: the poller's) */
	/* A copy-engine collective: its CUDA events and context, the stream they go on, and the
	 * poller's list link. */
	void *ce_stream, *ce_ctx, *ce_start, *ce_stop;
	struct event *ce_next;
	int ce, ce_tracked, ce_started;
	union {
		struct rw_collective_frame coll;
		struct rw_p2p_frame p2p;
		struct rw_bulk_proxy_frame proxy; /* a proxy op's identity; a step's frame */
	};
	uint16_t n_channels;
	_Atomic uint16_t ch_started, ch_ended;
};

static struct event g_group_event = { .kind = EV_GROUP };
static struct event g_other_event = { .kind = EV_OTHER };

static _Atomic long g_live_ops;

/* Proxy ops and steps alive (RINGWATCH_PROXY_STEPS): past RW_MAX_LIVE_PROXY a new one is
 * not tracked (its steps give no frames; counted in rw_shim_untracked_proxy). */
#define RW_MAX_LIVE_PROXY 65536
static _Atomic long g_live_proxy;
RW_EXPORT _Atomic unsigned long rw_shim_untracked_proxy;

static void release(struct event *e)
{
	if (e && (e->kind == EV_COLL || e->kind == EV_P2P || e->kind == EV_KERNEL_CH || e->kind == EV_PROXY_OP ||
		  e->kind == EV_PROXY_STEP) &&
	    atomic_fetch_sub(&e->refs, 1) == 1) {
		if (e->kind == EV_COLL || e->kind == EV_P2P)
			atomic_fetch_sub(&g_live_ops, 1);
		else if (e->kind == EV_PROXY_OP || e->kind == EV_PROXY_STEP)
			atomic_fetch_sub(&g_live_proxy, 1);
		free(e);
	}
}

/* Function and type names this shim does not know: the frame says RW_OP_UNKNOWN /
 * RW_DTYPE_UNKNOWN (never a guess), and each is counted here. */
RW_EXPORT _Atomic unsigned long rw_shim_unknown_names;

static uint8_t op_code(const char *func)
{
	/* NCCL's names (ncclFuncToString): all-to-all is "AlltoAll". */
	static const struct {
		const char *name;
		uint8_t code;
	} t[] = {
		{ "AllReduce", RW_OP_ALL_REDUCE }, { "AllGather", RW_OP_ALL_GATHER },
		{ "ReduceScatter", RW_OP_REDUCE_SCATTER }, { "Reduce", RW_OP_REDUCE },
		{ "Broadcast", RW_OP_BROADCAST }, { "AlltoAll", RW_OP_ALL_TO_ALL },
		{ "Gather", RW_OP_GATHER }, { "Scatter", RW_OP_SCATTER },
		{ "Send", RW_OP_SEND }, { "Recv", RW_OP_RECV },
	};
	if (!func)
		return 0;
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		if (strcmp(func, t[i].name) == 0)
			return t[i].code;
	atomic_fetch_add(&rw_shim_unknown_names, 1);
	return RW_OP_UNKNOWN;
}

static uint8_t dtype_code(const char *d)
{
	/* NCCL's names (ncclDatatypeToString), in ncclDataType_t order; its lookup has no
	 * case for ncclUint8 and passes "Unknown", which stays unknown here. */
	static const char *names[] = { "ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64",
				       "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16",
				       "ncclFloat8e4m3", "ncclFloat8e5m2" };
	if (!d)
		return 0;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (strcmp(d, names[i]) == 0)
			return (uint8_t)(i + 1);
	atomic_fetch_add(&rw_shim_unknown_names, 1);
	return RW_DTYPE_UNKNOWN;
}

/* Emits one phase of an op: a copy of its frame with the phase and time set (NCCL's user
 * thread and its proxy thread may emit phases of one op at once). */
static void emit(struct event *op, uint8_t phase, uint64_t ts)
{
	if (op->kind == EV_COLL) {
		struct rw_collective_frame f = op->coll;
		f.phase = phase;
		f.hdr.ts_ns = ts;
		rw_probe_collective(&f);
	} else if (op->kind == EV_P2P) {
		struct rw_p2p_frame f = op->p2p;
		f.phase = phase;
		f.hdr.ts_ns = ts;
		rw_probe_p2p(&f);
	}
}

/* ---- the plugin ---- */

static int ce_available(void);
RW_EXPORT _Atomic unsigned long rw_shim_ce_unavailable;

/* RINGWATCH_PROXY_STEPS=1: ask NCCL for proxy ops and steps, one bulk frame per step. */
static int proxy_steps_wanted(void)
{
	const char *v = getenv("RINGWATCH_PROXY_STEPS");
	return v && strcmp(v, "1") == 0;
}

static ncclResult_t rw_init(void **context, int *mask, const char *name, uint64_t hash, int n_nodes, int nranks,
			    int rank, int version)
{
	struct comm *c = calloc(1, sizeof(*c));
	if (!c)
		return 1; /* ncclSystemError */
	pthread_mutex_init(&c->lock, NULL);
	c->hash = hash;
	uint64_t d = 0xcbf29ce484222325ull;
	if (name)
		d = fnv1a(d, name, strlen(name));
	d = fnv1a(d, &nranks, sizeof(nranks));
	d = fnv1a(d, &n_nodes, sizeof(n_nodes));
	c->disambiguator = d;
	c->instance = next_instance(hash, d);
	c->rank = rank;
	c->nranks = nranks;
	c->pid = (uint32_t)getpid();
	c->p2p_send = calloc((size_t)(nranks > 0 ? nranks : 1), sizeof(uint64_t));
	c->p2p_recv = calloc((size_t)(nranks > 0 ? nranks : 1), sizeof(uint64_t));
	gpu_uuid(c->uuid);
	refresh_pair();
	/* Collectives, P2P and kernel channels: kernel channels are the completion source. From
	 * v6, copy-engine collectives too (their completion source: CUDA events on their
	 * stream), when the driver's event API is there. */
	*mask = ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh;
	if (proxy_steps_wanted())
		*mask |= ncclProfileProxyOp | ncclProfileProxyStep;
	if (version >= 6) {
		if (ce_available())
			*mask |= ncclProfileCeColl;
		else
			atomic_fetch_add(&rw_shim_ce_unavailable, 1);
	}

	struct rw_progress_entry p;
	memset(&p, 0, sizeof(p));
	p.comm_hash = hash;
	p.comm_disambiguator = d;
	p.comm_instance = c->instance;
	p.rank = (uint32_t)rank;
	p.pid = c->pid;
	memcpy(p.gpu_uuid, c->uuid, 16);
	c->mask = (uint64_t)(uint32_t)*mask;
	p.activation_mask = (uint32_t)*mask;
	p.proc_state = RW_PROC_STATE_RUNNING;
	p.last_update_ns = clock_ns(CLOCK_MONOTONIC);
	rw_probe_comm_init(&p);
	*context = c;
	return RW_NCCL_SUCCESS;
}

static ncclResult_t chain_init(int v, void **context, uint64_t id, int *mask, const char *name, int n_nodes,
			       int nranks, int rank, ncclDebugLogger_t logfn);

static ncclResult_t rw_init_v5(void **context, uint64_t comm_id, int *mask, const char *name, int n_nodes, int nranks,
			       int rank, ncclDebugLogger_t logfn)
{
	return chain_init(5, context, comm_id, mask, name, n_nodes, nranks, rank, logfn);
}

static ncclResult_t rw_init_v6(void **context, uint64_t comm_id, int *mask, const char *name, int n_nodes, int nranks,
			       int rank, ncclDebugLogger_t logfn)
{
	return chain_init(6, context, comm_id, mask, name, n_nodes, nranks, rank, logfn);
}

static ncclResult_t rw_init_v4(void **context, int *mask, const char *name, uint64_t hash, int n_nodes, int nranks,
			       int rank, ncclDebugLogger_t logfn)
{
	return chain_init(4, context, hash, mask, name, n_nodes, nranks, rank, logfn);
}

/* Ops waiting for their channels, process-wide: past this many, a new op is freed at its
 * stopEvent (its kernel events, if NCCL reports any, are then not turned into frames and
 * are counted in g_untracked). Bounds memory when NCCL never reports kernel channels for
 * ops (graph capture, a mask without kernel channels). */
#define RW_MAX_LIVE_OPS 65536
RW_EXPORT _Atomic unsigned long rw_shim_untracked_ops;

static struct event *new_op(struct comm *c, enum ev_kind kind)
{
	struct event *e = calloc(1, sizeof(*e));
	if (!e)
		return NULL;
	e->kind = kind;
	e->comm = c;
	atomic_store(&e->refs, 1);
	atomic_fetch_add(&g_live_ops, 1);
	return e;
}

/* The op outlives NCCL's handle until every channel ended: one reference per channel. */
static void expect_channels(struct event *e, uint16_t n)
{
	e->n_channels = n;
	atomic_fetch_add(&e->refs, n);
}

/* An op past RW_MAX_LIVE_OPS: its enqueue_start went out (its comm_op_seq is taken, as on
 * every rank), then it is freed and NCCL gets this shared handle, so no later event —
 * its stop, its channels — can reach freed memory; it gets no further frames. */
static struct event g_untracked_event = { .kind = EV_OTHER };

static int over_op_cap(void)
{
	if (atomic_load(&g_live_ops) <= RW_MAX_LIVE_OPS)
		return 0;
	atomic_fetch_add(&rw_shim_untracked_ops, 1);
	return 1;
}

/* ---- copy-engine collectives: CUDA events on the collective's stream ---- */

/* The CUDA driver's event API, resolved from the libcuda the process already loaded. */
typedef int (*cu_event_create_fn)(void **event, unsigned flags);
typedef int (*cu_event_record_fn)(void *event, void *stream);
typedef int (*cu_event_query_fn)(void *event);
typedef int (*cu_event_destroy_fn)(void *event);
typedef int (*cu_ctx_get_fn)(void **ctx);
typedef int (*cu_ctx_set_fn)(void *ctx);
#define RW_CU_SUCCESS 0
#define RW_CU_NOT_READY 600
#define RW_CU_EVENT_DISABLE_TIMING 0x2

static struct {
	pthread_once_t once;
	int ok;
	cu_event_create_fn create;
	cu_event_record_fn record;
	cu_event_query_fn query;
	cu_event_destroy_fn destroy;
	cu_ctx_get_fn ctx_get;
	cu_ctx_set_fn ctx_set;
	/* The poller: ops whose stop event was recorded, oldest first. */
	pthread_mutex_t lock;
	pthread_cond_t wake;
	struct event *head, *tail;
	int thread_started;
	unsigned poll_us;
} g_ce = { .once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER };

/* Communicators whose init found no CUDA event API (so CE events were not asked for), and CE
 * collectives whose events could not be created or recorded (their enqueue phases go out,
 * their completion cannot: the op is left without kernel phases, as an untracked op). */
RW_EXPORT _Atomic unsigned long rw_shim_ce_untracked;

/* A forked child has no poller thread and must not wait on its parent's ops. */
static void ce_atfork_child(void)
{
	pthread_mutex_init(&g_ce.lock, NULL);
	pthread_cond_init(&g_ce.wake, NULL);
	g_ce.head = g_ce.tail = NULL;
	g_ce.thread_started = 0;
}

static void ce_resolve(void)
{
	pthread_atfork(NULL, NULL, ce_atfork_child);
	void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (!cuda)
		return;
	g_ce.create = (cu_event_create_fn)dlsym(cuda, "cuEventCreate");
	g_ce.record = (cu_event_record_fn)dlsym(cuda, "cuEventRecord");
	g_ce.query = (cu_event_query_fn)dlsym(cuda, "cuEventQuery");
	g_ce.destroy = (cu_event_destroy_fn)dlsym(cuda, "cuEventDestroy_v2");
	if (!g_ce.destroy)
		g_ce.destroy = (cu_event_destroy_fn)dlsym(cuda, "cuEventDestroy");
	g_ce.ctx_get = (cu_ctx_get_fn)dlsym(cuda, "cuCtxGetCurrent");
	g_ce.ctx_set = (cu_ctx_set_fn)dlsym(cuda, "cuCtxSetCurrent");
	g_ce.ok = g_ce.create && g_ce.record && g_ce.query && g_ce.destroy && g_ce.ctx_get && g_ce.ctx_set;
	const char *poll = getenv("RINGWATCH_CE_POLL_US");
	long us = poll ? strtol(poll, NULL, 10) : 200;
	g_ce.poll_us = (unsigned)(us < 20 ? 20 : us > 100000 ? 100000 : us);
	/* The library stays loaded (NOLOAD took a reference): the process loaded it already. */
}

static int ce_available(void)
{
	pthread_once(&g_ce.once, ce_resolve);
	return g_ce.ok;
}

static void ce_destroy_events(struct event *e)
{
	if (e->ce_start)
		g_ce.destroy(e->ce_start);
	if (e->ce_stop)
		g_ce.destroy(e->ce_stop);
	e->ce_start = e->ce_stop = NULL;
}

/* One pending op's events, queried: 1 when it is done with (completed, or a query failed
 * for good: CUDA_ERROR_NOT_READY is the only "not yet"). */
static int ce_poll_one(struct event *e, void **current)
{
	if (e->ce_ctx != *current && g_ce.ctx_set(e->ce_ctx) == RW_CU_SUCCESS)
		*current = e->ce_ctx;
	if (!e->ce_started) {
		int q = g_ce.query(e->ce_start);
		if (q == RW_CU_SUCCESS) {
			e->ce_started = 1;
			emit(e, RW_PHASE_KERNEL_START, clock_ns(CLOCK_MONOTONIC));
		} else if (q != RW_CU_NOT_READY) {
			atomic_fetch_add(&rw_shim_ce_untracked, 1);
			return 1;
		}
	}
	if (e->ce_started) {
		int q = g_ce.query(e->ce_stop);
		if (q == RW_CU_SUCCESS) {
			emit(e, RW_PHASE_KERNEL_END, clock_ns(CLOCK_MONOTONIC));
			return 1;
		}
		if (q != RW_CU_NOT_READY) {
			atomic_fetch_add(&rw_shim_ce_untracked, 1);
			return 1;
		}
	}
	return 0;
}

static void *ce_poller(void *arg)
{
	(void)arg;
	void *current = NULL;
	for (;;) {
		/* Take the pending list; new ops append to an empty one meanwhile (the launching
		 * thread never waits on the queries). */
		pthread_mutex_lock(&g_ce.lock);
		while (!g_ce.head)
			pthread_cond_wait(&g_ce.wake, &g_ce.lock);
		struct event *list = g_ce.head;
		g_ce.head = g_ce.tail = NULL;
		pthread_mutex_unlock(&g_ce.lock);
		/* Every pending op (ranks' and communicators' streams complete independently). */
		struct event *keep = NULL, *keep_tail = NULL;
		while (list) {
			struct event *e = list;
			list = e->ce_next;
			e->ce_next = NULL;
			if (ce_poll_one(e, &current)) {
				ce_destroy_events(e);
				release(e);
			} else if (keep_tail) {
				keep_tail->ce_next = e;
				keep_tail = e;
			} else {
				keep = keep_tail = e;
			}
		}
		if (!keep)
			continue;
		/* What is still pending goes back in front of what arrived meanwhile. */
		pthread_mutex_lock(&g_ce.lock);
		keep_tail->ce_next = g_ce.head;
		g_ce.head = keep;
		if (!g_ce.tail)
			g_ce.tail = keep_tail;
		pthread_mutex_unlock(&g_ce.lock);
		usleep(g_ce.poll_us);
	}
	return NULL;
}

/* At the CE collective's start: its start event on its stream (the poller's reference is
 * taken here; dropped when the stop event completed). 0 when the op cannot be tracked. */
static int ce_track_start(struct event *e, void *stream)
{
	if (!ce_available())
		return 0;
	e->ce_stream = stream;
	if (g_ce.ctx_get(&e->ce_ctx) != RW_CU_SUCCESS ||
	    g_ce.create(&e->ce_start, RW_CU_EVENT_DISABLE_TIMING) != RW_CU_SUCCESS ||
	    g_ce.create(&e->ce_stop, RW_CU_EVENT_DISABLE_TIMING) != RW_CU_SUCCESS ||
	    g_ce.record(e->ce_start, stream) != RW_CU_SUCCESS) {
		ce_destroy_events(e);
		atomic_fetch_add(&rw_shim_ce_untracked, 1);
		return 0;
	}
	atomic_fetch_add(&e->refs, 1);
	return 1;
}

/* At the CE collective's stop (everything enqueued, the final barrier included): its stop
 * event on the stream, and the op handed to the poller. */
static void ce_track_stop(struct event *e)
{
	if (g_ce.record(e->ce_stop, e->ce_stream) != RW_CU_SUCCESS) {
		atomic_fetch_add(&rw_shim_ce_untracked, 1);
		ce_destroy_events(e);
		release(e); /* the poller's reference */
		return;
	}
	pthread_mutex_lock(&g_ce.lock);
	if (!g_ce.thread_started) {
		pthread_t t;
		pthread_attr_t a;
		pthread_attr_init(&a);
		pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
		g_ce.thread_started = pthread_create(&t, &a, ce_poller, NULL) == 0;
		pthread_attr_destroy(&a);
	}
	if (!g_ce.thread_started) {
		pthread_mutex_unlock(&g_ce.lock);
		atomic_fetch_add(&rw_shim_ce_untracked, 1);
		ce_destroy_events(e);
		release(e);
		return;
	}
	e->ce_next = NULL;
	if (g_ce.tail)
		g_ce.tail->ce_next = e;
	else
		g_ce.head = e;
	g_ce.tail = e;
	pthread_cond_signal(&g_ce.wake);
	pthread_mutex_unlock(&g_ce.lock);
}

/* One start for either version: the fields both descriptors share, already extracted. */
struct start {
	uint64_t type;
	void *parent;
	uint64_t nccl_seq;
	const char *func;
	size_t count;
	int root;
	const char *datatype;
	uint8_t n_channels;
	int peer;
	uint64_t ptimer; /* kernel channel: its GPU timer at start */
	uint8_t channel; /* proxy op */
	int step;        /* proxy step */
	void *stream;    /* copy-engine collective: its stream */
};

/* A frame's header fields the shim sets (the kernel sets the rest) and its communicator. */
#define RW_FRAME_IDENT(f, kind_, c)                                                                \
	do {                                                                                       \
		(f)->hdr.version = RW_WIRE_VERSION;                                                \
		(f)->hdr.kind = (kind_);                                                           \
		(f)->hdr.length = sizeof(*(f));                                                    \
		(f)->comm_hash = (c)->hash;                                                        \
		(f)->comm_disambiguator = (c)->disambiguator;                                      \
		(f)->comm_instance = (c)->instance;                                                \
	} while (0)

static ncclResult_t rw_start(void *context, void **handle, const struct start *s)
{
	struct comm *c = context;
	*handle = &g_other_event;
	if (!c)
		return RW_NCCL_SUCCESS;
	/* Only what the shim asked for: a chained plugin's extra types are not its business. */
	if (!(s->type & c->mask))
		return RW_NCCL_SUCCESS;
	uint64_t now = clock_ns(CLOCK_MONOTONIC);
	if (s->type == ncclProfileGroup) {
		*handle = &g_group_event;
	} else if (s->type == ncclProfileColl || s->type == ncclProfileCeColl) {
		struct event *e = new_op(c, EV_COLL);
		if (!e)
			return RW_NCCL_SUCCESS;
		e->ce = s->type == ncclProfileCeColl;
		struct rw_collective_frame *f = &e->coll;
		RW_FRAME_IDENT(f, RW_FRAME_KIND_COLLECTIVE, c);
		pthread_mutex_lock(&c->lock);
		f->comm_op_seq = ++c->comm_op_seq;
		pthread_mutex_unlock(&c->lock);
		f->local_op_seq = atomic_fetch_add(&g_local_op_seq, 1) + 1;
		f->nccl_seq = s->nccl_seq;
		f->count = s->count;
		f->rank = (uint32_t)c->rank;
		f->nranks = (uint32_t)c->nranks;
		f->root = s->root < 0 ? UINT32_MAX : (uint32_t)s->root;
		f->pid = c->pid;
		f->n_channels = s->n_channels ? s->n_channels : 1;
		f->op = op_code(s->func);
		f->dtype = dtype_code(s->datatype);
		if (e->ce)
			f->n_channels = 1; /* one completion for the whole op: the stop event on its stream */
		emit(e, RW_PHASE_ENQUEUE_START, now);
		if (over_op_cap()) {
			release(e);
			*handle = &g_untracked_event;
			return RW_NCCL_SUCCESS;
		}
		if (e->ce)
			e->ce_tracked = ce_track_start(e, s->stream);
		else
			expect_channels(e, f->n_channels);
		*handle = e;
	} else if (s->type == ncclProfileP2p) {
		struct event *e = new_op(c, EV_P2P);
		if (!e)
			return RW_NCCL_SUCCESS;
		struct rw_p2p_frame *f = &e->p2p;
		RW_FRAME_IDENT(f, RW_FRAME_KIND_P2P, c);
		f->op = op_code(s->func);
		int peer = (s->peer >= 0 && s->peer < c->nranks) ? s->peer : 0;
		pthread_mutex_lock(&c->lock);
		f->p2p_seq = f->op == RW_OP_SEND ? ++c->p2p_send[peer] : ++c->p2p_recv[peer];
		pthread_mutex_unlock(&c->lock);
		f->local_op_seq = atomic_fetch_add(&g_local_op_seq, 1) + 1;
		f->count = s->count;
		f->rank = (uint32_t)c->rank;
		f->src = f->op == RW_OP_SEND ? (uint32_t)c->rank : (uint32_t)peer;
		f->dst = f->op == RW_OP_SEND ? (uint32_t)peer : (uint32_t)c->rank;
		f->pid = c->pid;
		f->n_channels = s->n_channels ? s->n_channels : 1;
		f->dtype = dtype_code(s->datatype);
		emit(e, RW_PHASE_ENQUEUE_START, now);
		if (over_op_cap()) {
			release(e);
			*handle = &g_untracked_event;
			return RW_NCCL_SUCCESS;
		}
		expect_channels(e, f->n_channels);
		*handle = e;
	} else if (s->type == ncclProfileKernelCh) {
		struct event *op = s->parent;
		if (!op || (op->kind != EV_COLL && op->kind != EV_P2P) || op->n_channels == 0 || op->comm != c)
			return RW_NCCL_SUCCESS;
		/* More channels than the op announced: nothing holds the op for it. */
		if (atomic_load(&op->ch_started) >= op->n_channels)
			return RW_NCCL_SUCCESS;
		struct event *ch = calloc(1, sizeof(*ch));
		if (!ch)
			return RW_NCCL_SUCCESS;
		ch->kind = EV_KERNEL_CH;
		ch->comm = c;
		ch->parent = op;
		atomic_store(&ch->refs, 1);
		if (atomic_fetch_add(&op->ch_started, 1) == 0)
			emit(op, RW_PHASE_KERNEL_START, gpu_to_mono(s->ptimer));
		*handle = ch;
	} else if (s->type == ncclProfileProxyOp || s->type == ncclProfileProxyStep) {
		struct event *op = s->parent;
		if (s->type == ncclProfileProxyStep && (!op || op->kind != EV_PROXY_OP))
			return RW_NCCL_SUCCESS; /* no proxy op to name its peer and channel */
		if (atomic_load(&g_live_proxy) >= RW_MAX_LIVE_PROXY) {
			atomic_fetch_add(&rw_shim_untracked_proxy, 1);
			return RW_NCCL_SUCCESS;
		}
		struct event *e = calloc(1, sizeof(*e));
		if (!e)
			return RW_NCCL_SUCCESS;
		atomic_fetch_add(&g_live_proxy, 1);
		e->comm = c;
		atomic_store(&e->refs, 1);
		if (s->type == ncclProfileProxyOp) {
			e->kind = EV_PROXY_OP;
			struct rw_bulk_proxy_frame *f = &e->proxy;
			RW_FRAME_IDENT(f, RW_FRAME_KIND_BULK_PROXY, c);
			f->rank = (uint32_t)c->rank;
			f->peer = s->peer < 0 ? UINT32_MAX : (uint32_t)s->peer;
			f->channel = s->channel;
			f->weight = 1;
		} else {
			/* The step carries a copy of its op's identity: nothing points back. */
			e->kind = EV_PROXY_STEP;
			e->proxy = op->proxy;
			e->proxy.step = s->step < 0 ? 0 : (uint64_t)s->step;
		}
		*handle = e;
	}
	return RW_NCCL_SUCCESS;
}

/* The fields both descriptor versions share, read the same way from either. */
#define RW_START_FROM(d, s)                                                                        \
	do {                                                                                       \
		(s).type = (d)->type;                                                              \
		(s).parent = (d)->parentObj;                                                       \
		if ((d)->type == ncclProfileColl) {                                                \
			(s).nccl_seq = (d)->coll.seqNumber;                                        \
			(s).func = (d)->coll.func;                                                 \
			(s).count = (d)->coll.count;                                               \
			(s).root = (d)->coll.root;                                                 \
			(s).datatype = (d)->coll.datatype;                                         \
			(s).n_channels = (d)->coll.nChannels;                                      \
		} else if ((d)->type == ncclProfileP2p) {                                          \
			(s).func = (d)->p2p.func;                                                  \
			(s).count = (d)->p2p.count;                                                \
			(s).datatype = (d)->p2p.datatype;                                          \
			(s).peer = (d)->p2p.peer;                                                  \
			(s).n_channels = (d)->p2p.nChannels;                                       \
		} else if ((d)->type == ncclProfileKernelCh) {                                     \
			(s).ptimer = (d)->kernelCh.pTimer;                                         \
		} else if ((d)->type == ncclProfileProxyOp) {                                      \
			(s).peer = (d)->proxyOp.peer;                                              \
			(s).channel = (d)->proxyOp.channelId;                                      \
		} else if ((d)->type == ncclProfileProxyStep) {                                    \
			(s).step = (d)->proxyStep.step;                                            \
		}                                                                                  \
	} while (0)

static ncclResult_t rw_start_v5(void *context, void **handle, ncclProfilerEventDescr_v5_t *d)
{
	struct start s = { 0 };
	RW_START_FROM(d, s);
	return rw_start(context, handle, &s);
}

/* v6: v5's arms, and the copy-engine collective (its CeSync and CeBatch children are not
 * needed: the collective's own start and stop bracket them on its stream). */
static ncclResult_t rw_start_v6(void *context, void **handle, ncclProfilerEventDescr_v6_t *d)
{
	struct start s = { 0 };
	if (d->type == ncclProfileCeColl) {
		s.type = d->type;
		s.parent = d->parentObj;
		s.nccl_seq = d->ceColl.seqNumber;
		s.func = d->ceColl.func;
		s.count = d->ceColl.count;
		s.root = d->ceColl.root;
		s.datatype = d->ceColl.datatype;
		s.n_channels = 1;
		s.stream = d->ceColl.stream;
	} else {
		RW_START_FROM(d, s);
	}
	return rw_start(context, handle, &s);
}

static ncclResult_t rw_start_v4(void *context, void **handle, ncclProfilerEventDescr_v4_t *d)
{
	struct start s = { 0 };
	RW_START_FROM(d, s);
	return rw_start(context, handle, &s);
}

/* One channel of an op ended: the rank-level kernel_end only once every channel did. */
static void channel_ended(struct event *ch, uint64_t ptimer)
{
	struct event *op = ch->parent;
	ch->parent = NULL;
	if (!op)
		return;
	if (atomic_fetch_add(&op->ch_ended, 1) + 1 == op->n_channels)
		emit(op, RW_PHASE_KERNEL_END, gpu_to_mono(ptimer));
	release(op);
}

/* stopEvent: for an op, NCCL has enqueued it (NOT completed); for a channel, its end (if
 * NCCL did not record KernelChStop first). */
static ncclResult_t rw_stop(void *handle)
{
	struct event *e = handle;
	if (!e)
		return RW_NCCL_SUCCESS;
	if (e->kind == EV_COLL || e->kind == EV_P2P) {
		emit(e, RW_PHASE_ENQUEUE_END, clock_ns(CLOCK_MONOTONIC));
		if (e->ce_tracked)
			ce_track_stop(e);
		release(e);
	} else if (e->kind == EV_KERNEL_CH) {
		channel_ended(e, 0);
		release(e);
	} else if (e->kind == EV_PROXY_STEP) {
		/* The step is over: its frame, with the bytes its states reported. */
		struct rw_bulk_proxy_frame f = e->proxy;
		f.hdr.ts_ns = clock_ns(CLOCK_MONOTONIC);
		rw_probe_proxy_step(&f);
		release(e);
	} else if (e->kind == EV_PROXY_OP) {
		release(e);
	}
	return RW_NCCL_SUCCESS;
}

/* `value`: the state args' first 8 bytes — a kernel channel's GPU timer, a proxy step's
 * transSize (the bytes moved so far). */
static ncclResult_t rw_record(void *handle, ncclProfilerEventState_t state, uint64_t value)
{
	struct event *e = handle;
	if (e && e->kind == EV_KERNEL_CH && state == RW_NCCL_KERNEL_CH_STOP)
		channel_ended(e, value);
	else if (e && e->kind == EV_PROXY_STEP && value > e->proxy.bytes)
		e->proxy.bytes = value;
	return RW_NCCL_SUCCESS;
}

/* The state args' first 8 bytes, in every version: kernelCh.pTimer / proxyStep.transSize. */
#define RW_RECORD(v)                                                                               \
	static ncclResult_t rw_record_v##v(void *handle, ncclProfilerEventState_t state,           \
					   ncclProfilerEventStateArgs_v##v##_t *a)                  \
	{                                                                                          \
		return rw_record(handle, state, a ? a->kernelCh.pTimer : 0);                       \
	}
RW_RECORD(4)
RW_RECORD(5)
RW_RECORD(6)

static ncclResult_t rw_finalize(void *context)
{
	struct comm *c = context;
	if (c) {
		free(c->p2p_send);
		free(c->p2p_recv);
		pthread_mutex_destroy(&c->lock);
		free(c);
	}
	return RW_NCCL_SUCCESS;
}

/* ---- chaining to a second profiler plugin (opt-in) ----
 *
 * NCCL loads one profiler plugin per process. RINGWATCH_PROFILER_CHAIN=/full/path/other.so
 * makes the shim load a second one (NVIDIA's Inspector, a site's own) and forward every
 * call to it with its own context: its init's mask is added to the shim's (an event only
 * it asked for reaches only it), its handles and parent pointers are its own. The second
 * plugin must export the same version NCCL loaded the shim with; under v6, a plugin with
 * only v5 gets v5's share (no copy-engine events, as NCCL's own adapter does). Otherwise
 * chaining stays off, said once through NCCL's logger (or stderr) and counted.
 *
 * Handles given to NCCL while chaining pair the shim's handle with the other plugin's, so
 * a child event's parent is translated for each. Events that can be parents get slots of
 * a fixed pool (16,384 per process, reused only once stopped; a slot keeps the shim's op
 * alive until reused), so a child started after its parent stopped still finds both
 * parents; events that never are parents get a pair freed at their stop. With no free
 * slot among the next 64 the event reaches only the shim (rw_shim_chain_dropped). */

RW_EXPORT _Atomic unsigned long rw_shim_chain_failures;
RW_EXPORT _Atomic unsigned long rw_shim_chain_dropped;

typedef int (*chain_init_v56_fn)(void **, uint64_t, int *, const char *, int, int, int, ncclDebugLogger_t);
typedef int (*chain_init_v4_fn)(void **, int *, const char *, uint64_t, int, int, int, ncclDebugLogger_t);
typedef int (*chain_start_fn)(void *, void **, void *);
typedef int (*chain_stop_fn)(void *);
typedef int (*chain_record_fn)(void *, int, void *);
typedef int (*chain_finalize_fn)(void *);

/* What one of the shim's versions forwards to (resolved at that version's first init). */
struct chain_target {
	pthread_mutex_t lock;
	int resolved, active;
	int their_version;
	void *init; /* chain_init_v56_fn or chain_init_v4_fn */
	chain_start_fn start;
	chain_stop_fn stop;
	chain_record_fn record;
	chain_finalize_fn finalize;
};
static struct chain_target g_chain[7] = {
	[4] = { .lock = PTHREAD_MUTEX_INITIALIZER },
	[5] = { .lock = PTHREAD_MUTEX_INITIALIZER },
	[6] = { .lock = PTHREAD_MUTEX_INITIALIZER },
};

struct chain_ctx {
	void *ours, *theirs; /* theirs: NULL when its init failed */
	int their_mask;
};

/* Parent-capable events' pairs: a pool, reused only once stopped; a pair whose shim side
 * is an op the shim holds keeps a reference on it until reused, so a late child's parent
 * is never freed memory. Events that are never parents get a pair of their own, freed at
 * their stop. */
#define RW_CHAIN_SLOTS 16384
#define RW_PAIR_MAGIC 0x5257504149523031ull
enum { SLOT_FREE, SLOT_LIVE, SLOT_STOPPED };
struct chain_slot {
	uint64_t magic;
	_Atomic int state;
	int theirs_valid;
	int version; /* the shim's version it was made under */
	int leaf;    /* a pair of its own (never a parent), freed at stop */
	int ours_held;
	void *ours, *theirs;
};
static struct chain_slot *g_slots;
static _Atomic unsigned g_slot_cursor;

static void chain_log(ncclDebugLogger_t logfn, const char *msg, const char *detail)
{
	if (logfn)
		logfn(2 /* NCCL_LOG_WARN */, 1 /* NCCL_INIT */, __FILE__, __LINE__, "ringwatch: %s%s", msg, detail);
	else
		fprintf(stderr, "ringwatch profiler shim: %s%s\n", msg, detail);
}

static void chain_resolve(int v, ncclDebugLogger_t logfn)
{
	struct chain_target *t = &g_chain[v];
	pthread_mutex_lock(&t->lock);
	if (t->resolved) {
		pthread_mutex_unlock(&t->lock);
		return;
	}
	t->resolved = 1;
	const char *path = getenv("RINGWATCH_PROFILER_CHAIN");
	if (!path || !*path) {
		pthread_mutex_unlock(&t->lock);
		return;
	}
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	void **table = NULL;
	char sym[32];
	if (lib) {
		for (int tv = v; tv >= (v == 6 ? 5 : v) && !table; tv--) {
			snprintf(sym, sizeof(sym), "ncclProfiler_v%d", tv);
			table = dlsym(lib, sym);
			t->their_version = tv;
		}
	}
	if (!g_slots)
		g_slots = calloc(RW_CHAIN_SLOTS, sizeof(*g_slots));
	if (!lib || !table || !g_slots || !table[1] || !table[2] || !table[3] || !table[4] || !table[5]) {
		atomic_fetch_add(&rw_shim_chain_failures, 1);
		snprintf(sym, sizeof(sym), "ncclProfiler_v%d", v);
		chain_log(logfn, !lib ? "RINGWATCH_PROFILER_CHAIN: cannot load " : "RINGWATCH_PROFILER_CHAIN: no usable table for ",
			  !lib ? path : sym);
		pthread_mutex_unlock(&t->lock);
		return;
	}
	t->init = table[1];
	t->start = (chain_start_fn)table[2];
	t->stop = (chain_stop_fn)table[3];
	t->record = (chain_record_fn)table[4];
	t->finalize = (chain_finalize_fn)table[5];
	t->active = 1;
	chain_log(logfn, "chained to ", path);
	pthread_mutex_unlock(&t->lock);
}

static int is_slot(const void *p)
{
	const char *b = (const char *)g_slots;
	const char *q = p;
	return g_slots && q >= b && q < b + sizeof(*g_slots) * RW_CHAIN_SLOTS &&
	       (size_t)(q - b) % sizeof(*g_slots) == 0;
}

/* The pair behind a handle NCCL passes back, or NULL for one of the shim's own (every
 * handle NCCL holds came from this shim: a pair, an event, or a shared static one). */
static struct chain_slot *pair_of(void *h)
{
	if (is_slot(h))
		return h;
	struct chain_slot *p = h;
	return p && p->magic == RW_PAIR_MAGIC ? p : NULL;
}

/* An op of the shim's own that a pair may hold a reference on. */
static struct event *held_op(void *ours)
{
	struct event *e = ours;
	if (!e || e == &g_group_event || e == &g_other_event || e == &g_untracked_event)
		return NULL;
	return e->kind == EV_COLL || e->kind == EV_P2P || e->kind == EV_PROXY_OP ? e : NULL;
}

static struct chain_slot *slot_alloc(uint64_t type)
{
	/* Never parents: kernel channels, proxy steps and control, net plugin, kernel launch,
	 * CE sync and batch. */
	const uint64_t leaves = ncclProfileKernelCh | ncclProfileProxyStep | ncclProfileProxyCtrl |
				ncclProfileNetPlugin | ncclProfileKernelLaunch | ncclProfileCeSync |
				ncclProfileCeBatch;
	if (type & leaves) {
		struct chain_slot *p = calloc(1, sizeof(*p));
		if (!p) {
			atomic_fetch_add(&rw_shim_chain_dropped, 1);
			return NULL;
		}
		p->magic = RW_PAIR_MAGIC;
		p->leaf = 1;
		return p;
	}
	for (int i = 0; i < 64; i++) {
		struct chain_slot *s = &g_slots[atomic_fetch_add(&g_slot_cursor, 1) % RW_CHAIN_SLOTS];
		int st = atomic_load(&s->state);
		if (st != SLOT_LIVE && atomic_compare_exchange_strong(&s->state, &st, SLOT_LIVE)) {
			if (s->ours_held)
				release(s->ours);
			s->ours_held = 0;
			s->magic = RW_PAIR_MAGIC;
			return s;
		}
	}
	atomic_fetch_add(&rw_shim_chain_dropped, 1);
	return NULL;
}

/* A parent pointer NCCL passed, for the shim (ours) or the other plugin (!ours). */
static void *parent_for(void *p, int ours)
{
	struct chain_slot *s = pair_of(p);
	if (!s)
		return ours ? p : NULL;
	return ours ? s->ours : s->theirs_valid ? s->theirs : NULL;
}

#define RW_CE_BITS (ncclProfileCeColl | ncclProfileCeSync | ncclProfileCeBatch)

static ncclResult_t chain_init(int v, void **context, uint64_t id, int *mask, const char *name, int n_nodes,
			       int nranks, int rank, ncclDebugLogger_t logfn)
{
	chain_resolve(v, logfn);
	struct chain_target *t = &g_chain[v];
	void *ours = NULL;
	ncclResult_t rc = rw_init(&ours, mask, name, id, n_nodes, nranks, rank, v);
	if (rc != RW_NCCL_SUCCESS || !t->active) {
		*context = ours;
		return rc;
	}
	struct chain_ctx *cc = calloc(1, sizeof(*cc));
	if (!cc) {
		/* Every context of a chaining version is a chain_ctx: fail this init instead. */
		rw_finalize(ours);
		return 1; /* ncclSystemError */
	}
	cc->ours = ours;
	int their_mask = 0;
	int their_rc = v == 4 ? ((chain_init_v4_fn)t->init)(&cc->theirs, &their_mask, name, id, n_nodes, nranks, rank, logfn)
			      : ((chain_init_v56_fn)t->init)(&cc->theirs, id, &their_mask, name, n_nodes, nranks, rank, logfn);
	if (their_rc != 0) {
		atomic_fetch_add(&rw_shim_chain_failures, 1);
		chain_log(logfn, "the chained plugin's init failed: ", "it gets no events of this communicator");
		cc->theirs = NULL;
		their_mask = 0;
	}
	cc->their_mask = t->their_version < 6 ? their_mask & ~RW_CE_BITS : their_mask;
	*mask |= cc->their_mask;
	*context = cc;
	return RW_NCCL_SUCCESS;
}

/* startEvent while chaining: each plugin gets its own copy of the descriptor with its own
 * parents; only an event type the other plugin asked for reaches it. */
#define RW_CHAIN_START(v, descr_t, ours_start, patch)                                              \
	static ncclResult_t chain_start_v##v(void *context, void **handle, descr_t *d)             \
	{                                                                                          \
		if (!g_chain[v].active)                                                            \
			return ours_start(context, handle, d);                                     \
		struct chain_ctx *cc = context;                                                    \
		struct chain_slot *s = slot_alloc((uint64_t)d->type);                              \
		descr_t mine = *d;                                                                 \
		mine.parentObj = parent_for(d->parentObj, 1);                                      \
		patch(mine, d, 1);                                                                 \
		void *ours_h = NULL;                                                               \
		ours_start(cc->ours, &ours_h, &mine);                                              \
		if (!s) {                                                                          \
			*handle = ours_h;                                                          \
			return RW_NCCL_SUCCESS;                                                    \
		}                                                                                  \
		s->ours = ours_h;                                                                  \
		if (!s->leaf && held_op(ours_h)) {                                                 \
			atomic_fetch_add(&held_op(ours_h)->refs, 1);                               \
			s->ours_held = 1;                                                          \
		}                                                                                  \
		s->theirs = NULL;                                                                  \
		s->theirs_valid = 0;                                                               \
		s->version = v;                                                                    \
		if (cc->theirs && ((uint64_t)d->type & (uint64_t)cc->their_mask)) {                \
			descr_t theirs = *d;                                                       \
			theirs.parentObj = parent_for(d->parentObj, 0);                            \
			patch(theirs, d, 0);                                                       \
			s->theirs_valid = g_chain[v].start(cc->theirs, &s->theirs, &theirs) == 0; \
		}                                                                                  \
		*handle = s;                                                                       \
		return RW_NCCL_SUCCESS;                                                            \
	}

#define RW_PATCH_NONE(copy, d, ours) ((void)0)
/* v5/v6: a collective's and a P2P op's parentGroup is a handle too. */
#define RW_PATCH_GROUPS(copy, d, ours)                                                             \
	do {                                                                                       \
		if ((d)->type == ncclProfileColl)                                                  \
			(copy).coll.parentGroup = parent_for((d)->coll.parentGroup, ours);         \
		else if ((d)->type == ncclProfileP2p)                                              \
			(copy).p2p.parentGroup = parent_for((d)->p2p.parentGroup, ours);           \
	} while (0)

RW_CHAIN_START(4, ncclProfilerEventDescr_v4_t, rw_start_v4, RW_PATCH_NONE)
RW_CHAIN_START(5, ncclProfilerEventDescr_v5_t, rw_start_v5, RW_PATCH_GROUPS)
RW_CHAIN_START(6, ncclProfilerEventDescr_v6_t, rw_start_v6, RW_PATCH_GROUPS)

static ncclResult_t chain_stop(void *handle)
{
	struct chain_slot *s = pair_of(handle);
	if (!s)
		return rw_stop(handle);
	rw_stop(s->ours);
	if (s->theirs_valid)
		g_chain[s->version].stop(s->theirs);
	if (s->leaf)
		free(s);
	else
		atomic_store(&s->state, SLOT_STOPPED);
	return RW_NCCL_SUCCESS;
}

#define RW_CHAIN_RECORD(v, args_t, ours_record)                                                    \
	static ncclResult_t chain_record_v##v(void *handle, ncclProfilerEventState_t state, args_t *a) \
	{                                                                                          \
		struct chain_slot *s = pair_of(handle);                                            \
		if (!s)                                                                            \
			return ours_record(handle, state, a);                                      \
		ours_record(s->ours, state, a);                                                    \
		if (s->theirs_valid)                                                               \
			g_chain[v].record(s->theirs, state, a);                                    \
		return RW_NCCL_SUCCESS;                                                            \
	}
RW_CHAIN_RECORD(4, ncclProfilerEventStateArgs_v4_t, rw_record_v4)
RW_CHAIN_RECORD(5, ncclProfilerEventStateArgs_v5_t, rw_record_v5)
RW_CHAIN_RECORD(6, ncclProfilerEventStateArgs_v6_t, rw_record_v6)

#define RW_CHAIN_FINALIZE(v)                                                                       \
	static ncclResult_t chain_finalize_v##v(void *context)                                     \
	{                                                                                          \
		if (!g_chain[v].active)                                                            \
			return rw_finalize(context);                                               \
		struct chain_ctx *cc = context;                                                    \
		if (cc && cc->theirs)                                                              \
			g_chain[v].finalize(cc->theirs);                                           \
		ncclResult_t rc = rw_finalize(cc ? cc->ours : NULL);                               \
		free(cc);                                                                          \
		return rc;                                                                         \
	}
RW_CHAIN_FINALIZE(4)
RW_CHAIN_FINALIZE(5)
RW_CHAIN_FINALIZE(6)

/* The exported tables: NCCL tries the newest version it knows first. */
#define RW_EXPORT_TABLE(v)                                                                         \
	RW_EXPORT const ncclProfiler_v##v##_t ncclProfiler_v##v = {                                \
		.name = "ringwatch",                                                               \
		.init = rw_init_v##v,                                                              \
		.startEvent = chain_start_v##v,                                                    \
		.stopEvent = chain_stop,                                                           \
		.recordEventState = chain_record_v##v,                                             \
		.finalize = chain_finalize_v##v,                                                   \
	};
RW_EXPORT_TABLE(6)
RW_EXPORT_TABLE(5)
RW_EXPORT_TABLE(4)
