/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ringwatch wire contract v1 — the C side of proto-flat.
 *
 * eBPF programs and the NCCL profiler shim include this header and write these structs
 * into BPF ring buffers; the shipper forwards them unparsed and the aggregator reads them
 * in place. Layout is the contract: proto-flat's parity test compiles this header with
 * gcc (sizeof/offsetof of every field) and with clang -target bpf (BTF), and compares
 * both with the Rust structs. Change a struct here only together with
 * proto-flat/src and proto-flat/README.md.
 *
 * Rules: little-endian (native order on every supported target); natural alignment;
 * fields ordered widest first; every struct a multiple of 8 bytes; frames padded to a
 * multiple of 8 (RW_FRAME_ALIGN). Enum code 0 means "unset" except for rw_class (P0 is 0)
 * and rw_proc_state (0 is "unknown").
 */
#ifndef RINGWATCH_H
#define RINGWATCH_H

#ifndef __VMLINUX_H__
#include <linux/types.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ringwatch's wire format is little-endian; big-endian targets are not supported"
#endif

#define RW_WIRE_VERSION 1
#define RW_FRAME_ALIGN 8
#define RW_BATCH_MAGIC 0x31425752u /* "RWB1" as little-endian bytes */
#define RW_DROP_SLOTS 8            /* drops[] slot = loss cause code - 1 */

/* ---- enumerations (values listed in proto-flat/README.md) ---- */

enum rw_frame_kind {
	RW_FRAME_KIND_COLLECTIVE = 1,
	RW_FRAME_KIND_P2P = 2,
	RW_FRAME_KIND_BULK_PACKET = 3,
	RW_FRAME_KIND_BULK_PROXY = 4,
	RW_FRAME_KIND_HEARTBEAT = 5,
	RW_FRAME_KIND_LOSS_RECORD = 6,
	RW_FRAME_KIND_SESSION_START = 7,
	RW_FRAME_KIND_SHIPPER_GAP = 8,
	RW_FRAME_KIND_EPOCH_START = 9,
};

enum rw_class {
	RW_CLASS_P0 = 0,
	RW_CLASS_P1 = 1,
	RW_CLASS_P2 = 2,
	RW_CLASS_P3 = 3,
};

enum rw_op {
	RW_OP_ALL_REDUCE = 1,
	RW_OP_ALL_GATHER = 2,
	RW_OP_REDUCE_SCATTER = 3,
	RW_OP_REDUCE = 4,
	RW_OP_BROADCAST = 5,
	RW_OP_ALL_TO_ALL = 6,
	RW_OP_GATHER = 7,
	RW_OP_SCATTER = 8,
	RW_OP_BARRIER = 9,
	RW_OP_ALL_TO_ALLV = 10,
	RW_OP_SEND = 11,
	RW_OP_RECV = 12,
	RW_OP_UNKNOWN = 255, /* a function name the shim does not know (counted) */
};

enum rw_dtype { /* ncclDataType_t + 1 */
	RW_DTYPE_INT8 = 1,
	RW_DTYPE_UINT8 = 2,
	RW_DTYPE_INT32 = 3,
	RW_DTYPE_UINT32 = 4,
	RW_DTYPE_INT64 = 5,
	RW_DTYPE_UINT64 = 6,
	RW_DTYPE_FLOAT16 = 7,
	RW_DTYPE_FLOAT32 = 8,
	RW_DTYPE_FLOAT64 = 9,
	RW_DTYPE_BFLOAT16 = 10,
	RW_DTYPE_FLOAT8_E4M3 = 11,
	RW_DTYPE_FLOAT8_E5M2 = 12,
	RW_DTYPE_UNKNOWN = 255, /* a type name the shim does not know (counted): NCCL says "Unknown" for uint8 */
};

enum rw_phase {
	RW_PHASE_ENQUEUE_START = 1,
	RW_PHASE_ENQUEUE_END = 2, /* NCCL's collective stopEvent: enqueued, NOT completed */
	RW_PHASE_KERNEL_START = 3,
	RW_PHASE_KERNEL_END = 4,  /* rank-level only after every channel ended */
	RW_PHASE_PROXY_DONE = 5,
};

enum rw_proc_state {
	RW_PROC_STATE_UNKNOWN = 0,
	RW_PROC_STATE_RUNNING = 1,
	RW_PROC_STATE_EXITED = 2,
};

enum rw_loss_cause {
	RW_LOSS_CAUSE_KERNEL_RING_FULL = 1,
	RW_LOSS_CAUSE_OVERSIZED = 2,
	RW_LOSS_CAUSE_SHIPPER_SPOOL_FULL = 3,
	RW_LOSS_CAUSE_SHIPPER_SHUTDOWN = 4,
	RW_LOSS_CAUSE_SHIPPER_RESTART = 5,
	RW_LOSS_CAUSE_REJECTED = 6,
	RW_LOSS_CAUSE_PSI_SHED = 7,
	RW_LOSS_CAUSE_UNKNOWN = 8,
	RW_LOSS_CAUSE_AGGREGATOR_CRASH = 9, /* counted by the aggregator only: no drops[] slot */
};

enum rw_nack_reason {
	RW_NACK_REASON_BAD_MAGIC = 1,
	RW_NACK_REASON_UNSUPPORTED_VERSION = 2,
	RW_NACK_REASON_TOO_SHORT = 3,
	RW_NACK_REASON_LENGTH_MISMATCH = 4,
	RW_NACK_REASON_CHECKSUM_MISMATCH = 5,
	RW_NACK_REASON_SUMMARY_MISMATCH = 6,
	RW_NACK_REASON_LANE_MISMATCH = 7,
	RW_NACK_REASON_NODE_MISMATCH = 8,
	RW_NACK_REASON_TOO_LARGE = 9,
	RW_NACK_REASON_MALFORMED_FRAME = 10,
	RW_NACK_REASON_DEDUP_WINDOW_FULL = 11,
};

enum rw_ack_status {
	RW_ACK_STATUS_APPLIED = 1,
	RW_ACK_STATUS_DUPLICATE = 2,
	RW_ACK_STATUS_DURABLE = 3,
};

enum rw_durability {
	RW_DURABILITY_NONE = 0,
	RW_DURABILITY_SNAPSHOT = 1,
	RW_DURABILITY_JETSTREAM = 2,
};

enum rw_control_type {
	RW_CONTROL_TYPE_HELLO = 1,
	RW_CONTROL_TYPE_ACK = 2,
	RW_CONTROL_TYPE_NACK = 3,
	RW_CONTROL_TYPE_RESUME = 4,
};

enum rw_section_tag {
	RW_SECTION_TAG_STREAMS = 1,
	RW_SECTION_TAG_PROGRESS = 2,
	RW_SECTION_TAG_CLOCK_REALTIME = 3,
	RW_SECTION_TAG_CLOCK_GPU = 4,
	RW_SECTION_TAG_SHIPPER_STATE = 5,
	RW_SECTION_TAG_SESSION_STREAMS = 6,
	RW_SECTION_TAG_STREAM_SUMMARY = 7,
	RW_SECTION_TAG_OWNER = 8,
	RW_SECTION_TAG_INTERFACES = 9,
};

enum rw_shipper_gap_reason {
	RW_SHIPPER_GAP_REASON_UNPINNED_RESTART = 1,
	RW_SHIPPER_GAP_REASON_SOURCE_DETACHED = 2,
	RW_SHIPPER_GAP_REASON_OTHER = 3,
};

/* Header flag bits. */
#define RW_FLAG_SAMPLED (1u << 0)
#define RW_FLAG_GRAPH_CAPTURED (1u << 1)
#define RW_FLAG_PER_CHANNEL (1u << 2)
#define RW_FLAG_TS_GPU_GLOBAL (1u << 3) /* clear: host CLOCK_MONOTONIC */

/* PROGRESS activation_mask bits: NCCL's ncclProfile* event types. */
#define RW_ACTIVATION_GROUP (1u << 0)
#define RW_ACTIVATION_COLL (1u << 1)
#define RW_ACTIVATION_P2P (1u << 2)
#define RW_ACTIVATION_PROXY_OP (1u << 3) /* proxy_done: a completion source */
#define RW_ACTIVATION_PROXY_STEP (1u << 4)
#define RW_ACTIVATION_PROXY_CTRL (1u << 5)
#define RW_ACTIVATION_KERNEL_CH (1u << 6) /* kernel channel events: the completion source */
#define RW_ACTIVATION_NET_PLUGIN (1u << 7)
#define RW_ACTIVATION_GROUP_API (1u << 8)
#define RW_ACTIVATION_COLL_API (1u << 9)
#define RW_ACTIVATION_P2P_API (1u << 10)
#define RW_ACTIVATION_KERNEL_LAUNCH (1u << 11)
#define RW_ACTIVATION_CE_COLL (1u << 12) /* copy-engine collectives (v6): the shim's stream events complete them */
#define RW_ACTIVATION_CE_SYNC (1u << 13)
#define RW_ACTIVATION_CE_BATCH (1u << 14)

/* stream_id = class:8 | ring:8 | cpu:16 */
#define RW_STREAM_ID(class, ring, cpu) \
	((((__u32)(class) & 0xff) << 24) | (((__u32)(ring) & 0xff) << 16) | ((__u32)(cpu) & 0xffff))
#define RW_STREAM_CLASS(id) (((__u32)(id) >> 24) & 0xff)
#define RW_STREAM_RING(id) (((__u32)(id) >> 16) & 0xff)
#define RW_STREAM_CPU(id) ((__u32)(id) & 0xffff)
#define RW_SHIPPER_RING 0xff

/* ---- frames ---- */

struct rw_frame_header { /* 32 B; frozen across versions */
	__u16 version;
	__u16 kind;       /* enum rw_frame_kind */
	__u32 flags;      /* RW_FLAG_* */
	__u32 length;     /* whole frame, header included, multiple of 8 */
	__u32 stream_id;  /* RW_STREAM_ID(class, ring, cpu) */
	__u64 seq;        /* per stream, from 0 each epoch, taken before the ring reserve */
	__u64 ts_ns;
};

struct rw_collective_frame { /* 144 B, P0 */
	struct rw_frame_header hdr;
	__u64 comm_hash;
	__u64 comm_disambiguator;
	__u64 comm_instance;
	__u64 comm_op_seq;  /* collectives only, from 1 */
	__u64 local_op_seq; /* rank issue order over all ops, from 1 */
	__u64 nccl_seq;     /* check field */
	__u64 count;
	__u64 group_id;
	__u64 graph_id;
	__u32 rank;
	__u32 nranks;
	__u32 root;
	__u32 pid;
	__s32 status;
	__u32 graph_node;
	__u32 replay_idx;
	__u16 local_rank;
	__u16 cuda_dev;
	__u16 channel;
	__u16 n_channels;
	__u8 op;    /* enum rw_op */
	__u8 dtype; /* enum rw_dtype */
	__u8 phase; /* enum rw_phase */
	__u8 _reserved0[1];
};

struct rw_p2p_frame { /* 120 B, P0 */
	struct rw_frame_header hdr;
	__u64 comm_hash;
	__u64 comm_disambiguator;
	__u64 comm_instance;
	__u64 local_op_seq;
	__u64 p2p_seq; /* per (comm, peer, direction), from 1 */
	__u64 count;
	__u64 group_id;
	__u32 rank;
	__u32 src;
	__u32 dst;
	__u32 pid;
	__s32 status;
	__u16 channel;
	__u16 n_channels;
	__u8 op; /* RW_OP_SEND or RW_OP_RECV */
	__u8 phase;
	__u8 dtype;
	__u8 _reserved0[5];
};

struct rw_bulk_packet_frame { /* 48 B, P2 */
	struct rw_frame_header hdr;
	__u32 ifindex;
	__u32 pkt_len;
	__u32 flow_hash;
	__u16 weight; /* packets this frame stands for (1 unless sampled) */
	__u16 queue;
};

struct rw_bulk_proxy_frame { /* 88 B, P2 */
	struct rw_frame_header hdr;
	__u64 comm_hash;
	__u64 comm_disambiguator;
	__u64 comm_instance;
	__u64 step;
	__u64 bytes;
	__u32 rank;
	__u32 peer;
	__u16 channel;
	__u16 weight;
	__u8 _reserved0[4];
};

struct rw_loss_record_frame { /* 96 B, P1 */
	struct rw_frame_header hdr;
	__u64 first_seq; /* inclusive */
	__u64 last_seq;  /* inclusive */
	__u64 first_ts;
	__u64 last_ts;
	__u64 count;
	__u64 shipper_session;
	__u64 batch_seq;
	__u32 stream_id; /* the stream that lost frames */
	__u16 cause;     /* enum rw_loss_cause */
	__u16 reason;    /* enum rw_nack_reason for RW_LOSS_CAUSE_REJECTED */
};

struct rw_shipper_gap_frame { /* 56 B, P1 */
	struct rw_frame_header hdr;
	__u64 from_ns;
	__u64 to_ns;
	__u16 reason; /* enum rw_shipper_gap_reason */
	__u8 _reserved0[6];
};

struct rw_epoch_start_frame { /* 64 B, P1 */
	struct rw_frame_header hdr;
	__u64 epoch;
	__u64 start_realtime_ns;
	__u8 boot_id[16];
};

/* ---- sectioned frames: header | head | sections; section = header + entries ---- */

struct rw_section_header { /* 8 B */
	__u16 tag;       /* enum rw_section_tag */
	__u16 entry_len; /* >= the v1 entry size */
	__u32 count;
};

struct rw_heartbeat_head { /* 16 B, after the frame header */
	__u32 head_len;
	__u32 section_count;
	__u64 snapshot_ns;
};

struct rw_session_start_head { /* 16 B */
	__u32 head_len;
	__u32 section_count;
	__u64 shipper_session;
};

struct rw_stream_entry { /* 96 B */
	__u32 stream_id;
	__u32 fill_max_ppm;
	__u64 attempted_seq; /* exclusive bound */
	__u64 drops[RW_DROP_SLOTS];
	__u64 sampled_out;
	__u64 held_from_seq; /* lowest seq still held unacked by the shipper, or attempted_seq */
};

struct rw_progress_entry { /* 104 B: the PROGRESS map value */
	__u64 comm_hash;
	__u64 comm_disambiguator;
	__u64 comm_instance;
	__u64 cgroup_id;
	__u64 last_enqueued_op;
	__u64 last_kernel_started_op;
	__u64 last_completed_op;
	__u64 last_update_ns;
	__u8 gpu_uuid[16];
	__u32 rank;
	__u32 pid;
	__s32 exit_code;
	__u32 activation_mask;
	__u8 proc_state; /* enum rw_proc_state */
	__u8 _reserved0[7];
};

struct rw_clock_realtime_entry { /* 16 B */
	__u64 mono_ns;
	__u64 realtime_ns;
};

struct rw_clock_gpu_entry { /* 32 B */
	__u8 gpu_uuid[16];
	__u64 gpu_ns;
	__u64 mono_ns;
};

struct rw_shipper_state_entry { /* 32 B */
	__u64 spool_bytes;
	__u64 spool_cap_bytes;
	__u32 psi_some_avg10_ppm;
	__u32 psi_full_avg10_ppm;
	__u8 shed_tier;
	__u8 sampling_level;
	__u8 _reserved0[6];
};

/* flags of rw_owner_entry */
#define RW_OWNER_POD (1u << 0)
#define RW_OWNER_CONTAINER (1u << 1)
#define RW_OWNER_SLURM_JOB (1u << 2)

struct rw_owner_entry { /* 64 B */
	__u32 pid;
	__u32 flags;
	__u64 slurm_job_id;
	__u8 pod_uid[16];
	__u8 container_id[32];
};

#define RW_IFINDEX_OVERFLOW 0 /* rw_interface_entry of the interfaces beyond RW_MAX_INTERFACES */

struct rw_interface_entry { /* 24 B: one interface's packets and bytes this epoch (before sampling) */
	__u32 ifindex;
	__u32 _reserved0;
	__u64 packets;
	__u64 bytes;
};

struct rw_session_stream_entry { /* 16 B */
	__u32 stream_id;
	__u8 _reserved0[4];
	__u64 attempted_seq;
};

struct rw_stream_summary_entry { /* 40 B */
	__u32 stream_id;
	__u32 frame_count;
	__u64 first_seq;
	__u64 last_seq;
	__u64 first_ts;
	__u64 last_ts;
};

/* ---- batch envelope: header | payload | stream_summary section ---- */

struct rw_batch_header { /* 152 B */
	__u32 magic; /* RW_BATCH_MAGIC */
	__u16 version;
	__u16 header_len;
	__u64 node_id;
	__u64 epoch;
	__u64 shipper_session;
	__u64 batch_seq;
	__u32 frame_count;
	__u32 payload_len;
	__u32 crc32c; /* over the whole envelope with this field read as 0 */
	__u8 lane;    /* enum rw_class */
	__u8 _reserved0[3];
	__u64 lost_total[RW_DROP_SLOTS];
	__u64 shipped_total;
	__u64 sampled_out_total;
	__u64 clock_mono_ns;
	__u64 clock_realtime_ns;
};

/* ---- control messages, aggregator -> shipper ---- */

struct rw_control_header { /* 8 B */
	__u16 msg_type; /* enum rw_control_type */
	__u8 _reserved0[2];
	__u32 length; /* whole message */
};

struct rw_hello_body { /* 16 B */
	__u64 aggregator_instance;
	__u64 aggregator_epoch;
};

struct rw_hello_ext { /* 8 B, after rw_hello_body from control protocol 3 on */
	__u16 control_version;
	__u8 durability; /* enum rw_durability */
	__u8 _reserved0[5];
};

struct rw_ack_head { /* 16 B, then range_count rw_ack_range */
	__u64 shipper_session;
	__u32 range_count;
	__u8 status; /* enum rw_ack_status */
	__u8 _reserved0[3];
};

struct rw_ack_range { /* 16 B, inclusive */
	__u64 first;
	__u64 last;
};

struct rw_nack_body { /* 24 B */
	__u64 shipper_session;
	__u64 batch_seq;
	__u16 reason; /* enum rw_nack_reason */
	__u8 _reserved0[6];
};

/* shipper -> aggregator, once per connection, right after the control preface */
struct rw_resume_head { /* 40 B, then range_count rw_ack_range, then stream_count rw_resume_stream */
	__u64 shipper_session;
	__u64 epoch;
	__u64 next_batch_seq;
	__u32 range_count;
	__u32 stream_count;
	__u64 sent_ns; /* node monotonic clock when written: a fresh clock sample (0: none) */
};

struct rw_resume_stream { /* 16 B */
	__u32 stream_id;
	__u8 _reserved0[4];
	__u64 floor_seq;
};


/* ---- kernel maps the shipper shares with the eBPF programs (not on the wire) ---- */

#define RW_RING_P0 0   /* ring index of the P0 ring (key of rw_counters) */
#define RW_RING_BULK 1 /* ring index of the bulk ring */
#define RW_RING_COUNT 2
#define RW_MAX_SAMPLING_LEVEL 15 /* bulk keeps 1 in 2^level events; weight = 2^level */
#define RW_PIN_LAYOUT 2          /* layout of the pinned maps (value of rw_layout, key 0) */
#define RW_MAX_INTERFACES 64     /* entries of rw_if_counters; further interfaces count in rw_if_overflow */

struct rw_ring_counters { /* 96 B: PERCPU_ARRAY value, key = ring index */
	__u64 seq;                  /* next seq = attempted_seq (exclusive) */
	__u64 drops[RW_DROP_SLOTS]; /* slot = loss cause - 1 */
	__u64 sampled_out;          /* events sampling decided against: no seq taken */
	__u64 sample_tick;          /* events offered to the sampler */
	__u64 shedding;             /* bulk: 1 after a failed reserve, until the ring is half empty */
};

struct rw_if_counters { /* 16 B: PERCPU_HASH value, key = ifindex; rw_if_overflow's value */
	__u64 packets;
	__u64 bytes;
};

struct rw_sampling_control { /* 8 B: ARRAY value, key 0; the shipper writes it */
	__u32 bulk_level; /* 0: keep every bulk event */
	__u32 _reserved0;
};

struct rw_progress_key { /* 32 B: PROGRESS LRU hash key: (comm key, comm instance, rank) */
	__u64 comm_hash;
	__u64 comm_disambiguator;
	__u64 comm_instance;
	__u32 rank;
	__u32 _reserved0;
};

struct rw_progress_stats { /* 16 B: ARRAY value, key 0 */
	__u64 inserted; /* entries created (inserted - entries present = LRU evictions) */
	__u64 exits;    /* process exits recorded into PROGRESS entries */
};

struct rw_epoch_meta { /* 48 B: ARRAY value, key 0; written by the shipper that created the maps */
	__u64 epoch;
	__u64 start_realtime_ns;
	__u64 start_mono_ns;
	__u64 sessions; /* shipper sessions that took the rings over, this one included */
	__u8 boot_id[16];
};

#define RW_ASSERT_SIZE(type, size) _Static_assert(sizeof(struct type) == (size), #type " size")
RW_ASSERT_SIZE(rw_frame_header, 32);
RW_ASSERT_SIZE(rw_collective_frame, 144);
RW_ASSERT_SIZE(rw_p2p_frame, 120);
RW_ASSERT_SIZE(rw_bulk_packet_frame, 48);
RW_ASSERT_SIZE(rw_bulk_proxy_frame, 88);
RW_ASSERT_SIZE(rw_loss_record_frame, 96);
RW_ASSERT_SIZE(rw_shipper_gap_frame, 56);
RW_ASSERT_SIZE(rw_epoch_start_frame, 64);
RW_ASSERT_SIZE(rw_section_header, 8);
RW_ASSERT_SIZE(rw_heartbeat_head, 16);
RW_ASSERT_SIZE(rw_session_start_head, 16);
RW_ASSERT_SIZE(rw_stream_entry, 96);
RW_ASSERT_SIZE(rw_progress_entry, 104);
RW_ASSERT_SIZE(rw_clock_realtime_entry, 16);
RW_ASSERT_SIZE(rw_clock_gpu_entry, 32);
RW_ASSERT_SIZE(rw_shipper_state_entry, 32);
RW_ASSERT_SIZE(rw_session_stream_entry, 16);
RW_ASSERT_SIZE(rw_stream_summary_entry, 40);
RW_ASSERT_SIZE(rw_owner_entry, 64);
RW_ASSERT_SIZE(rw_interface_entry, 24);
RW_ASSERT_SIZE(rw_batch_header, 152);
RW_ASSERT_SIZE(rw_control_header, 8);
RW_ASSERT_SIZE(rw_hello_body, 16);
RW_ASSERT_SIZE(rw_hello_ext, 8);
RW_ASSERT_SIZE(rw_ack_head, 16);
RW_ASSERT_SIZE(rw_ack_range, 16);
RW_ASSERT_SIZE(rw_nack_body, 24);
RW_ASSERT_SIZE(rw_resume_head, 40);
RW_ASSERT_SIZE(rw_resume_stream, 16);
RW_ASSERT_SIZE(rw_ring_counters, 96);
RW_ASSERT_SIZE(rw_sampling_control, 8);
RW_ASSERT_SIZE(rw_if_counters, 16);
RW_ASSERT_SIZE(rw_epoch_meta, 48);
RW_ASSERT_SIZE(rw_progress_key, 32);
RW_ASSERT_SIZE(rw_progress_stats, 16);
#undef RW_ASSERT_SIZE

#endif /* RINGWATCH_H */
