//! One struct per fixed-size frame kind. Sectioned frames (heartbeat, session_start) are
//! in [`crate::sections`].
//!
//! Invariants (checked at compile time here and against `include/ringwatch.h` by the
//! parity test):
//! - every field is a little-endian, alignment-1 type, so a frame reads in place from any
//!   buffer; the C header keeps natural alignment, so fields are ordered widest first and
//!   every struct's size is a multiple of 8;
//! - a frame is read by prefix: a longer frame of a known kind (a later version appended
//!   fields) reads its v1 prefix; a shorter one is `TooShort`.

use zerocopy::little_endian::{I32, U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::codes::{DType, FrameKind, LossCause, Op, Phase, ShipperGapReason, WireEnum};
use crate::header::{FRAME_ALIGN, FrameHeader, StreamId};

/// A frame kind with a fixed v1 size.
pub trait FixedFrame: Sized + FromBytes + IntoBytes + KnownLayout + Immutable + Unaligned {
    /// The kind in the header.
    const KIND: FrameKind;
    /// The frame's header.
    fn header(&self) -> &FrameHeader;
    /// A header for this kind with `length` = the v1 size.
    #[must_use]
    fn make_header(flags: u32, stream: StreamId, seq: u64, ts_ns: u64) -> FrameHeader {
        #[allow(clippy::cast_possible_truncation, reason = "v1 frames are at most 144 B (const-asserted)")]
        let len = size_of::<Self>() as u32;
        FrameHeader::new(Self::KIND, flags, len, stream, seq, ts_ns)
    }
}

macro_rules! fixed_frame {
    ($ty:ident, $kind:ident, $size:literal) => {
        const _: () = assert!(size_of::<$ty>() == $size);
        const _: () = assert!(size_of::<$ty>() % FRAME_ALIGN == 0);
        impl FixedFrame for $ty {
            const KIND: FrameKind = FrameKind::$kind;
            fn header(&self) -> &FrameHeader {
                &self.hdr
            }
        }
    };
}

/// Communicator identity and collective key fields, shared by several frames' readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommKey {
    /// NCCL's `commHash`.
    pub comm_hash: u64,
    /// Secondary hash (host + pid hashes, as NCCL RAS pairs with `commHash`).
    pub comm_disambiguator: u64,
    /// Which instance of a communicator with this hash (re-creations after a restart).
    pub comm_instance: u64,
}

/// A collective lifecycle event (P0, 144 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveFrame {
    pub hdr: FrameHeader,
    /// NCCL `commHash`.
    pub comm_hash: U64,
    /// Secondary hash against `commHash` collisions.
    pub comm_disambiguator: U64,
    /// Communicator instance.
    pub comm_instance: U64,
    /// ringwatch's per-communicator-instance collective counter (issue order, all
    /// functions; P2P does not advance it). Starts at 1; 0 = none.
    pub comm_op_seq: U64,
    /// The rank process's issue order over all its ops on all communicators. From 1.
    pub local_op_seq: U64,
    /// NCCL's own per-function `seqNumber` (a check field only).
    pub nccl_seq: U64,
    /// Element count (NCCL's `size_t count`, so 64 bits).
    pub count: U64,
    /// Fused group (ncclGroupStart/End) id; 0 = not grouped.
    pub group_id: U64,
    /// CUDA graph id when `graph_captured`.
    pub graph_id: U64,
    pub rank: U32,
    pub nranks: U32,
    /// Root rank for rooted ops; `u32::MAX` when the op has none.
    pub root: U32,
    pub pid: U32,
    /// NCCL result code for this phase (0 = success).
    pub status: I32,
    /// Node within the graph when `graph_captured`.
    pub graph_node: U32,
    /// Replay index of the graph when `graph_captured`.
    pub replay_idx: U32,
    /// Rank within the node.
    pub local_rank: U16,
    /// CUDA ordinal as the process sees it (container-relative; identity is the GPU UUID
    /// in PROGRESS).
    pub cuda_dev: U16,
    /// Channel of a `per_channel` event; 0 otherwise.
    pub channel: U16,
    pub n_channels: U16,
    /// [`Op`] code.
    pub op: u8,
    /// [`DType`] code.
    pub dtype: u8,
    /// [`Phase`] code.
    pub phase: u8,
    pub _reserved0: [u8; 1],
}
fixed_frame!(CollectiveFrame, Collective, 144);

impl CollectiveFrame {
    /// The communicator identity.
    #[must_use]
    pub fn comm(&self) -> CommKey {
        CommKey {
            comm_hash: self.comm_hash.get(),
            comm_disambiguator: self.comm_disambiguator.get(),
            comm_instance: self.comm_instance.get(),
        }
    }
    /// The operation.
    #[must_use]
    pub fn op(&self) -> Op {
        Op::from_code(self.op)
    }
    /// The element type.
    #[must_use]
    pub fn dtype(&self) -> DType {
        DType::from_code(self.dtype)
    }
    /// The phase.
    #[must_use]
    pub fn phase(&self) -> Phase {
        Phase::from_code(self.phase)
    }
}

/// A point-to-point send/recv lifecycle event (P0, 120 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pFrame {
    pub hdr: FrameHeader,
    pub comm_hash: U64,
    pub comm_disambiguator: U64,
    pub comm_instance: U64,
    /// The rank process's issue order over all ops (P2P included).
    pub local_op_seq: U64,
    /// Per (comm, peer, direction), from 1: send(a→b, n) pairs with recv(b←a, n).
    pub p2p_seq: U64,
    pub count: U64,
    pub group_id: U64,
    pub rank: U32,
    pub src: U32,
    pub dst: U32,
    pub pid: U32,
    pub status: I32,
    pub channel: U16,
    pub n_channels: U16,
    /// [`Op::Send`] or [`Op::Recv`].
    pub op: u8,
    pub phase: u8,
    pub dtype: u8,
    pub _reserved0: [u8; 5],
}
fixed_frame!(P2pFrame, P2p, 120);

impl P2pFrame {
    /// The communicator identity.
    #[must_use]
    pub fn comm(&self) -> CommKey {
        CommKey {
            comm_hash: self.comm_hash.get(),
            comm_disambiguator: self.comm_disambiguator.get(),
            comm_instance: self.comm_instance.get(),
        }
    }
    /// The operation.
    #[must_use]
    pub fn op(&self) -> Op {
        Op::from_code(self.op)
    }
    /// The phase.
    #[must_use]
    pub fn phase(&self) -> Phase {
        Phase::from_code(self.phase)
    }
}

/// One packet seen by XDP/tc (P2, 48 B: at 8.3 M packets/s ≈ 0.37 GiB/s).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkPacketFrame {
    pub hdr: FrameHeader,
    pub ifindex: U32,
    pub pkt_len: U32,
    pub flow_hash: U32,
    /// Packets this frame stands for under sampling (1 when not sampled).
    pub weight: U16,
    /// RX queue.
    pub queue: U16,
}
fixed_frame!(BulkPacketFrame, BulkPacket, 48);

/// One NCCL proxy/net step, the bulk source on RDMA fabrics (P2, 88 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkProxyFrame {
    pub hdr: FrameHeader,
    pub comm_hash: U64,
    pub comm_disambiguator: U64,
    pub comm_instance: U64,
    /// Proxy step counter.
    pub step: U64,
    /// Bytes moved in this step.
    pub bytes: U64,
    pub rank: U32,
    pub peer: U32,
    pub channel: U16,
    /// Steps this frame stands for under sampling (1 when not sampled).
    pub weight: U16,
    pub _reserved0: [u8; 4],
}
fixed_frame!(BulkProxyFrame, BulkProxy, 88);

/// Frames of one stream that will never arrive, with the cause (P1, 96 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossRecordFrame {
    pub hdr: FrameHeader,
    /// First lost seq (inclusive).
    pub first_seq: U64,
    /// Last lost seq (inclusive).
    pub last_seq: U64,
    /// Earliest event time in the range, ns, host monotonic.
    pub first_ts: U64,
    /// Latest event time in the range.
    pub last_ts: U64,
    /// Frames lost in the range (≤ the range's width; 64 bits: a long partition at
    /// 8 M frames/s passes 2³² in nine minutes).
    pub count: U64,
    /// Session of the batch that was dropped (0 when no batch was involved).
    pub shipper_session: U64,
    /// The dropped batch (0 when no batch was involved; batch_seq starts at 1).
    pub batch_seq: U64,
    /// The stream that lost frames (the header's stream is the shipper's P1 stream).
    pub stream_id: U32,
    /// [`LossCause`] code.
    pub cause: U16,
    /// [`crate::codes::NackReason`] code for `rejected`; 0 otherwise.
    pub reason: U16,
}
fixed_frame!(LossRecordFrame, LossRecord, 96);

impl LossRecordFrame {
    /// The cause.
    #[must_use]
    pub fn cause(&self) -> LossCause {
        LossCause::from_code(self.cause.get())
    }
    /// The stream that lost frames.
    #[must_use]
    pub fn lost_stream(&self) -> StreamId {
        StreamId(self.stream_id.get())
    }
}

/// A time range in which the shipper could not keep recording (P1, 56 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShipperGapFrame {
    pub hdr: FrameHeader,
    /// Start of the gap, ns, host monotonic.
    pub from_ns: U64,
    /// End of the gap.
    pub to_ns: U64,
    /// [`ShipperGapReason`] code.
    pub reason: U16,
    pub _reserved0: [u8; 6],
}
fixed_frame!(ShipperGapFrame, ShipperGap, 56);

impl ShipperGapFrame {
    /// The reason.
    #[must_use]
    pub fn reason(&self) -> ShipperGapReason {
        ShipperGapReason::from_code(self.reason.get())
    }
}

/// The kernel counters (re)started: one lifetime of them is an epoch (P1, 64 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochStartFrame {
    pub hdr: FrameHeader,
    /// The new epoch id.
    pub epoch: U64,
    /// Wall-clock time the counters were created, ns since the Unix epoch.
    pub start_realtime_ns: U64,
    /// `/proc/sys/kernel/random/boot_id` as 16 bytes.
    pub boot_id: [u8; 16],
}
fixed_frame!(EpochStartFrame, EpochStart, 64);
