//! Plausible frames of every kind, for tests, fuzz seeds and benchmarks.
//!
//! Not a simulator (that is `loadgen-sim`): these are single well-formed frames with
//! realistic field values, so decoders and benchmarks see real sizes and shapes.

use alloc::vec::Vec;

use zerocopy::little_endian::{I32, U16, U32, U64};
use zerocopy::{FromZeros, IntoBytes};

use crate::codes::{Class, DType, LossCause, Op, Phase, ProcState, ShipperGapReason, WireEnum};
use crate::encode::SectionedFrameWriter;
use crate::frames::{
    BulkPacketFrame, BulkProxyFrame, CollectiveFrame, EpochStartFrame, FixedFrame, LossRecordFrame, P2pFrame,
    ShipperGapFrame,
};
use crate::header::StreamId;
use crate::sections::{
    ClockGpuEntry, ClockRealtimeEntry, ProgressEntry, SessionStreamEntry, ShipperStateEntry, StreamEntry,
};

/// The shipper's own P1 stream.
pub const SHIPPER_STREAM: StreamId = StreamId::new(Class::P1, StreamId::SHIPPER_RING, 0);

/// A rank-level collective event.
#[must_use]
pub fn collective(stream: StreamId, seq: u64, ts_ns: u64, comm_op_seq: u64, phase: Phase) -> CollectiveFrame {
    let mut f = CollectiveFrame::new_zeroed();
    f.hdr = CollectiveFrame::make_header(0, stream, seq, ts_ns);
    f.comm_hash = U64::new(0x9e37_79b9_7f4a_7c15);
    f.comm_disambiguator = U64::new(0x0123_4567_89ab_cdef);
    f.comm_instance = U64::new(1);
    f.comm_op_seq = U64::new(comm_op_seq);
    f.local_op_seq = U64::new(comm_op_seq);
    f.nccl_seq = U64::new(comm_op_seq.saturating_sub(1));
    f.count = U64::new(64 << 20);
    f.rank = U32::new(3);
    f.nranks = U32::new(64);
    f.root = U32::new(u32::MAX);
    f.pid = U32::new(4242);
    f.status = I32::new(0);
    f.local_rank = U16::new(3);
    f.cuda_dev = U16::new(3);
    f.n_channels = U16::new(16);
    f.op = Op::AllReduce.code();
    f.dtype = DType::Bfloat16.code();
    f.phase = phase.code();
    f
}

/// A P2P send.
#[must_use]
pub fn p2p(stream: StreamId, seq: u64, ts_ns: u64, p2p_seq: u64) -> P2pFrame {
    let mut f = P2pFrame::new_zeroed();
    f.hdr = P2pFrame::make_header(0, stream, seq, ts_ns);
    f.comm_hash = U64::new(0x9e37_79b9_7f4a_7c15);
    f.comm_instance = U64::new(1);
    f.local_op_seq = U64::new(p2p_seq + 100);
    f.p2p_seq = U64::new(p2p_seq);
    f.count = U64::new(1 << 20);
    f.rank = U32::new(3);
    f.src = U32::new(3);
    f.dst = U32::new(4);
    f.pid = U32::new(4242);
    f.n_channels = U16::new(2);
    f.op = Op::Send.code();
    f.phase = Phase::EnqueueEnd.code();
    f.dtype = DType::Float16.code();
    f
}

/// A 1,500-byte packet seen by XDP.
#[must_use]
pub fn bulk_packet(stream: StreamId, seq: u64, ts_ns: u64) -> BulkPacketFrame {
    let mut f = BulkPacketFrame::new_zeroed();
    f.hdr = BulkPacketFrame::make_header(0, stream, seq, ts_ns);
    f.ifindex = U32::new(4);
    f.pkt_len = U32::new(1500);
    #[allow(clippy::cast_possible_truncation, reason = "truncation intended: a cheap stand-in for a flow hash")]
    let hash = (seq.wrapping_mul(0x9e37_79b9)) as u32;
    f.flow_hash = U32::new(hash);
    f.weight = U16::new(1);
    f.queue = U16::new(u16::try_from(seq % 8).unwrap_or(0));
    f
}

/// A proxy/net step.
#[must_use]
pub fn bulk_proxy(stream: StreamId, seq: u64, ts_ns: u64) -> BulkProxyFrame {
    let mut f = BulkProxyFrame::new_zeroed();
    f.hdr = BulkProxyFrame::make_header(0, stream, seq, ts_ns);
    f.comm_hash = U64::new(0x9e37_79b9_7f4a_7c15);
    f.comm_instance = U64::new(1);
    f.step = U64::new(seq);
    f.bytes = U64::new(512 * 1024);
    f.rank = U32::new(3);
    f.peer = U32::new(4);
    f.channel = U16::new(1);
    f.weight = U16::new(1);
    f
}

/// A loss record for a dropped batch.
#[must_use]
pub fn loss_record(seq: u64, ts_ns: u64, lost: StreamId, first: u64, last: u64, cause: LossCause) -> LossRecordFrame {
    let mut f = LossRecordFrame::new_zeroed();
    f.hdr = LossRecordFrame::make_header(0, SHIPPER_STREAM, seq, ts_ns);
    f.first_seq = U64::new(first);
    f.last_seq = U64::new(last);
    f.first_ts = U64::new(ts_ns.saturating_sub(1_000_000));
    f.last_ts = U64::new(ts_ns);
    f.count = U64::new(last.saturating_sub(first).saturating_add(1));
    f.shipper_session = U64::new(7);
    f.batch_seq = U64::new(12);
    f.stream_id = U32::new(lost.0);
    f.cause = U16::new(cause.code());
    f
}

/// A shipper gap.
#[must_use]
pub fn shipper_gap(seq: u64, ts_ns: u64) -> ShipperGapFrame {
    let mut f = ShipperGapFrame::new_zeroed();
    f.hdr = ShipperGapFrame::make_header(0, SHIPPER_STREAM, seq, ts_ns);
    f.from_ns = U64::new(ts_ns.saturating_sub(2_000_000_000));
    f.to_ns = U64::new(ts_ns);
    f.reason = U16::new(ShipperGapReason::UnpinnedRestart.code());
    f
}

/// An epoch start.
#[must_use]
pub fn epoch_start(seq: u64, ts_ns: u64, epoch: u64) -> EpochStartFrame {
    let mut f = EpochStartFrame::new_zeroed();
    f.hdr = EpochStartFrame::make_header(0, SHIPPER_STREAM, seq, ts_ns);
    f.epoch = U64::new(epoch);
    f.start_realtime_ns = U64::new(1_795_000_000_000_000_000);
    f.boot_id = *b"\x8a\x1d\x4c\x2e\x90\x11\x4b\x7f\xa5\x01\x66\x3c\x27\xde\x55\x10";
    f
}

/// A heartbeat with one entry in every v1 section.
#[must_use]
pub fn heartbeat(seq: u64, ts_ns: u64, stream: StreamId, attempted_seq: u64) -> Vec<u8> {
    let mut s = StreamEntry::new_zeroed();
    s.stream_id = U32::new(stream.0);
    s.fill_max_ppm = U32::new(125_000);
    s.attempted_seq = U64::new(attempted_seq);
    if let Some(d) = s.drops.get_mut(0) {
        *d = U64::new(3);
    }
    s.sampled_out = U64::new(10);
    s.held_from_seq = U64::new(attempted_seq.saturating_sub(5));

    let mut p = ProgressEntry::new_zeroed();
    p.comm_hash = U64::new(0x9e37_79b9_7f4a_7c15);
    p.comm_instance = U64::new(1);
    p.cgroup_id = U64::new(0x1234);
    p.last_enqueued_op = U64::new(12);
    p.last_kernel_started_op = U64::new(11);
    p.last_completed_op = U64::new(10);
    p.last_update_ns = U64::new(ts_ns);
    p.gpu_uuid = [0x42; 16];
    p.rank = U32::new(3);
    p.pid = U32::new(4242);
    p.activation_mask = U32::new(0xff);
    p.proc_state = ProcState::Running.code();

    let clock = ClockRealtimeEntry { mono_ns: U64::new(ts_ns), realtime_ns: U64::new(1_795_000_000_000_000_000) };
    let gpu = ClockGpuEntry { gpu_uuid: [0x42; 16], gpu_ns: U64::new(ts_ns * 2), mono_ns: U64::new(ts_ns) };
    let mut st = ShipperStateEntry::new_zeroed();
    st.spool_bytes = U64::new(1 << 20);
    st.spool_cap_bytes = U64::new(256 << 20);
    st.psi_some_avg10_ppm = U32::new(1500);

    let mut w = SectionedFrameWriter::heartbeat(SHIPPER_STREAM, seq, ts_ns, ts_ns.saturating_sub(1000));
    w.section(&[s]).section(&[p]).section(&[clock]).section(&[gpu]).section(&[st]);
    w.finish()
}

/// A session_start naming two streams.
#[must_use]
pub fn session_start(seq: u64, ts_ns: u64, shipper_session: u64) -> Vec<u8> {
    let entries = [
        SessionStreamEntry {
            stream_id: U32::new(StreamId::new(Class::P0, 0, 0).0),
            _reserved0: [0; 4],
            attempted_seq: U64::new(1000),
        },
        SessionStreamEntry {
            stream_id: U32::new(StreamId::new(Class::P2, 1, 1).0),
            _reserved0: [0; 4],
            attempted_seq: U64::new(9_000_000),
        },
    ];
    let mut w = SectionedFrameWriter::session_start(SHIPPER_STREAM, seq, ts_ns, shipper_session);
    w.section(&entries);
    w.finish()
}

/// One frame of every kind for `lane`, as bytes (P0: collective + P2P; P1: control-plane
/// frames; P2: both bulk kinds).
#[must_use]
pub fn frames_for_lane(lane: Class, first_seq: u64) -> Vec<Vec<u8>> {
    let t = 1_000_000_000 + first_seq * 1000;
    match lane {
        Class::P0 => {
            let s = StreamId::new(Class::P0, 0, 1);
            alloc::vec![
                collective(s, first_seq, t, 7, Phase::EnqueueEnd).as_bytes().to_vec(),
                p2p(s, first_seq + 1, t + 10, 2).as_bytes().to_vec(),
                collective(s, first_seq + 2, t + 20, 7, Phase::KernelEnd).as_bytes().to_vec(),
            ]
        }
        Class::P1 => alloc::vec![
            heartbeat(first_seq, t, StreamId::new(Class::P0, 0, 1), 42),
            loss_record(first_seq + 1, t + 10, StreamId::new(Class::P2, 1, 0), 100, 199, LossCause::ShipperSpoolFull)
                .as_bytes()
                .to_vec(),
            session_start(first_seq + 2, t + 20, 7),
            shipper_gap(first_seq + 3, t + 30).as_bytes().to_vec(),
            epoch_start(first_seq + 4, t + 40, 3).as_bytes().to_vec(),
        ],
        _ => {
            let s = StreamId::new(Class::P2, 1, 0);
            alloc::vec![
                bulk_packet(s, first_seq, t).as_bytes().to_vec(),
                bulk_proxy(s, first_seq + 1, t + 10).as_bytes().to_vec(),
            ]
        }
    }
}

/// A sealed batch holding `frames` (which must all be of class `lane`).
#[cfg(feature = "std")]
pub fn batch(lane: Class, batch_seq: u64, frames: &[Vec<u8>]) -> Result<Vec<u8>, crate::DecodeError> {
    let mut w = crate::batch::BatchWriter::with_capacity(64 * 1024);
    w.begin(&crate::batch::BatchMeta {
        node_id: 0x5eed_0000_0000_0003,
        epoch: 3,
        shipper_session: 7,
        batch_seq,
        lane: lane.code(),
        clock_mono_ns: 1_000_000_000,
        clock_realtime_ns: 1_795_000_000_000_000_000,
    });
    for f in frames {
        w.push_frame(f)?;
    }
    let frames = u64::from(w.frame_count());
    Ok(w.finish(&crate::batch::RunningTotals { lost: [0; 8], shipped: frames, sampled_out: 0 }).to_vec())
}
