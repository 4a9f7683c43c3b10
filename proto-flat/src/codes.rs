//! Every enumerated wire value, with its code.
//!
//! Invariants:
//! - A code, once given a meaning, keeps it forever; new values take new codes.
//! - Decoding never fails on a code: an unrecognised one reads as `Unrecognized(code)`,
//!   displayed `unknown(code)`, and is carried through so a newer writer's value is not
//!   lost by an older reader.
//! - Code 0 means "unset" for every enum except [`Class`] (P0 is 0) and [`ProcState`]
//!   (0 is the explicit `unknown` state), so a zeroed field never reads as a real value.
//!
//! The README's tables are checked against [`WireEnum::ALL`] by a test.

use core::fmt;

/// Common surface of the wire enums: code ↔ value, and a stable lower-case name.
pub trait WireEnum: Sized + Copy + 'static {
    /// The integer type on the wire.
    type Code: Copy + fmt::Display;
    /// The enum's name as the README and the C header spell it.
    const NAME: &'static str;
    /// Every known value, in code order.
    const ALL: &'static [Self];
    /// Name and code of every known value (for the README and the C parity test).
    const TABLE: EnumTable;
    /// The value for `code`; unknown codes read as `Unrecognized(code)`.
    fn from_code(code: Self::Code) -> Self;
    /// The code on the wire.
    fn code(self) -> Self::Code;
    /// The lower-case name (`None` for an unrecognised code).
    fn name(self) -> Option<&'static str>;
}

/// Name and codes of one wire enum, as the README and the C header list them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnumTable {
    /// The enum's name (`op`, `loss_cause`, …); C constants are `RW_<NAME>_<VALUE>`.
    pub name: &'static str,
    /// `(value name, code)` in code order.
    pub values: &'static [(&'static str, u64)],
}

macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $name:ident : $repr:ty, $cname:literal {
            $( $(#[$vmeta:meta])* $var:ident = $code:literal => $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $var, )+
            /// A code this version does not know; kept so it can be reported.
            Unrecognized($repr),
        }

        impl $name {
            /// The value for `code` (usable in `const` context).
            #[must_use]
            pub const fn from_code_const(code: $repr) -> Self {
                match code {
                    $( $code => Self::$var, )+
                    other => Self::Unrecognized(other),
                }
            }

            /// The code on the wire (usable in `const` context).
            #[must_use]
            pub const fn code_const(self) -> $repr {
                match self {
                    $( Self::$var => $code, )+
                    Self::Unrecognized(code) => code,
                }
            }
        }

        impl WireEnum for $name {
            type Code = $repr;
            const NAME: &'static str = $cname;
            const ALL: &'static [Self] = &[ $( Self::$var ),+ ];
            const TABLE: EnumTable = EnumTable {
                name: $cname,
                values: &[ $( ($text, $code as u64) ),+ ],
            };
            fn from_code(code: $repr) -> Self {
                Self::from_code_const(code)
            }
            fn code(self) -> $repr {
                self.code_const()
            }
            fn name(self) -> Option<&'static str> {
                match self {
                    $( Self::$var => Some($text), )+
                    Self::Unrecognized(_) => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(text) => f.write_str(text),
                    None => write!(f, "unknown({})", self.code()),
                }
            }
        }
    };
}

wire_enum! {
    /// What a frame is (`FrameHeader::kind`).
    FrameKind: u16, "frame_kind" {
        /// A collective's lifecycle event (P0).
        Collective = 1 => "collective",
        /// A point-to-point send/recv lifecycle event (P0).
        P2p = 2 => "p2p",
        /// One network packet seen by XDP/tc (P2, 48 B).
        BulkPacket = 3 => "bulk_packet",
        /// One NCCL proxy/net step on RDMA fabrics, where XDP sees no data path (P2).
        BulkProxy = 4 => "bulk_proxy",
        /// Shipper heartbeat with counters, progress, clocks and shipper state (P1).
        Heartbeat = 5 => "heartbeat",
        /// Frames that will never arrive, with cause (P1).
        LossRecord = 6 => "loss_record",
        /// A new shipper session took over the pinned counters (P1).
        SessionStart = 7 => "session_start",
        /// A time range in which the shipper could not keep recording (P1).
        ShipperGap = 8 => "shipper_gap",
        /// The kernel counters (re)started: a new epoch (P1).
        EpochStart = 9 => "epoch_start",
    }
}

wire_enum! {
    /// Priority class of a stream (top byte of `stream_id`) and of a batch (`lane`).
    Class: u8, "class" {
        /// Collective and P2P lifecycle: own ring, never sampled, dropped last and loudly.
        P0 = 0 => "p0",
        /// Heartbeats, loss records, session/epoch/gap frames, control.
        P1 = 1 => "p1",
        /// Bulk packet and proxy frames: sampled and shed first.
        P2 = 2 => "p2",
        /// Caches and debug.
        P3 = 3 => "p3",
    }
}

wire_enum! {
    /// Collective and P2P operation.
    Op: u8, "op" {
        AllReduce = 1 => "all_reduce",
        AllGather = 2 => "all_gather",
        ReduceScatter = 3 => "reduce_scatter",
        Reduce = 4 => "reduce",
        Broadcast = 5 => "broadcast",
        AllToAll = 6 => "all_to_all",
        Gather = 7 => "gather",
        Scatter = 8 => "scatter",
        Barrier = 9 => "barrier",
        /// All-to-all with per-peer sizes; fr_trace leaves its size check undecided.
        AllToAllv = 10 => "all_to_allv",
        /// P2P frames only.
        Send = 11 => "send",
        /// P2P frames only.
        Recv = 12 => "recv",
        /// A function name the NCCL shim does not know (counted there): never guessed.
        Unknown = 255 => "unknown",
    }
}

wire_enum! {
    /// Element type (NCCL's `ncclDataType_t` + 1, so 0 stays "unset").
    DType: u8, "dtype" {
        Int8 = 1 => "int8",
        Uint8 = 2 => "uint8",
        Int32 = 3 => "int32",
        Uint32 = 4 => "uint32",
        Int64 = 5 => "int64",
        Uint64 = 6 => "uint64",
        Float16 = 7 => "float16",
        Float32 = 8 => "float32",
        Float64 = 9 => "float64",
        Bfloat16 = 10 => "bfloat16",
        Float8E4m3 = 11 => "float8_e4m3",
        Float8E5m2 = 12 => "float8_e5m2",
        /// A type name the NCCL shim does not know (counted there; NCCL's own name lookup
        /// says "Unknown" for uint8): never guessed.
        Unknown = 255 => "unknown",
    }
}

impl DType {
    /// Element size in bytes (`None` for a code this version does not know).
    #[must_use]
    pub const fn bytes(self) -> Option<u64> {
        match self {
            DType::Int8 | DType::Uint8 | DType::Float8E4m3 | DType::Float8E5m2 => Some(1),
            DType::Float16 | DType::Bfloat16 => Some(2),
            DType::Int32 | DType::Uint32 | DType::Float32 => Some(4),
            DType::Int64 | DType::Uint64 | DType::Float64 => Some(8),
            DType::Unknown | DType::Unrecognized(_) => None,
        }
    }
}

wire_enum! {
    /// Lifecycle phase of a collective or P2P op.
    Phase: u8, "phase" {
        /// The host began enqueueing the op (proves only that the rank entered).
        EnqueueStart = 1 => "enqueue_start",
        /// NCCL's collective `stopEvent`: enqueued, **not** completed.
        EnqueueEnd = 2 => "enqueue_end",
        /// The GPU kernel started (rank-level: first channel; per-channel with the flag).
        KernelStart = 3 => "kernel_start",
        /// The GPU kernel ended on every channel (rank-level) — a completion.
        KernelEnd = 4 => "kernel_end",
        /// The last proxy operation finished on every channel — a completion.
        ProxyDone = 5 => "proxy_done",
    }
}

wire_enum! {
    /// State of a rank's process in a PROGRESS entry.
    ProcState: u8, "proc_state" {
        /// Not known (no process information). Code 0 on purpose.
        Unknown = 0 => "unknown",
        Running = 1 => "running",
        Exited = 2 => "exited",
    }
}

wire_enum! {
    /// Why frames were lost. `drops[]` slots in heartbeat stream entries are indexed by
    /// `code - 1` (see [`LossCause::drop_slot`]).
    LossCause: u16, "loss_cause" {
        /// `bpf_ringbuf_reserve` failed: the ring was full.
        KernelRingFull = 1 => "kernel_ring_full",
        /// The event did not fit a ring record.
        Oversized = 2 => "oversized",
        /// The shipper's spool had no room (bulk evicted oldest-first).
        ShipperSpoolFull = 3 => "shipper_spool_full",
        /// The shipper stopped with data it could not ship.
        ShipperShutdown = 4 => "shipper_shutdown",
        /// Read from the ring by a previous session but never shipped.
        ShipperRestart = 5 => "shipper_restart",
        /// The aggregator refused the batch (`reason` holds the [`NackReason`]).
        Rejected = 6 => "rejected",
        /// Shed under memory pressure (PSI).
        PsiShed = 7 => "psi_shed",
        /// A gap that nothing explained before the reorder timeout.
        Unknown = 8 => "unknown",
        /// Applied and acked by an aggregator that crashed before a snapshot covered them
        /// (bulk: acked when applied; P0/P1 wait for `ack durable` where the aggregator
        /// declares durability). Counted by the restored aggregator; no kernel slot.
        AggregatorCrash = 9 => "aggregator_crash",
    }
}

/// Every wire enum's table.
pub const ALL_ENUMS: &[EnumTable] = &[
    <FrameKind as WireEnum>::TABLE,
    <Class as WireEnum>::TABLE,
    <Op as WireEnum>::TABLE,
    <DType as WireEnum>::TABLE,
    <Phase as WireEnum>::TABLE,
    <ProcState as WireEnum>::TABLE,
    <LossCause as WireEnum>::TABLE,
    <NackReason as WireEnum>::TABLE,
    <AckStatus as WireEnum>::TABLE,
    <Durability as WireEnum>::TABLE,
    <ControlType as WireEnum>::TABLE,
    <SectionTag as WireEnum>::TABLE,
    <ShipperGapReason as WireEnum>::TABLE,
];

/// Number of named `drops[]` slots in a heartbeat stream entry and in a batch's running
/// totals (one per cause a node can count: codes 1–8). Frozen with the wire layout.
pub const DROP_SLOTS: usize = 8;

/// Number of causes the aggregator counts: the [`DROP_SLOTS`] causes and
/// `aggregator_crash`, which only the aggregator can know.
pub const LOSS_CAUSES: usize = 9;

impl LossCause {
    /// The `drops[]` / running-total slot of this cause; `None` for an unrecognised code
    /// and for causes no node counts (`aggregator_crash`).
    #[must_use]
    pub fn drop_slot(self) -> Option<usize> {
        self.cause_slot().filter(|&s| s < DROP_SLOTS)
    }

    /// The cause counted in `drops[slot]`.
    #[must_use]
    pub fn from_drop_slot(slot: usize) -> Option<Self> {
        if slot >= DROP_SLOTS {
            return None;
        }
        Self::from_cause_slot(slot)
    }

    /// This cause's index in the aggregator's per-cause counts (`0..LOSS_CAUSES`);
    /// `None` for an unrecognised code.
    #[must_use]
    pub fn cause_slot(self) -> Option<usize> {
        match self {
            Self::Unrecognized(_) => None,
            known => usize::from(known.code()).checked_sub(1),
        }
    }

    /// The cause counted at index `slot` of the aggregator's per-cause counts.
    #[must_use]
    pub fn from_cause_slot(slot: usize) -> Option<Self> {
        let code = u16::try_from(slot).ok()?.checked_add(1)?;
        match Self::from_code(code) {
            Self::Unrecognized(_) => None,
            cause => Some(cause),
        }
    }
}

wire_enum! {
    /// Why the aggregator refused a batch (`nack.reason`, `loss_record.reason`).
    NackReason: u16, "nack_reason" {
        BadMagic = 1 => "bad_magic",
        UnsupportedVersion = 2 => "unsupported_version",
        TooShort = 3 => "too_short",
        LengthMismatch = 4 => "length_mismatch",
        ChecksumMismatch = 5 => "checksum_mismatch",
        SummaryMismatch = 6 => "summary_mismatch",
        LaneMismatch = 7 => "lane_mismatch",
        /// `node_id` disagrees with the client certificate's name.
        NodeMismatch = 8 => "node_mismatch",
        TooLarge = 9 => "too_large",
        MalformedFrame = 10 => "malformed_frame",
        /// The aggregator's dedup window for this shipper session is full (too many
        /// batches applied above a missing one): refused rather than risk applying a
        /// batch twice or treating an unseen one as applied.
        DedupWindowFull = 11 => "dedup_window_full",
    }
}

wire_enum! {
    /// Status of an `ack`.
    AckStatus: u8, "ack_status" {
        /// Applied to the aggregator's state.
        Applied = 1 => "applied",
        /// Already applied before (dedup key `(node, shipper_session, batch_seq)`).
        Duplicate = 2 => "duplicate",
        /// Durably accepted (a log or snapshot holds it).
        Durable = 3 => "durable",
    }
}

wire_enum! {
    /// What an aggregator keeps across a crash (`hello`, protocol 3): with `none` an
    /// applied ack is the last word (a restart is a knowledge gap); with `snapshot` it
    /// sends `ack durable` for P0/P1 batches once a snapshot written to disk holds them,
    /// and the shipper keeps those batches until then; with `jetstream` (a scaled-out
    /// aggregator's ingest shard) it sends `ack durable` once the records the batch
    /// produced are in NATS JetStream, the shipper keeping them alike.
    Durability: u8, "durability" {
        None = 0 => "none",
        Snapshot = 1 => "snapshot",
        Jetstream = 2 => "jetstream",
    }
}

wire_enum! {
    /// Control message type (aggregator → shipper).
    ControlType: u16, "control_type" {
        Hello = 1 => "hello",
        Ack = 2 => "ack",
        Nack = 3 => "nack",
        /// Shipper → aggregator, right after the control preface: where its session stands.
        Resume = 4 => "resume",
    }
}

wire_enum! {
    /// Tag of a section in a sectioned frame or in the batch envelope.
    SectionTag: u16, "section_tag" {
        /// Heartbeat: per-stream kernel counters and spool position.
        Streams = 1 => "streams",
        /// Heartbeat: per-rank PROGRESS entries.
        Progress = 2 => "progress",
        /// Heartbeat: host monotonic ↔ realtime pairs.
        ClockRealtime = 3 => "clock_realtime",
        /// Heartbeat: GPU global timer ↔ host monotonic per GPU.
        ClockGpu = 4 => "clock_gpu",
        /// Heartbeat: PSI, shedding and spool state.
        ShipperState = 5 => "shipper_state",
        /// session_start: per-stream `attempted_seq` at takeover.
        SessionStreams = 6 => "session_streams",
        /// Batch envelope: the stream summary.
        StreamSummary = 7 => "stream_summary",
        /// Heartbeat: who owns each rank process (Kubernetes pod and container, Slurm
        /// job), resolved by the shipper from the process's cgroup.
        Owner = 8 => "owner",
        /// Heartbeat: per network interface, the packets and bytes the bulk XDP program
        /// saw (every packet, before sampling and the ring), from the kernel's counters.
        Interfaces = 9 => "interfaces",
    }
}

wire_enum! {
    /// Why the shipper could not keep recording (`shipper_gap.reason`).
    ShipperGapReason: u16, "shipper_gap_reason" {
        /// The shipper was down and the rings/programs were not pinned.
        UnpinnedRestart = 1 => "unpinned_restart",
        /// A source (ring, uprobe target) was detached or reloaded.
        SourceDetached = 2 => "source_detached",
        /// Any other reason; details in the shipper's log.
        Other = 3 => "other",
    }
}

/// Header flag bits (`FrameHeader::flags`). Unknown bits are ignored by readers and
/// preserved by the shipper, which forwards frames unparsed.
pub mod flags {
    /// Kept by sampling; bulk frames carry the represented count in `weight`.
    pub const SAMPLED: u32 = 1 << 0;
    /// Captured into a CUDA graph (keyed by graph id/node/replay, not `comm_op_seq`).
    pub const GRAPH_CAPTURED: u32 = 1 << 1;
    /// A per-channel kernel/proxy event (the rank-level event has the bit clear).
    pub const PER_CHANNEL: u32 = 1 << 2;
    /// `ts_ns` is the GPU global timer; clear means host `CLOCK_MONOTONIC`.
    pub const TS_GPU_GLOBAL: u32 = 1 << 3;
    /// Every bit v1 defines, as `(mask, name)`.
    pub const ALL: &[(u32, &str)] = &[
        (SAMPLED, "sampled"),
        (GRAPH_CAPTURED, "graph_captured"),
        (PER_CHANNEL, "per_channel"),
        (TS_GPU_GLOBAL, "ts_gpu_global"),
    ];
}

/// NCCL profiler activation mask bits (`ncclProfile*` event types), as PROGRESS entries
/// carry them in `activation_mask`: which event kinds the profiler reports on that rank.
pub mod activation {
    pub const GROUP: u32 = 1 << 0;
    /// Host collective calls: enqueue events.
    pub const COLL: u32 = 1 << 1;
    /// Host P2P calls.
    pub const P2P: u32 = 1 << 2;
    /// Proxy operations: `proxy_done` is a completion source.
    pub const PROXY_OP: u32 = 1 << 3;
    pub const PROXY_STEP: u32 = 1 << 4;
    pub const PROXY_CTRL: u32 = 1 << 5;
    /// Kernel channels (GPU timer): `kernel_start` / `kernel_end`, the completion source.
    pub const KERNEL_CH: u32 = 1 << 6;
    pub const NET_PLUGIN: u32 = 1 << 7;
    pub const GROUP_API: u32 = 1 << 8;
    pub const COLL_API: u32 = 1 << 9;
    pub const P2P_API: u32 = 1 << 10;
    pub const KERNEL_LAUNCH: u32 = 1 << 11;
    /// Copy-engine collectives (NCCL profiler v6): the shim completes them from the CUDA
    /// events it records on their stream (`kernel_start` / `kernel_end`), a completion
    /// source.
    pub const CE_COLL: u32 = 1 << 12;
    pub const CE_SYNC: u32 = 1 << 13;
    pub const CE_BATCH: u32 = 1 << 14;
    /// Without one of these, completion can never be proven.
    pub const COMPLETION_SOURCES: u32 = KERNEL_CH | PROXY_OP | CE_COLL;
    /// Every bit, as `(mask, name)`.
    pub const ALL: &[(u32, &str)] = &[
        (GROUP, "group"),
        (COLL, "coll"),
        (P2P, "p2p"),
        (PROXY_OP, "proxy_op"),
        (PROXY_STEP, "proxy_step"),
        (PROXY_CTRL, "proxy_ctrl"),
        (KERNEL_CH, "kernel_ch"),
        (NET_PLUGIN, "net_plugin"),
        (GROUP_API, "group_api"),
        (COLL_API, "coll_api"),
        (P2P_API, "p2p_api"),
        (KERNEL_LAUNCH, "kernel_launch"),
        (CE_COLL, "ce_coll"),
        (CE_SYNC, "ce_sync"),
        (CE_BATCH, "ce_batch"),
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<E: WireEnum + PartialEq + fmt::Debug>()
    where
        E::Code: Into<u64>,
    {
        let from_all: std::vec::Vec<(&str, u64)> =
            E::ALL.iter().map(|v| (v.name().unwrap(), v.code().into())).collect();
        assert_eq!(E::TABLE.values, from_all.as_slice());
        assert!(ALL_ENUMS.contains(&E::TABLE), "{} missing from ALL_ENUMS", E::NAME);
        for &v in E::ALL {
            assert_eq!(E::from_code(v.code()), v);
            assert!(v.name().is_some());
        }
    }

    #[test]
    fn codes_round_trip_and_unknown_reads_as_unknown_code() {
        round_trip::<FrameKind>();
        round_trip::<Class>();
        round_trip::<Op>();
        round_trip::<DType>();
        round_trip::<Phase>();
        round_trip::<ProcState>();
        round_trip::<LossCause>();
        round_trip::<NackReason>();
        round_trip::<AckStatus>();
        round_trip::<Durability>();
        round_trip::<ControlType>();
        round_trip::<SectionTag>();
        round_trip::<ShipperGapReason>();
        assert_eq!(ALL_ENUMS.len(), 13);
        assert_eq!(FrameKind::from_code(999), FrameKind::Unrecognized(999));
        assert_eq!(std::format!("{}", LossCause::from_code(77)), "unknown(77)");
        assert_eq!(std::format!("{}", LossCause::Unknown), "unknown");
        assert_eq!(std::format!("{}", Op::from_code(0)), "unknown(0)");
    }

    #[test]
    fn drop_slots_cover_every_node_cause_once_and_cause_slots_every_cause() {
        for (slot, cause) in LossCause::ALL.iter().enumerate() {
            assert_eq!(cause.cause_slot(), Some(slot));
            assert_eq!(LossCause::from_cause_slot(slot), Some(*cause));
            if slot < DROP_SLOTS {
                assert_eq!(cause.drop_slot(), Some(slot));
                assert_eq!(LossCause::from_drop_slot(slot), Some(*cause));
            } else {
                assert_eq!(cause.drop_slot(), None, "{cause} has no kernel slot");
            }
        }
        assert_eq!(LossCause::ALL.len(), LOSS_CAUSES);
        assert_eq!(LossCause::AggregatorCrash.drop_slot(), None);
        assert_eq!(LossCause::from_drop_slot(DROP_SLOTS), None);
        assert_eq!(LossCause::from_cause_slot(LOSS_CAUSES), None);
        assert_eq!(LossCause::Unrecognized(40).drop_slot(), None);
    }
}
