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
//! Rules (docs/design.md, "Collectives: keys, phases, verdicts"):
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
//!   unreachable node (`unknown_silent`; a silent node's watermark still gates, and an
//!   unreachable one gates finality until it is back or presumed dead —
//!   `MatcherConfig::dead_after_ns` — so such a verdict is final only then); (e) the only GPU that never
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

/// Matcher configuration (the timers of docs/design.md).
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
    /// How long a final op is remembered so that a late frame for it is counted
    /// (`late_frames_after_final`) and ignored, never the seed of a new op (at most
    /// 65,536 ops, oldest forgotten first).
    pub final_memory_ns: u64,
    /// How long an unreachable node still gates finality (aggregator time, from when it
    /// became unreachable). Its ranks are `unknown_silent` at once, but final only when
    /// it comes back and its watermark passes, or once it has been unreachable this
    /// long (presumed dead): a live node cut off by a partition longer than the
    /// connection's idle timeout resends its spooled P0 frames when it is back, and its
    /// ranks' `unknown_silent` must not be final before then.
    pub dead_after_ns: u64,
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
            final_memory_ns: 600_000_000_000,
            dead_after_ns: 300_000_000_000,
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
    /// Final unresolved ranks (stuck, waiting, blocked, not joined, unknown_silent) whose
    /// completion arrived after all: a `Recovered` event each.
    pub recovered: u64,
    /// Nodes unreachable for `dead_after_ns`: presumed dead, they stopped gating
    /// finality (counted each time).
    pub nodes_presumed_dead: u64,
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

mod bounds;
mod classify;
mod clock;
pub mod derived;
mod emit;
mod evaluate;
mod finality;
mod health;
mod state;

pub use derived::Derived;
use health::GpuEvidence;
pub use health::Health;
pub use state::Homes;
use state::*;

/// The widest `comm_op_seq` gap filled with inferred ops at once (a hostile or broken
/// peer must not make the matcher create unbounded state).
pub const MAX_SEQ_GAP_OPS: u64 = 256;

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
    /// Ops to evaluate at the next `handle_timeout` (each once: `OpState::dirty`).
    dirty: Vec<OpRef>,
    /// (due, op) re-evaluations at deadlines.
    deadlines: BTreeSet<(u64, OpRef)>,
    /// (when presumed dead, node) of unreachable nodes (one each: `NodeView::dead_at_ns`);
    /// at most `max_nodes` plus views evicted within `dead_after_ns`.
    dead_due: BTreeSet<(u64, NodeId)>,
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
    /// not joined. A B-tree, not a hash set: it turns over its whole content every
    /// `final_memory_ns`, and a hash table under that churn doubled once, late (its
    /// tombstones filled it while it held more than half its buckets' worth): a step of
    /// ~0.4 MB in the aggregator's RSS minutes into a steady run. Looked up only when a
    /// frame names an op not in flight.
    final_recent: BTreeSet<OpRef>,
    /// (when final, op), oldest first from `final_head`.
    final_order: Vec<(u64, OpRef)>,
    final_head: usize,
    /// (comm, rank) → the last 5 instances: (lagging beyond the bound, host-side).
    lag_history: FxMap<RankKey, Vec<Lag>>,
    /// Latest verdict per (node, gpu) that drives health: (degraded evidence, suspect).
    gpu_flags: BTreeMap<(NodeId, [u8; 16]), GpuEvidence>,
    stats: MatcherStats,
    /// Loss-aware figures of final collectives (not in snapshots: figures of this
    /// process, like the ingest's end-to-end latency).
    #[rkyv(with = rkyv::with::Skip)]
    derived: Derived,
    out: crate::outbox::Outbox<MatcherEvent>,
}

/// Marks `key` for evaluation at the next `handle_timeout` (once, and only an op that
/// exists: a key with no op has nothing to evaluate).
fn mark(ops: &mut FxMap<OpRef, OpState>, dirty: &mut Vec<OpRef>, key: OpRef) {
    if let Some(o) = ops.get_mut(&key)
        && !o.dirty
    {
        o.dirty = true;
        dirty.push(key);
    }
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
            dirty: Vec::new(),
            deadlines: BTreeSet::new(),
            dead_due: BTreeSet::new(),
            durations: BTreeMap::new(),
            comm_done: BTreeMap::new(),
            seen_through: FxMap::default(),
            unresolved: BTreeMap::new(),
            homes: FxMap::default(),
            lag_history: FxMap::default(),
            final_recent: BTreeSet::new(),
            final_order: Vec::new(),
            final_head: 0,
            groups_done: FxSet::default(),
            collided: BTreeSet::new(),
            final_stuck: BTreeMap::new(),
            recoverable: BTreeMap::new(),
            recoverable_ranks: 0,
            gpu_flags: BTreeMap::new(),
            stats: MatcherStats::default(),
            derived: Derived::default(),
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

    /// Loss-aware figures of the collectives that became final (see [`derived`]).
    #[must_use]
    pub fn derived(&self) -> &Derived {
        &self.derived
    }

    /// Its configuration.
    #[must_use]
    pub fn config(&self) -> &MatcherConfig {
        &self.config
    }

    /// Takes another configuration (a restored matcher, this run's flags): timers and caps
    /// apply from the next record or timeout; maps past a lowered cap shrink at the next
    /// sweep, counted. An unreachable node's presumed death stays where it was set.
    pub fn reconfigure(&mut self, config: MatcherConfig) {
        self.config = config;
    }

    /// Ops not yet final.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.ops.len()
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
        let op = self.deadlines.iter().next().map(|d| d.0);
        let node = self.dead_due.iter().next().map(|d| d.0);
        match (op, node) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
                    for &seq in open.range(..=hi) {
                        mark(&mut self.ops, &mut self.dirty, OpRef::Coll { comm: p.comm, seq });
                    }
                }
            }
            Record::Watermark(w) if w.class == 0 => {
                let n = self.node_view(w.node);
                n.w_p0_cluster_ns = n.w_p0_cluster_ns.max(w.cluster_ns);
                n.epsilon_ns = w.epsilon_ns;
                let wm = n.w_p0_cluster_ns;
                self.mark_node_watermark(w.node, wm);
            }
            Record::Liveness(l) => {
                let dead_after = self.config.dead_after_ns;
                let n = self.node_view(l.node);
                let was = n.liveness;
                n.liveness = Some(l.state);
                let old_due = n.dead_at_ns;
                if l.state != LivenessState::Unreachable {
                    n.dead_at_ns = 0;
                } else if was != Some(LivenessState::Unreachable) {
                    n.dead_at_ns = now.saturating_add(dead_after).max(1);
                }
                let new_due = n.dead_at_ns;
                if old_due != new_due {
                    self.dead_due.remove(&(old_due, l.node));
                    if new_due != 0 {
                        self.dead_due.insert((new_due, l.node));
                    }
                }
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
        // Unreachable nodes presumed dead stop gating finality: their ops look again.
        while let Some(&(due, node)) = self.dead_due.iter().next() {
            if due > now {
                break;
            }
            self.dead_due.remove(&(due, node));
            if self.nodes.get(&node).is_some_and(|v| v.dead_at_ns == due) {
                self.stats.nodes_presumed_dead.inc();
                self.mark_node_dirty(node);
            }
        }
        while let Some(&(due, op)) = self.deadlines.iter().next() {
            if due > now {
                break;
            }
            self.deadlines.remove(&(due, op));
            if let Some(o) = self.ops.get_mut(&op) {
                o.due_ns = 0;
            }
            mark(&mut self.ops, &mut self.dirty, op);
        }
        // Sorted, so evaluation (and so event) order does not depend on hashing.
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        // An op evicted while listed and created again can be listed twice.
        dirty.dedup();
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
        for (k, o) in &mut self.ops {
            if !o.dirty && o.nodes.contains(&node) {
                o.dirty = true;
                self.dirty.push(*k);
            }
        }
    }

    /// A P0 watermark of `node` moved to `w`: its open ops whose evaluation it can change
    /// (`OpState::wake_w`) are evaluated again.
    fn mark_node_watermark(&mut self, node: NodeId, w: i64) {
        for (k, o) in &mut self.ops {
            if !o.dirty && w >= o.wake_w && o.nodes.contains(&node) {
                o.dirty = true;
                self.dirty.push(*k);
            }
        }
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
        // Only a change of what the rank proved makes the op worth evaluating again.
        if (!was_present || completed != was_completed || started != was_started) && !op.dirty {
            op.dirty = true;
            self.dirty.push(key);
        }
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
            proc_ops.note(l.local_op_seq, key, completed);
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
            for (k, o) in &mut self.ops {
                if !o.dirty && o.observed().any(|x| x.group_id == l.group_id && x.pid == l.pid && x.node == Some(node))
                {
                    o.dirty = true;
                    self.dirty.push(*k);
                }
            }
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
                f.degraded_at_ns = f.degraded_at_ns.max(now);
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
                    for &seq in open {
                        mark(&mut self.ops, &mut self.dirty, OpRef::Coll { comm, seq });
                    }
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
            op.dirty = true;
            self.ops.insert(key, op);
            self.open_by_comm.entry(comm).or_default().insert(k);
            self.dirty.push(key);
            self.stats.ops_created.inc();
            self.stats.ops_inferred_from_seq_gap.inc();
        }
    }
}
