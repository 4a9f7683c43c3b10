//! `CollectiveMatcher`: records in, verdicts out — telling telemetry loss apart from real
//! degradation, never blaming a healthy node, never missing a GPU-side hang the evidence
//! shows.
//!
//! Method groups and call order (quinn-proto's `Connection` is the model):
//! - inputs: [`CollectiveMatcher::handle_record`] for every record ingest produced, in
//!   any interleaving across nodes; [`CollectiveMatcher::handle_timeout`] when
//!   [`CollectiveMatcher::poll_timeout`] says (and after a burst of records: evaluation
//!   is batched there);
//! - outputs: [`CollectiveMatcher::poll_event`] until `None`;
//! - getters: [`CollectiveMatcher::stats`], [`CollectiveMatcher::in_flight`],
//!   [`CollectiveMatcher::health`], [`CollectiveMatcher::node_health`].
//!
//! Rules (DESIGN "Collectives: keys, phases, verdicts"):
//! - keys: `(comm, comm_op_seq)` for collectives, `(comm, src, dst, p2p_seq)` for P2P;
//!   `local_op_seq` orders a rank's ops across communicators (`blocked_by`);
//! - completion only from a rank-level `kernel_end`/`proxy_done`, PROGRESS
//!   `last_completed ≥ k`, or the rank's completion of a later op on the communicator
//!   (ops on a communicator complete in order); an enqueue proves entry only;
//! - C1: any completion of a strong collective proves every rank entered;
//! - deadlines count from when k became the oldest unfinished op: when k − 1 was decided
//!   or completed by every participant, in cluster time (not when k − 1's verdict became
//!   final, so deadlines of consecutive ops do not stack), or k's first sight if later:
//!   stuck `max(20 s, 4 × p99)` of (comm, op, size bucket), join 600 s; nothing is
//!   `stuck`/`not_joined` before them;
//! - C3 culprit classes in order: (a) not entered while instrumented and fresh; (b) an
//!   earlier unresolved op of the same rank (`blocked_by`); (c) on a silent or
//!   unreachable node (`unknown_silent`; a silent node's watermark still gates, so such a
//!   verdict is final only once the node is unreachable); (e) the only GPU that never
//!   started k while every peer's did → `stuck`. Culprits on one node → the others
//!   `waiting_on(culprit)`; on none or several → `waiting_on(unknown)` (hung, culprit
//!   unknown);
//! - a rank that entered and did not finish after every peer finished is `stuck`;
//! - `telemetry_loss` only from P0 loss intervals of the rank's node overlapping the op;
//!   bulk loss never touches a verdict;
//! - final once every gating participant's `w_p0` has passed `decided_at` + the
//!   reorder timeout; a final `stuck` that completes later emits `Recovered`.
//!   `decided_at` is the frame time of the evidence (the last completion) or, for a
//!   decision resting on evidence without a frame time of its own (an inference from
//!   PROGRESS or a later op, an undecidable rank), the aggregator time it was first
//!   reached, kept while it holds — so a completion frame overtaken by PROGRESS or by
//!   a later op is in before the inference can become final; a decision past the stuck
//!   deadline is dated no earlier than the latest frame it rests on (a rank that starts
//!   k after a long pause has its completion in before the decision is final);
//! - an op needs no deadline to be final once every rank will say no more: completed,
//!   or `indeterminate(no_completion_source | key_collision)`, or — when the cluster's
//!   size is configured (`expected_nodes`) and that many nodes' watermarks passed the
//!   decision — `indeterminate(uninstrumented)` (without the size, a rank without
//!   PROGRESS looks the same as a rank of a node that has not connected yet). A rank on
//!   an unreachable node is not (a live node's connection can close for a moment): its
//!   ops wait for the stuck deadline.
//!
//! Memory: in-flight ops are capped (`max_ops`; the oldest is evicted and counted).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use rustc_hash::FxBuildHasher;

use proto_flat::codes::{Op, Phase, ProcState, WireEnum, activation, flags};
use rkyv::{Archive, Deserialize, Serialize};

use crate::records::{Comm, LifecycleKind, LivenessState, NodeId, Record};
use crate::tally::Tally;
use crate::verdict::{
    Evidence, FrameRef, Indeterminate, MatcherEvent, OpRef, Outcome, ProgressRef, Rule, Verdict, VerdictTag,
};

/// Matcher configuration (DESIGN's timers).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatcherConfig {
    /// Lower bound of the stuck deadline (NCCL RAS: 20 s).
    pub stuck_min_ns: u64,
    /// Join deadline (PyTorch's watchdog default: 600 s).
    pub join_deadline_ns: u64,
    pub reorder_timeout_ns: u64,
    pub max_ops: usize,
    /// Durations remembered per (comm, op, size bucket) for the p99.
    pub duration_window: usize,
    /// Straggler threshold; the bound is `max(threshold, 3·(ε_a + ε_b))`.
    pub straggler_threshold_ns: u64,
    /// How many nodes the cluster has (0: unknown). Known, a rank nobody ever reported
    /// (no frame, no PROGRESS) is `uninstrumented` for good once that many nodes'
    /// watermarks have passed the decision — all of their data from then is in, and none
    /// names the rank — instead of after the stuck deadline (a node that has not
    /// connected yet looks the same until then).
    pub expected_nodes: u32,
    /// How long a `degraded` GPU stays degraded without new evidence.
    pub degraded_clear_ns: u64,
    /// A communicator with no open collective and no activity (an op created, a PROGRESS
    /// entry) for this long is forgotten: its per-rank progress, op history, durations,
    /// homes and blocking root go (counted in `MatcherStats::comms_retired`). A
    /// communicator that comes back starts afresh (no seq-gap inference for its first op,
    /// default stuck deadline until durations are learnt again).
    pub comm_retention_ns: u64,
    /// Communicators remembered; past it the least recently active eighth is forgotten
    /// (`comms_evicted`; their open ops are evicted too, counted in `ops_evicted`).
    pub max_comms: usize,
    /// Per-rank entries (PROGRESS, completions, straggler history) remembered; past it
    /// communicators are forgotten as for `max_comms`.
    pub max_ranks: usize,
    /// Rank processes whose op order is remembered (for `blocked_by`); past it the least
    /// recently active eighth is forgotten (`procs_evicted`), and one idle for
    /// `comm_retention_ns` is forgotten anyway (`procs_retired`).
    pub max_procs: usize,
    /// GPUs whose health evidence is remembered; past it the eighth with the oldest
    /// evidence is forgotten (`gpus_evicted`).
    pub max_gpus: usize,
    /// Nodes remembered (watermarks, liveness, losses, clock residuals); past it an
    /// unreachable node (else the one with the oldest watermark) is forgotten
    /// (`nodes_evicted`). Ingest's own node cap keeps this from being reached.
    pub max_nodes: usize,
}

impl Default for MatcherConfig {
    fn default() -> Self {
        Self {
            stuck_min_ns: 20_000_000_000,
            join_deadline_ns: 600_000_000_000,
            reorder_timeout_ns: 500_000_000,
            max_ops: 200_000,
            duration_window: 128,
            straggler_threshold_ns: 50_000_000,
            expected_nodes: 0,
            degraded_clear_ns: 300_000_000_000,
            comm_retention_ns: 3_600_000_000_000,
            max_comms: 16_384,
            max_ranks: 1 << 20,
            max_procs: 16_384,
            max_gpus: 65_536,
            max_nodes: 4096,
        }
    }
}

/// Counters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatcherStats {
    pub lifecycle: u64,
    pub ops_created: u64,
    pub ops_final: u64,
    pub ops_evicted: u64,
    /// Graph-captured kernel-channel frames (matched by graph key).
    pub graph_frames: u64,
    /// Graph-captured frames that are not kernel-channel records: no verdict possible.
    pub unmatched_graph: u64,
    pub revisions_before_final: u64,
    /// Changes caused by data stamped at or before `decided_at` of a final verdict: a bug.
    pub revisions_after_final: u64,
    /// Final unresolved ranks (stuck, waiting, blocked, not joined) whose completion
    /// arrived after all: a `Recovered` event each.
    pub recovered: u64,
    /// Final ops still waiting for recovery forgotten at the caps (4,096 ops, 262,144
    /// ranks; oldest first, a communicator's blocking root last).
    pub recoverable_evicted: u64,
    pub late_frames_after_final: u64,
    /// Collectives none of whose frames arrived, known from the gap in a communicator's
    /// `comm_op_seq` (judged like any other op, from PROGRESS and later ops).
    pub ops_inferred_from_seq_gap: u64,
    /// Seq gaps wider than [`MAX_SEQ_GAP_OPS`]: those ops get no verdict (counted).
    pub seq_gap_ops_skipped: u64,
    /// PROGRESS entries older than the one already held for their rank (a heartbeat
    /// that arrived out of order or was resent): ignored.
    pub progress_stale: u64,
    /// Communicators forgotten after `comm_retention_ns` without activity.
    pub comms_retired: u64,
    /// Communicators forgotten at `max_comms` / `max_ranks` (least recently active first).
    pub comms_evicted: u64,
    /// Rank processes forgotten after `comm_retention_ns` without activity.
    pub procs_retired: u64,
    /// Rank processes forgotten at `max_procs`.
    pub procs_evicted: u64,
    /// GPUs' health evidence forgotten at `max_gpus`.
    pub gpus_evicted: u64,
    /// Nodes forgotten at `max_nodes`.
    pub nodes_evicted: u64,
    /// Fused groups forgotten at their cap (65,536; their ops long final).
    pub groups_forgotten: u64,
    /// Final stuck ops forgotten at `RECOVERABLE_CAP` (they no longer block ops of their
    /// ranks on other communicators).
    pub final_stuck_evicted: u64,
    /// Ranks ≥ 4,096 of a communicator not remembered as homes (4,096 of them are).
    pub homes_refused: u64,
}

/// The widest `comm_op_seq` gap filled with inferred ops at once (a hostile or broken
/// peer must not make the matcher create unbounded state).
pub const MAX_SEQ_GAP_OPS: u64 = 256;

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
struct RankObs {
    /// Whether any frame of this rank for this op arrived.
    present: bool,
    node: Option<NodeId>,
    entered: Option<FrameRef>,
    started: Option<FrameRef>,
    completed: Option<FrameRef>,
    completed_cluster_ns: i64,
    first_cluster_ns: i64,
    first_node_ns: u64,
    last_node_ns: u64,
    started_node_ns: u64,
    completed_node_ns: u64,
    started_cluster_ns: i64,
    enqueued_cluster_ns: i64,
    /// Per-channel ends seen (bit per channel < 64), for graph replays.
    channels_ended: u64,
    /// Fused group (ncclGroupStart/End) id; 0 = none.
    group_id: u64,
    n_channels: u16,
    local_op_seq: u64,
    pid: u32,
    op: u8,
    dtype: u8,
    count: u64,
    nranks: u32,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
struct RankVerdict {
    outcome: Outcome,
    tags: Vec<VerdictTag>,
    is_final: bool,
    revision: u32,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
struct OpState {
    key: OpRef,
    /// Aggregator time first seen.
    first_seen_ns: u64,
    /// Participants: comm ranks (0..nranks for collectives, {src, dst} for P2P).
    participants: Vec<u32>,
    /// Per participant, in `participants` order.
    ranks: Vec<RankObs>,
    op: u8,
    count: u64,
    /// Per participant, in `participants` order.
    verdicts: Vec<Option<RankVerdict>>,
    /// Distinct nodes of the participants seen so far (for watermark marking).
    nodes: Vec<NodeId>,
    decided_at_ns: u64,
    /// Aggregator time when the current outcomes were first reached (0: never decided):
    /// a decision with no frame time of its own is dated then, and stays dated then while
    /// it holds, so its finality can catch up with it.
    decided_now_ns: u64,
    is_final: bool,
    key_collision: bool,
    /// Its entry in `deadlines` (0: none), so an op holds at most one.
    due_ns: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Default)]
struct ProgressView {
    node: Option<NodeId>,
    pid: u32,
    gpu_uuid: [u8; 16],
    proc_state: u8,
    activation_mask: u32,
    last_enqueued: u64,
    last_kernel_started: u64,
    last_completed: u64,
    snapshot_cluster_ns: i64,
    received_at_ns: u64,
    /// The node epoch and node time of the heartbeat snapshot it came from: a later
    /// entry replaces it only if it is newer (heartbeats can arrive out of order).
    epoch: u64,
    snapshot_node_ns: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
struct NodeView {
    w_p0_cluster_ns: i64,
    epsilon_ns: u64,
    /// Completion residuals of strong collectives (last 32), for clock refinement.
    residuals: Vec<i64>,
    /// Their median (the correction) and the 90th percentile of deviations from it,
    /// recomputed when a residual is added.
    correction_ns: i64,
    residual_spread_ns: u64,
    liveness: Option<LivenessState>,
    /// `(interval id, from, to)` of P0 losses, node time; the last 256.
    p0_losses: Vec<(u64, u64, u64)>,
    knowledge_gaps: Vec<(u64, u64)>,
}

/// Hash map with FxHash: fast on the per-frame path, deterministic iteration.
type FxMap<K, V> = HashMap<K, V, FxBuildHasher>;
type FxSet<K> = HashSet<K, FxBuildHasher>;

/// A rank whose final verdict left it unfinished (stuck, waiting, blocked, not joined):
/// its completion, if it comes, is a recovery.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
struct Unfinished {
    /// Aggregator time the verdict became final.
    final_at_ns: u64,
    /// Its verdict was `stuck` (its GPU's degraded evidence).
    stuck: bool,
    gpu_uuid: [u8; 16],
}

/// A rank of a communicator.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, Hash))]
struct RankKey {
    comm: Comm,
    rank: u32,
}

/// Final ops remembered for late frames (between this and twice this many).
const FINAL_MEMORY: usize = 65_536;

/// Where each rank of a communicator spoke from: `(node, pid)`. Dense below
/// [`DENSE_RANKS`] (the participant cap: compact and cache-friendly, a communicator's
/// ranks are looked up together), sparse above — a rank number from the wire costs one
/// entry whatever its value (a dense Vec once let one frame with rank 65,535 allocate
/// 1.5 MiB, issue 18).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct Homes {
    dense: Vec<Option<(NodeId, u32)>>,
    sparse: BTreeMap<u32, (NodeId, u32)>,
}

/// What [`Homes::claim`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// The rank's home is this one (now, or already).
    Known,
    /// Another process speaks for the rank: two communicators share a key.
    Collision,
    /// A sparse rank past the cap: not remembered (counted).
    Refused,
}

/// Ranks kept in [`Homes`]'s dense part (the participants a collective tracks).
const DENSE_RANKS: u32 = 4096;

impl Homes {
    fn get(&self, rank: u32) -> Option<(NodeId, u32)> {
        if rank < DENSE_RANKS {
            self.dense.get(usize::try_from(rank).ok()?).copied().flatten()
        } else {
            self.sparse.get(&rank).copied()
        }
    }

    /// Records `home` for `rank` unless one is known; true when a different one is (two
    /// processes speak for one rank: the communicators' keys collide).
    fn claim(&mut self, rank: u32, home: (NodeId, u32)) -> Claim {
        if rank >= DENSE_RANKS {
            if let Some(known) = self.sparse.get(&rank) {
                return if *known == home { Claim::Known } else { Claim::Collision };
            }
            if self.sparse.len() >= usize::try_from(DENSE_RANKS).unwrap_or(usize::MAX) {
                return Claim::Refused;
            }
            self.sparse.insert(rank, home);
            return Claim::Known;
        }
        let i = usize::try_from(rank).unwrap_or(0);
        if self.dense.len() <= i {
            self.dense.resize(i.saturating_add(1), None);
        }
        match self.dense.get_mut(i) {
            Some(Some(known)) if *known != home => Claim::Collision,
            Some(Some(_)) | None => Claim::Known,
            Some(slot) => {
                *slot = Some(home);
                Claim::Known
            }
        }
    }

    fn len(&self) -> usize {
        self.dense.iter().flatten().count().saturating_add(self.sparse.len())
    }

    fn iter(&self) -> impl Iterator<Item = &(NodeId, u32)> + '_ {
        self.dense.iter().flatten().chain(self.sparse.values())
    }
}

/// Ops remembered per rank process for `blocked_by` (the oldest are dropped).
const RANK_OPS_CAP: usize = 1024;
/// (op code, size bucket) keys of durations kept per communicator, on average, before
/// communicators are forgotten (a communicator runs a few op kinds at a few sizes).
const DURATION_KEYS_PER_COMM: usize = 16;
/// Fused groups remembered as done.
const GROUPS_CAP: usize = 65_536;
/// How soon an op whose deadline passed by arrival time, but not yet by every gating
/// node's watermark, is evaluated again (the aggregator's timer turns at least this
/// often anyway).
const WATERMARK_RECHECK_NS: u64 = 100_000_000;
/// Final ops remembered for recovery (and stuck ops for `blocked_by` across
/// communicators).
const RECOVERABLE_CAP: usize = 4096;
/// Unfinished ranks remembered for recovery, over all those ops.
const RECOVERABLE_RANKS_CAP: usize = 262_144;

/// A rank process's recent ops, in its own order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
struct ProcOps {
    /// Aggregator time of its last op.
    active_ns: u64,
    /// local_op_seq → (op, completed); the last [`RANK_OPS_CAP`].
    ops: BTreeMap<u64, (OpRef, bool)>,
}

/// A rank process.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, Hash))]
struct ProcKey {
    node: NodeId,
    pid: u32,
}

/// Health of a GPU or node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    Healthy,
    HealthyLossy,
    Suspect,
    Degraded,
    Silent,
    Unreachable,
}

/// The matcher. See the module docs.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CollectiveMatcher {
    config: MatcherConfig,
    nodes: BTreeMap<NodeId, NodeView>,
    progress: FxMap<RankKey, ProgressView>,
    /// (comm, rank) → highest comm_op_seq completed by an own frame.
    completed_through: FxMap<RankKey, u64>,
    /// (node, pid) → local_op_seq → (op, completed).
    rank_ops: FxMap<ProcKey, ProcOps>,
    /// Communicator → when it was last active (aggregator time: an op created, a
    /// PROGRESS entry). Every communicator-keyed entry of the maps below belongs to one
    /// of these; forgetting a communicator forgets them all (see `retire_comms`).
    comm_active: FxMap<Comm, u64>,
    /// When idle communicators and processes are next looked for (aggregator time).
    next_sweep_ns: u64,
    ops: FxMap<OpRef, OpState>,
    /// comm → the comm_op_seqs of its open collectives.
    open_by_comm: FxMap<Comm, BTreeSet<u64>>,
    dirty: FxSet<OpRef>,
    /// (due, op) re-evaluations at deadlines.
    deadlines: BTreeSet<(u64, OpRef)>,
    /// (comm, op code, size bucket) → recent durations (ns).
    durations: BTreeMap<(Comm, u8, u8), Vec<u64>>,
    /// Communicator → (last final comm_op_seq, when it became final): the next op's
    /// deadline clock starts there.
    comm_done: BTreeMap<Comm, (u64, u64)>,
    /// Communicator → the highest comm_op_seq seen: `comm_op_seq` is dense per
    /// communicator, so a seq skipped below it is an op all of whose frames were lost.
    seen_through: FxMap<Comm, u64>,
    /// (comm, rank) → the (node, pid) that speaks for it; another one means two
    /// communicators share a key.
    /// Per communicator, indexed by rank (compact and cache-friendly: a communicator's
    /// ranks are looked up together).
    homes: FxMap<Comm, Homes>,
    /// Communicators whose key collided.
    collided: BTreeSet<Comm>,
    /// Communicator → its earliest op that became final unresolved (hung, stuck, not
    /// joined): later ops on it are `blocked_by` that op.
    unresolved: BTreeMap<Comm, (OpRef, u64)>,
    /// Final ops with a stuck rank not yet recovered: op → (rank → decided_at). An op
    /// here still blocks its ranks' later ops on other communicators.
    final_stuck: BTreeMap<OpRef, BTreeMap<u32, u64>>,
    /// Final ops with ranks left unfinished, for recovery (capped at `RECOVERABLE_CAP`
    /// ops, oldest forgotten and counted): when the last of them completes, the op no
    /// longer blocks its communicator.
    recoverable: BTreeMap<OpRef, BTreeMap<u32, Unfinished>>,
    /// Ranks held in `recoverable` (capped at `RECOVERABLE_RANKS_CAP`: a hung
    /// communicator of thousands of ranks must not hold thousands of ops' worth).
    recoverable_ranks: usize,
    /// (node, pid, group_id) of fused groups one of whose ops completed: the group ran as
    /// one kernel, so every op in it completed.
    groups_done: FxSet<(ProcKey, u64)>,
    /// Ops that became final recently (bounded, oldest forgotten first): a late frame
    /// for one is counted and ignored, never the seed of a new op that could be judged
    /// not joined.
    final_recent: FxSet<OpRef>,
    final_order: Vec<OpRef>,
    /// (comm, rank) → the last 5 instances: (lagging beyond the bound, host-side).
    lag_history: FxMap<RankKey, Vec<(bool, bool)>>,
    /// Latest verdict per (node, gpu) that drives health: (degraded evidence, suspect).
    gpu_flags: BTreeMap<(NodeId, [u8; 16]), (u64, u64, u64)>,
    stats: MatcherStats,
    out: crate::outbox::Outbox<MatcherEvent>,
}

impl OpState {
    fn new(key: OpRef, participants: Vec<u32>, op: u8, count: u64) -> Self {
        Self {
            key,
            // Cluster time of the earliest frame (0 while only frames from before clock
            // sync were seen), so no decision depends on arrival order.
            first_seen_ns: 0,
            ranks: vec![RankObs::default(); participants.len()],
            participants,
            op,
            count,
            verdicts: Vec::new(),
            nodes: Vec::new(),
            decided_at_ns: 0,
            decided_now_ns: 0,
            is_final: false,
            key_collision: false,
            due_ns: 0,
        }
    }

    /// Index of a communicator rank among the participants.
    fn slot(&self, rank: u32) -> Option<usize> {
        let i = usize::try_from(rank).ok()?;
        if self.participants.get(i) == Some(&rank) {
            return Some(i);
        }
        self.participants.iter().position(|&p| p == rank)
    }

    fn observed(&self) -> impl Iterator<Item = &RankObs> {
        self.ranks.iter().filter(|r| r.present)
    }
}

/// Whether a node's watermark gates deadlines and finality. A `silent` node still does:
/// its connection is open and its data may be queued on either side (under a CPU hog a
/// live node's heartbeats were processed seconds late, and a hung op of its own went
/// final as `unknown_silent` for it). Only an `unreachable` node — connection closed, or
/// unheard for the unreachable timeout — stops gating; its ranks' verdicts can then be
/// final as `unknown_silent`.
fn gates(live: LivenessState) -> bool {
    live != LivenessState::Unreachable
}

fn strong(op: u8) -> bool {
    matches!(
        Op::from_code(op),
        Op::AllReduce | Op::AllGather | Op::ReduceScatter | Op::AllToAll | Op::Barrier | Op::AllToAllv
    )
}

/// A map size as a counter increment.
fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn size_bucket(count: u64) -> u8 {
    u8::try_from(64u32.saturating_sub(count.leading_zeros())).unwrap_or(64)
}

impl CollectiveMatcher {
    /// A matcher with no state.
    #[must_use]
    pub fn new(config: MatcherConfig) -> Self {
        Self {
            config,
            nodes: BTreeMap::new(),
            progress: FxMap::default(),
            completed_through: FxMap::default(),
            rank_ops: FxMap::default(),
            comm_active: FxMap::default(),
            next_sweep_ns: 0,
            ops: FxMap::default(),
            open_by_comm: FxMap::default(),
            dirty: FxSet::default(),
            deadlines: BTreeSet::new(),
            durations: BTreeMap::new(),
            comm_done: BTreeMap::new(),
            seen_through: FxMap::default(),
            unresolved: BTreeMap::new(),
            homes: FxMap::default(),
            lag_history: FxMap::default(),
            final_recent: FxSet::default(),
            final_order: Vec::new(),
            groups_done: FxSet::default(),
            collided: BTreeSet::new(),
            final_stuck: BTreeMap::new(),
            recoverable: BTreeMap::new(),
            recoverable_ranks: 0,
            gpu_flags: BTreeMap::new(),
            stats: MatcherStats::default(),
            out: crate::outbox::Outbox::default(),
        }
    }

    // ---------------------------------------------------------------- getters

    /// The aggregator's own knowledge gaps about `node` (aggregator/cluster ns): from a
    /// restart's snapshot time to the node's first batch after it.
    #[must_use]
    pub fn knowledge_gaps(&self, node: NodeId) -> &[(u64, u64)] {
        self.nodes.get(&node).map_or(&[], |n| n.knowledge_gaps.as_slice())
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &MatcherStats {
        &self.stats
    }

    /// Its maps, with their sizes and caps (see [`crate::bounds`]).
    #[must_use]
    pub fn map_sizes(&self) -> Vec<crate::MapSize> {
        use crate::MapSize;
        let c = &self.config;
        let comms = c.max_comms;
        let rank_ops: usize = self.rank_ops.values().map(|p| p.ops.len()).sum();
        let homes: usize = self.homes.values().map(Homes::len).sum();
        vec![
            MapSize::new("matcher.ops", self.ops.len(), c.max_ops),
            MapSize::new("matcher.open_by_comm", self.open_by_comm.len(), comms),
            MapSize::new("matcher.deadlines", self.deadlines.len(), c.max_ops),
            MapSize::new("matcher.dirty", self.dirty.len(), c.max_ops.saturating_add(comms)),
            MapSize::new("matcher.nodes", self.nodes.len(), c.max_nodes),
            MapSize::new("matcher.comm_active", self.comm_active.len(), comms),
            MapSize::new("matcher.progress", self.progress.len(), c.max_ranks),
            MapSize::new("matcher.completed_through", self.completed_through.len(), c.max_ranks),
            MapSize::new("matcher.lag_history", self.lag_history.len(), c.max_ranks),
            MapSize::new("matcher.durations", self.durations.len(), comms.saturating_mul(DURATION_KEYS_PER_COMM)),
            MapSize::new("matcher.comm_done", self.comm_done.len(), comms),
            MapSize::new("matcher.seen_through", self.seen_through.len(), comms),
            MapSize::new("matcher.homes", self.homes.len(), comms),
            MapSize::new(
                "matcher.homes_ranks",
                homes,
                comms.saturating_mul(usize::try_from(DENSE_RANKS).unwrap_or(usize::MAX).saturating_mul(2)),
            ),
            MapSize::new("matcher.collided", self.collided.len(), comms),
            MapSize::new("matcher.unresolved", self.unresolved.len(), comms),
            MapSize::new("matcher.rank_ops", self.rank_ops.len(), c.max_procs),
            MapSize::new("matcher.rank_ops_entries", rank_ops, c.max_procs.saturating_mul(RANK_OPS_CAP)),
            MapSize::new("matcher.groups_done", self.groups_done.len(), GROUPS_CAP),
            MapSize::new("matcher.final_recent", self.final_recent.len(), FINAL_MEMORY.saturating_mul(2)),
            MapSize::new("matcher.final_stuck", self.final_stuck.len(), RECOVERABLE_CAP),
            MapSize::new("matcher.recoverable", self.recoverable.len(), RECOVERABLE_CAP),
            MapSize::new("matcher.recoverable_ranks", self.recoverable_ranks, RECOVERABLE_RANKS_CAP),
            MapSize::new("matcher.gpu_flags", self.gpu_flags.len(), c.max_gpus),
        ]
    }

    /// See [`MatcherConfig::degraded_clear_ns`].
    pub fn set_degraded_clear_ns(&mut self, ns: u64) {
        self.config.degraded_clear_ns = ns;
    }

    /// Ops not yet final.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.ops.len()
    }

    /// Health of every GPU seen, `(node, gpu_uuid) → health`, at `now`: a pure function
    /// of the verdicts so far and liveness. `degraded` clears
    /// `MatcherConfig::degraded_clear_ns` after its last evidence.
    #[must_use]
    pub fn health(&self, now: u64) -> BTreeMap<(NodeId, [u8; 16]), Health> {
        let degraded_clear_ns = self.config.degraded_clear_ns;
        let mut out = BTreeMap::new();
        for ((node, rank_uuid), &(degraded_at, suspect_at, lossy_at)) in &self.gpu_flags {
            let live = self.nodes.get(node).and_then(|n| n.liveness);
            let h = match live {
                Some(LivenessState::Unreachable) => Health::Unreachable,
                Some(LivenessState::Silent) => Health::Silent,
                _ if degraded_at > 0 && now.saturating_sub(degraded_at) < degraded_clear_ns => Health::Degraded,
                _ if suspect_at > 0 => Health::Suspect,
                _ if lossy_at > 0 => Health::HealthyLossy,
                _ => Health::Healthy,
            };
            out.insert((*node, *rank_uuid), h);
        }
        out
    }

    /// Node health: its worst GPU.
    #[must_use]
    pub fn node_health(&self, now: u64) -> BTreeMap<NodeId, Health> {
        let mut out: BTreeMap<NodeId, Health> = BTreeMap::new();
        for ((node, _), h) in self.health(now) {
            let e = out.entry(node).or_insert(h);
            *e = (*e).max(h);
        }
        for (node, n) in &self.nodes {
            let live = match n.liveness {
                Some(LivenessState::Unreachable) => Health::Unreachable,
                Some(LivenessState::Silent) => Health::Silent,
                _ => Health::Healthy,
            };
            let e = out.entry(*node).or_insert(live);
            *e = (*e).max(live);
        }
        out
    }

    // ---------------------------------------------------------------- outputs

    /// The next event.
    pub fn poll_event(&mut self) -> Option<MatcherEvent> {
        self.out.poll()
    }

    /// When to call `handle_timeout` next (dirty ops: now).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        if !self.dirty.is_empty() {
            return Some(0);
        }
        // The idle sweep is not a timer of its own: it runs in whichever `handle_timeout`
        // finds it due (a core with nothing due grows nothing to forget).
        self.deadlines.iter().next().map(|d| d.0)
    }

    // ---------------------------------------------------------------- inputs

    /// One record from ingest.
    pub fn handle_record(&mut self, now: u64, record: &Record) {
        self.apply_record(now, record);
        if self.over_comm_caps() {
            self.evict_comms();
        }
    }

    fn apply_record(&mut self, now: u64, record: &Record) {
        match record {
            Record::Lifecycle(l) => self.on_lifecycle(now, l),
            Record::Progress(p) => {
                let key = RankKey { comm: p.comm, rank: p.rank };
                // A heartbeat older than the one already applied for this rank (out of
                // order, or resent) must not turn fresh evidence stale: a decision taken
                // on a stale entry (PROGRESS from before the stuck deadline) could go
                // final wrong. Newer = later epoch, or same epoch and later snapshot.
                if let Some(old) = self.progress.get(&key)
                    && old.node == Some(p.node)
                    && (old.epoch, old.snapshot_node_ns) > (p.epoch, p.snapshot_node_ns)
                {
                    self.stats.progress_stale.inc();
                    return;
                }
                self.progress.insert(
                    key,
                    ProgressView {
                        node: Some(p.node),
                        pid: p.pid,
                        gpu_uuid: p.gpu_uuid,
                        proc_state: p.proc_state,
                        activation_mask: p.activation_mask,
                        last_enqueued: p.last_enqueued_op,
                        last_kernel_started: p.last_kernel_started_op,
                        last_completed: p.last_completed_op,
                        snapshot_cluster_ns: p.snapshot_cluster_ns,
                        received_at_ns: now,
                        epoch: p.epoch,
                        snapshot_node_ns: p.snapshot_node_ns,
                    },
                );
                self.comm_active.insert(p.comm, now);
                // Ops of this communicator up to what the entry proves may change.
                let hi = p.last_enqueued_op.max(p.last_completed_op).saturating_add(1);
                if let Some(open) = self.open_by_comm.get(&p.comm) {
                    self.dirty.extend(open.range(..=hi).map(|&seq| OpRef::Coll { comm: p.comm, seq }));
                }
            }
            Record::Watermark(w) if w.class == 0 => {
                let n = self.node_view(w.node);
                n.w_p0_cluster_ns = n.w_p0_cluster_ns.max(w.cluster_ns);
                n.epsilon_ns = w.epsilon_ns;
                self.mark_node_dirty(w.node);
            }
            Record::Liveness(l) => {
                self.node_view(l.node).liveness = Some(l.state);
                self.mark_node_dirty(l.node);
            }
            Record::Loss(l) if l.stream.stream_id >> 24 == 0 => {
                let n = self.node_view(l.stream.node);
                if n.p0_losses.len() >= 256 {
                    n.p0_losses.remove(0);
                }
                n.p0_losses.push((l.id, l.from_node_ns, l.to_node_ns.max(l.from_node_ns)));
            }
            Record::KnowledgeGap(g) => {
                // A fresh start's "gap" (nothing known before the first batch, and nothing
                // happened that we could have known) is empty of ops; keep the list short.
                let gaps = &mut self.node_view(g.node).knowledge_gaps;
                if gaps.len() >= 64 {
                    gaps.remove(0);
                }
                gaps.push((g.from_ns, g.to_ns));
            }
            _ => {}
        }
    }

    /// Evaluates dirty ops and ops whose deadlines passed.
    pub fn handle_timeout(&mut self, now: u64) {
        while let Some(&(due, op)) = self.deadlines.iter().next() {
            if due > now {
                break;
            }
            self.deadlines.remove(&(due, op));
            if let Some(o) = self.ops.get_mut(&op) {
                o.due_ns = 0;
            }
            self.dirty.insert(op);
        }
        // Sorted, so evaluation (and so event) order does not depend on hashing.
        let mut dirty: Vec<OpRef> = self.dirty.drain().collect();
        dirty.sort_unstable();
        for op in dirty {
            self.evaluate(now, op);
        }
        if self.over_comm_caps() {
            self.evict_comms();
        }
        if self.gpu_flags.len() > self.config.max_gpus {
            self.evict_gpus();
        }
        if now >= self.next_sweep_ns {
            self.sweep(now);
        }
    }

    // ---------------------------------------------------------------- internals

    /// Every open op with a rank on `node` (`OpState::nodes`: from its frames, and from
    /// each evaluation's view of its ranks — PROGRESS included) is evaluated again: that
    /// node's watermark or liveness may decide it.
    fn mark_node_dirty(&mut self, node: NodeId) {
        let keys: Vec<OpRef> = self.ops.iter().filter(|(_, o)| o.nodes.contains(&node)).map(|(k, _)| *k).collect();
        self.dirty.extend(keys);
    }

    fn on_lifecycle(&mut self, now: u64, l: &crate::records::Lifecycle) {
        self.stats.lifecycle.inc();
        let graph = l.flags & flags::GRAPH_CAPTURED != 0;
        let per_channel_frame = l.flags & flags::PER_CHANNEL != 0;
        if graph && !per_channel_frame {
            // Graph replays are matched from kernel-channel records only.
            self.stats.unmatched_graph.inc();
            return;
        }
        let (key, nranks) = match l.kind {
            LifecycleKind::Collective { graph_id, graph_node, replay_idx, nranks, .. } if graph => {
                self.stats.graph_frames.inc();
                (OpRef::Graph { comm: l.comm, graph_id, graph_node, replay_idx }, nranks)
            }
            LifecycleKind::Collective { comm_op_seq, nranks, .. } => {
                if comm_op_seq == 0 {
                    return;
                }
                (OpRef::Coll { comm: l.comm, seq: comm_op_seq }, nranks)
            }
            LifecycleKind::P2p { src, dst, p2p_seq } => (OpRef::P2p { comm: l.comm, src, dst, p2p_seq }, 2),
        };
        let node = l.stream.node;
        let frame = FrameRef { node, stream_id: l.stream.stream_id, seq: l.seq, phase: l.phase };
        let per_channel = l.flags & flags::PER_CHANNEL != 0;
        let phase = Phase::from_code(l.phase);
        // A completion for a final op that left ranks unfinished: a recovery (checked only
        // while such ops exist).
        if !self.recoverable.is_empty()
            && matches!(phase, Phase::KernelEnd | Phase::ProxyDone)
            && !per_channel
            && !self.ops.contains_key(&key)
            && self.recover(now, key, l.rank, node)
        {
            return;
        }
        // One map lookup on the hot path (the op exists); creation is the slow path.
        let mut created = false;
        let mut op = match self.ops.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // Late data for a final op: a recovery (handled above), or a late frame
                // to count.
                if self.final_recent.contains(&key) {
                    self.stats.late_frames_after_final.inc();
                    return;
                }
                self.stats.ops_created.inc();
                created = true;
                self.comm_active.insert(l.comm, now);
                let participants: Vec<u32> = match key {
                    OpRef::Coll { .. } | OpRef::Graph { .. } => (0..nranks.min(4096)).collect(),
                    OpRef::P2p { src, dst, .. } => vec![src, dst],
                };
                if let OpRef::Coll { comm, seq } = key {
                    self.open_by_comm.entry(comm).or_default().insert(seq);
                }
                v.insert(OpState::new(key, participants, l.op, l.count))
            }
        };
        // A new collective may reveal earlier ones none of whose frames arrived (slow
        // path only: the op was just created).
        if created && let OpRef::Coll { comm, seq } = key {
            self.fill_seq_gap(comm, seq, nranks, l.ts_cluster_ns);
            let Some(o) = self.ops.get_mut(&key) else { return };
            op = o;
        }
        if nranks as usize != op.participants.len() && matches!(key, OpRef::Coll { .. }) {
            op.key_collision = true;
        }
        if let Ok(t) = u64::try_from(l.ts_cluster_ns)
            && t > 0
            && (op.first_seen_ns == 0 || t < op.first_seen_ns)
        {
            op.first_seen_ns = t;
        }
        let Some(slot) = op.slot(l.rank) else {
            // A rank outside the key's participants: another communicator's frame.
            op.key_collision = true;
            return;
        };
        if !op.nodes.contains(&node) {
            op.nodes.push(node);
        }
        let Some(obs) = op.ranks.get_mut(slot) else { return };
        let was_present = obs.present;
        let was_completed = obs.completed.is_some();
        let was_started = obs.started.is_some();
        obs.present = true;
        if obs.node.is_some_and(|n| n != node) || (obs.pid != 0 && obs.pid != l.pid) {
            // Two different processes claim the same rank of the same key: two
            // communicators share a key.
            op.key_collision = true;
        }
        obs.node = Some(node);
        obs.pid = l.pid;
        obs.local_op_seq = l.local_op_seq;
        obs.group_id = l.group_id;
        obs.op = l.op;
        obs.dtype = l.dtype;
        obs.count = l.count;
        obs.nranks = nranks;
        if obs.first_cluster_ns == 0 {
            obs.first_cluster_ns = l.ts_cluster_ns;
            obs.first_node_ns = l.ts_node_ns;
        }
        obs.last_node_ns = obs.last_node_ns.max(l.ts_node_ns);
        match phase {
            Phase::EnqueueStart | Phase::EnqueueEnd => {
                obs.entered.get_or_insert(frame);
                obs.enqueued_cluster_ns = obs.enqueued_cluster_ns.max(l.ts_cluster_ns);
            }
            Phase::KernelStart => {
                obs.entered.get_or_insert(frame);
                if !per_channel && obs.started_cluster_ns == 0 {
                    obs.started_cluster_ns = l.ts_cluster_ns;
                }
                if obs.started.is_none() {
                    obs.started = Some(frame);
                    obs.started_node_ns = l.ts_node_ns;
                }
            }
            Phase::KernelEnd if per_channel && graph => {
                obs.n_channels = l.n_channels;
                if l.channel < 64 {
                    obs.channels_ended |= 1 << l.channel;
                }
                if obs.channels_ended.count_ones() >= u32::from(l.n_channels.clamp(1, 64)) && obs.completed.is_none() {
                    obs.completed = Some(frame);
                    obs.completed_cluster_ns = l.ts_cluster_ns;
                    obs.completed_node_ns = l.ts_node_ns;
                }
            }
            Phase::KernelEnd | Phase::ProxyDone if !per_channel => {
                obs.entered.get_or_insert(frame);
                obs.started.get_or_insert(frame);
                if obs.completed.is_none() {
                    obs.completed = Some(frame);
                    obs.completed_cluster_ns = l.ts_cluster_ns;
                    obs.completed_node_ns = l.ts_node_ns;
                }
            }
            _ => {}
        }
        let completed = obs.completed.is_some();
        let started = obs.started.is_some();
        let group_done = completed && !was_completed && l.group_id != 0;
        if let OpRef::Coll { comm, seq } = key
            && completed
        {
            let c = self.completed_through.entry(RankKey { comm, rank: l.rank }).or_default();
            *c = (*c).max(seq);
        }
        // The rank's own op order (for blocked_by): touched once per op, and when it
        // completes — not for every phase.
        if !graph && (!was_present || completed != was_completed) {
            let proc_ops = self.rank_ops.entry(ProcKey { node, pid: l.pid }).or_default();
            proc_ops.active_ns = now;
            proc_ops.ops.insert(l.local_op_seq, (key, completed));
            while proc_ops.ops.len() > RANK_OPS_CAP {
                proc_ops.ops.pop_first();
            }
            if self.rank_ops.len() > self.config.max_procs {
                self.evict_procs();
            }
        }
        if group_done {
            self.groups_done.insert((ProcKey { node, pid: l.pid }, l.group_id));
            while self.groups_done.len() > GROUPS_CAP {
                // Bounded: forget an arbitrary old group (its ops are long final).
                let Some(&k) = self.groups_done.iter().next() else { break };
                self.groups_done.remove(&k);
                self.stats.groups_forgotten.inc();
            }
            // Its fused siblings may now be complete.
            let keys: Vec<OpRef> = self
                .ops
                .iter()
                .filter(|(_, o)| {
                    o.observed().any(|x| x.group_id == l.group_id && x.pid == l.pid && x.node == Some(node))
                })
                .map(|(k, _)| *k)
                .collect();
            self.dirty.extend(keys);
        }
        if !was_present {
            // Who speaks for this rank: another process means two communicators share a key.
            match self.homes.entry(l.comm).or_default().claim(l.rank, (node, l.pid)) {
                Claim::Known => {}
                Claim::Collision => {
                    self.collided.insert(l.comm);
                }
                Claim::Refused => self.stats.homes_refused.inc(),
            }
        }
        // Only a change of what the rank proved makes the op worth evaluating again.
        if !was_present || completed != was_completed || started != was_started {
            self.dirty.insert(key);
        }
        if created && self.ops.len() > self.config.max_ops {
            self.evict_oldest(key);
        }
    }

    /// A completion for a rank a final verdict left unfinished: `Recovered`, the GPU's
    /// degraded evidence dated now (it clears `degraded_clear` after the recovery), and
    /// once no rank of the op is left unfinished, the op stops blocking its
    /// communicator's later ops (they are judged on their own again). False: the rank
    /// was not waiting for recovery.
    fn recover(&mut self, now: u64, key: OpRef, rank: u32, node: NodeId) -> bool {
        let Some(waiting) = self.recoverable.get_mut(&key) else { return false };
        let Some(u) = waiting.remove(&rank) else { return false };
        self.recoverable_ranks = self.recoverable_ranks.saturating_sub(1);
        let all_back = waiting.is_empty();
        self.stats.recovered.inc();
        self.out.push(MatcherEvent::Recovered {
            op: key,
            rank,
            node: Some(node),
            after_ms: now.saturating_sub(u.final_at_ns) / 1_000_000,
        });
        if u.stuck {
            if let Some(f) = self.gpu_flags.get_mut(&(node, u.gpu_uuid)) {
                f.0 = f.0.max(now);
            }
            if let Some(s) = self.final_stuck.get_mut(&key) {
                s.remove(&rank);
                if s.is_empty() {
                    self.final_stuck.remove(&key);
                }
            }
        }
        if all_back {
            self.recoverable.remove(&key);
            if let OpRef::Coll { comm, .. } = key
                && self.unresolved.get(&comm).is_some_and(|(root, _)| *root == key)
            {
                self.unresolved.remove(&comm);
                if let Some(open) = self.open_by_comm.get(&comm) {
                    self.dirty.extend(open.iter().map(|&seq| OpRef::Coll { comm, seq }));
                }
            }
        }
        true
    }

    /// The node a communicator rank spoke from (its first frame).
    fn home_node(&self, comm: Comm, rank: u32) -> Option<NodeId> {
        self.homes.get(&comm)?.get(rank).map(|h| h.0)
    }

    /// `comm_op_seq` is dense per communicator: seqs skipped between the highest seen and
    /// `seq` are ops whose every frame was lost (a P0 overflow, say). They become ops
    /// with no observations, judged like the rest — completed (inferred, with the
    /// node's loss as `telemetry_loss`) when PROGRESS or a later op proves it, never
    /// silently absent. Seqs below the first one seen are not guessed at.
    fn fill_seq_gap(&mut self, comm: Comm, seq: u64, nranks: u32, ts_cluster_ns: i64) {
        let Some(&high) = self.seen_through.get(&comm) else {
            self.seen_through.insert(comm, seq);
            return;
        };
        if seq <= high {
            return;
        }
        self.seen_through.insert(comm, seq);
        // `seq > high`, so this is at least 0.
        let missing = seq.saturating_sub(high).saturating_sub(1);
        if missing > MAX_SEQ_GAP_OPS {
            self.stats.seq_gap_ops_skipped = self.stats.seq_gap_ops_skipped.saturating_add(missing);
            return;
        }
        for k in high.saturating_add(1)..seq {
            let key = OpRef::Coll { comm, seq: k };
            if self.ops.contains_key(&key) || self.final_recent.contains(&key) {
                continue;
            }
            let mut op = OpState::new(key, (0..nranks.min(4096)).collect(), 0, 0);
            op.first_seen_ns = u64::try_from(ts_cluster_ns).unwrap_or(0);
            // Re-evaluated when the watermarks of the nodes its ranks live on move.
            op.nodes = self.homes.get(&comm).into_iter().flat_map(Homes::iter).map(|h| h.0).collect();
            op.nodes.sort_unstable();
            op.nodes.dedup();
            self.ops.insert(key, op);
            self.open_by_comm.entry(comm).or_default().insert(k);
            self.dirty.insert(key);
            self.stats.ops_created.inc();
            self.stats.ops_inferred_from_seq_gap.inc();
        }
    }

    /// Bounded memory: drops the oldest open op (not `keep`), counted.
    fn evict_oldest(&mut self, keep: OpRef) {
        let Some((&oldest, _)) = self.ops.iter().filter(|(k, _)| **k != keep).min_by_key(|(_, o)| o.first_seen_ns)
        else {
            return;
        };
        if let Some(o) = self.ops.remove(&oldest) {
            self.deadlines.remove(&(o.due_ns, oldest));
        }
        if let OpRef::Coll { comm, seq } = oldest
            && let Some(open) = self.open_by_comm.get_mut(&comm)
        {
            open.remove(&seq);
        }
        self.stats.ops_evicted.inc();
    }

    // ---------------------------------------------------------------- bounds

    /// A node's view, created if new; at `max_nodes` an unreachable node (else the one
    /// with the oldest watermark) is forgotten first, counted.
    fn node_view(&mut self, node: NodeId) -> &mut NodeView {
        if !self.nodes.contains_key(&node) && self.nodes.len() >= self.config.max_nodes.max(1) {
            let victim = self
                .nodes
                .iter()
                .min_by_key(|(_, v)| (v.liveness != Some(LivenessState::Unreachable), v.w_p0_cluster_ns))
                .map(|(k, _)| *k);
            if let Some(v) = victim {
                self.nodes.remove(&v);
                self.stats.nodes_evicted.inc();
            }
        }
        self.nodes.entry(node).or_default()
    }

    /// Whether a communicator-keyed map is past its cap.
    fn over_comm_caps(&self) -> bool {
        let ranks = self.config.max_ranks;
        self.comm_active.len() > self.config.max_comms
            || self.progress.len() > ranks
            || self.completed_through.len() > ranks
            || self.lag_history.len() > ranks
            || self.durations.len() > self.config.max_comms.saturating_mul(DURATION_KEYS_PER_COMM)
    }

    /// Forgets the least recently active eighth of the communicators (at least one),
    /// counted: a map keyed by communicator or rank is past its cap.
    fn evict_comms(&mut self) {
        let mut by_age: Vec<(u64, Comm)> = self.comm_active.iter().map(|(c, t)| (*t, *c)).collect();
        by_age.sort_unstable();
        let n = (by_age.len() / 8).max(1);
        let victims: FxSet<Comm> = by_age.into_iter().take(n).map(|(_, c)| c).collect();
        self.stats.comms_evicted = self.stats.comms_evicted.saturating_add(count(victims.len()));
        self.retire_comms(&victims, true);
    }

    /// Forgets everything known about `comms`. `evicting`: also their open ops (a cap,
    /// counted in `ops_evicted`); otherwise they have none open (idle retirement).
    fn retire_comms(&mut self, comms: &FxSet<Comm>, evicting: bool) {
        if comms.is_empty() {
            return;
        }
        let gone = |c: &Comm| comms.contains(c);
        let before = self.ops.len();
        let mut dropped = Vec::new();
        self.ops.retain(|k, o| {
            let keep = !gone(&k.comm());
            if !keep {
                dropped.push((o.due_ns, *k));
            }
            keep
        });
        for d in dropped {
            self.deadlines.remove(&d);
            self.dirty.remove(&d.1);
        }
        if evicting {
            let n = before.saturating_sub(self.ops.len());
            self.stats.ops_evicted = self.stats.ops_evicted.saturating_add(count(n));
        }
        self.comm_active.retain(|c, _| !gone(c));
        self.open_by_comm.retain(|c, _| !gone(c));
        self.progress.retain(|k, _| !gone(&k.comm));
        self.completed_through.retain(|k, _| !gone(&k.comm));
        self.lag_history.retain(|k, _| !gone(&k.comm));
        self.durations.retain(|k, _| !gone(&k.0));
        self.comm_done.retain(|c, _| !gone(c));
        self.seen_through.retain(|c, _| !gone(c));
        self.homes.retain(|c, _| !gone(c));
        self.collided.retain(|c| !gone(c));
        self.unresolved.retain(|c, _| !gone(c));
    }

    /// Forgets the least recently active eighth of the rank processes, counted.
    fn evict_procs(&mut self) {
        let mut by_age: Vec<(u64, ProcKey)> = self.rank_ops.iter().map(|(k, p)| (p.active_ns, *k)).collect();
        by_age.sort_unstable();
        let n = (by_age.len() / 8).max(1);
        for (_, k) in by_age.into_iter().take(n) {
            self.rank_ops.remove(&k);
            self.stats.procs_evicted.inc();
        }
    }

    /// Forgets the eighth of the GPUs with the oldest health evidence, counted.
    fn evict_gpus(&mut self) {
        let mut by_age: Vec<(u64, (NodeId, [u8; 16]))> =
            self.gpu_flags.iter().map(|(k, f)| (f.0.max(f.1).max(f.2), *k)).collect();
        by_age.sort_unstable();
        let n = (by_age.len() / 8).max(1);
        for (_, k) in by_age.into_iter().take(n) {
            self.gpu_flags.remove(&k);
            self.stats.gpus_evicted.inc();
        }
    }

    /// Forgets communicators with no open collective and rank processes idle for
    /// `comm_retention_ns`, counted; next looked at an eighth of that later.
    fn sweep(&mut self, now: u64) {
        let retention = self.config.comm_retention_ns;
        self.next_sweep_ns = now.saturating_add((retention / 8).max(1));
        let cutoff = now.saturating_sub(retention);
        if now < retention {
            return;
        }
        let idle: FxSet<Comm> = self
            .comm_active
            .iter()
            .filter(|(c, t)| **t < cutoff && !self.open_by_comm.contains_key(c))
            .map(|(c, _)| *c)
            .collect();
        self.stats.comms_retired = self.stats.comms_retired.saturating_add(count(idle.len()));
        self.retire_comms(&idle, false);
        let before = self.rank_ops.len();
        self.rank_ops.retain(|_, p| p.active_ns >= cutoff);
        let retired = before.saturating_sub(self.rank_ops.len());
        self.stats.procs_retired = self.stats.procs_retired.saturating_add(count(retired));
    }

    fn stuck_deadline(&self, op: &OpState) -> u64 {
        let key = (op.key.comm(), op.op, size_bucket(op.count));
        let p99 = self.durations.get(&key).and_then(|d| {
            let mut v = d.clone();
            v.sort_unstable();
            v.get(v.len().saturating_sub(1).saturating_mul(99) / 100).copied()
        });
        self.config.stuck_min_ns.max(p99.unwrap_or(0).saturating_mul(4))
    }

    /// When op k became the oldest unfinished op: when op k − 1 was decided or completed
    /// by every participant, in cluster time (or k's first sight, if later or if k − 1
    /// was never seen) — not when k − 1's verdict became final, so the deadlines of
    /// consecutive ops do not stack; never while k − 1 is undecided.
    fn clock_start(&self, op: &OpState) -> u64 {
        let OpRef::Coll { comm, seq } = op.key else { return op.first_seen_ns };
        if seq > 1
            && let Some(prev) = self.ops.get(&OpRef::Coll { comm, seq: seq.saturating_sub(1) })
            && !prev.is_final
        {
            let decided = prev.decided_now_ns != 0
                && prev.verdicts.len() == prev.participants.len()
                && prev.verdicts.iter().all(|v| v.as_ref().is_some_and(|v| !matches!(v.outcome, Outcome::InFlight)));
            return if decided { prev.decided_at_ns.max(op.first_seen_ns) } else { u64::MAX };
        }
        match self.comm_done.get(&comm) {
            Some(&(done, at)) if done.checked_add(1) == Some(seq) => at.max(op.first_seen_ns),
            _ => op.first_seen_ns,
        }
    }

    #[allow(clippy::too_many_lines, reason = "the rules read best in one place, in DESIGN's order")]
    fn evaluate(&mut self, now: u64, key: OpRef) {
        // Taken out while evaluated (no clone); put back unless final.
        let Some(mut op) = self.ops.remove(&key) else { return };
        let seq = match key {
            OpRef::Coll { seq, .. } => seq,
            OpRef::P2p { .. } | OpRef::Graph { .. } => 0,
        };
        let comm = key.comm();
        let is_coll = matches!(key, OpRef::Coll { .. });
        let is_graph = matches!(key, OpRef::Graph { .. });
        struct R {
            rank: u32,
            node: Option<NodeId>,
            entered: bool,
            started: bool,
            completed: Option<bool>, // Some(direct?)
            instrumented: bool,
            no_source: bool,
            exited: bool,
            live: LivenessState,
            progress: Option<ProgressView>,
            local_op_seq: u64,
            pid: u32,
        }
        let mut rs: Vec<R> = Vec::new();
        for &rank in &op.participants {
            let obs = op.slot(rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present);
            let prog = self.progress.get(&RankKey { comm, rank }).copied();
            // Where the rank lives: its frames, its PROGRESS entry, or (an op none of whose
            // frames arrived) where it spoke from before.
            let node = obs.and_then(|o| o.node).or(prog.and_then(|p| p.node)).or_else(|| self.home_node(comm, rank));
            let direct = obs.is_some_and(|o| o.completed.is_some());
            let by_progress = is_coll && prog.is_some_and(|p| p.last_completed >= seq);
            let by_later = is_coll && self.completed_through.get(&RankKey { comm, rank }).is_some_and(|&c| c > seq);
            // A fused group ran as one kernel: one of its ops completing completes all.
            let by_group = obs.is_some_and(|o| {
                o.group_id != 0
                    && o.node.is_some_and(|n| self.groups_done.contains(&(ProcKey { node: n, pid: o.pid }, o.group_id)))
            });
            let completed = if direct {
                Some(true)
            } else if by_progress || by_later || by_group {
                Some(false)
            } else {
                None
            };
            let entered = completed.is_some()
                || obs.is_some_and(|o| o.entered.is_some())
                || (is_coll && prog.is_some_and(|p| p.last_enqueued >= seq));
            let started = completed.is_some()
                || obs.is_some_and(|o| o.started.is_some())
                || (is_coll && prog.is_some_and(|p| p.last_kernel_started >= seq));
            let live = node.and_then(|n| self.nodes.get(&n)).and_then(|n| n.liveness).unwrap_or(LivenessState::Fresh);
            rs.push(R {
                rank,
                node,
                entered,
                started,
                completed,
                instrumented: prog.is_some(),
                no_source: prog.is_some_and(|p| p.activation_mask & activation::COMPLETION_SOURCES == 0),
                exited: prog.is_some_and(|p| p.proc_state == ProcState::Exited.code()),
                live,
                progress: prog,
                local_op_seq: obs.map_or(0, |o| o.local_op_seq),
                pid: obs.map_or(0, |o| o.pid),
            });
        }
        let any_completed = rs.iter().any(|r| r.completed.is_some());
        let all_completed = rs.iter().all(|r| r.completed.is_some());
        if is_coll && strong(op.op) && any_completed {
            for r in &mut rs {
                r.entered = true; // C1
            }
        }
        // A completed recv proves the send entered (participants are [src, dst]).
        if matches!(key, OpRef::P2p { .. })
            && rs.get(1).is_some_and(|d| d.completed.is_some())
            && let Some(src) = rs.get_mut(0)
        {
            src.entered = true;
        }
        let start = self.clock_start(&op);
        let stuck_at = start.saturating_add(self.stuck_deadline(&op));
        let join_at = start.saturating_add(self.config.join_deadline_ns);
        // Deadlines pass on the participants' watermarks, not on arrival time: a deadline
        // has passed only when every gating node's data up to it is in (so any
        // interleaving of the same records decides the same).
        let rank_nodes: Vec<NodeId> = rs.iter().filter_map(|r| r.node).collect();
        let horizon = rs
            .iter()
            .filter(|r| gates(r.live))
            .map(|r| {
                r.node.and_then(|n| self.nodes.get(&n)).and_then(|v| u64::try_from(v.w_p0_cluster_ns).ok()).unwrap_or(0)
            })
            .min()
            .unwrap_or(now);
        let past_stuck = horizon >= stuck_at;
        let past_join = horizon >= join_at;
        let blocked_root = match key {
            OpRef::Coll { comm, seq } => self.unresolved.get(&comm).copied().filter(|(root, _)| match root {
                OpRef::Coll { seq: r, .. } => *r < seq,
                OpRef::P2p { .. } | OpRef::Graph { .. } => false,
            }),
            OpRef::P2p { .. } | OpRef::Graph { .. } => None,
        };
        let in_gap = rs.iter().any(|r| {
            // A gap of positive length that the op lived through (it was first seen
            // before the gap ended).
            r.node
                .and_then(|n| self.nodes.get(&n))
                .is_some_and(|n| n.knowledge_gaps.iter().any(|&(from, to)| to > from && op.first_seen_ns <= to))
        });

        // Per-rank outcomes.
        let mut outcomes: Vec<Outcome> = Vec::with_capacity(rs.len());
        let mut culprits: Vec<(u32, Option<NodeId>)> = Vec::new();
        for r in &rs {
            // Only this op's own evidence of two processes claiming one rank makes it a
            // key collision: a communicator that once shared its key with another (seen
            // in `collided`) still has ops no one else claimed, judged on their merits
            // (the ground truth scores collisions per (key, comm_op_seq) alike).
            let o = if op.key_collision {
                Outcome::Indeterminate(Indeterminate::KeyCollision)
            } else if let Some(direct) = r.completed {
                if direct { Outcome::Completed } else { Outcome::CompletedInferred }
            } else if is_graph {
                // Graph replays are excluded from ordering and inference: complete when
                // every channel ended, otherwise still running; never not_joined.
                if r.live == LivenessState::Fresh { Outcome::InFlight } else { Outcome::UnknownSilent }
            } else if r.no_source {
                Outcome::Indeterminate(Indeterminate::NoCompletionSource)
            } else if r.live != LivenessState::Fresh {
                Outcome::UnknownSilent
            } else if !r.instrumented && any_completed {
                // No PROGRESS and no completion frame: peers finished, this rank cannot be
                // decided either way.
                Outcome::Indeterminate(Indeterminate::Uninstrumented)
            } else if let Some((root, _)) = blocked_root {
                if !r.entered && r.exited {
                    // The process is gone: it will never join this op either.
                    Outcome::NotJoinedExited
                } else {
                    // An earlier op on this communicator ended unresolved: this one
                    // cannot run.
                    Outcome::BlockedBy(root)
                }
            } else if !r.entered {
                if !past_join && !past_stuck {
                    Outcome::InFlight
                } else if in_gap {
                    Outcome::Indeterminate(Indeterminate::AggregatorGap)
                } else if !r.instrumented {
                    Outcome::Indeterminate(Indeterminate::Uninstrumented)
                } else {
                    // Not joined needs a fresh PROGRESS entry (after the join deadline)
                    // showing the rank behind.
                    let fresh =
                        past_join && r.progress.is_some_and(|p| snapshot_at(&p) >= join_at && p.last_enqueued < seq);
                    if fresh && r.exited {
                        Outcome::NotJoinedExited
                    } else if fresh {
                        Outcome::NotJoined
                    } else {
                        Outcome::InFlight
                    }
                }
            } else if !past_stuck {
                Outcome::InFlight
            } else if in_gap {
                Outcome::Indeterminate(Indeterminate::AggregatorGap)
            } else if !r.instrumented {
                Outcome::Indeterminate(Indeterminate::Uninstrumented)
            } else if any_completed && is_coll {
                // Every peer that could finish did; this rank entered and did not: stuck,
                // once PROGRESS past the deadline still shows last_completed < k.
                let frozen = r.progress.is_some_and(|p| snapshot_at(&p) >= stuck_at && p.last_completed < seq);
                if frozen { Outcome::Stuck } else { Outcome::InFlight }
            } else if r.started {
                // Its kernel started: whatever else the rank has in flight on other
                // streams, it is inside this op, waiting on peers (not blocked by an
                // earlier op).
                Outcome::WaitingOn(None)
            } else if let Some(b) = self.blocked_by(r.node, r.pid, r.local_op_seq, key) {
                Outcome::BlockedBy(b)
            } else {
                Outcome::WaitingOn(None)
            };
            outcomes.push(o);
        }
        // C3(e): the only GPU that never started k while every live peer's did.
        if past_stuck && !any_completed && !in_gap && !op.key_collision {
            let not_started: Vec<usize> = rs
                .iter()
                .enumerate()
                .filter(|(i, r)| {
                    r.entered
                        && !r.started
                        && r.live == LivenessState::Fresh
                        // Behind its own earlier op on this communicator it cannot start
                        // k (a GPU runs a communicator's ops in order): that is the earlier
                        // op's doing, not a stall of its own. Behind an op on another
                        // communicator (another stream) it could have.
                        && match outcomes[*i] {
                            Outcome::WaitingOn(_) => true,
                            Outcome::BlockedBy(b) => b.comm() != comm,
                            _ => false,
                        }
                        && r.progress.is_some_and(|p| snapshot_at(&p) >= stuck_at && p.last_kernel_started < seq)
                })
                .map(|(i, _)| i)
                .collect();
            let others_started = rs
                .iter()
                .enumerate()
                .filter(|(i, _)| !not_started.contains(i))
                .all(|(i, r)| r.started || !matches!(outcomes[i], Outcome::WaitingOn(_) | Outcome::BlockedBy(_)));
            if not_started.len() == 1 && others_started {
                outcomes[not_started[0]] = Outcome::Stuck;
            }
        }
        for (r, o) in rs.iter().zip(&outcomes) {
            if matches!(
                o,
                Outcome::Stuck
                    | Outcome::NotJoined
                    | Outcome::NotJoinedExited
                    | Outcome::UnknownSilent
                    | Outcome::BlockedBy(_)
            ) {
                culprits.push((r.rank, r.node));
            }
        }
        // C3(a) candidates not yet past their join deadline still name the culprit the
        // others wait on (their own outcome stays in flight until the deadline).
        if past_stuck && culprits.is_empty() {
            for (r, o) in rs.iter().zip(outcomes.iter()) {
                let behind = r.progress.is_some_and(|p| snapshot_at(&p) >= stuck_at && p.last_enqueued < seq);
                if matches!(o, Outcome::InFlight) && !r.entered && r.instrumented && behind {
                    culprits.push((r.rank, r.node));
                }
            }
        }
        // A silent node's ranks do not gate (C3c): when a rank with real evidence is a
        // culprit, the others wait on it, whatever a dead node's ranks are doing.
        let silent_rank = |rank: u32| {
            rs.iter().zip(outcomes.iter()).any(|(r, o)| r.rank == rank && matches!(o, Outcome::UnknownSilent))
        };
        let evidenced: Vec<(u32, Option<NodeId>)> = culprits.iter().copied().filter(|c| !silent_rank(c.0)).collect();
        let named = if evidenced.is_empty() { &culprits } else { &evidenced };
        let culprit_nodes: BTreeSet<Option<NodeId>> = named.iter().map(|c| c.1).collect();
        let waiting_on = if culprit_nodes.len() == 1 { named.first().map(|c| c.0) } else { None };
        let decisive = culprits.iter().any(|c| {
            rs.iter().zip(outcomes.iter()).any(|(r, o)| r.rank == c.0 && !matches!(o, Outcome::UnknownSilent))
        });
        for (r, o) in rs.iter().zip(outcomes.iter_mut()) {
            match o {
                Outcome::WaitingOn(w) => *w = waiting_on,
                // C4: once a culprit is identified, ranks that entered wait on it.
                Outcome::InFlight if decisive && r.entered && waiting_on.is_some() => {
                    *o = Outcome::WaitingOn(waiting_on)
                }
                _ => {}
            }
        }

        // Decision time and finality. A decision resting on evidence with no frame time of
        // its own (an inference from PROGRESS or a later op, an undecidable rank) is dated
        // when these outcomes were first reached, and keeps that date while they hold: the
        // evidence arrived by then, so once every gating watermark passes that date (+ the
        // reorder timeout) any frame stamped before the evidence is in — a completion frame
        // overtaken by a PROGRESS entry or a later op cannot turn up after finality.
        let same_as_before = op.decided_now_ns != 0
            && rs.iter().zip(&outcomes).all(|(r, o)| {
                op.slot(r.rank)
                    .and_then(|i| op.verdicts.get(i))
                    .and_then(Option::as_ref)
                    .is_some_and(|v| v.outcome == *o)
            });
        let decided_now = if same_as_before { op.decided_now_ns } else { now };
        let last_completion = op
            .observed()
            .filter(|o| o.completed.is_some())
            .map(|o| o.completed_cluster_ns)
            .max()
            .and_then(|t| u64::try_from(t).ok());
        let any_inferred = rs.iter().any(|r| r.completed == Some(false));
        // The latest frame this op's decision can rest on.
        let latest_frame = op
            .observed()
            .map(|o| o.enqueued_cluster_ns.max(o.started_cluster_ns).max(o.first_cluster_ns))
            .max()
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0);
        // Ranks that will never say more: completed, or undecidable for good. A rank
        // without PROGRESS only when the cluster's size is known and every node's data is
        // in past the decision: otherwise it looks the same as a rank of a node that has
        // not connected yet (CI saw a late node's ranks go final as `uninstrumented`).
        // Not a rank on an unreachable node: under a CPU hog a live node's connection
        // closed, it was unreachable for a moment, and a hung op's verdicts went final as
        // `unknown_silent` for it. Those wait for the stuck deadline.
        // With the cluster's size known, a rank without PROGRESS settles once every node's
        // watermark has passed the decision (see `MatcherConfig::expected_nodes`).
        let expected = usize::try_from(self.config.expected_nodes).unwrap_or(usize::MAX);
        let quiet = |o: &Outcome| expected > 0 && matches!(o, Outcome::Indeterminate(Indeterminate::Uninstrumented));
        let settled_rank = |r: &R, o: &Outcome| {
            r.completed.is_some()
                || quiet(o)
                || matches!(o, Outcome::Indeterminate(Indeterminate::NoCompletionSource | Indeterminate::KeyCollision))
        };
        let every_node_in = || {
            let at = last_completion.map_or(decided_now, |t| t.max(decided_now));
            let need = i64::try_from(at.saturating_add(self.config.reorder_timeout_ns)).unwrap_or(i64::MAX);
            self.nodes.values().filter(|v| v.w_p0_cluster_ns >= need).count() >= expected
        };
        let resolved = !all_completed
            && rs.iter().zip(&outcomes).all(|(r, o)| settled_rank(r, o))
            && (!outcomes.iter().any(quiet) || every_node_in());
        let decided_at = if all_completed && !any_inferred {
            last_completion.map_or(decided_now, |t| t.min(decided_now))
        } else if all_completed || resolved {
            last_completion.map_or(decided_now, |t| t.max(decided_now))
        } else if past_stuck {
            // Never before the latest frame the decision rests on: a rank paused past the
            // deadline that then enqueues and starts k makes every rank "started, waiting"
            // at that moment, and its completion follows milliseconds later — dated at the
            // deadline, the decision was final before that completion could arrive (a
            // checkpoint pause at 1x: `waiting_on(unknown)` final, every later op
            // `blocked_by` it). A state known from PROGRESS alone is dated when reached.
            let progress_only = rs.iter().any(|r| {
                let obs = op.slot(r.rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present);
                (r.entered && obs.is_none_or(|o| o.entered.is_none() && o.started.is_none()))
                    || (r.started && obs.is_none_or(|o| o.started.is_none()))
            });
            if progress_only { decided_now } else { stuck_at.max(latest_frame).min(decided_now) }
        } else if decisive && past_join {
            join_at.min(decided_now)
        } else if let Some((_, root_decided)) = blocked_root {
            // Never before this op's own frames: the root's culprit participates here
            // too, so once its node's watermark passes them, a recovery of the root
            // stamped before them is in (and lifted the block) — an op entered after a
            // paused GPU came back is not called blocked by the pause.
            root_decided.max(latest_frame).min(decided_now)
        } else {
            decided_now
        };
        let gating: Vec<NodeId> = rs.iter().filter(|r| gates(r.live)).filter_map(|r| r.node).collect();
        let need = i64::try_from(decided_at.saturating_add(self.config.reorder_timeout_ns)).unwrap_or(i64::MAX);
        let settled = |m: &Self| gating.iter().all(|n| m.nodes.get(n).is_some_and(|v| v.w_p0_cluster_ns >= need));
        let terminal = all_completed || outcomes.iter().all(|o| !matches!(o, Outcome::InFlight));
        let is_final = terminal
            && settled(self)
            && (all_completed || resolved || past_stuck || decisive || blocked_root.is_some());

        // Durations of completed ops feed the stuck deadline: kernel start to end on
        // each rank's own clock (never across clocks), the longest rank.
        if all_completed && is_coll {
            let d = op
                .observed()
                .filter(|o| o.started_node_ns > 0 && o.completed_node_ns > o.started_node_ns)
                .map(|o| o.completed_node_ns.saturating_sub(o.started_node_ns))
                .max();
            if let Some(d) = d {
                let w = self.durations.entry((comm, op.op, size_bucket(op.count))).or_default();
                if w.len() >= self.config.duration_window {
                    w.remove(0);
                }
                w.push(d);
            }
        }

        // Stragglers: once per op, when it is final and every rank completed.
        let mut stragglers: BTreeMap<u32, VerdictTag> = BTreeMap::new();
        if is_final && all_completed && is_coll && strong(op.op) {
            self.learn_residuals(&op);
        }
        if is_final && all_completed && is_coll {
            // Where each rank's kernel started, relative to a common reference, with the
            // reference's uncertainty. A strong collective ends at one moment on every
            // rank (its last step needs everyone), so its own end is the reference: a
            // rank's start measured back from its end on its own clock, no cross-node
            // clock in it (ε 0: under a CPU hog the heartbeat estimate's ε grew past a
            // 200 ms lag, and a GPU-side straggler went untagged). Other collectives:
            // kernel starts on one cluster clock, each node's residual correction
            // (learned from strong collectives' completions) applied, ± ε.
            let same_clock = strong(op.op);
            let per_rank: Vec<(u32, i64, i64, u64)> = rs
                .iter()
                .filter_map(|r| {
                    let o = op.slot(r.rank).and_then(|i| op.ranks.get(i))?;
                    if same_clock {
                        if o.completed.is_none() || o.started_node_ns == 0 || o.completed_node_ns < o.started_node_ns {
                            return None;
                        }
                        let start =
                            i64::try_from(o.completed_node_ns.saturating_sub(o.started_node_ns)).ok()?.saturating_neg();
                        let host_gap = if o.enqueued_cluster_ns != 0 {
                            o.enqueued_cluster_ns.saturating_sub(o.started_cluster_ns)
                        } else {
                            0
                        };
                        return Some((r.rank, start, start.saturating_add(host_gap), 0));
                    }
                    if o.started_cluster_ns == 0 {
                        return None;
                    }
                    let c = o.node.map_or(0, |n| self.correction_ns(n));
                    let eps = r.node.map_or(u64::MAX / 8, |n| self.epsilon_ns(n));
                    Some((r.rank, o.started_cluster_ns.saturating_sub(c), o.enqueued_cluster_ns.saturating_sub(c), eps))
                })
                .collect();
            let mut starts: Vec<i64> = per_rank.iter().map(|x| x.1).collect();
            if starts.len() >= 3 {
                starts.sort_unstable();
                let median = starts[starts.len() / 2];
                let eps_max = per_rank.iter().map(|x| x.3).max();
                for &(rank, start, enqueued, eps_a) in &per_rank {
                    let bound = self.config.straggler_threshold_ns.max(3u64.saturating_mul(
                        eps_a.min(u64::MAX / 8).saturating_add(eps_max.unwrap_or(0).min(u64::MAX / 8)),
                    ));
                    let lag = start.saturating_sub(median);
                    let lagging = lag > i64::try_from(bound).unwrap_or(i64::MAX);
                    // Host-side when the rank's own enqueue was already late by most of
                    // the lag (the GPU started as soon as the host let it).
                    let host = enqueued.saturating_sub(median) > lag / 2;
                    let h = self.lag_history.entry(RankKey { comm, rank }).or_default();
                    if h.len() >= 5 {
                        h.remove(0);
                    }
                    h.push((lagging, host));
                    let lagging_count = h.iter().filter(|x| x.0).count();
                    if lagging && lagging_count >= 3 {
                        let host_count = h.iter().filter(|x| x.0 && x.1).count();
                        stragglers.insert(
                            rank,
                            VerdictTag::Straggler {
                                lag_ns: lag,
                                bound_ns: bound,
                                host: host_count.saturating_mul(2) >= lagging_count,
                            },
                        );
                    }
                }
            }
        }

        // Emit changes.
        let reference = op.observed().find(|x| x.op == op.op).cloned();
        let reference = reference.as_ref();
        let mut new_verdicts = std::mem::take(&mut op.verdicts);
        new_verdicts.resize(op.participants.len(), None);
        let mut events = Vec::new();
        for (r, o) in rs.iter().zip(outcomes.iter()) {
            let mut tags = Vec::new();
            if let Some(n) = r.node.and_then(|n| self.nodes.get(&n))
                && matches!(o, Outcome::CompletedInferred | Outcome::EnteredInferred)
            {
                // The window where the missing record would have been emitted: around
                // this op's frames from the same node, or the node's latest losses when
                // none of them arrived.
                let same_node: Vec<&RankObs> = op.observed().filter(|x| x.node == r.node).collect();
                let ids: Vec<u64> = if same_node.is_empty() {
                    n.p0_losses.iter().rev().take(16).map(|l| l.0).collect()
                } else {
                    let lo = same_node.iter().map(|x| x.first_node_ns).min().unwrap_or(0).saturating_sub(5_000_000_000);
                    let hi = same_node.iter().map(|x| x.last_node_ns).max().unwrap_or(0).saturating_add(5_000_000_000);
                    n.p0_losses.iter().filter(|l| l.1 <= hi && l.2 >= lo).map(|l| l.0).collect()
                };
                if !ids.is_empty() {
                    tags.push(VerdictTag::TelemetryLoss { ids });
                }
            }
            if in_gap {
                tags.push(VerdictTag::AggregatorGap);
            }
            if is_graph {
                tags.push(VerdictTag::GraphCaptured);
            }
            if let Some(t) = stragglers.get(&r.rank) {
                tags.push(t.clone());
            }
            if let Some(obs) = op.slot(r.rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present)
                && let Some(refo) = reference
            {
                {
                    // A P2P op's two sides legitimately differ: one is the send, the other
                    // the recv (issue 11: every real P2P pair was tagged a mismatch).
                    if obs.op != refo.op && !matches!(op.key, OpRef::P2p { .. }) {
                        tags.push(VerdictTag::Mismatch { field: "op".into() });
                    } else if obs.dtype != refo.dtype {
                        tags.push(VerdictTag::Mismatch { field: "dtype".into() });
                    } else if obs.count != refo.count
                        // fr_trace: all_to_allv sizes are undecided; gather/scatter roots
                        // legitimately move a different amount than the other ranks.
                        && !matches!(Op::from_code(op.op), Op::AllToAllv | Op::Gather | Op::Scatter)
                    {
                        tags.push(VerdictTag::Mismatch { field: "count".into() });
                    }
                }
            }
            let slot = op.slot(r.rank).unwrap_or(0);
            let prev = new_verdicts.get(slot).cloned().flatten();
            let changed = prev.as_ref().is_none_or(|p| p.outcome != *o || p.tags != tags || (!p.is_final && is_final));
            if !changed {
                continue;
            }
            // Kept in state, emitted only when it says something: final verdicts, and
            // non-final ones that are neither in flight nor a plain completion.
            let emit = is_final || !matches!(o, Outcome::InFlight | Outcome::Completed);
            let mut revision = prev.as_ref().map_or(0, |p| p.revision);
            if let Some(p) = &prev
                && p.outcome != *o
            {
                if p.is_final {
                    self.stats.revisions_after_final.inc();
                } else if is_decision(&p.outcome) {
                    // A decided outcome changed before it became final. Waiting states
                    // (in flight, waiting on, blocked by) evolving are not revisions.
                    revision = revision.saturating_add(1);
                    self.stats.revisions_before_final.inc();
                }
            }
            if let Some(v) = new_verdicts.get_mut(slot) {
                *v = Some(RankVerdict { outcome: *o, tags: tags.clone(), is_final, revision });
            }
            let gpu_uuid = r.progress.map_or([0; 16], |p| p.gpu_uuid);
            let mut evidence = Evidence::default();
            if let Some(obs) = op.slot(r.rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present) {
                evidence.frames.extend([obs.entered, obs.started, obs.completed].into_iter().flatten());
            }
            if let Some(p) = r.progress {
                evidence.progress.push(ProgressRef {
                    node: p.node.unwrap_or(NodeId(0)),
                    rank: r.rank,
                    last_enqueued_op: p.last_enqueued,
                    last_kernel_started_op: p.last_kernel_started,
                    last_completed_op: p.last_completed,
                    snapshot_cluster_ns: p.snapshot_cluster_ns,
                });
            }
            for t in &tags {
                if let VerdictTag::TelemetryLoss { ids } = t {
                    evidence.loss_intervals.extend(ids);
                }
            }
            if let Some(n) = r.node.and_then(|n| self.nodes.get(&n).map(|v| (n, v.w_p0_cluster_ns))) {
                evidence.watermarks.push(n);
            }
            evidence.rule = rule_for(o);
            if let Some(node) = r.node {
                let f = self.gpu_flags.entry((node, gpu_uuid)).or_default();
                let gpu_straggler = tags.iter().any(|t| matches!(t, VerdictTag::Straggler { host: false, .. }));
                match o {
                    Outcome::Stuck if is_final => f.0 = now,
                    _ if is_final && gpu_straggler => f.0 = now,
                    Outcome::NotJoined | Outcome::NotJoinedExited if is_final => f.1 = now,
                    Outcome::WaitingOn(None) if is_final => f.1 = now,
                    // Only a final inference: one revised to `completed` when the late frame
                    // arrived was no loss after all.
                    Outcome::CompletedInferred if is_final && !tags.is_empty() => f.2 = now,
                    _ => {}
                }
            }
            if !emit {
                continue;
            }
            events.push(MatcherEvent::Verdict(Verdict {
                op: key,
                rank: r.rank,
                node: r.node,
                gpu_uuid,
                outcome: *o,
                tags,
                is_final,
                decided_at_ns: decided_at,
                evidence,
                revision,
            }));
        }
        self.out.extend(events);
        if is_final {
            self.deadlines.remove(&(op.due_ns, key));
            self.stats.ops_final.inc();
            self.final_recent.insert(key);
            self.final_order.push(key);
            if self.final_order.len() > 2 * FINAL_MEMORY {
                for old in self.final_order.drain(..FINAL_MEMORY) {
                    self.final_recent.remove(&old);
                }
            }
            let stuck: BTreeMap<u32, u64> = rs
                .iter()
                .zip(outcomes.iter())
                .filter(|(_, o)| matches!(o, Outcome::Stuck))
                .map(|(r, _)| (r.rank, now))
                .collect();
            let unresolved = !all_completed
                && outcomes.iter().any(|o| {
                    matches!(o, Outcome::Stuck | Outcome::NotJoined | Outcome::NotJoinedExited | Outcome::WaitingOn(_))
                });
            if unresolved && let OpRef::Coll { comm, .. } = key {
                self.unresolved.entry(comm).or_insert((key, decided_at));
                if let Some(open) = self.open_by_comm.get(&comm) {
                    self.dirty.extend(open.iter().map(|&seq| OpRef::Coll { comm, seq }));
                }
            }
            if !stuck.is_empty() {
                self.final_stuck.insert(key, stuck);
                while self.final_stuck.len() > RECOVERABLE_CAP {
                    self.final_stuck.pop_first();
                    self.stats.final_stuck_evicted.inc();
                }
            }
            let unfinished: BTreeMap<u32, Unfinished> = rs
                .iter()
                .zip(outcomes.iter())
                .filter(|(_, o)| {
                    matches!(o, Outcome::Stuck | Outcome::WaitingOn(_) | Outcome::BlockedBy(_) | Outcome::NotJoined)
                })
                .map(|(r, o)| {
                    let gpu_uuid = r.progress.map_or([0; 16], |p| p.gpu_uuid);
                    (r.rank, Unfinished { final_at_ns: now, stuck: matches!(o, Outcome::Stuck), gpu_uuid })
                })
                .collect();
            if !unfinished.is_empty() {
                self.recoverable_ranks = self.recoverable_ranks.saturating_add(unfinished.len());
                if let Some(old) = self.recoverable.insert(key, unfinished) {
                    self.recoverable_ranks = self.recoverable_ranks.saturating_sub(old.len());
                }
                while self.recoverable.len() > RECOVERABLE_CAP || self.recoverable_ranks > RECOVERABLE_RANKS_CAP {
                    // Forget the op that became final longest ago — a communicator's
                    // blocking root last (its recovery is what unblocks the communicator).
                    let roots: BTreeSet<OpRef> = self.unresolved.values().map(|r| r.0).collect();
                    let oldest = self
                        .recoverable
                        .iter()
                        .min_by_key(|(k, w)| (roots.contains(k), w.values().map(|u| u.final_at_ns).min().unwrap_or(0)))
                        .map(|(k, _)| *k);
                    let Some(k) = oldest else { break };
                    if let Some(w) = self.recoverable.remove(&k) {
                        self.recoverable_ranks = self.recoverable_ranks.saturating_sub(w.len());
                    }
                    self.stats.recoverable_evicted.inc();
                }
            }
            if let OpRef::Coll { comm, seq } = key
                && let Some(open) = self.open_by_comm.get_mut(&comm)
            {
                open.remove(&seq);
                if open.is_empty() {
                    self.open_by_comm.remove(&comm);
                }
            }
            // The next op's clock starts now.
            if let OpRef::Coll { comm, seq } = key {
                // k + 1 became the oldest unfinished op when k completed, not when the
                // verdict on k became final.
                let e = self.comm_done.entry(comm).or_insert((0, 0));
                if seq > e.0 {
                    *e = (seq, decided_at);
                }
                self.dirty.insert(OpRef::Coll { comm, seq: seq.saturating_add(1) });
            }
        } else {
            let mut o = op;
            // A rank known only from PROGRESS (a hung rank often is) still gates: its
            // node's watermark and liveness must wake the op.
            for n in rank_nodes {
                if !o.nodes.contains(&n) {
                    o.nodes.push(n);
                }
            }
            o.verdicts = new_verdicts;
            o.decided_at_ns = decided_at;
            o.decided_now_ns = decided_now;
            let due = if past_stuck {
                now.saturating_add(self.config.reorder_timeout_ns)
            } else {
                // The nearest deadline still ahead; one already passed by arrival time but
                // not yet by the watermarks is looked at again shortly (and whenever a
                // watermark of the op's nodes moves) — never at a time already past, which
                // re-inserted the op at `now` on every evaluation and spun the timer
                // (found by the issue 18 overflow test, watermarks held back).
                [stuck_at, join_at]
                    .into_iter()
                    .filter(|&d| d > now)
                    .min()
                    .unwrap_or_else(|| now.saturating_add(WATERMARK_RECHECK_NS.min(self.config.reorder_timeout_ns)))
            };
            if o.due_ns != due {
                self.deadlines.remove(&(o.due_ns, key));
                o.due_ns = 0;
                if due != u64::MAX {
                    self.deadlines.insert((due, key));
                    o.due_ns = due;
                }
            }
            self.ops.insert(key, o);
        }
    }

    /// Cluster-time refinement: in a strong collective every rank finishes at the same
    /// moment (the last step needs everyone), so each node's completion residual against
    /// the median of the nodes is its clock error left over by the heartbeat estimate.
    fn learn_residuals(&mut self, op: &OpState) {
        let mut per_node: BTreeMap<NodeId, i64> = BTreeMap::new();
        for o in op.observed().filter(|o| o.completed.is_some() && o.completed_cluster_ns != 0) {
            if let Some(n) = o.node {
                let e = per_node.entry(n).or_insert(o.completed_cluster_ns);
                *e = (*e).min(o.completed_cluster_ns);
            }
        }
        if per_node.len() < 3 {
            return;
        }
        let mut ends: Vec<i64> = per_node.values().copied().collect();
        ends.sort_unstable();
        let median = ends[ends.len() / 2];
        for (n, end) in per_node {
            let v = self.node_view(n);
            if v.residuals.len() >= 32 {
                v.residuals.remove(0);
            }
            v.residuals.push(end.saturating_sub(median));
            let mut r = v.residuals.clone();
            r.sort_unstable();
            v.correction_ns = r.get(r.len() / 2).copied().unwrap_or(0);
            let mut dev: Vec<u64> = v.residuals.iter().map(|x| x.abs_diff(v.correction_ns)).collect();
            dev.sort_unstable();
            v.residual_spread_ns = dev.get(dev.len().saturating_mul(9) / 10).copied().unwrap_or(0);
        }
    }

    /// A node's learned clock correction (median completion residual; 0 before any).
    fn correction_ns(&self, node: NodeId) -> i64 {
        self.nodes.get(&node).map_or(0, |v| v.correction_ns)
    }

    /// A node's cluster-time uncertainty: the heartbeat estimate's ε, narrowed by the
    /// residuals' spread once at least 5 strong collectives refined it.
    fn epsilon_ns(&self, node: NodeId) -> u64 {
        let Some(v) = self.nodes.get(&node) else { return u64::MAX / 8 };
        if v.residuals.len() < 5 {
            return v.epsilon_ns;
        }
        v.epsilon_ns.min(v.residual_spread_ns.saturating_add(1_000_000))
    }

    fn blocked_by(&self, node: Option<NodeId>, pid: u32, local_op_seq: u64, me: OpRef) -> Option<OpRef> {
        let proc_ops = self.rank_ops.get(&ProcKey { node: node?, pid })?;
        proc_ops
            .ops
            .range(..local_op_seq)
            .find(|(_, (k, done))| !done && *k != me && (self.ops.contains_key(k) || self.final_stuck.contains_key(k)))
            .map(|(_, (k, _))| *k)
    }
}

/// When a PROGRESS entry was snapshotted, cluster time (arrival time before the node's
/// clock was estimated).
fn snapshot_at(p: &ProgressView) -> u64 {
    u64::try_from(p.snapshot_cluster_ns).ok().filter(|&t| t > 0).unwrap_or(p.received_at_ns)
}

/// Outcomes that decide something (as opposed to waiting states that evolve).
fn is_decision(o: &Outcome) -> bool {
    matches!(
        o,
        Outcome::Completed
            | Outcome::CompletedInferred
            | Outcome::Stuck
            | Outcome::NotJoined
            | Outcome::NotJoinedExited
            | Outcome::Indeterminate(_)
    )
}

fn rule_for(o: &Outcome) -> Rule {
    match o {
        Outcome::Completed => Rule::CompletionFrame,
        Outcome::CompletedInferred => Rule::CompletionInferred,
        Outcome::EnteredInferred => Rule::EnteredByPeer,
        Outcome::InFlight => Rule::Pending,
        Outcome::WaitingOn(Some(_)) => Rule::WaitingOnCulprit,
        Outcome::WaitingOn(None) => Rule::HungNoCulprit,
        Outcome::NotJoined => Rule::NotJoined,
        Outcome::NotJoinedExited => Rule::ProcessExited,
        Outcome::Stuck => Rule::Stuck,
        Outcome::BlockedBy(_) => Rule::BlockedBy,
        Outcome::UnknownSilent => Rule::Silent,
        Outcome::Indeterminate(_) => Rule::Indeterminate,
    }
}
