// SPDX-License-Identifier: GPL-2.0
/*
 * ringwatch's eBPF side, part 1: the rings, the per-(ring, CPU) counters, the sampling
 * control, and the bulk producer.
 *
 * Every producer follows the same order (docs/design.md, "Streams, sequence numbers,
 * epochs"):
 *   1. sampling first — a sampled-out event bumps `sampled_out` and takes no seq;
 *   2. the seq, with an atomic add, BEFORE the ring reserve;
 *   3. bpf_ringbuf_reserve (P0: bpf_ringbuf_output of a frame built on the stack); a
 *      failure bumps drops[cause - 1] and leaves an exact hole
 *      (bulk: and sheds, counted the same way, until the ring is half empty again);
 *   4. fill the frame, submit with BPF_RB_NO_WAKEUP: the shipper drains on a timer
 *      (adaptive wakeups dominated producer cost when measured on these VMs).
 * So per stream: attempted_seq = delivered + dropped-by-cause, and sampled_out counts
 * the rest of what was generated.
 *
 * Maps are pinned by the loader under the shipper's pin directory (bpffs), so events keep
 * being counted and recorded while the shipper is down.
 *
 * Programs here:
 *   rw_uprobe_proxy_step  uprobe on the shim's rw_probe_proxy_step: one bulk proxy frame per
 *                  NCCL proxy step (RDMA clusters), sampled like XDP's packets;
 *   rw_bulk_xdp    XDP: counts every packet and its bytes on its interface (rw_if_counters,
 *                  before sampling), then one 48-byte bulk packet frame per packet
 *                  (sampled). Attached to
 *                  interfaces in production; driven by BPF_PROG_TEST_RUN with repeat in
 *                  tests and benchmarks (≈ 10 M events/s on one core here, measured before
 *                  the per-interface counters were added).
 *   rw_p0_test_xdp XDP, tests only: copies a collective frame carried in the packet into
 *                  the P0 ring (never sampled).
 *   rw_uprobe_*    uprobes on the NCCL profiler shim's probe functions
 *                  (node-shipper/nccl-shim): P0 collective and P2P frames, and the PROGRESS
 *                  map, updated BEFORE the ring reserve so it survives a ring overflow.
 *   rw_on_exit     sched_process_exit: marks the PROGRESS entries of an exiting process
 *                  (state and exit code).
 */
#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "ringwatch.h"

#define RW_P0_RING_DEFAULT (256 * 1024)
#define RW_BULK_RING_DEFAULT (4 * 1024 * 1024)

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, RW_P0_RING_DEFAULT); /* resized at load */
} rw_p0_ring SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, RW_BULK_RING_DEFAULT); /* resized at load */
} rw_bulk_ring SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RW_RING_COUNT);
	__type(key, __u32);
	__type(value, struct rw_ring_counters);
} rw_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rw_sampling_control);
} rw_control SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rw_epoch_meta);
} rw_meta SEC(".maps");

/* Per network interface, every packet rw_bulk_xdp saw (before sampling and the ring):
 * exact rates per interface whatever the telemetry loses. A hash of at most
 * RW_MAX_INTERFACES interfaces; the packets of any further one count in rw_if_overflow. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, RW_MAX_INTERFACES);
	__type(key, __u32);
	__type(value, struct rw_if_counters);
} rw_if_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rw_if_counters);
} rw_if_overflow SEC(".maps");

/* The layout of these pinned maps (RW_PIN_LAYOUT, written by the shipper that created
 * them): a shipper of another layout ends the epoch instead of reading them. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} rw_layout SEC(".maps");

/* PROGRESS: one entry per (comm key, comm instance, rank); LRU, so a cluster's churn of
 * communicators cannot fill it (evictions = inserted - present, in rw_progress_stats). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct rw_progress_key);
	__type(value, struct rw_progress_entry);
} rw_progress SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rw_progress_stats);
} rw_progress_stats SEC(".maps");

static __always_inline struct rw_ring_counters *counters_of(__u32 ring)
{
	return bpf_map_lookup_elem(&rw_counters, &ring);
}

static __always_inline void fill_header(struct rw_frame_header *h, __u16 kind, __u32 flags, __u32 length,
					__u32 class, __u32 ring, __u64 seq)
{
	h->version = RW_WIRE_VERSION;
	h->kind = kind;
	h->flags = flags;
	h->length = length;
	h->stream_id = RW_STREAM_ID(class, ring, bpf_get_smp_processor_id());
	h->seq = seq;
	h->ts_ns = bpf_ktime_get_ns(); /* CLOCK_MONOTONIC: RW_FLAG_TS_GPU_GLOBAL clear */
}

/* P0 frames are never sampled: the seq is the first step. None without counters. */
static __always_inline int p0_seq(__u64 *seq)
{
	struct rw_ring_counters *c = counters_of(RW_RING_P0);
	if (!c)
		return -1;
	*seq = __sync_fetch_and_add(&c->seq, 1);
	return 0;
}

/* Writes a P0 frame (built on the stack) into the P0 ring under `seq`: the kernel sets
 * the header; a time the frame already carries (the shim's, GPU timer converted) is kept.
 * A full ring is counted, seq taken: an exact hole. */
static __always_inline void p0_output(void *frame, struct rw_frame_header *h, __u32 size, __u16 kind, __u64 seq)
{
	__u64 ts = h->ts_ns;
	fill_header(h, kind, h->flags & ~RW_FLAG_SAMPLED, size, RW_CLASS_P0, RW_RING_P0, seq);
	if (ts)
		h->ts_ns = ts;
	if (bpf_ringbuf_output(&rw_p0_ring, frame, size, BPF_RB_NO_WAKEUP)) {
		struct rw_ring_counters *c = counters_of(RW_RING_P0);
		if (c)
			__sync_fetch_and_add(&c->drops[RW_LOSS_CAUSE_KERNEL_RING_FULL - 1], 1);
	}
}

/* Counts a packet on its interface: this CPU's entry, created on first sight; when it
 * cannot be created (the map is full, or the update failed otherwise), in rw_if_overflow.
 * Atomic adds, as for rw_counters: programs run with migration off, not always with
 * preemption off, so two runs may interleave on one CPU. */
static __always_inline void count_interface(__u32 ifindex, __u64 len)
{
	struct rw_if_counters *ic = bpf_map_lookup_elem(&rw_if_counters, &ifindex);
	if (!ic) {
		struct rw_if_counters init = {};
		bpf_map_update_elem(&rw_if_counters, &ifindex, &init, BPF_NOEXIST);
		ic = bpf_map_lookup_elem(&rw_if_counters, &ifindex);
	}
	if (!ic) {
		__u32 zero = 0;
		ic = bpf_map_lookup_elem(&rw_if_overflow, &zero);
	}
	if (ic) {
		__sync_fetch_and_add(&ic->packets, 1);
		__sync_fetch_and_add(&ic->bytes, len);
	}
}

/* The bulk producers' common path: 1. sampling (keep 1 in 2^level, deterministically per
 * CPU), 2. the seq before the reserve, 3. the reserve, unless still shedding after an
 * overflow (hysteresis: without it a producer faster than the reader fills every slot the
 * reader frees, one record at a time, and an overflow leaves thousands of one-seq holes
 * instead of one). NULL when sampled out or dropped, each counted. */
static __always_inline void *bulk_reserve(struct rw_ring_counters *c, __u32 size, __u32 *level_out, __u64 *seq_out)
{
	__u32 zero = 0;
	struct rw_sampling_control *ctl = bpf_map_lookup_elem(&rw_control, &zero);
	__u32 level = ctl ? ctl->bulk_level : 0;
	if (level > RW_MAX_SAMPLING_LEVEL)
		level = RW_MAX_SAMPLING_LEVEL;
	__u64 tick = __sync_fetch_and_add(&c->sample_tick, 1);
	if (tick & ((1ull << level) - 1)) {
		__sync_fetch_and_add(&c->sampled_out, 1);
		return NULL;
	}
	__u64 seq = __sync_fetch_and_add(&c->seq, 1);
	if (c->shedding) {
		if (bpf_ringbuf_query(&rw_bulk_ring, BPF_RB_AVAIL_DATA) >
		    bpf_ringbuf_query(&rw_bulk_ring, BPF_RB_RING_SIZE) / 2) {
			__sync_fetch_and_add(&c->drops[RW_LOSS_CAUSE_KERNEL_RING_FULL - 1], 1);
			return NULL;
		}
		c->shedding = 0;
	}
	void *f = bpf_ringbuf_reserve(&rw_bulk_ring, size, 0);
	if (!f) {
		c->shedding = 1;
		__sync_fetch_and_add(&c->drops[RW_LOSS_CAUSE_KERNEL_RING_FULL - 1], 1);
		return NULL;
	}
	*level_out = level;
	*seq_out = seq;
	return f;
}

SEC("xdp")
int rw_bulk_xdp(struct xdp_md *ctx)
{
	struct rw_ring_counters *c = counters_of(RW_RING_BULK);
	if (!c)
		return XDP_PASS;
	/* 0. the interface's packet and byte counters: every packet, before sampling */
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	count_interface(ctx->ingress_ifindex, (__u64)(data_end - data));
	/* 1-3. sampling, the seq, the reserve */
	__u32 level;
	__u64 seq;
	struct rw_bulk_packet_frame *f = bulk_reserve(c, sizeof(*f), &level, &seq);
	if (!f)
		return XDP_PASS;
	/* 4. fill and submit */
	fill_header(&f->hdr, RW_FRAME_KIND_BULK_PACKET, level ? RW_FLAG_SAMPLED : 0, sizeof(*f), RW_CLASS_P2,
		    RW_RING_BULK, seq);
	f->ifindex = ctx->ingress_ifindex;
	f->pkt_len = (__u32)(data_end - data);
	__u32 hash = 0;
	if (data + 16 <= data_end) {
		/* a cheap flow key: the first 16 bytes (MACs + ethertype) folded FNV-style */
		const __u32 *w = data;
		hash = 2166136261u;
		hash = (hash ^ w[0]) * 16777619u;
		hash = (hash ^ w[1]) * 16777619u;
		hash = (hash ^ w[2]) * 16777619u;
		hash = (hash ^ w[3]) * 16777619u;
	}
	f->flow_hash = hash;
	f->weight = (__u16)(1u << level);
	f->queue = (__u16)ctx->rx_queue_index;
	bpf_ringbuf_submit(f, BPF_RB_NO_WAKEUP);
	return XDP_PASS;
}

/* RDMA clusters (XDP sees no RDMA data): one bulk proxy frame per NCCL proxy step the
 * shim reports (comm, step, bytes, rank, peer, channel), sampled and accounted exactly as
 * XDP's packets, on the same bulk ring and streams. */
SEC("uprobe")
int rw_uprobe_proxy_step(struct pt_regs *ctx)
{
	const struct rw_bulk_proxy_frame *arg = (const struct rw_bulk_proxy_frame *)PT_REGS_PARM1(ctx);
	struct rw_ring_counters *c = counters_of(RW_RING_BULK);
	if (!c)
		return 0;
	struct rw_bulk_proxy_frame in;
	if (bpf_probe_read_user(&in, sizeof(in), arg))
		return 0;
	__u32 level;
	__u64 seq;
	struct rw_bulk_proxy_frame *f = bulk_reserve(c, sizeof(*f), &level, &seq);
	if (!f)
		return 0;
	__builtin_memcpy(f, &in, sizeof(in));
	fill_header(&f->hdr, RW_FRAME_KIND_BULK_PROXY, level ? RW_FLAG_SAMPLED : 0, sizeof(*f), RW_CLASS_P2,
		    RW_RING_BULK, seq);
	f->weight = (__u16)(1u << level);
	bpf_ringbuf_submit(f, BPF_RB_NO_WAKEUP);
	return 0;
}

SEC("xdp")
int rw_p0_test_xdp(struct xdp_md *ctx)
{
	struct rw_collective_frame f;
	if (bpf_xdp_load_bytes(ctx, 0, &f, sizeof(f)))
		return XDP_ABORTED; /* too short: not an event, nothing generated, nothing counted */
	__u64 seq;
	if (p0_seq(&seq))
		return XDP_PASS;
	/* the test's template gives the body (and no time); its comm_op_seq and local_op_seq
	 * count up with the seq */
	f.comm_op_seq += seq;
	f.local_op_seq += seq;
	f.hdr.ts_ns = 0;
	p0_output(&f, &f.hdr, sizeof(f), RW_FRAME_KIND_COLLECTIVE, seq);
	return XDP_PASS;
}

/* ---- NCCL: uprobes on the shim's probe functions ---- */

static __always_inline void count_insert(void)
{
	__u32 zero = 0;
	struct rw_progress_stats *st = bpf_map_lookup_elem(&rw_progress_stats, &zero);
	if (st)
		__sync_fetch_and_add(&st->inserted, 1);
}

/* The communicator's PROGRESS entry, created if absent (an op seen before its init). */
static __always_inline struct rw_progress_entry *progress_of(__u64 hash, __u64 dis, __u64 inst, __u32 rank)
{
	struct rw_progress_key k = { .comm_hash = hash, .comm_disambiguator = dis, .comm_instance = inst, .rank = rank };
	struct rw_progress_entry *v = bpf_map_lookup_elem(&rw_progress, &k);
	if (v)
		return v;
	struct rw_progress_entry fresh = {};
	fresh.comm_hash = hash;
	fresh.comm_disambiguator = dis;
	fresh.comm_instance = inst;
	fresh.rank = rank;
	fresh.pid = bpf_get_current_pid_tgid() >> 32;
	fresh.cgroup_id = bpf_get_current_cgroup_id();
	fresh.proc_state = RW_PROC_STATE_RUNNING;
	if (bpf_map_update_elem(&rw_progress, &k, &fresh, BPF_NOEXIST) == 0)
		count_insert();
	return bpf_map_lookup_elem(&rw_progress, &k);
}

SEC("uprobe")
int rw_uprobe_comm_init(struct pt_regs *ctx)
{
	const struct rw_progress_entry *arg = (const struct rw_progress_entry *)PT_REGS_PARM1(ctx);
	struct rw_progress_entry e;
	if (bpf_probe_read_user(&e, sizeof(e), arg))
		return 0;
	e.pid = bpf_get_current_pid_tgid() >> 32;
	e.cgroup_id = bpf_get_current_cgroup_id();
	e.last_update_ns = bpf_ktime_get_ns();
	e.proc_state = RW_PROC_STATE_RUNNING;
	e.exit_code = 0;
	struct rw_progress_key k = { .comm_hash = e.comm_hash,
				     .comm_disambiguator = e.comm_disambiguator,
				     .comm_instance = e.comm_instance,
				     .rank = e.rank };
	if (!bpf_map_lookup_elem(&rw_progress, &k))
		count_insert();
	bpf_map_update_elem(&rw_progress, &k, &e, BPF_ANY);
	return 0;
}

static __always_inline void advance(__u64 *field, __u64 k)
{
	if (k > *field)
		*field = k;
}

SEC("uprobe")
int rw_uprobe_collective(struct pt_regs *ctx)
{
	const struct rw_collective_frame *arg = (const struct rw_collective_frame *)PT_REGS_PARM1(ctx);
	struct rw_collective_frame f;
	if (bpf_probe_read_user(&f, sizeof(f), arg))
		return 0;
	/* PROGRESS first, before the reserve: it must survive a ring overflow. Graph-captured
	 * ops are not in comm_op_seq order and never move it. */
	if (!(f.hdr.flags & RW_FLAG_GRAPH_CAPTURED)) {
		struct rw_progress_entry *p = progress_of(f.comm_hash, f.comm_disambiguator, f.comm_instance, f.rank);
		if (p) {
			if (f.phase == RW_PHASE_ENQUEUE_END)
				advance(&p->last_enqueued_op, f.comm_op_seq);
			else if (f.phase == RW_PHASE_KERNEL_START)
				advance(&p->last_kernel_started_op, f.comm_op_seq);
			else if ((f.phase == RW_PHASE_KERNEL_END || f.phase == RW_PHASE_PROXY_DONE) &&
				 !(f.hdr.flags & RW_FLAG_PER_CHANNEL))
				advance(&p->last_completed_op, f.comm_op_seq);
			p->last_update_ns = bpf_ktime_get_ns();
		}
	}
	__u64 seq;
	if (p0_seq(&seq))
		return 0;
	f.pid = bpf_get_current_pid_tgid() >> 32;
	p0_output(&f, &f.hdr, sizeof(f), RW_FRAME_KIND_COLLECTIVE, seq);
	return 0;
}

SEC("uprobe")
int rw_uprobe_p2p(struct pt_regs *ctx)
{
	const struct rw_p2p_frame *arg = (const struct rw_p2p_frame *)PT_REGS_PARM1(ctx);
	struct rw_p2p_frame f;
	if (bpf_probe_read_user(&f, sizeof(f), arg))
		return 0;
	/* P2P ops do not advance comm_op_seq; the communicator's entry is only refreshed. */
	struct rw_progress_entry *p = progress_of(f.comm_hash, f.comm_disambiguator, f.comm_instance, f.rank);
	if (p)
		p->last_update_ns = bpf_ktime_get_ns();
	__u64 seq;
	if (p0_seq(&seq))
		return 0;
	f.pid = bpf_get_current_pid_tgid() >> 32;
	p0_output(&f, &f.hdr, sizeof(f), RW_FRAME_KIND_P2P, seq);
	return 0;
}

/* ---- process exits ---- */

/* Only the field we read; CO-RE relocates its offset against the running kernel's BTF. */
struct task_struct {
	int exit_code;
} __attribute__((preserve_access_index));

struct exit_ctx {
	__u32 pid;
	__s32 code;
	__u64 now;
	__u64 marked;
};

static long mark_exited(void *map, struct rw_progress_key *key, struct rw_progress_entry *v, struct exit_ctx *x)
{
	(void)map;
	(void)key;
	if (v->pid == x->pid && v->proc_state != RW_PROC_STATE_EXITED) {
		v->proc_state = RW_PROC_STATE_EXITED;
		v->exit_code = x->code;
		v->last_update_ns = x->now;
		x->marked = 1; /* a constant: a counter here makes the verifier walk every iteration */
	}
	return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int rw_on_exit(void *ctx)
{
	(void)ctx;
	__u64 id = bpf_get_current_pid_tgid();
	if ((__u32)id != (__u32)(id >> 32))
		return 0; /* a thread, not the process */
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	int raw = BPF_CORE_READ(task, exit_code);
	/* wait(2) encoding: exit status in bits 8-15, or the killing signal in bits 0-6. */
	struct exit_ctx x = { .pid = id >> 32,
			      .code = (raw & 0x7f) ? -(raw & 0x7f) : ((raw >> 8) & 0xff),
			      .now = bpf_ktime_get_ns() };
	bpf_for_each_map_elem(&rw_progress, mark_exited, &x, 0);
	if (x.marked) {
		__u32 zero = 0;
		struct rw_progress_stats *st = bpf_map_lookup_elem(&rw_progress_stats, &zero);
		if (st)
			__sync_fetch_and_add(&st->exits, 1);
	}
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
