//! Structure-aware hostile input (issue 18): what a certified peer can send that passes
//! `BatchView::parse` and `validate` — batches of every lane with collectives, P2P and
//! bulk frames, heartbeats (stream counters, progress), loss records, session starts,
//! shipper gaps and epoch starts; resumes; time passing; connections closing — with
//! every number drawn towards the edges where arithmetic breaks (0, 1, 2⁶² ± 1,
//! i64::MAX, u64::MAX − 1, u64::MAX).
//!
//! Shared by the `hostile` fuzz target (`proto-flat/fuzz`, libFuzzer drives the bytes)
//! and `tests/hostile.rs` (a fixed number of seeded byte strings, on stable, with overflow
//! checks on). [`run`] feeds a [`Script`] through `Core::handle_resume`,
//! `Core::receive_batch`, `Core::handle_timeout` and `poll_event`, and returns what
//! became of each step.

#![allow(dead_code, unreachable_pub, reason = "shared by a test binary and a fuzz target")]

use arbitrary::{Arbitrary, Result, Unstructured};
use proto_flat::batch::{BatchMeta, BatchView, BatchWriter, RunningTotals, SummaryCheck};
use proto_flat::codes::{Class, LossCause, Op, Phase, WireEnum};
use proto_flat::encode::SectionedFrameWriter;
use proto_flat::frames::{CollectiveFrame, EpochStartFrame, FixedFrame, LossRecordFrame, P2pFrame, ShipperGapFrame};
use proto_flat::header::StreamId;
use proto_flat::sample;
use proto_flat::sections::{InterfaceEntry, ProgressEntry, SessionStreamEntry, StreamEntry};
use ringwatch_core::plausible::MAX_SEQ;
use ringwatch_core::{Core, NodeId, Receipt};
use zerocopy::little_endian::{I32, U16, U32, U64};
use zerocopy::{FromZeros, IntoBytes};

/// A u64 drawn towards the edges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edgy(pub u64);

impl<'a> Arbitrary<'a> for Edgy {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        // About one draw in ten is past what a real shipper sends, so a batch of a few
        // frames is often refused and often applied.
        let v = match u.int_in_range(0u8..=23)? {
            0..=15 => u.int_in_range(0..=64)?,
            16..=18 => u.int_in_range(0..=100_000_000_000)?,
            19 => u64::from(u32::MAX),
            20 => MAX_SEQ - 1,
            21 => MAX_SEQ,
            22 => u.arbitrary()?,
            _ => *u.choose(&[0, 1, u64::MAX, u64::MAX - 1, MAX_SEQ + 1, i64::MAX as u64, (i64::MAX as u64) + 1])?,
        };
        Ok(Self(v))
    }
}

/// A stream of the batch's lane: few rings and CPUs, so streams meet often.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub struct StreamSel {
    pub ring: bool,
    pub cpu: u8,
}

impl StreamSel {
    fn id(self, lane: Class) -> StreamId {
        if lane == Class::P1 {
            // The shipper's own stream, or another P1 ring now and then.
            return if self.ring {
                sample::SHIPPER_STREAM
            } else {
                StreamId::new(Class::P1, 0, u16::from(self.cpu % 2))
            };
        }
        StreamId::new(lane, u8::from(self.ring), u16::from(self.cpu % 4))
    }
    /// A stream of any class, for the stream entries of heartbeats, loss records and
    /// session starts (they name streams of other lanes).
    fn any(self, class: u8) -> StreamId {
        let class = match class % 3 {
            0 => Class::P0,
            1 => Class::P2,
            _ => Class::P1,
        };
        self.id(class)
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Lane {
    P0,
    P1,
    Bulk,
}

impl Lane {
    fn class(self) -> Class {
        match self {
            Self::P0 => Class::P0,
            Self::P1 => Class::P1,
            Self::Bulk => Class::P2,
        }
    }
}

#[derive(Debug, Clone, Arbitrary)]
pub struct Head {
    pub stream: StreamSel,
    pub seq: Edgy,
    pub ts: Edgy,
}

#[derive(Debug, Clone, Arbitrary)]
pub struct StreamCounters {
    pub stream: StreamSel,
    pub class: u8,
    pub attempted: Edgy,
    pub held_from: Edgy,
    pub ring_full: Edgy,
    pub oversized: Edgy,
    pub other_drop: Edgy,
    pub sampled_out: Edgy,
}

#[derive(Debug, Clone, Arbitrary)]
pub struct Progress {
    pub comm: u8,
    pub rank: u8,
    pub enqueued: Edgy,
    pub started: Edgy,
    pub completed: Edgy,
    pub update_ns: Edgy,
    pub proc_state: u8,
    pub gpu: u8,
}

#[derive(Debug, Clone, Arbitrary)]
pub enum FrameSpec {
    Collective {
        head: Head,
        comm: u8,
        comm_op_seq: Edgy,
        local_op_seq: Edgy,
        nccl_seq: Edgy,
        rank: u16,
        nranks: u16,
        phase: u8,
        op: u8,
        count: Edgy,
        graph: Option<(Edgy, u16, u16)>,
        pid: u8,
        status: i32,
    },
    P2p {
        head: Head,
        comm: u8,
        p2p_seq: Edgy,
        local_op_seq: Edgy,
        rank: u16,
        src: u16,
        dst: u16,
        phase: u8,
    },
    Bulk {
        head: Head,
    },
    Heartbeat {
        head: Head,
        snapshot_ns: Edgy,
        streams: Vec<StreamCounters>,
        progress: Vec<Progress>,
        /// `interfaces` entries: (ifindex, packets, bytes); more than a node keeps.
        interfaces: Vec<(u8, Edgy, Edgy)>,
    },
    LossRecord {
        head: Head,
        lost: StreamSel,
        class: u8,
        first: Edgy,
        last: Edgy,
        count: Edgy,
        cause: u8,
        session: u8,
        batch_seq: Edgy,
    },
    SessionStart {
        head: Head,
        session: u8,
        entries: Vec<(StreamSel, u8, Edgy)>,
    },
    ShipperGap {
        head: Head,
        from: Edgy,
        to: Edgy,
    },
    EpochStart {
        head: Head,
        epoch: u8,
    },
}

#[derive(Debug, Clone, Arbitrary)]
pub enum Step {
    Batch {
        node: u8,
        epoch: u8,
        session: u8,
        batch_seq: Edgy,
        lane: Lane,
        frames: Vec<FrameSpec>,
    },
    Resume {
        node: u8,
        epoch: u8,
        session: u8,
        next_batch_seq: Edgy,
        sent_ns: Edgy,
        held: Vec<(Edgy, Edgy)>,
        floors: Vec<(StreamSel, u8, Edgy)>,
    },
    Advance {
        ms: u16,
    },
    Closed {
        node: u8,
    },
    /// Honest traffic between the hostile steps, so the matcher has ops to judge: every
    /// node's heartbeat (a clock sample, its P0 stream's exact counters) and, for op
    /// `op` of one communicator, each rank's enqueue, kernel start and kernel end —
    /// except the ranks in `skip` (bits), and phases past `stop` for the rank `stop`
    /// names.
    Round {
        op: u8,
        skip: u8,
        stop: u8,
        ts_ms: u16,
    },
}

/// A whole input: steps in order.
#[derive(Debug, Clone, Arbitrary)]
pub struct Script {
    pub steps: Vec<Step>,
}

fn comm_hash(c: u8) -> u64 {
    0x9e37_79b9_7f4a_7c15 ^ u64::from(c % 4)
}

fn node(n: u8) -> NodeId {
    NodeId(u64::from(n % 4) + 1)
}

/// The bytes of one frame, on a stream of `lane`.
pub fn frame(spec: &FrameSpec, lane: Class) -> Vec<u8> {
    match spec {
        FrameSpec::Collective {
            head,
            comm,
            comm_op_seq,
            local_op_seq,
            nccl_seq,
            rank,
            nranks,
            phase,
            op,
            count,
            graph,
            pid,
            status,
        } => {
            let mut f = CollectiveFrame::new_zeroed();
            f.hdr = CollectiveFrame::make_header(0, head.stream.id(lane), head.seq.0, head.ts.0);
            f.comm_hash = U64::new(comm_hash(*comm));
            f.comm_instance = U64::new(1);
            f.comm_op_seq = U64::new(comm_op_seq.0);
            f.local_op_seq = U64::new(local_op_seq.0);
            f.nccl_seq = U64::new(nccl_seq.0);
            f.count = U64::new(count.0);
            f.rank = U32::new(u32::from(*rank % 8));
            f.nranks = U32::new(u32::from(*nranks % 10));
            f.root = U32::new(u32::MAX);
            f.pid = U32::new(u32::from(*pid % 4) + 100);
            f.status = I32::new(*status);
            if let Some((id, node, replay)) = graph {
                f.hdr.flags = U32::new(proto_flat::codes::flags::GRAPH_CAPTURED);
                f.graph_id = U64::new(id.0);
                f.graph_node = U32::new(u32::from(*node));
                f.replay_idx = U32::new(u32::from(*replay));
            }
            f.op = [Op::AllReduce, Op::AllGather, Op::Broadcast, Op::Barrier][usize::from(*op % 4)].code();
            f.phase = [Phase::EnqueueStart, Phase::EnqueueEnd, Phase::KernelStart, Phase::KernelEnd, Phase::ProxyDone]
                [usize::from(*phase % 5)]
            .code();
            f.as_bytes().to_vec()
        }
        FrameSpec::P2p { head, comm, p2p_seq, local_op_seq, rank, src, dst, phase } => {
            let mut f = P2pFrame::new_zeroed();
            f.hdr = P2pFrame::make_header(0, head.stream.id(lane), head.seq.0, head.ts.0);
            f.comm_hash = U64::new(comm_hash(*comm));
            f.comm_instance = U64::new(1);
            f.p2p_seq = U64::new(p2p_seq.0);
            f.local_op_seq = U64::new(local_op_seq.0);
            f.rank = U32::new(u32::from(*rank % 8));
            f.src = U32::new(u32::from(*src % 8));
            f.dst = U32::new(u32::from(*dst % 8));
            f.op = if src == dst { Op::Recv.code() } else { Op::Send.code() };
            f.phase = [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd][usize::from(*phase % 3)].code();
            f.as_bytes().to_vec()
        }
        FrameSpec::Bulk { head } => {
            sample::bulk_packet(head.stream.id(lane), head.seq.0, head.ts.0).as_bytes().to_vec()
        }
        FrameSpec::Heartbeat { head, snapshot_ns, streams, progress, interfaces } => {
            let entries: Vec<StreamEntry> = streams
                .iter()
                .take(16)
                .map(|s| {
                    let mut e = StreamEntry::new_zeroed();
                    e.stream_id = U32::new(s.stream.any(s.class).0);
                    e.attempted_seq = U64::new(s.attempted.0);
                    e.held_from_seq = U64::new(s.held_from.0);
                    let slot = |c: LossCause| c.drop_slot().unwrap_or(0);
                    e.drops[slot(LossCause::KernelRingFull)] = U64::new(s.ring_full.0);
                    e.drops[slot(LossCause::Oversized)] = U64::new(s.oversized.0);
                    e.drops[slot(LossCause::ShipperSpoolFull)] = U64::new(s.other_drop.0);
                    e.sampled_out = U64::new(s.sampled_out.0);
                    e
                })
                .collect();
            let progress: Vec<ProgressEntry> = progress
                .iter()
                .take(16)
                .map(|p| {
                    let mut e = ProgressEntry::new_zeroed();
                    e.comm_hash = U64::new(comm_hash(p.comm));
                    e.comm_instance = U64::new(1);
                    e.rank = U32::new(u32::from(p.rank % 8));
                    e.pid = U32::new(u32::from(p.rank % 4) + 100);
                    e.last_enqueued_op = U64::new(p.enqueued.0);
                    e.last_kernel_started_op = U64::new(p.started.0);
                    e.last_completed_op = U64::new(p.completed.0);
                    e.last_update_ns = U64::new(p.update_ns.0);
                    e.proc_state = p.proc_state % 5;
                    e.gpu_uuid = [p.gpu % 4; 16];
                    e
                })
                .collect();
            let mut w = SectionedFrameWriter::heartbeat(head.stream.id(lane), head.seq.0, head.ts.0, snapshot_ns.0);
            w.section(&entries).section(&progress);
            if !interfaces.is_empty() {
                let ifs: Vec<InterfaceEntry> = interfaces
                    .iter()
                    .take(80)
                    .map(|(ifindex, packets, bytes)| InterfaceEntry {
                        ifindex: U32::new(u32::from(*ifindex)),
                        _reserved0: U32::new(0),
                        packets: U64::new(packets.0),
                        bytes: U64::new(bytes.0),
                    })
                    .collect();
                w.section(&ifs);
            }
            w.finish()
        }
        FrameSpec::LossRecord { head, lost, class, first, last, count, cause, session, batch_seq } => {
            let mut f = LossRecordFrame::new_zeroed();
            f.hdr = LossRecordFrame::make_header(0, head.stream.id(lane), head.seq.0, head.ts.0);
            f.first_seq = U64::new(first.0);
            f.last_seq = U64::new(last.0);
            f.count = U64::new(count.0);
            f.shipper_session = U64::new(u64::from(*session % 4));
            f.batch_seq = U64::new(batch_seq.0);
            f.stream_id = U32::new(lost.any(*class).0);
            f.cause = U16::new(u16::from(*cause % 10));
            f.as_bytes().to_vec()
        }
        FrameSpec::SessionStart { head, session, entries } => {
            let entries: Vec<SessionStreamEntry> = entries
                .iter()
                .take(16)
                .map(|(s, class, attempted)| SessionStreamEntry {
                    stream_id: U32::new(s.any(*class).0),
                    _reserved0: [0; 4],
                    attempted_seq: U64::new(attempted.0),
                })
                .collect();
            let mut w = SectionedFrameWriter::session_start(
                head.stream.id(lane),
                head.seq.0,
                head.ts.0,
                u64::from(*session % 4),
            );
            w.section(&entries);
            w.finish()
        }
        FrameSpec::ShipperGap { head, from, to } => {
            let mut f = ShipperGapFrame::new_zeroed();
            f.hdr = ShipperGapFrame::make_header(0, head.stream.id(lane), head.seq.0, head.ts.0);
            f.from_ns = U64::new(from.0);
            f.to_ns = U64::new(to.0);
            f.as_bytes().to_vec()
        }
        FrameSpec::EpochStart { head, epoch } => {
            let mut f = EpochStartFrame::new_zeroed();
            f.hdr = EpochStartFrame::make_header(0, head.stream.id(lane), head.seq.0, head.ts.0);
            f.epoch = U64::new(u64::from(*epoch % 4) + 1);
            f.as_bytes().to_vec()
        }
    }
}

/// The bytes of one batch: every frame on a stream of the batch's lane, so it passes
/// `validate`.
pub fn batch(node_n: u8, epoch: u8, session: u8, batch_seq: u64, lane: Lane, frames: &[FrameSpec]) -> Vec<u8> {
    let class = lane.class();
    let mut w = BatchWriter::with_capacity(64 * 1024);
    w.begin(&BatchMeta {
        node_id: node(node_n).0,
        epoch: u64::from(epoch % 4) + 1,
        shipper_session: u64::from(session % 4),
        batch_seq,
        lane: class.code(),
        clock_mono_ns: 0,
        clock_realtime_ns: 0,
    });
    for f in frames.iter().take(64) {
        // A frame that does not fit is left out; the batch stays valid.
        let _ = w.push_frame(&frame(f, class));
    }
    w.finish(&RunningTotals::default()).to_vec()
}

/// What became of the steps of a script.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub batches: u64,
    /// Built batches that failed `validate` (a generator bug: every one should pass).
    pub invalid: u64,
    pub applied: u64,
    pub implausible: u64,
    pub other_refusals: u64,
    pub resumes: u64,
    pub resumes_implausible: u64,
    /// Honest batches applied.
    pub honest: u64,
    pub events: u64,
}

/// The honest side's sequence numbers, kept across scripts that share a core.
#[derive(Debug, Default, Clone)]
pub struct Honest {
    /// Per node: next P0 seq, next P1 seq, next batch_seq (session 9), node time.
    nodes: [(u64, u64, u64, u64); 4],
}

impl Honest {
    #[allow(clippy::too_many_arguments, reason = "one Round step's fields")]
    fn round(&mut self, core: &mut Core, now: u64, op: u8, skip: u8, stop: u8, ts_ms: u16, out: &mut Outcome) {
        let p0 = StreamId::new(Class::P0, 0, 0);
        for (i, st) in self.nodes.iter_mut().enumerate() {
            let n = u8::try_from(i).unwrap_or(0);
            st.3 = st.3.saturating_add(u64::from(ts_ms) * 1_000_000 + 1);
            let mut frames = Vec::new();
            if skip & (1 << i) == 0 {
                let phases = [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd];
                let keep = if usize::from(stop % 4) == i { usize::from(stop / 4 % 3) } else { 3 };
                for (k, phase) in phases.into_iter().take(keep).enumerate() {
                    let mut f = sample::collective(p0, st.0, st.3 + k as u64, u64::from(op % 8) + 1, phase);
                    f.comm_hash = U64::new(comm_hash(0));
                    f.rank = U32::new(u32::from(n));
                    f.nranks = U32::new(4);
                    f.pid = U32::new(u32::from(n) + 100);
                    frames.push(f.as_bytes().to_vec());
                    st.0 += 1;
                }
            }
            let mut e = StreamEntry::new_zeroed();
            e.stream_id = U32::new(p0.0);
            e.attempted_seq = U64::new(st.0);
            e.held_from_seq = U64::new(st.0);
            let mut w = SectionedFrameWriter::heartbeat(sample::SHIPPER_STREAM, st.1, st.3 + 10, st.3 + 10);
            w.section(&[e]);
            st.1 += 1;
            let hb = w.finish();
            for (lane, fs) in [(Class::P0, frames), (Class::P1, vec![hb])] {
                if fs.is_empty() {
                    continue;
                }
                let mut b = BatchWriter::with_capacity(4096);
                b.begin(&BatchMeta {
                    node_id: node(n).0,
                    epoch: 1,
                    shipper_session: 9,
                    batch_seq: st.2,
                    lane: lane.code(),
                    clock_mono_ns: 0,
                    clock_realtime_ns: 0,
                });
                st.2 += 1;
                for f in &fs {
                    let _ = b.push_frame(f);
                }
                let bytes = b.finish(&RunningTotals::default()).to_vec();
                if let Ok(view) = BatchView::parse(&bytes)
                    && matches!(core.receive_batch(now, node(n), 200_000, &view), Receipt::Applied)
                {
                    out.honest += 1;
                }
            }
        }
    }
}

/// Feeds `script` to `core`, time starting at `*now` (moved on by `Advance` steps).
pub fn run(core: &mut Core, now: &mut u64, honest: &mut Honest, script: &Script) -> Outcome {
    let mut out = Outcome::default();
    let mut scratch = SummaryCheck::default();
    for step in script.steps.iter().take(256) {
        match step {
            Step::Batch { node: n, epoch, session, batch_seq, lane, frames } => {
                out.batches += 1;
                let bytes = batch(*n, *epoch, *session, batch_seq.0, *lane, frames);
                let Ok(view) = BatchView::parse(&bytes) else {
                    out.invalid += 1;
                    continue;
                };
                if view.validate(&mut scratch).is_err() {
                    out.invalid += 1;
                    continue;
                }
                match core.receive_batch(*now, node(*n), 200_000, &view) {
                    Receipt::Applied | Receipt::Duplicate => out.applied += 1,
                    Receipt::Implausible(_) => out.implausible += 1,
                    _ => out.other_refusals += 1,
                }
            }
            Step::Resume { node: n, epoch, session, next_batch_seq, sent_ns, held, floors } => {
                out.resumes += 1;
                let held: Vec<(u64, u64)> = held.iter().take(64).map(|(a, b)| (a.0, b.0)).collect();
                let floors: Vec<(u32, u64)> =
                    floors.iter().take(64).map(|(s, class, f)| (s.any(*class).0, f.0)).collect();
                let r = core.handle_resume(
                    *now,
                    node(*n),
                    u64::from(*session % 4),
                    u64::from(*epoch % 4) + 1,
                    next_batch_seq.0,
                    (sent_ns.0, 200_000),
                    &held,
                    &floors,
                );
                if r.is_err() {
                    out.resumes_implausible += 1;
                }
            }
            Step::Advance { ms } => {
                *now = now.saturating_add(u64::from(*ms) * 1_000_000);
                // Every due timer, as the aggregator's timer task does.
                while let Some(due) = core.poll_timeout().filter(|&d| d <= *now) {
                    core.handle_timeout(due.max(1));
                    if due == 0 {
                        break;
                    }
                }
                core.handle_timeout(*now);
            }
            Step::Closed { node: n } => core.handle_connection_closed(*now, node(*n)),
            Step::Round { op, skip, stop, ts_ms } => honest.round(core, *now, *op, *skip, *stop, *ts_ms, &mut out),
        }
        while core.poll_event().is_some() {
            out.events += 1;
        }
    }
    // Reading what the API reads must not panic either.
    let _ = core.node_health(*now);
    let _ = core.gpu_health(*now);
    for n in 0..4 {
        let _ = core.p0_loss(node(n));
        for t in core.ingest().trackers(node(n)) {
            let _ = (t.generated(), t.in_transit(), t.counts().lost_total());
        }
    }
    out
}
