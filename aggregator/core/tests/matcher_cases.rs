//! Hand-built record sequences for the cases a simulated cluster does not reach easily:
//! arrival order, recovery after a final `stuck`, `blocked_by` across communicators,
//! a channel that never ends, the aggregator's own gap, a very late join.

use proto_flat::codes::{Op, Phase, ProcState, WireEnum, activation, flags};
use ringwatch_core::records::{
    Comm, KnowledgeGap, Lifecycle, LifecycleKind, NodeId, Progress, Record, StreamKey, Watermark,
};
use ringwatch_core::verdict::{Indeterminate, MatcherEvent, OpRef, Outcome, Verdict};
use ringwatch_core::{CollectiveMatcher, MatcherConfig};

const S: u64 = 1_000_000_000;
const MASK: u32 = activation::COLL | activation::KERNEL_CH | activation::PROXY_OP;

fn comm(h: u64) -> Comm {
    Comm { hash: h, disambiguator: 1, instance: 1 }
}

struct Case {
    /// Per node: an error of its cluster-time stamps (as if its clock estimate were off).
    skew: std::collections::BTreeMap<u64, i64>,
    m: CollectiveMatcher,
    now: u64,
    seq: u64,
    verdicts: std::collections::BTreeMap<(OpRef, u32), Verdict>,
    events: Vec<MatcherEvent>,
    /// The activation mask every PROGRESS entry reports.
    mask: u32,
}

impl Case {
    fn new() -> Self {
        Self {
            skew: Default::default(),
            m: CollectiveMatcher::new(MatcherConfig::default()),
            now: S,
            seq: 0,
            verdicts: Default::default(),
            events: Vec::new(),
            mask: MASK,
        }
    }

    fn with_config(config: MatcherConfig) -> Self {
        Self { m: CollectiveMatcher::new(config), ..Self::new() }
    }

    fn rec(&mut self, r: Record) {
        self.m.handle_record(self.now, &r);
    }

    #[allow(clippy::too_many_arguments, reason = "test builder")]
    fn frame(
        &mut self,
        node: u64,
        pid: u32,
        c: Comm,
        seq: u64,
        rank: u32,
        nranks: u32,
        phase: Phase,
        channel: Option<u16>,
        local: u64,
    ) {
        self.frame_with(node, pid, c, seq, rank, nranks, phase, channel, local, (Op::AllReduce, 8, 1 << 20));
    }

    #[allow(clippy::too_many_arguments, reason = "test builder")]
    fn frame_with(
        &mut self,
        node: u64,
        pid: u32,
        c: Comm,
        seq: u64,
        rank: u32,
        nranks: u32,
        phase: Phase,
        channel: Option<u16>,
        local: u64,
        (op, dtype, count): (Op, u8, u64),
    ) {
        self.seq += 1;
        let ts = self.now;
        let skew = self.skew.get(&node).copied().unwrap_or(0);
        self.rec(Record::Lifecycle(Lifecycle {
            stream: StreamKey { node: NodeId(node), epoch: 1, stream_id: 0 },
            seq: self.seq,
            flags: if channel.is_some() { flags::PER_CHANNEL } else { 0 },
            ts_node_ns: ts,
            ts_cluster_ns: i64::try_from(ts).unwrap() + skew,
            comm: c,
            local_op_seq: local,
            rank,
            pid,
            op: op.code(),
            dtype,
            phase: phase.code(),
            count,
            group_id: 0,
            status: 0,
            channel: channel.unwrap_or(0),
            n_channels: 16,
            kind: LifecycleKind::Collective {
                comm_op_seq: seq,
                nccl_seq: seq,
                nranks,
                root: u32::MAX,
                local_rank: 0,
                cuda_dev: 0,
                graph_id: 0,
                graph_node: 0,
                replay_idx: 0,
            },
        }));
    }

    #[allow(clippy::too_many_arguments, reason = "test builder")]
    fn progress(&mut self, node: u64, pid: u32, c: Comm, rank: u32, enq: u64, kst: u64, done: u64, state: ProcState) {
        let now = self.now;
        self.progress_at(node, pid, c, rank, (enq, kst, done), state, now);
    }

    /// A PROGRESS entry from a heartbeat snapshotted at `at` (node time = cluster time here).
    #[allow(clippy::too_many_arguments, reason = "test builder")]
    fn progress_at(
        &mut self,
        node: u64,
        pid: u32,
        c: Comm,
        rank: u32,
        (enq, kst, done): (u64, u64, u64),
        state: ProcState,
        at: u64,
    ) {
        let ts = i64::try_from(at).unwrap();
        self.rec(Record::Progress(Progress {
            node: NodeId(node),
            epoch: 1,
            comm: c,
            rank,
            pid,
            proc_state: state.code(),
            exit_code: 0,
            gpu_uuid: [u8::try_from(node).unwrap(); 16],
            cgroup_id: 1,
            activation_mask: self.mask,
            last_enqueued_op: enq,
            last_kernel_started_op: kst,
            last_completed_op: done,
            last_update_node_ns: at,
            snapshot_node_ns: at,
            snapshot_cluster_ns: ts,
            received_at_ns: self.now,
        }));
    }

    fn liveness(&mut self, node: u64, state: ringwatch_core::records::LivenessState) {
        let now = self.now;
        self.rec(Record::Liveness(ringwatch_core::records::Liveness {
            node: NodeId(node),
            state,
            at_ns: now,
            last_heard_ns: now,
        }));
    }

    fn watermarks(&mut self, nodes: &[u64]) {
        for &n in nodes {
            let t = i64::try_from(self.now).unwrap();
            self.rec(Record::Watermark(Watermark {
                node: NodeId(n),
                class: 0,
                node_ns: self.now,
                cluster_ns: t,
                epsilon_ns: 100_000,
            }));
        }
    }

    fn tick(&mut self, dt: u64) {
        self.now += dt;
        self.m.handle_timeout(self.now);
        while let Some(e) = self.m.poll_event() {
            match e {
                MatcherEvent::Verdict(v) => {
                    self.verdicts.insert((v.op, v.rank), v);
                }
                other => self.events.push(other),
            }
        }
    }

    fn outcome(&self, c: Comm, seq: u64, rank: u32) -> (Outcome, bool) {
        let v = &self.verdicts[&(OpRef::Coll { comm: c, seq }, rank)];
        (v.outcome, v.is_final)
    }
}

#[test]
fn complete_on_cpu_1_before_start_on_cpu_0_is_completed() {
    let mut c = Case::new();
    let k = comm(1);
    // Completion frames arrive first (another CPU's ring was drained first).
    c.frame(1, 10, k, 1, 0, 2, Phase::KernelEnd, None, 1);
    c.frame(2, 20, k, 1, 1, 2, Phase::KernelEnd, None, 1);
    c.frame(1, 10, k, 1, 0, 2, Phase::EnqueueStart, None, 1);
    c.frame(2, 20, k, 1, 1, 2, Phase::KernelStart, None, 1);
    c.tick(S);
    c.watermarks(&[1, 2]);
    c.tick(S / 10);
    assert_eq!(c.outcome(k, 1, 0), (Outcome::Completed, true));
    assert_eq!(c.outcome(k, 1, 1), (Outcome::Completed, true));
}

/// Rank 1's GPU never starts op 1 while rank 0's is inside it.
fn hang(c: &mut Case, k: Comm) {
    hang_with(c, k, |_| {});
}

/// [`hang`], with `each` run after the fresh PROGRESS of every heartbeat.
fn hang_with(c: &mut Case, k: Comm, mut each: impl FnMut(&mut Case)) {
    c.frame(1, 10, k, 1, 0, 2, Phase::EnqueueStart, None, 1);
    c.frame(1, 10, k, 1, 0, 2, Phase::KernelStart, None, 1);
    c.frame(2, 20, k, 1, 1, 2, Phase::EnqueueStart, None, 1);
    for _ in 0..22 {
        c.progress(1, 10, k, 0, 1, 1, 0, ProcState::Running);
        c.progress(2, 20, k, 1, 1, 0, 0, ProcState::Running);
        each(c);
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
}

#[test]
fn stuck_final_then_completing_is_recovered_not_revised() {
    let mut c = Case::new();
    let k = comm(2);
    hang(&mut c, k);
    assert_eq!(c.outcome(k, 1, 1), (Outcome::Stuck, true), "C3(e): the only GPU that never started k");
    assert_eq!(c.outcome(k, 1, 0), (Outcome::WaitingOn(Some(1)), true));
    // Ten seconds later it completes after all.
    for _ in 0..10 {
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    c.frame(2, 20, k, 1, 1, 2, Phase::KernelEnd, None, 1);
    c.tick(S / 10);
    let recovered: Vec<_> = c
        .events
        .iter()
        .filter_map(|e| match e {
            MatcherEvent::Recovered { rank, after_ms, .. } => Some((*rank, *after_ms)),
            _ => None,
        })
        .collect();
    assert_eq!(recovered.len(), 1);
    assert_eq!(recovered[0].0, 1);
    assert!((9_000..=11_000).contains(&recovered[0].1), "{recovered:?}");
    assert_eq!(c.m.stats().revisions_after_final, 0);
    assert_eq!(c.outcome(k, 1, 1).0, Outcome::Stuck, "the final verdict stands; recovery is an event");
}

#[test]
fn a_rank_stuck_in_comm_a_is_blocked_by_it_in_comm_b() {
    let mut c = Case::new();
    let (a, b) = (comm(3), comm(4));
    // Rank 1 (node 2, pid 20) issues A:1 then B:1; A:1 hangs on its GPU.
    c.frame(2, 20, b, 1, 1, 2, Phase::EnqueueStart, None, 2);
    c.frame(1, 11, b, 1, 0, 2, Phase::EnqueueStart, None, 1);
    c.frame(1, 11, b, 1, 0, 2, Phase::KernelStart, None, 1);
    for _ in 0..2 {
        c.progress(1, 11, b, 0, 1, 1, 0, ProcState::Running);
        c.progress(2, 20, b, 1, 1, 0, 0, ProcState::Running);
    }
    hang(&mut c, a);
    for _ in 0..2 {
        c.progress(1, 11, b, 0, 1, 1, 0, ProcState::Running);
        c.progress(2, 20, b, 1, 1, 0, 0, ProcState::Running);
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    let (o, _) = c.outcome(b, 1, 1);
    assert_eq!(o, Outcome::BlockedBy(OpRef::Coll { comm: a, seq: 1 }), "{o:?}");
    assert_eq!(c.outcome(b, 1, 0).0, Outcome::WaitingOn(Some(1)));
}

#[test]
fn fifteen_of_sixteen_channels_is_not_completed() {
    let mut c = Case::new();
    let k = comm(5);
    for (node, pid, rank) in [(1, 10, 0), (2, 20, 1)] {
        c.frame(node, pid, k, 1, rank, 2, Phase::EnqueueStart, None, 1);
        c.frame(node, pid, k, 1, rank, 2, Phase::KernelStart, None, 1);
        for ch in 0..15 {
            c.frame(node, pid, k, 1, rank, 2, Phase::KernelEnd, Some(ch), 1);
        }
    }
    for _ in 0..22 {
        c.progress(1, 10, k, 0, 1, 1, 0, ProcState::Running);
        c.progress(2, 20, k, 1, 1, 1, 0, ProcState::Running);
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    for rank in [0, 1] {
        let (o, fin) = c.outcome(k, 1, rank);
        assert_eq!(o, Outcome::WaitingOn(None), "hung, culprit unknown");
        assert!(fin);
    }
}

#[test]
fn the_aggregators_own_gap_is_indeterminate_never_stuck() {
    let mut c = Case::new();
    let k = comm(6);
    c.rec(Record::KnowledgeGap(KnowledgeGap { node: NodeId(2), from_ns: 0, to_ns: 30 * S }));
    hang(&mut c, k);
    assert_eq!(c.outcome(k, 1, 1).0, Outcome::Indeterminate(Indeterminate::AggregatorGap));
    assert!(c.verdicts.values().all(|v| v.outcome != Outcome::Stuck));
}

#[test]
fn joining_60_s_late_is_completed_with_no_revision() {
    let mut c = Case::new();
    let k = comm(7);
    c.frame(1, 10, k, 1, 0, 2, Phase::EnqueueStart, None, 1);
    c.frame(1, 10, k, 1, 0, 2, Phase::KernelStart, None, 1);
    for _ in 0..60 {
        c.progress(1, 10, k, 0, 1, 1, 0, ProcState::Running);
        c.progress(2, 20, k, 1, 0, 0, 0, ProcState::Running);
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    assert!(
        c.verdicts.get(&(OpRef::Coll { comm: k, seq: 1 }, 1)).is_none_or(|v| v.outcome == Outcome::InFlight),
        "not joined only after the join deadline"
    );
    assert_eq!(c.outcome(k, 1, 0).0, Outcome::WaitingOn(Some(1)), "the others wait on the rank behind");
    c.frame(2, 20, k, 1, 1, 2, Phase::EnqueueStart, None, 1);
    c.frame(2, 20, k, 1, 1, 2, Phase::KernelStart, None, 1);
    c.frame(2, 20, k, 1, 1, 2, Phase::KernelEnd, None, 1);
    c.frame(1, 10, k, 1, 0, 2, Phase::KernelEnd, None, 1);
    c.tick(S);
    c.watermarks(&[1, 2]);
    c.tick(S);
    assert_eq!(c.outcome(k, 1, 0), (Outcome::Completed, true));
    assert_eq!(c.outcome(k, 1, 1), (Outcome::Completed, true));
    assert_eq!(c.m.stats().revisions_before_final + c.m.stats().revisions_after_final, 0);
}

// ------------------------------------------------------------------ public fixtures
//
// Written as our own test data from public descriptions: PyTorch fr_trace's match
// categories (type, size, dtype mismatches; gather root asymmetry; all_to_allv sizes
// undecided; asymmetric send/recv) and NCCL RAS situations (in-flight skew, a missing
// rank, enqueue-only end records).

/// Four ranks on four nodes complete op 1, rank `odd` reporting `(op, dtype, count)`.
fn four_ranks(odd: u32, odd_fields: (Op, u8, u64), normal: (Op, u8, u64)) -> Case {
    let mut c = Case::new();
    let k = comm(100);
    for rank in 0..4u32 {
        let f = if rank == odd { odd_fields } else { normal };
        let node = u64::from(rank) + 1;
        for phase in [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd] {
            c.frame_with(node, 10 + rank, k, 1, rank, 4, phase, None, 1, f);
        }
    }
    c.tick(S);
    c.watermarks(&[1, 2, 3, 4]);
    c.tick(S);
    c
}

fn mismatch_of(c: &Case, rank: u32) -> Option<String> {
    c.verdicts[&(OpRef::Coll { comm: comm(100), seq: 1 }, rank)].tags.iter().find_map(|t| match t {
        ringwatch_core::verdict::VerdictTag::Mismatch { field } => Some(field.clone()),
        _ => None,
    })
}

#[test]
fn fr_trace_type_size_dtype_mismatches_are_reported_not_degraded() {
    let normal = (Op::AllReduce, 8, 1 << 20);
    for (odd, want) in [
        ((Op::AllGather, 8, 1 << 20), "op"),
        ((Op::AllReduce, 7, 1 << 20), "dtype"),
        ((Op::AllReduce, 8, 1 << 19), "count"),
    ] {
        let c = four_ranks(2, odd, normal);
        assert_eq!(mismatch_of(&c, 2).as_deref(), Some(want));
        for rank in [0, 1, 3] {
            assert_eq!(mismatch_of(&c, rank), None);
        }
        assert!(c.m.node_health(c.now).values().all(|h| *h != ringwatch_core::Health::Degraded));
    }
}

#[test]
fn fr_trace_gather_root_asymmetry_and_all_to_allv_sizes_are_not_mismatches() {
    let c = four_ranks(0, (Op::Gather, 8, 4 << 20), (Op::Gather, 8, 1 << 20));
    assert!((0..4).all(|r| mismatch_of(&c, r).is_none()), "the gather root receives 4× what each rank sends");
    let c = four_ranks(3, (Op::AllToAllv, 8, 123), (Op::AllToAllv, 8, 456));
    assert!((0..4).all(|r| mismatch_of(&c, r).is_none()), "all_to_allv sizes are undecided");
}

#[test]
fn fr_trace_asymmetric_send_recv_is_not_completed() {
    let mut c = Case::new();
    let k = comm(101);
    // A send from 0 to 1 with no matching recv on rank 1.
    let p2p = |c: &mut Case, phase: Phase| {
        c.seq += 1;
        let ts = c.now;
        c.rec(Record::Lifecycle(Lifecycle {
            stream: StreamKey { node: NodeId(1), epoch: 1, stream_id: 0 },
            seq: c.seq,
            flags: 0,
            ts_node_ns: ts,
            ts_cluster_ns: i64::try_from(ts).unwrap(),
            comm: k,
            local_op_seq: 1,
            rank: 0,
            pid: 10,
            op: Op::Send.code(),
            dtype: 8,
            phase: phase.code(),
            count: 1 << 20,
            group_id: 0,
            status: 0,
            channel: 0,
            n_channels: 1,
            kind: LifecycleKind::P2p { src: 0, dst: 1, p2p_seq: 1 },
        }));
    };
    p2p(&mut c, Phase::EnqueueStart);
    p2p(&mut c, Phase::KernelStart);
    for _ in 0..3 {
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    let op = OpRef::P2p { comm: k, src: 0, dst: 1, p2p_seq: 1 };
    assert!(c.verdicts.get(&(op, 0)).is_none_or(|v| v.outcome != Outcome::Completed));
    assert_eq!(c.m.in_flight(), 1, "the unmatched send stays open");
    assert!(c.verdicts.values().all(|v| !matches!(v.outcome, Outcome::Stuck | Outcome::NotJoined)));
}

#[test]
fn ras_in_flight_skew_is_not_a_fault() {
    // Most ranks have issued op 6650, one is still at 6649: normal skew while it runs.
    let mut c = Case::new();
    let k = comm(102);
    for rank in 0..4u32 {
        let node = u64::from(rank) + 1;
        let at = if rank == 3 { 6649 } else { 6650 };
        c.progress(node, 10 + rank, k, rank, at, at.min(6649), 6648, ProcState::Running);
        if rank != 3 {
            c.frame(node, 10 + rank, k, 6650, rank, 4, Phase::EnqueueStart, None, 9000);
        }
    }
    for _ in 0..5 {
        c.watermarks(&[1, 2, 3, 4]);
        c.tick(S);
    }
    assert!(c.verdicts.values().all(|v| matches!(v.outcome, Outcome::InFlight | Outcome::WaitingOn(_)) && !v.is_final));
    assert_eq!(c.m.in_flight(), 1, "op 6650 is open, nothing decided");
}

#[test]
fn ras_missing_rank_is_silent_not_stuck() {
    let mut c = Case::new();
    let k = comm(103);
    for rank in 0..3u32 {
        let node = u64::from(rank) + 1;
        c.frame(node, 10 + rank, k, 1, rank, 4, Phase::EnqueueStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 4, Phase::KernelStart, None, 1);
    }
    // Rank 3's node was heard once, then went silent.
    c.progress(4, 13, k, 3, 0, 0, 0, ProcState::Running);
    c.liveness(4, ringwatch_core::records::LivenessState::Silent);
    for _ in 0..25 {
        for rank in 0..3u32 {
            c.progress(u64::from(rank) + 1, 10 + rank, k, rank, 1, 1, 0, ProcState::Running);
        }
        c.watermarks(&[1, 2, 3]);
        c.tick(S);
    }
    assert_eq!(c.outcome(k, 1, 3).0, Outcome::UnknownSilent);
    // A silent node still gates (its data may be queued): no deadline has passed on its
    // watermark, nothing is final yet.
    assert!(c.verdicts.values().all(|v| !v.is_final));
    c.liveness(4, ringwatch_core::records::LivenessState::Unreachable);
    c.tick(S);
    // Unreachable is not dead (a partition past the idle timeout looks the same): it
    // still gates finality, until it has been unreachable for `dead_after_ns`.
    assert_eq!(c.outcome(k, 1, 3), (Outcome::UnknownSilent, false));
    assert!(c.verdicts.values().all(|v| !v.is_final));
    let dead_after = MatcherConfig::default().dead_after_ns;
    c.watermarks(&[1, 2, 3]);
    c.tick(dead_after - 2 * S);
    assert!(c.verdicts.values().all(|v| !v.is_final), "final before the node is presumed dead");
    c.watermarks(&[1, 2, 3]);
    c.tick(2 * S);
    assert_eq!(c.outcome(k, 1, 3), (Outcome::UnknownSilent, true));
    for rank in 0..3 {
        assert_eq!(c.outcome(k, 1, rank), (Outcome::WaitingOn(Some(3)), true));
    }
    assert_eq!(c.m.stats().nodes_presumed_dead, 1);
    assert!(c.m.node_health(c.now).values().all(|h| *h != ringwatch_core::Health::Degraded));
}

/// Ranks 0–2 of a 4-rank all-reduce complete; rank 3's node (4) started it, then its
/// connection dropped (a partition): unreachable.
fn op_whose_last_node_is_cut_off() -> (Case, Comm) {
    let mut c = Case::new();
    let k = comm(1);
    for rank in 0..4u32 {
        let node = u64::from(rank) + 1;
        c.frame(node, 10 + rank, k, 1, rank, 4, Phase::EnqueueStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 4, Phase::KernelStart, None, 1);
    }
    c.watermarks(&[1, 2, 3, 4]);
    c.tick(S);
    for rank in 0..3u32 {
        c.frame(u64::from(rank) + 1, 10 + rank, k, 1, rank, 4, Phase::KernelEnd, None, 1);
    }
    c.liveness(4, ringwatch_core::records::LivenessState::Unreachable);
    // Past the stuck deadline on every reachable node's watermark.
    for _ in 0..60 {
        c.watermarks(&[1, 2, 3]);
        c.tick(S);
    }
    (c, k)
}

#[test]
fn a_partitioned_node_back_before_dead_after_is_judged_on_its_spooled_frames() {
    // sim_pair, partitions of 20 s and 70 s (past the connection's idle timeout): the cut
    // node's ranks went final `unknown_silent` while its shipper spooled the completions,
    // which then arrived as late frames — 76 wrong final verdicts in a simulated hour.
    let (mut c, k) = op_whose_last_node_is_cut_off();
    assert_eq!(c.outcome(k, 1, 3), (Outcome::UnknownSilent, false), "not final while it may come back");
    assert!(c.verdicts.values().all(|v| !v.is_final));
    // Back: its spooled completion, then its watermark past it.
    c.frame(4, 13, k, 1, 3, 4, Phase::KernelEnd, None, 1);
    c.liveness(4, ringwatch_core::records::LivenessState::Fresh);
    c.tick(S);
    c.watermarks(&[1, 2, 3, 4]);
    c.tick(S);
    for rank in 0..4 {
        assert_eq!(c.outcome(k, 1, rank), (Outcome::Completed, true), "rank {rank}");
    }
    // Its presumed-death timer was dropped with its unreachability.
    c.tick(MatcherConfig::default().dead_after_ns);
    assert_eq!(c.m.stats().nodes_presumed_dead, 0);
}

#[test]
fn a_node_back_after_dead_after_recovers_its_unknown_silent_ranks() {
    let (mut c, k) = op_whose_last_node_is_cut_off();
    c.tick(MatcherConfig::default().dead_after_ns);
    assert_eq!(c.outcome(k, 1, 3), (Outcome::UnknownSilent, true), "presumed dead: final");
    assert_eq!(c.outcome(k, 1, 0), (Outcome::Completed, true));
    // It was not dead after all: its completion is a recovery, not a silent late frame.
    c.frame(4, 13, k, 1, 3, 4, Phase::KernelEnd, None, 1);
    c.tick(S);
    assert!(
        c.events.iter().any(|e| matches!(e, MatcherEvent::Recovered { rank: 3, node: Some(NodeId(4)), .. })),
        "{:?}",
        c.events
    );
    assert_eq!(c.m.stats().recovered, 1);
}

#[test]
fn a_silent_node_that_comes_back_is_judged_on_its_frames_regression_issue_17() {
    // Under a CPU hog a live node's heartbeats were processed seconds late: it read
    // `silent` past a hung op's stuck deadline, and the op went final `unknown_silent`
    // for it. A silent node keeps gating: when its data arrives, the op is judged on it.
    let mut c = Case::new();
    let k = comm(107);
    for rank in 0..3u32 {
        let node = u64::from(rank) + 1;
        c.frame(node, 10 + rank, k, 1, rank, 3, Phase::EnqueueStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 3, Phase::KernelStart, None, 1);
    }
    c.liveness(3, ringwatch_core::records::LivenessState::Silent);
    for _ in 0..25 {
        for rank in 0..2u32 {
            c.progress(u64::from(rank) + 1, 10 + rank, k, rank, 1, 1, 0, ProcState::Running);
        }
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    assert!(c.verdicts.values().all(|v| !v.is_final), "nothing final while node 3 is silent");
    // Node 3 is back: its PROGRESS shows the kernel started and never ended, like its peers.
    c.liveness(3, ringwatch_core::records::LivenessState::Fresh);
    for _ in 0..3 {
        for rank in 0..3u32 {
            c.progress(u64::from(rank) + 1, 10 + rank, k, rank, 1, 1, 0, ProcState::Running);
        }
        c.watermarks(&[1, 2, 3]);
        c.tick(S);
    }
    for rank in 0..3 {
        let (o, f) = c.outcome(k, 1, rank);
        assert!(f, "final once every node's watermark passed");
        assert_ne!(o, Outcome::UnknownSilent, "rank {rank}");
    }
}

#[test]
fn nccl_enqueue_only_end_records_never_count_as_completions() {
    // NCCL's collective stopEvent (our enqueue_end) arrives for every rank; nothing else.
    let mut c = Case::new();
    let k = comm(104);
    for rank in 0..2u32 {
        let node = u64::from(rank) + 1;
        c.frame(node, 10 + rank, k, 1, rank, 2, Phase::EnqueueStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 2, Phase::EnqueueEnd, None, 1);
    }
    for _ in 0..3 {
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    assert!(c.verdicts.values().all(|v| !matches!(v.outcome, Outcome::Completed | Outcome::CompletedInferred)));
}

/// Eight all-reduces on four nodes; node 2's stamps carry `skew` of clock error its
/// heartbeat estimate missed, and its kernels start `lag` late.
fn skewed(skew: i64, lag: u64) -> Case {
    let mut c = Case::new();
    c.skew.insert(2, skew);
    let k = comm(200);
    for seq in 1..=8u64 {
        for rank in 0..4u32 {
            let node = u64::from(rank) + 1;
            c.frame(node, 10 + rank, k, seq, rank, 4, Phase::EnqueueStart, None, seq);
        }
        c.now += 1_000_000;
        for rank in [0u32, 2, 3] {
            c.frame(u64::from(rank) + 1, 10 + rank, k, seq, rank, 4, Phase::KernelStart, None, seq);
        }
        c.now += lag;
        c.frame(2, 11, k, seq, 1, 4, Phase::KernelStart, None, seq);
        c.now += 10_000_000;
        for rank in 0..4u32 {
            c.frame(u64::from(rank) + 1, 10 + rank, k, seq, rank, 4, Phase::KernelEnd, None, seq);
        }
        c.tick(S / 2);
        c.watermarks(&[1, 2, 3, 4]);
        c.tick(S / 2);
    }
    c
}

fn straggler_ranks(c: &Case) -> Vec<(u64, u32)> {
    c.verdicts
        .iter()
        .filter(|(_, v)| v.tags.iter().any(|t| matches!(t, ringwatch_core::verdict::VerdictTag::Straggler { .. })))
        .map(|((op, r), _)| {
            (
                match op {
                    OpRef::Coll { seq, .. } => *seq,
                    _ => 0,
                },
                *r,
            )
        })
        .collect()
}

#[test]
fn completion_residuals_refine_cluster_time() {
    // 80 ms of clock error on node 2 and no slowdown: without refinement its kernels
    // would look 80 ms late (over the 50 ms threshold); the strong collectives'
    // simultaneous completions expose and remove the error.
    let c = skewed(80_000_000, 0);
    assert!(straggler_ranks(&c).is_empty(), "{:?}", straggler_ranks(&c));
    // The same error with a real 200 ms GPU-side lag: still a straggler, from the third
    // lagging instance on.
    let c = skewed(80_000_000, 200_000_000);
    let s = straggler_ranks(&c);
    assert!(s.len() >= 5 && s.iter().all(|&(_, r)| r == 1), "{s:?}");
    assert!(s.iter().all(|&(seq, _)| seq >= 3));
}

#[test]
fn fused_group_completes_together() {
    // fr_trace's coalesced groups: rank 0 sends to 1 and receives from 1 inside one
    // ncclGroupStart/End (group 7). The group ran as one kernel: one op's completion
    // frame completes both.
    let mut c = Case::new();
    let k = comm(300);
    let p2p = |c: &mut Case, node: u64, pid: u32, rank: u32, src: u32, dst: u32, op: Op, phase: Phase| {
        c.seq += 1;
        let ts = c.now;
        c.rec(Record::Lifecycle(Lifecycle {
            stream: StreamKey { node: NodeId(node), epoch: 1, stream_id: 0 },
            seq: c.seq,
            flags: 0,
            ts_node_ns: ts,
            ts_cluster_ns: i64::try_from(ts).unwrap(),
            comm: k,
            local_op_seq: u64::from(src * 10 + dst),
            rank,
            pid,
            op: op.code(),
            dtype: 8,
            phase: phase.code(),
            count: 1 << 20,
            group_id: 7,
            status: 0,
            channel: 0,
            n_channels: 1,
            kind: LifecycleKind::P2p { src, dst, p2p_seq: 1 },
        }));
    };
    // Rank 0: send 0→1 and recv 1→0 enqueued; only the send's kernel_end arrives.
    p2p(&mut c, 1, 10, 0, 0, 1, Op::Send, Phase::EnqueueStart);
    p2p(&mut c, 1, 10, 0, 1, 0, Op::Recv, Phase::EnqueueStart);
    p2p(&mut c, 1, 10, 0, 0, 1, Op::Send, Phase::KernelEnd);
    // Rank 1 completes both directly.
    for (src, dst, op) in [(0, 1, Op::Recv), (1, 0, Op::Send)] {
        p2p(&mut c, 2, 20, 1, src, dst, op, Phase::EnqueueStart);
        p2p(&mut c, 2, 20, 1, src, dst, op, Phase::KernelEnd);
    }
    c.tick(S);
    c.watermarks(&[1, 2]);
    c.tick(S);
    // The inference is dated when it was reached (the first tick): final once the
    // watermarks pass that + the reorder timeout.
    c.watermarks(&[1, 2]);
    c.tick(S);
    let recv_on_0 = &c.verdicts[&(OpRef::P2p { comm: k, src: 1, dst: 0, p2p_seq: 1 }, 0)];
    assert_eq!((recv_on_0.outcome, recv_on_0.is_final), (Outcome::CompletedInferred, true));
}

#[test]
fn a_late_frame_for_a_final_op_is_counted_not_a_new_op() {
    let mut c = Case::new();
    let k = comm(400);
    for rank in 0..2u32 {
        c.frame(u64::from(rank) + 1, 10 + rank, k, 1, rank, 2, Phase::EnqueueStart, None, 1);
        c.frame(u64::from(rank) + 1, 10 + rank, k, 1, rank, 2, Phase::KernelEnd, None, 1);
    }
    c.tick(S);
    c.watermarks(&[1, 2]);
    c.tick(S);
    assert_eq!(c.outcome(k, 1, 0), (Outcome::Completed, true));
    assert_eq!(c.m.in_flight(), 0);
    // The same frame again, long after: counted, and no op to misjudge later.
    c.frame(1, 10, k, 1, 0, 2, Phase::EnqueueStart, None, 1);
    for _ in 0..30 {
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    assert_eq!(c.m.in_flight(), 0);
    assert_eq!(c.m.stats().late_frames_after_final, 1);
    assert!(c.verdicts.values().all(|v| v.outcome == Outcome::Completed));
}

/// Regression (issue 7, found by the 8-shipper end-to-end test): a P0 overflow can drop
/// every frame of an op on every rank of a node-local communicator. `comm_op_seq` is
/// dense, so op 2 existed; a later completion proves it completed — the verdict is
/// `completed_inferred` with `telemetry_loss`, never an op that silently has no verdict.
#[test]
fn an_op_none_of_whose_frames_arrived_is_inferred_from_the_seq_gap() {
    let mut c = Case::new();
    let k = comm(7);
    for rank in 0..2 {
        c.frame(1, 10 + rank, k, 1, rank, 2, Phase::KernelEnd, None, 1);
    }
    c.tick(S / 10);
    // The node's ring overflowed: op 2 never arrives; the loss is on record.
    c.rec(Record::Loss(ringwatch_core::records::LossInterval {
        id: 42,
        stream: StreamKey { node: NodeId(1), epoch: 1, stream_id: 0 },
        first_seq: 3,
        last_seq: 6,
        count: Some(4),
        cause: proto_flat::LossCause::KernelRingFull.code(),
        reason: 0,
        from_node_ns: c.now,
        to_node_ns: c.now + S / 10,
        decided_at_ns: c.now,
    }));
    c.tick(S / 10);
    for rank in 0..2 {
        c.frame(1, 10 + rank, k, 3, rank, 2, Phase::KernelEnd, None, 3);
    }
    c.tick(S);
    // The inference was reached at that tick, and is dated then: final once the node's
    // data is in through it + the reorder timeout.
    c.watermarks(&[1]);
    c.tick(S / 10);
    for rank in 0..2 {
        assert_eq!(c.outcome(k, 2, rank), (Outcome::CompletedInferred, false), "not before the watermark passed");
    }
    c.tick(S);
    c.watermarks(&[1]);
    c.tick(S / 10);
    for rank in 0..2 {
        let v = &c.verdicts[&(OpRef::Coll { comm: k, seq: 2 }, rank)];
        assert_eq!((v.outcome, v.is_final), (Outcome::CompletedInferred, true), "rank {rank}");
        assert!(
            v.tags
                .iter()
                .any(|t| matches!(t, ringwatch_core::verdict::VerdictTag::TelemetryLoss { ids } if ids == &[42])),
            "{:?}",
            v.tags
        );
        assert_eq!(v.node, Some(NodeId(1)), "the rank's node is known from its other ops");
    }
    assert_eq!(c.m.stats().ops_inferred_from_seq_gap, 1);
    assert_eq!(c.outcome(k, 3, 0), (Outcome::Completed, true));
}

#[test]
fn huge_comm_op_seq_gaps_are_counted_without_overflow_regression_fuzz() {
    // Found by the ingest fuzz target: two communicators each jumping from op 1 to op
    // u64::MAX overflowed the skipped-ops counter (a panic on the batch path).
    let mut c = Case::new();
    for h in [500, 501] {
        let k = comm(h);
        c.frame(1, 10, k, 1, 0, 2, Phase::EnqueueStart, None, 1);
        c.frame(1, 10, k, u64::MAX, 0, 2, Phase::EnqueueStart, None, 2);
    }
    c.tick(S);
    assert_eq!(c.m.stats().seq_gap_ops_skipped, u64::MAX, "saturated, not wrapped");
}

#[test]
fn a_gpu_side_straggler_is_tagged_whatever_the_clock_uncertainty_regression_issue_17() {
    // Under a CPU hog the heartbeat clock estimate's ε grew past a 200 ms lag and a
    // GPU-side straggler went untagged (`net_sweep_gpu_straggler_skew`). A strong
    // collective ends at one moment on every rank, so the lag is measured back from each
    // rank's own end on its own clock: no clock offset or ε enters.
    let mut c = Case::new();
    c.skew.insert(2, 300_000_000); // node 2's cluster mapping is 300 ms off
    let k = comm(108);
    let ms = 1_000_000;
    for seq in 1..=6u64 {
        for rank in 0..4u32 {
            c.frame(u64::from(rank) + 1, 10 + rank, k, seq, rank, 4, Phase::EnqueueStart, None, seq);
        }
        for rank in 0..3u32 {
            c.frame(u64::from(rank) + 1, 10 + rank, k, seq, rank, 4, Phase::KernelStart, None, seq);
        }
        c.tick(200 * ms);
        c.frame(4, 13, k, seq, 3, 4, Phase::KernelStart, None, seq);
        c.tick(30 * ms);
        for rank in 0..4u32 {
            c.frame(u64::from(rank) + 1, 10 + rank, k, seq, rank, 4, Phase::KernelEnd, None, seq);
        }
        for _ in 0..3 {
            for rank in 0..4u32 {
                c.progress(u64::from(rank) + 1, 10 + rank, k, rank, seq, seq, seq, ProcState::Running);
            }
            for n in 1..=4u64 {
                let t = i64::try_from(c.now).unwrap();
                c.rec(Record::Watermark(Watermark {
                    node: NodeId(n),
                    class: 0,
                    node_ns: c.now,
                    cluster_ns: t,
                    epsilon_ns: 400 * ms,
                }));
            }
            c.tick(S);
        }
    }
    let tagged: Vec<(u32, bool, i64)> = c
        .verdicts
        .values()
        .filter(|v| v.is_final)
        .filter_map(|v| {
            v.tags.iter().find_map(|t| match t {
                ringwatch_core::verdict::VerdictTag::Straggler { host, lag_ns, .. } => Some((v.rank, *host, *lag_ns)),
                _ => None,
            })
        })
        .collect();
    assert!(tagged.len() >= 3, "tagged from the third lagging op on: {tagged:?}");
    assert!(tagged.iter().all(|&(rank, host, lag)| rank == 3 && !host && lag >= 190 * 1_000_000), "{tagged:?}");
}

#[test]
fn a_rank_that_starts_after_the_deadline_is_not_final_before_its_completion_regression_issue_17() {
    // A checkpoint pause past the stuck deadline: rank 1 enqueues and starts k long after
    // its peers. The moment it starts, every rank is "started, waiting"; its completion
    // follows milliseconds later. Dated at the deadline, that decision was final before the
    // completion could arrive (`waiting_on(unknown)` final, at 1x time, in real runs).
    let mut c = Case::new();
    let k = comm(109);
    for rank in [0u32, 2, 3] {
        let node = u64::from(rank) + 1;
        c.frame(node, 10 + rank, k, 1, rank, 4, Phase::EnqueueStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 4, Phase::KernelStart, None, 1);
    }
    for _ in 0..30 {
        for rank in 0..4u32 {
            let (enq, kst) = if rank == 1 { (0, 0) } else { (1, 1) };
            c.progress(u64::from(rank) + 1, 10 + rank, k, rank, enq, kst, 0, ProcState::Running);
        }
        c.watermarks(&[1, 2, 3, 4]);
        c.tick(S);
    }
    assert!(c.verdicts.values().all(|v| !v.is_final), "rank 1 has not joined: nothing final");
    // Rank 1 is back: it enqueues and starts k (one evaluation), and every watermark moves on.
    c.frame(2, 11, k, 1, 1, 4, Phase::EnqueueStart, None, 1);
    c.frame(2, 11, k, 1, 1, 4, Phase::KernelStart, None, 1);
    c.watermarks(&[1, 2, 3, 4]);
    c.tick(S / 100);
    assert!(c.verdicts.values().all(|v| !v.is_final), "started a moment ago: its completion may be in flight");
    for rank in 0..4u32 {
        c.frame(u64::from(rank) + 1, 10 + rank, k, 1, rank, 4, Phase::KernelEnd, None, 1);
    }
    for _ in 0..3 {
        c.watermarks(&[1, 2, 3, 4]);
        c.tick(S);
    }
    for rank in 0..4 {
        assert_eq!(c.outcome(k, 1, rank), (Outcome::Completed, true), "rank {rank}");
    }
    assert_eq!(c.m.stats().revisions_after_final, 0);
}

/// Regression (issue 16/17: `demo` beside a CPU hog): heartbeats travel on their own
/// streams and can be applied out of order. A heartbeat from before the stuck deadline
/// that arrived after a fresh one replaced the fresh PROGRESS; the hung rank then lacked
/// C3(e)'s fresh evidence, and its op went final `blocked_by` another op instead of
/// `stuck` — a missed `degraded`. An older entry never replaces a newer one.
#[test]
fn an_old_heartbeat_arriving_late_does_not_make_progress_stale_regression_issue_16() {
    let mut c = Case::new();
    let k = comm(9);
    let early = c.now;
    // After every fresh heartbeat, the first heartbeat's entries again, late (a resent or
    // reordered batch).
    hang_with(&mut c, k, |c| {
        c.progress_at(1, 10, k, 0, (1, 1, 0), ProcState::Running, early);
        c.progress_at(2, 20, k, 1, (1, 0, 0), ProcState::Running, early);
    });
    assert_eq!(c.outcome(k, 1, 1), (Outcome::Stuck, true), "C3(e) on the fresh entry");
    assert!(c.m.stats().progress_stale >= 40, "{:?}", c.m.stats());
}

/// Op 1 of a 3-rank communicator on nodes 1–3 (pids 10, 20, 30): everyone enqueues and
/// starts it; ranks 0 and 1 end it; rank 2's GPU (node 3) stalls inside it.
fn stall_in_op_1(c: &mut Case, k: Comm) {
    for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
        let pid = u32::try_from(node * 10).unwrap();
        c.frame(node, pid, k, 1, rank, 3, Phase::EnqueueStart, None, 1);
        c.frame(node, pid, k, 1, rank, 3, Phase::KernelStart, None, 1);
    }
    c.frame(1, 10, k, 1, 0, 3, Phase::KernelEnd, None, 1);
    c.frame(2, 20, k, 1, 1, 3, Phase::KernelEnd, None, 1);
}

/// Regression (issue 17, `gpu-pause`): a GPU stalls inside op 1 after contributing (its
/// peers complete), past the stuck deadline, with op 2 queued behind it, then ends.
/// `stuck` is the rule and goes final, op 2 (entered during the stall) is `blocked_by`
/// op 1 — not a second `stuck` (its GPU could not start op 2 before op 1 ended); the
/// completion is a recovery, for op 1 and op 2; the GPU clears `degraded` the clear time
/// after the recovery; and an op entered after the recovery is judged on its own:
/// `completed`, not `blocked_by` a pause that is over. A reorder timeout longer than the
/// stuck deadline (`loadgen run` at x4) lets op 2's own deadline pass while op 1 is
/// decided but not yet final: the case where op 2 was called `stuck` too.
#[test]
fn a_gpu_pause_past_the_deadline_is_stuck_then_recovered_and_unblocks_its_communicator_regression_issue_17() {
    use ringwatch_core::Health;
    let mut c = Case::with_config(MatcherConfig {
        stuck_min_ns: 5 * S,
        reorder_timeout_ns: 6 * S,
        degraded_clear_ns: 40 * S,
        ..MatcherConfig::default()
    });
    let k = comm(17);
    let nodes = [1, 2, 3];
    stall_in_op_1(&mut c, k);
    // Op 2: everyone enqueues; ranks 0 and 1 start; rank 2's GPU is still in op 1.
    c.tick(S / 10);
    for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
        let pid = u32::try_from(node * 10).unwrap();
        c.frame(node, pid, k, 2, rank, 3, Phase::EnqueueStart, None, 2);
        if rank < 2 {
            c.frame(node, pid, k, 2, rank, 3, Phase::KernelStart, None, 2);
        }
    }
    // 30 s of heartbeats: the stall outlives the 5 s deadline and the reorder timeout,
    // and op 2's own deadline (5 s after op 1 was decided) passes too.
    for _ in 0..30 {
        c.progress(1, 10, k, 0, 2, 2, 1, ProcState::Running);
        c.progress(2, 20, k, 1, 2, 2, 1, ProcState::Running);
        c.progress(3, 30, k, 2, 2, 1, 0, ProcState::Running);
        c.watermarks(&nodes);
        c.tick(S);
    }
    assert_eq!(c.outcome(k, 1, 2), (Outcome::Stuck, true));
    assert_eq!(c.outcome(k, 1, 0), (Outcome::Completed, true));
    let op1 = OpRef::Coll { comm: k, seq: 1 };
    for rank in 0..3 {
        assert_eq!(c.outcome(k, 2, rank), (Outcome::BlockedBy(op1), true), "op 2 rank {rank}");
    }
    let gpu = |c: &Case| c.m.health(c.now).get(&(NodeId(3), [3; 16])).copied();
    assert_eq!(gpu(&c), Some(Health::Degraded));

    // The stall ends, and op 3 is entered after it; node 3's data lags: op 3's frames from
    // nodes 1 and 2 arrive first, and their watermarks move on past the reorder timeout
    // while node 3's stays where it was. Op 3 is not final `blocked_by` op 1 on that:
    // node 3's watermark has not passed op 3's frames, so the recovery may yet be in it.
    for (rank, node) in [(0, 1), (1, 2)] {
        let pid = u32::try_from(node * 10).unwrap();
        c.frame(node, pid, k, 2, rank, 3, Phase::KernelEnd, None, 2);
        c.frame(node, pid, k, 3, rank, 3, Phase::EnqueueStart, None, 3);
        c.frame(node, pid, k, 3, rank, 3, Phase::KernelStart, None, 3);
    }
    for _ in 0..8 {
        c.watermarks(&[1, 2]);
        c.tick(S);
    }
    let op3 = |c: &Case| c.verdicts.get(&(OpRef::Coll { comm: k, seq: 3 }, 0)).map(|v| (v.outcome, v.is_final));
    assert!(!matches!(op3(&c), Some((Outcome::BlockedBy(_), true))), "{:?}", op3(&c));
    // Node 3's lagging data: the end of op 1 and op 2.
    c.frame(3, 30, k, 1, 2, 3, Phase::KernelEnd, None, 1);
    c.frame(3, 30, k, 2, 2, 3, Phase::KernelStart, None, 2);
    c.frame(3, 30, k, 2, 2, 3, Phase::KernelEnd, None, 2);
    c.tick(S / 10);
    let recovered: Vec<(u64, u32)> = c
        .events
        .iter()
        .filter_map(|e| match e {
            MatcherEvent::Recovered { op: OpRef::Coll { seq, .. }, rank, .. } => Some((*seq, *rank)),
            _ => None,
        })
        .collect();
    assert_eq!(recovered, vec![(2, 0), (2, 1), (1, 2), (2, 2)]);
    assert_eq!(c.outcome(k, 1, 2).0, Outcome::Stuck, "a final verdict stands; the recovery is an event");
    assert_eq!(gpu(&c), Some(Health::Degraded), "degraded until the clear time after the recovery");
    c.frame(3, 30, k, 3, 2, 3, Phase::EnqueueStart, None, 3);
    c.frame(3, 30, k, 3, 2, 3, Phase::KernelStart, None, 3);
    for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
        c.frame(node, u32::try_from(node * 10).unwrap(), k, 3, rank, 3, Phase::KernelEnd, None, 3);
    }
    for _ in 0..8 {
        c.progress(3, 30, k, 2, 3, 3, 3, ProcState::Running);
        c.watermarks(&nodes);
        c.tick(S);
    }
    for rank in 0..3 {
        assert_eq!(c.outcome(k, 3, rank), (Outcome::Completed, true), "op 3 rank {rank}");
    }
    assert_eq!(gpu(&c), Some(Health::Degraded), "some seconds after the recovery");
    for _ in 0..40 {
        c.watermarks(&nodes);
        c.tick(S);
    }
    assert_eq!(gpu(&c), Some(Health::Healthy), "healthy again the clear time after the recovery");
    assert_eq!(c.m.stats().revisions_after_final, 0);
}

/// Regression (a sweep under a CPU hog, `gpu-pause`): batches are applied in any order.
/// After a GPU's stall made op 1 final `stuck` (op 2 `blocked_by` it), ops 3–5 run; op 5's
/// frames are applied first, so ops 3 and 4 are known only from the seq gap, and node 3's
/// recovery (the end of ops 1 and 2) is in a batch still to come. Dated by the stall's
/// decision (their own frames: none yet), ops 3 and 4 went final at once — `blocked_by`
/// op 1 for node 3's rank, `completed_inferred` from PROGRESS for the others — and the
/// frames that came a moment later changed nothing. They wait for the watermarks to pass
/// the frame that made them known, by which time their frames are in: `completed`.
#[test]
fn ops_known_only_from_a_seq_gap_are_not_final_before_their_frames_could_arrive() {
    let mut c = Case::with_config(MatcherConfig {
        stuck_min_ns: 5 * S,
        reorder_timeout_ns: 6 * S,
        degraded_clear_ns: 40 * S,
        ..MatcherConfig::default()
    });
    let k = comm(18);
    let nodes = [1, 2, 3];
    stall_in_op_1(&mut c, k);
    c.tick(S / 10);
    for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
        let pid = u32::try_from(node * 10).unwrap();
        c.frame(node, pid, k, 2, rank, 3, Phase::EnqueueStart, None, 2);
        if rank < 2 {
            c.frame(node, pid, k, 2, rank, 3, Phase::KernelStart, None, 2);
        }
    }
    for _ in 0..30 {
        c.progress(1, 10, k, 0, 2, 2, 1, ProcState::Running);
        c.progress(2, 20, k, 1, 2, 2, 1, ProcState::Running);
        c.progress(3, 30, k, 2, 2, 1, 0, ProcState::Running);
        c.watermarks(&nodes);
        c.tick(S);
    }
    assert_eq!(c.outcome(k, 1, 2), (Outcome::Stuck, true));
    let op1 = OpRef::Coll { comm: k, seq: 1 };
    assert_eq!(c.outcome(k, 2, 2), (Outcome::BlockedBy(op1), true));

    // Op 5's frames first, from nodes 1 and 2 (node 3's are behind its recovery); ranks
    // 0 and 1 report op 5 done.
    for (rank, node) in [(0, 1), (1, 2)] {
        let pid = u32::try_from(node * 10).unwrap();
        for phase in [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd] {
            c.frame(node, pid, k, 5, rank, 3, phase, None, 5);
        }
    }
    c.progress(1, 10, k, 0, 5, 5, 5, ProcState::Running);
    c.progress(2, 20, k, 1, 5, 5, 5, ProcState::Running);
    // Every watermark is honest: it stops below the batch still to come (here: now).
    c.watermarks(&nodes);
    for _ in 0..3 {
        c.tick(S);
    }
    let op = |c: &Case, seq: u64, rank: u32| {
        c.verdicts.get(&(OpRef::Coll { comm: k, seq }, rank)).map(|v| (v.outcome, v.is_final))
    };
    for seq in [3, 4] {
        for rank in 0..3 {
            assert!(
                matches!(op(&c, seq, rank), Some((_, false))),
                "op {seq} rank {rank}: decided, not final before its frames: {:?}",
                op(&c, seq, rank)
            );
        }
    }
    // The batch that was still to come: node 3's recovery and ops 3 and 4 everywhere.
    c.frame(3, 30, k, 1, 2, 3, Phase::KernelEnd, None, 1);
    c.frame(3, 30, k, 2, 2, 3, Phase::KernelStart, None, 2);
    c.frame(3, 30, k, 2, 2, 3, Phase::KernelEnd, None, 2);
    for (rank, node) in [(0, 1), (1, 2)] {
        c.frame(node, u32::try_from(node * 10).unwrap(), k, 2, rank, 3, Phase::KernelEnd, None, 2);
    }
    for seq in [3, 4, 5] {
        for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
            if seq == 5 && rank < 2 {
                continue;
            }
            let pid = u32::try_from(node * 10).unwrap();
            for phase in [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd] {
                c.frame(node, pid, k, seq, rank, 3, phase, None, seq);
            }
        }
    }
    for _ in 0..10 {
        c.progress(1, 10, k, 0, 5, 5, 5, ProcState::Running);
        c.progress(2, 20, k, 1, 5, 5, 5, ProcState::Running);
        c.progress(3, 30, k, 2, 5, 5, 5, ProcState::Running);
        c.watermarks(&nodes);
        c.tick(S);
    }
    for seq in [3, 4, 5] {
        for rank in 0..3 {
            assert_eq!(op(&c, seq, rank), Some((Outcome::Completed, true)), "op {seq} rank {rank}");
        }
    }
    assert_eq!(c.m.stats().revisions_after_final, 0);
}

/// Recovery memory is bounded: a GPU stuck in op 1 with thousands of ops blocked behind
/// it fills the 4,096-op cap; the oldest blocked ops are forgotten (counted), the
/// communicator's blocking root never, so its recovery still unblocks the communicator.
#[test]
fn recovery_memory_is_capped_and_keeps_the_blocking_root() {
    let mut c = Case::new();
    let k = comm(18);
    let nodes = [1, 2, 3];
    stall_in_op_1(&mut c, k);
    for _ in 0..25 {
        c.progress(1, 10, k, 0, 1, 1, 1, ProcState::Running);
        c.progress(2, 20, k, 1, 1, 1, 1, ProcState::Running);
        c.progress(3, 30, k, 2, 1, 1, 0, ProcState::Running);
        c.watermarks(&nodes);
        c.tick(S);
    }
    assert_eq!(c.outcome(k, 1, 2), (Outcome::Stuck, true));
    // 4,200 more ops entered by every rank, each final `blocked_by` op 1.
    for seq in 2..=4_201u64 {
        for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
            c.frame(node, u32::try_from(node * 10).unwrap(), k, seq, rank, 3, Phase::EnqueueStart, None, seq);
        }
        if seq % 100 == 0 {
            c.watermarks(&nodes);
            c.tick(S / 10);
        }
    }
    for _ in 0..3 {
        c.watermarks(&nodes);
        c.tick(S);
    }
    let op1 = OpRef::Coll { comm: k, seq: 1 };
    assert_eq!(c.outcome(k, 4_201, 0), (Outcome::BlockedBy(op1), true));
    assert!(c.m.stats().recoverable_evicted >= 100, "{:?}", c.m.stats());
    // The root recovers: the communicator is unblocked.
    c.frame(3, 30, k, 1, 2, 3, Phase::KernelEnd, None, 1);
    c.tick(S / 10);
    assert!(c.events.iter().any(|e| matches!(e, MatcherEvent::Recovered { op, rank: 2, .. } if *op == op1)));
    for (rank, node) in [(0, 1), (1, 2), (2, 3)] {
        let pid = u32::try_from(node * 10).unwrap();
        for phase in [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd] {
            c.frame(node, pid, k, 4_202, rank, 3, phase, None, 4_202);
        }
    }
    for _ in 0..3 {
        c.watermarks(&nodes);
        c.tick(S);
    }
    assert_eq!(c.outcome(k, 4_202, 0), (Outcome::Completed, true), "judged on its own after the recovery");
}

#[test]
fn copy_engine_collectives_are_a_completion_source() {
    // NCCL ≥ 2.29.2 running collectives on the copy engine, profiled through v6: the shim
    // asks for CE collectives (no kernel channels are involved) and completes them from
    // the CUDA events it records on their stream. A rank whose stream never reaches the op
    // is stuck — not indeterminate for want of a source — and a mask with enqueue events
    // only stays indeterminate(no_completion_source).
    let ce = activation::COLL | activation::P2P | activation::CE_COLL;
    for (mask, expect) in [
        (ce, Outcome::Stuck),
        (activation::COLL | activation::P2P, Outcome::Indeterminate(Indeterminate::NoCompletionSource)),
    ] {
        let mut c = Case::new();
        c.mask = mask;
        let k = comm(300);
        hang(&mut c, k);
        assert_eq!(c.outcome(k, 1, 1), (expect, true), "mask {mask:#x}");
    }
    // And with the CE source, an op whose every rank's stop event completed is completed.
    let mut c = Case::new();
    c.mask = ce;
    let k = comm(301);
    for rank in 0..2u32 {
        let node = u64::from(rank) + 1;
        c.frame(node, 10 + rank, k, 1, rank, 2, Phase::EnqueueStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 2, Phase::EnqueueEnd, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 2, Phase::KernelStart, None, 1);
        c.frame(node, 10 + rank, k, 1, rank, 2, Phase::KernelEnd, None, 1);
        c.progress(node, 10 + rank, k, rank, 1, 1, 1, ProcState::Running);
    }
    c.tick(S);
    c.watermarks(&[1, 2]);
    c.tick(S / 10);
    assert_eq!(c.outcome(k, 1, 0), (Outcome::Completed, true));
    assert_eq!(c.outcome(k, 1, 1), (Outcome::Completed, true));
}
