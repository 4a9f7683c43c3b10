//! `Ingest`: validated batches in, records out — sequence accounting, watermarks,
//! liveness, clocks and the aggregator's own knowledge gaps for every node.
//!
//! The matcher never sees a batch: [`Ingest::handle_batch`] is the one function that
//! turns a decoded batch into [`Record`]s.
//!
//! Method groups and call order (quinn-proto's `Connection` is the model):
//! - getters: [`Ingest::tracker`], [`Ingest::node`], [`Ingest::stats`];
//! - checks: [`Ingest::check_batch`] and [`Ingest::check_resume`] ([`crate::plausible`],
//!   counted) before a batch or a resume is applied — `Core` calls them;
//! - inputs: [`Ingest::handle_batch`] (a batch that passed `BatchView::parse`,
//!   `validate` and [`Ingest::check_batch`]), [`Ingest::handle_connection_closed`], [`Ingest::handle_timeout`];
//! - outputs: [`Ingest::poll_record`] until `None`, then [`Ingest::poll_timeout`] for
//!   the next time to call `handle_timeout`.
//!
//! Time is always an argument (`now`, aggregator ns); nothing here reads a clock.
//!
//! Invariants:
//! - a P0 frame yields exactly one `Lifecycle` record; bulk frames yield none;
//! - a node's watermark for a class never moves back, and never passes a pending gap of
//!   any stream of that class in the current epoch;
//! - memory is bounded: `max_nodes`, `max_streams_per_node`, per-tracker gap caps; what a
//!   cap turns away is counted in [`IngestStats`].

use std::collections::{BTreeMap, HashMap};

use proto_flat::Frame;
use proto_flat::batch::BatchView;
use proto_flat::codes::{Class, LossCause, WireEnum};
use proto_flat::sections::{OWNER_CONTAINER, OWNER_POD, OWNER_SLURM_JOB, OwnerEntry, ProgressEntry, Section};
use rkyv::{Archive, Deserialize, Serialize};

use crate::clock::ClockEstimate;
use crate::dedup::{BatchDedup, DedupConfig};
use crate::loss::{HeartbeatCounters, SeqTracker, TrackerLimits};
use crate::plausible::{self, Implausible};
use crate::records::{
    Comm, EpochChange, KnowledgeGap, Lifecycle, LifecycleKind, Liveness, LivenessState, LossInterval, NodeId, Progress,
    Record, ShipperGap, StreamKey, Watermark,
};
use crate::tally::Tally;

/// Configuration (timer defaults from docs/design.md, "Timers").
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestConfig {
    /// Settlement delay after a heartbeat (docs/design.md: 500 ms).
    pub reorder_timeout_ns: u64,
    /// Silent after this long without frames or heartbeats (NCCL RAS warns at 5 s).
    pub silent_ns: u64,
    /// Unreachable after this long (RAS: dead at 60 s), or when the connection closes.
    pub unreachable_ns: u64,
    pub max_nodes: usize,
    /// Streams per node in its open epochs (trackers of closed epochs do not count).
    pub max_streams_per_node: usize,
    /// Closed epochs whose trackers are kept per node (late frames of them still revive
    /// what their close declared lost); older ones are summarised into
    /// [`NodeState::retired`] and dropped (`IngestStats::trackers_retired`).
    pub closed_epochs_kept: usize,
    pub tracker: TrackerLimits,
    /// Batch dedup limits.
    pub dedup: DedupConfig,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            reorder_timeout_ns: 500_000_000,
            silent_ns: 5_000_000_000,
            unreachable_ns: 60_000_000_000,
            max_nodes: 4096,
            // 2 rings × 256 CPUs × 2 + the shipper's own streams, with room.
            max_streams_per_node: 2048,
            closed_epochs_kept: 2,
            tracker: TrackerLimits::default(),
            dedup: DedupConfig::default(),
        }
    }
}

/// What ingest counted (the aggregator shows it at `/v1/ingest`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IngestStats {
    pub batches: u64,
    pub frames: u64,
    pub lifecycle_records: u64,
    pub unknown_frames: u64,
    pub malformed_frames: u64,
    /// Frames of an epoch already closed.
    pub stale_epoch_frames: u64,
    /// Frames of streams refused by `max_streams_per_node`.
    pub streams_refused_frames: u64,
    /// Batches of nodes refused by `max_nodes`.
    pub nodes_refused_batches: u64,
    pub loss_intervals: u64,
    /// Frames already received (retransmitted or duplicated batches), dropped.
    pub duplicate_frames: u64,
    /// Streams a shipper's resume showed this instance had missed part of (another
    /// instance received it: a restart).
    pub resume_windows: u64,
    /// Resume stream entries beyond `max_streams_per_node` or of a closed epoch.
    pub resume_streams_refused: u64,
    /// Heartbeats written before their connection's `resume` (they waited in the
    /// shipper's spool), not taken as clock samples.
    pub clock_samples_stale: u64,
    /// Batches refused whole for a field no real shipper sends ([`crate::plausible`]).
    pub implausible_batches: u64,
    /// Trackers of old closed epochs summarised into their node's totals and dropped
    /// (`closed_epochs_kept`).
    pub trackers_retired: u64,
    /// Heartbeat settlements not scheduled because [`MAX_PENDING_SETTLES`] were pending
    /// (a later heartbeat of the stream settles what this one would have).
    pub settles_refused: u64,
    /// Resumes refused for the same reason (the shell closes the connection).
    pub implausible_resumes: u64,
    /// Owner rows past [`MAX_OWNERS_PER_NODE`] in one heartbeat, not kept.
    pub owners_turned_away: u64,
}

/// Upper bounds (ns) of the end-to-end latency histogram ([`EndToEnd`]).
pub const E2E_BOUNDS_NS: [u64; 15] = [
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
    60_000_000_000,
];

/// End-to-end latency: a frame's kernel timestamp (the node's clock, in cluster time)
/// to its batch applied here, per class (P0, P2, P3; P1 is the shipper's own records). One observation per (batch, stream): the
/// stream's oldest frame in the batch, so the figures are each batch's worst. Not
/// kept in snapshots (a restart starts it afresh, as Prometheus expects of a counter).
#[derive(Debug, Clone, Default)]
pub struct EndToEnd {
    /// Per class (P0..P3): observations per bound (not cumulative), and one above the
    /// last bound.
    pub counts: [[u64; E2E_BOUNDS_NS.len() + 1]; 4],
    pub sum_ns: [u64; 4],
    /// Streams of batches from nodes whose clock was not estimated yet (no cluster
    /// time to measure in): not observed.
    pub unsynced: u64,
}

impl PartialEq for EndToEnd {
    /// Figures of this process, not state (snapshots leave them out): any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl EndToEnd {
    fn observe(&mut self, class: usize, ns: u64) {
        let i = E2E_BOUNDS_NS.iter().position(|&le| ns <= le).unwrap_or(E2E_BOUNDS_NS.len());
        if let (Some(c), Some(s)) = (self.counts.get_mut(class).and_then(|c| c.get_mut(i)), self.sum_ns.get_mut(class))
        {
            c.inc();
            *s = s.saturating_add(ns);
        }
    }

    /// Observations of `class`.
    #[must_use]
    pub fn count(&self, class: usize) -> u64 {
        self.counts.get(class).map_or(0, |c| c.iter().sum())
    }
}

/// One node's ingest state.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct NodeState {
    pub epoch: u64,
    /// `(epoch, stream_id)` → tracker.
    pub trackers: BTreeMap<(u64, u32), SeqTracker>,
    pub clock: ClockEstimate,
    pub last_heard_ns: u64,
    pub liveness: LivenessState,
    pub connected: bool,
    /// Whether a batch arrived since start or restore (the knowledge gap ends there).
    pub heard_since_start: bool,
    /// Watermark per class code (node ns); 0 = none yet.
    pub watermark_ns: [u64; 4],
    /// Epochs up to this one are closed (their tails declared).
    pub closed_through_epoch: u64,
    /// The pending close of the previous epochs (its `settles` key), if any: a further
    /// epoch change moves it on instead of adding another.
    pending_close: Option<(u64, u64)>,
    /// Trackers of open epochs (what `max_streams_per_node` caps).
    open_streams: usize,
    /// What the trackers of retired epochs counted.
    pub retired: RetiredStreams,
    /// The shipper's state from its last heartbeat: spool, memory pressure, sampling.
    /// Not snapshotted (the next heartbeat, within a second, says it again).
    #[rkyv(with = rkyv::with::Skip)]
    pub shipper: Option<ShipperState>,
    /// Who owns its rank processes (pod, container, Slurm job), per GPU and
    /// communicator, from its last heartbeat (empty when that heartbeat named none; at
    /// most [`MAX_OWNERS_PER_NODE`]). Not snapshotted, like `shipper`.
    #[rkyv(with = rkyv::with::Skip)]
    pub owners: Vec<GpuOwner>,
    /// Its bulk (P2) event rate from the heartbeats' exact counters. Not snapshotted:
    /// the next heartbeats rebuild it.
    #[rkyv(with = rkyv::with::Skip)]
    pub bulk_rate: crate::rates::BulkRate,
    /// Its per-interface packet and byte rates from the heartbeats' `interfaces`
    /// sections (the kernel's counters). Not snapshotted, like `bulk_rate`.
    #[rkyv(with = rkyv::with::Skip)]
    pub interfaces: crate::rates::InterfaceRates,
}

/// The most `owners` a node keeps.
pub const MAX_OWNERS_PER_NODE: usize = 4096;

/// A rank process's owner, joined with the PROGRESS entries of the same heartbeat: one
/// row per (GPU, communicator, rank, process).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuOwner {
    pub gpu_uuid: [u8; 16],
    pub comm_hash: u64,
    pub comm_disambiguator: u64,
    pub rank: u32,
    pub pid: u32,
    pub pod_uid: Option<[u8; 16]>,
    pub container_id: Option<[u8; 32]>,
    pub slurm_job_id: Option<u64>,
}

/// A shipper's own state, from a heartbeat's `shipper_state` section.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShipperState {
    pub spool_bytes: u64,
    pub spool_cap_bytes: u64,
    /// Memory pressure: `memory.pressure` some/full avg10 (ppm of the time), and what it
    /// sheds (0 nothing, 1 P3, 2 P2 too, 3 P1 coalesced too).
    pub psi_some_avg10_ppm: u32,
    pub psi_full_avg10_ppm: u32,
    pub shed_tier: u8,
    pub sampling_level: u8,
    /// When it arrived (aggregator ns).
    pub at_ns: u64,
}

impl ShipperState {
    /// The pressure level the shed tier stands for: `nominal`, `some` (P3/P2 shed),
    /// `full` (P1 coalesced too), or `unknown` (a tier this build does not know).
    #[must_use]
    pub const fn pressure_level(&self) -> &'static str {
        match self.shed_tier {
            0 => "nominal",
            1 | 2 => "some",
            3 => "full",
            _ => "unknown",
        }
    }
}

/// The totals of a node's retired trackers (closed epochs past `closed_epochs_kept`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetiredStreams {
    pub epochs: u64,
    pub streams: u64,
    pub received: u64,
    /// Lost, all causes, net of revivals.
    pub lost: u64,
    pub prior_instance: u64,
    /// P0 streams: frames lost, and frames known attempted (received, lost, another
    /// instance's, pending or in transit) — [`crate::Core::p0_loss`] adds them in.
    pub p0_lost: u64,
    pub p0_known: u64,
}

impl RetiredStreams {
    fn absorb(&mut self, t: &SeqTracker) {
        let c = t.counts();
        self.streams.inc();
        self.received = self.received.saturating_add(c.received);
        self.lost = self.lost.saturating_add(c.lost_total());
        self.prior_instance = self.prior_instance.saturating_add(c.prior_instance);
        if t.key.stream_id >> 24 == 0 {
            self.p0_lost = self.p0_lost.saturating_add(c.lost_total());
            self.p0_known = self.p0_known.saturating_add(p0_known(t));
        }
    }
}

/// Frames a P0 tracker knows were attempted: received, lost, another instance's, pending
/// or in transit (counts rest on heartbeat numbers from the wire: saturating).
#[must_use]
pub fn p0_known(t: &SeqTracker) -> u64 {
    let c = t.counts();
    [c.received, c.lost_total(), c.prior_instance, t.pending(), t.in_transit()]
        .iter()
        .fold(0u64, |a, &x| a.saturating_add(x))
}

/// Drops the trackers of closed epochs older than the newest `kept`, adding them to the
/// node's retired totals, and recounts its open streams; returns how many were dropped.
fn retire_closed(n: &mut NodeState, kept: usize) -> u64 {
    let closed = n.closed_through_epoch;
    let open_from = (closed.saturating_add(1), 0);
    n.open_streams = n.trackers.range(open_from..).count();
    let mut epochs: Vec<u64> = n.trackers.range(..open_from).map(|((e, _), _)| *e).collect();
    epochs.dedup();
    let Some(drop_through) = epochs.len().checked_sub(kept.saturating_add(1)).and_then(|i| epochs.get(i).copied())
    else {
        return 0;
    };
    // `split_off` keeps the newer part; what stays in `old` is retired.
    let newer = n.trackers.split_off(&(drop_through.saturating_add(1), 0));
    let old = std::mem::replace(&mut n.trackers, newer);
    let mut retired = 0u64;
    let mut last_epoch = None;
    for ((e, _), t) in &old {
        if last_epoch != Some(*e) {
            n.retired.epochs.inc();
            last_epoch = Some(*e);
        }
        n.retired.absorb(t);
        retired.inc();
    }
    retired
}

/// Heartbeat settlements pending at once, over all nodes (an honest cluster has about
/// one per stream per reorder timeout).
pub const MAX_PENDING_SETTLES: usize = 1 << 20;
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
struct Settle {
    node: NodeId,
    epoch: u64,
    stream_id: u32,
    hb: HeartbeatCounters,
    /// When the heartbeat arrived.
    announced_ns: u64,
    /// Close every epoch up to `epoch` instead (an epoch change, `reorder_timeout` on,
    /// so the old epoch's batches in flight land first).
    close: bool,
}

/// Moves `n` to `state`, recording the change (nothing when it is already there).
fn set_liveness(
    out: &mut crate::outbox::Outbox<Record>,
    node: NodeId,
    n: &mut NodeState,
    state: LivenessState,
    now: u64,
) {
    if n.liveness != state {
        n.liveness = state;
        out.push(Record::Liveness(Liveness { node, state, at_ns: now, last_heard_ns: n.last_heard_ns }));
    }
}

/// The ingest state machine. See the module docs for the call order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Ingest {
    config: IngestConfig,
    nodes: BTreeMap<NodeId, NodeState>,
    /// `(due, order)` → settlement.
    settles: BTreeMap<(u64, u64), Settle>,
    next_order: u64,
    next_loss_id: u64,
    /// Aggregator start, or the time of the snapshot restored.
    known_since_ns: u64,
    /// Restored from a snapshot (or started after one it could not read): what was
    /// applied between the snapshot and the crash is gone, so each node's first batch
    /// closes a knowledge gap. A fresh start has none — shippers spool until they are
    /// acked, nothing acked was forgotten.
    restored: bool,
    /// Restored from its own snapshot: seqs below a shipper's resume floor that this
    /// instance never saw were acked by the instance that crashed after the snapshot —
    /// `aggregator_crash` loss, not `prior_instance`.
    resume_crash: bool,
    stats: IngestStats,
    out: crate::outbox::Outbox<Record>,
    /// Which batches are settled (applied, or reported lost by their shipper).
    dedup: BatchDedup,
    /// Reused buffers of the bulk path (not state: never snapshotted).
    #[rkyv(with = rkyv::with::Skip)]
    bulk: BulkScratch,
    #[rkyv(with = rkyv::with::Skip)]
    e2e: EndToEnd,
    /// An ingest shard (`Core::set_role`): it says `Fresh` for every node it starts to
    /// hear — a matcher shard may have heard the node go unreachable from another
    /// instance (a restarted shard, or the node's previous shard) — and a resume above
    /// what it saw is no knowledge gap: the matchers have what the earlier instance
    /// published (every batch it acked durable). One process needs neither.
    announce_new_nodes: bool,
}

/// The bulk path's per-batch buffers: a bulk batch's frames grouped by stream (streams
/// of one ring interleave frame by frame; grouped, each stream's tracker is looked up
/// once per batch instead of once per frame).
#[derive(Debug, Clone)]
struct BulkScratch {
    /// The summary's stream ids, in order, and each one's `(seq, ts)` in frame order.
    sids: Vec<u32>,
    by_stream: Vec<Vec<(u64, u64)>>,
    /// Direct-mapped stream id → position in `sids`.
    index: [u16; 64],
}

impl Default for BulkScratch {
    fn default() -> Self {
        Self { sids: Vec::new(), by_stream: Vec::new(), index: [u16::MAX; 64] }
    }
}

impl PartialEq for BulkScratch {
    /// Scratch, not state: any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl BulkScratch {
    fn slot(sid: u32) -> usize {
        (sid ^ (sid >> 16)) as usize % 64
    }

    /// Position of `sid` in the summary, if it is there.
    #[inline]
    fn find(&mut self, sid: u32, last: usize) -> Option<usize> {
        if self.sids.get(last) == Some(&sid) {
            return Some(last);
        }
        let cached = self.index.get(Self::slot(sid)).map(|&i| usize::from(i))?;
        if self.sids.get(cached) == Some(&sid) {
            return Some(cached);
        }
        let i = self.sids.iter().position(|&x| x == sid)?;
        if let (Some(slot), Ok(v)) = (self.index.get_mut(Self::slot(sid)), u16::try_from(i)) {
            *slot = v;
        }
        Some(i)
    }
}

impl Ingest {
    /// A fresh ingest started at `now`.
    #[must_use]
    pub fn new(config: IngestConfig, now: u64) -> Self {
        Self {
            config,
            nodes: BTreeMap::new(),
            settles: BTreeMap::new(),
            next_order: 0,
            next_loss_id: 0,
            known_since_ns: now,
            restored: false,
            resume_crash: false,
            stats: IngestStats::default(),
            out: crate::outbox::Outbox::default(),
            dedup: BatchDedup::new(config.dedup),
            bulk: BulkScratch::default(),
            e2e: EndToEnd::default(),
            announce_new_nodes: false,
        }
    }

    /// Records `Fresh` liveness for every node from now on first heard (an ingest shard).
    pub fn announce_new_nodes(&mut self) {
        self.announce_new_nodes = true;
    }

    /// Loss interval ids from here on start at `base` at least (an ingest shard's ids
    /// must not collide with another shard's in a matcher that hears from both).
    pub fn reserve_loss_ids(&mut self, base: u64) {
        self.next_loss_id = self.next_loss_id.max(base);
    }

    /// The API role: a node's state as its ingest shard published it, with what its
    /// snapshots leave out (the shipper's state and the rank owners, carried apart). An
    /// older state than the one held (by last-heard time) is ignored; a new node past
    /// `max_nodes` is refused (counted in `nodes_refused_batches`). Whether it was
    /// installed.
    pub fn install_node(
        &mut self,
        node: NodeId,
        mut state: NodeState,
        shipper: Option<ShipperState>,
        owners: Vec<GpuOwner>,
    ) -> bool {
        state.shipper = shipper;
        state.owners = owners;
        state.owners.truncate(MAX_OWNERS_PER_NODE);
        let full = self.nodes.len() >= self.config.max_nodes;
        match self.nodes.get_mut(&node) {
            Some(held) if held.last_heard_ns > state.last_heard_ns => false,
            Some(held) => {
                *held = state;
                true
            }
            None if full => {
                self.stats.nodes_refused_batches.inc();
                false
            }
            None => {
                self.nodes.insert(node, state);
                true
            }
        }
    }

    /// Batch dedup state (see [`crate::dedup`]).
    #[must_use]
    pub fn dedup(&self) -> &BatchDedup {
        &self.dedup
    }

    /// Batch dedup state, for [`crate::Core::receive_batch`] and for other limits.
    pub fn dedup_mut(&mut self) -> &mut BatchDedup {
        &mut self.dedup
    }

    // ---------------------------------------------------------------- getters

    /// The tracker of a stream.
    #[must_use]
    pub fn tracker(&self, key: StreamKey) -> Option<&SeqTracker> {
        self.nodes.get(&key.node)?.trackers.get(&(key.epoch, key.stream_id))
    }

    /// Every tracker of a node.
    pub fn trackers(&self, node: NodeId) -> impl Iterator<Item = &SeqTracker> {
        self.nodes.get(&node).into_iter().flat_map(|n| n.trackers.values())
    }

    /// A node's state.
    #[must_use]
    pub fn node(&self, node: NodeId) -> Option<&NodeState> {
        self.nodes.get(&node)
    }

    /// Every node ingest knows (a restored core: also those not heard from since).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.keys().copied()
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &IngestStats {
        &self.stats
    }

    /// End-to-end latency so far (since this process started).
    #[must_use]
    pub fn end_to_end(&self) -> &EndToEnd {
        &self.e2e
    }

    /// Takes another configuration's timers and caps (a restored ingest, this run's
    /// flags); the tracker limits and the dedup window stay (they shape state held).
    pub fn reconfigure(&mut self, config: IngestConfig) {
        self.config = IngestConfig { tracker: self.config.tracker, dedup: self.config.dedup, ..config };
    }

    /// Its maps, with their sizes and caps (see [`crate::bounds`]).
    #[must_use]
    pub fn map_sizes(&self) -> Vec<crate::MapSize> {
        let trackers = self.nodes.values().map(|n| n.trackers.len()).sum();
        // Open epochs' streams, plus the kept closed epochs' (each at most as many).
        let per_node =
            self.config.max_streams_per_node.saturating_mul(self.config.closed_epochs_kept.saturating_add(1));
        let trackers_cap = self.config.max_nodes.saturating_mul(per_node);
        let mut out = vec![
            crate::MapSize::new("ingest.nodes", self.nodes.len(), self.config.max_nodes),
            crate::MapSize::new("ingest.trackers", trackers, trackers_cap),
            crate::MapSize::new(
                "ingest.settles",
                self.settles.len(),
                MAX_PENDING_SETTLES.saturating_add(self.config.max_nodes),
            ),
        ];
        out.extend(self.dedup.map_sizes(self.config.max_nodes));
        out
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &IngestConfig {
        &self.config
    }

    // ---------------------------------------------------------------- outputs

    /// The next record, in the order they were produced.
    pub fn poll_record(&mut self) -> Option<Record> {
        self.out.poll()
    }

    /// When to call [`Self::handle_timeout`] next.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        let settle = self.settles.keys().next().map(|k| k.0);
        let liveness = self
            .nodes
            .values()
            .filter_map(|n| match n.liveness {
                LivenessState::Fresh => Some(n.last_heard_ns.saturating_add(self.config.silent_ns)),
                LivenessState::Silent => Some(n.last_heard_ns.saturating_add(self.config.unreachable_ns)),
                LivenessState::Unreachable => None,
            })
            .min();
        match (settle, liveness) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // ---------------------------------------------------------------- checks

    /// [`plausible::check_batch`], counted when it refuses.
    ///
    /// # Errors
    /// The field no real shipper sends.
    pub fn check_batch(&mut self, batch: &BatchView<'_>) -> Result<(), Implausible> {
        plausible::check_batch(batch).inspect_err(|_| self.stats.implausible_batches.inc())
    }

    /// [`plausible::check_resume`], counted when it refuses.
    ///
    /// # Errors
    /// The field no real shipper sends.
    pub fn check_resume(
        &mut self,
        next_batch_seq: u64,
        sent_ns: u64,
        held: &[(u64, u64)],
        floors: &[(u32, u64)],
    ) -> Result<(), Implausible> {
        plausible::check_resume(next_batch_seq, sent_ns, held, floors)
            .inspect_err(|_| self.stats.implausible_resumes.inc())
    }

    // ---------------------------------------------------------------- inputs

    /// Time passed: due settlements and liveness transitions.
    pub fn handle_timeout(&mut self, now: u64) {
        let mut scratch = Vec::new();
        while let Some((&key, _)) = self.settles.iter().next() {
            if key.0 > now {
                break;
            }
            let Some(s) = self.settles.remove(&key) else { break };
            if s.close {
                if let Some(n) = self.nodes.get_mut(&s.node) {
                    for ((e, _), t) in &mut n.trackers {
                        if *e <= s.epoch {
                            t.close_epoch(now, &mut scratch, &mut self.next_loss_id);
                        }
                    }
                    n.closed_through_epoch = n.closed_through_epoch.max(s.epoch);
                    if n.pending_close == Some(key) {
                        n.pending_close = None;
                    }
                    let retired = retire_closed(n, self.config.closed_epochs_kept);
                    self.stats.trackers_retired = self.stats.trackers_retired.saturating_add(retired);
                }
            } else if let Some(t) =
                self.nodes.get_mut(&s.node).and_then(|n| n.trackers.get_mut(&(s.epoch, s.stream_id)))
                && !t.is_closed()
            {
                t.settle(&s.hb, s.announced_ns, now, &mut scratch, &mut self.next_loss_id);
            }
            self.flush_losses(&mut scratch);
            self.update_watermarks(now, s.node);
        }
        let (silent, unreachable) = (self.config.silent_ns, self.config.unreachable_ns);
        for (&id, n) in &mut self.nodes {
            let age = now.saturating_sub(n.last_heard_ns);
            let state = if !n.connected || age >= unreachable {
                LivenessState::Unreachable
            } else if age >= silent {
                LivenessState::Silent
            } else {
                LivenessState::Fresh
            };
            set_liveness(&mut self.out, id, n, state, now);
        }
    }

    /// The node's connection closed: unreachable now.
    pub fn handle_connection_closed(&mut self, now: u64, node: NodeId) {
        if let Some(n) = self.nodes.get_mut(&node) {
            n.connected = false;
            set_liveness(&mut self.out, node, n, LivenessState::Unreachable, now);
        }
    }

    /// A validated batch from `node` arrived at `now` over a path with round-trip
    /// `rtt_ns` (for the clock estimate). Returns false if the node was refused by
    /// `max_nodes` (counted).
    pub fn handle_batch(&mut self, now: u64, node: NodeId, rtt_ns: u64, batch: &BatchView<'_>) -> bool {
        if !self.ensure_node(now, node, batch.header.epoch.get()) {
            self.stats.nodes_refused_batches.inc();
            return false;
        }
        self.stats.batches.inc();
        let mut scratch = Vec::new();
        {
            let Some(n) = self.nodes.get_mut(&node) else { return false };
            n.last_heard_ns = now;
            n.connected = true;
            set_liveness(&mut self.out, node, n, LivenessState::Fresh, now);
            if !n.heard_since_start {
                n.heard_since_start = true;
                if self.restored {
                    self.out.push(Record::KnowledgeGap(KnowledgeGap {
                        node,
                        from_ns: self.known_since_ns,
                        to_ns: now,
                    }));
                }
            }
        }
        let epoch = batch.header.epoch.get();
        self.maybe_new_epoch(now, node, epoch, [0; 16]);
        self.observe_end_to_end(now, node, batch);
        match batch.lane() {
            Class::P1 => self.ingest_p1(now, node, epoch, rtt_ns, batch, &mut scratch),
            Class::P0 => self.ingest_frames(now, node, epoch, batch, true, &mut scratch),
            _ => self.ingest_frames(now, node, epoch, batch, false, &mut scratch),
        }
        self.flush_losses(&mut scratch);
        self.update_watermarks(now, node);
        true
    }

    /// A shipper's `resume` (see [`crate::dedup`] and [`SeqTracker::on_resume`]): per
    /// stream of `epoch`, the floor below which another instance may have received what
    /// this one never saw. Returns how many streams this instance had missed part of;
    /// when any, and this instance did not restore a snapshot (which records its own gap
    /// at the node's first batch), the node gets a knowledge gap from this instance's
    /// start to now. False if the node was refused by `max_nodes`.
    ///
    /// `clock` is `(sent_ns, rtt_ns)`: the resume's node time and the connection's RTT, a
    /// fresh clock sample (see [`ClockEstimate::on_resume`]).
    pub fn handle_resume(
        &mut self,
        now: u64,
        node: NodeId,
        epoch: u64,
        clock: (u64, u64),
        floors: &[(u32, u64)],
    ) -> Option<u64> {
        if !self.ensure_node(now, node, epoch) {
            return None;
        }
        if let Some(n) = self.nodes.get_mut(&node) {
            n.clock.on_resume(clock.0, now, clock.1);
        }
        self.maybe_new_epoch(now, node, epoch, [0; 16]);
        let mut windows = 0u64;
        for &(sid, floor) in floors {
            match Self::tracker_mut(&mut self.nodes, &self.config, &mut self.stats, node, epoch, sid) {
                Some(t) => windows.grow(u64::from(t.on_resume(floor, self.resume_crash, now))),
                None => self.stats.resume_streams_refused.inc(),
            }
        }
        self.stats.resume_windows.grow(windows);
        if windows > 0 && !self.restored && !self.announce_new_nodes {
            self.out.push(Record::KnowledgeGap(KnowledgeGap { node, from_ns: self.known_since_ns, to_ns: now }));
        }
        self.update_watermarks(now, node);
        Some(windows)
    }

    // ---------------------------------------------------------------- internals

    /// Creates the node's state if the node cap allows; false if refused.
    fn ensure_node(&mut self, now: u64, node: NodeId, epoch: u64) -> bool {
        if self.nodes.contains_key(&node) {
            return true;
        }
        if self.nodes.len() >= self.config.max_nodes {
            return false;
        }
        self.nodes.insert(
            node,
            NodeState {
                epoch,
                trackers: BTreeMap::new(),
                clock: ClockEstimate::default(),
                last_heard_ns: now,
                liveness: LivenessState::Fresh,
                connected: true,
                heard_since_start: false,
                watermark_ns: [0; 4],
                closed_through_epoch: 0,
                pending_close: None,
                open_streams: 0,
                retired: RetiredStreams::default(),
                shipper: None,
                owners: Vec::new(),
                bulk_rate: crate::rates::BulkRate::default(),
                interfaces: crate::rates::InterfaceRates::default(),
            },
        );
        if self.announce_new_nodes {
            self.out.push(Record::Liveness(Liveness {
                node,
                state: LivenessState::Fresh,
                at_ns: now,
                last_heard_ns: now,
            }));
        }
        true
    }

    fn flush_losses(&mut self, scratch: &mut Vec<LossInterval>) {
        self.stats.loss_intervals.grow(scratch.len() as u64);
        self.out.extend(scratch.drain(..).map(Record::Loss));
    }

    fn maybe_new_epoch(&mut self, now: u64, node: NodeId, epoch: u64, boot_id: [u8; 16]) {
        let Some(n) = self.nodes.get_mut(&node) else { return };
        if epoch <= n.epoch {
            return;
        }
        let old = n.epoch;
        n.epoch = epoch;
        n.watermark_ns = [0; 4];
        // Close the old epoch once its batches in flight have had time to land; a close
        // still pending is moved on (one per node, however fast epochs change).
        if let Some(pending) = n.pending_close.take() {
            self.settles.remove(&pending);
        }
        let due = now.saturating_add(self.config.reorder_timeout_ns);
        let key = (due, self.next_order);
        self.settles.insert(
            key,
            Settle { node, epoch: old, stream_id: 0, hb: HeartbeatCounters::default(), announced_ns: now, close: true },
        );
        n.pending_close = Some(key);
        self.next_order.inc();
        self.out.push(Record::Epoch(EpochChange { node, old_epoch: old, new_epoch: epoch, boot_id, at_ns: now }));
    }

    /// The tracker for `(node, epoch, stream)`, created if the caps allow; `None` if
    /// refused or the epoch is closed.
    fn tracker_mut<'a>(
        nodes: &'a mut BTreeMap<NodeId, NodeState>,
        config: &IngestConfig,
        stats: &mut IngestStats,
        node: NodeId,
        epoch: u64,
        stream_id: u32,
    ) -> Option<&'a mut SeqTracker> {
        let n = nodes.get_mut(&node)?;
        if epoch <= n.closed_through_epoch {
            // A closed epoch: late frames revive what its tail declared lost; nothing new.
            let t = n.trackers.get_mut(&(epoch, stream_id));
            if t.is_none() {
                stats.stale_epoch_frames.inc();
            }
            return t;
        }
        // Only the open epochs' streams count (a node that restarts often keeps a few
        // closed epochs' trackers for late frames: they must not crowd out its new ones).
        let open = n.open_streams;
        match n.trackers.entry((epoch, stream_id)) {
            std::collections::btree_map::Entry::Occupied(e) => Some(e.into_mut()),
            std::collections::btree_map::Entry::Vacant(v) => {
                if open >= config.max_streams_per_node {
                    stats.streams_refused_frames.inc();
                    return None;
                }
                n.open_streams = open.saturating_add(1);
                Some(v.insert(SeqTracker::new(StreamKey { node, epoch, stream_id }, config.tracker)))
            }
        }
    }

    /// Sequence accounting of one decoded frame (P0 and P1 lanes; bulk has its own
    /// scan loop with a per-run tracker cache). False for a duplicate: the caller drops
    /// it (a retransmitted batch must not become records twice).
    fn account_frame(
        &mut self,
        now: u64,
        node: NodeId,
        epoch: u64,
        h: &proto_flat::FrameHeader,
        scratch: &mut Vec<LossInterval>,
    ) -> bool {
        self.stats.frames.inc();
        match Self::tracker_mut(&mut self.nodes, &self.config, &mut self.stats, node, epoch, h.stream_id.get()) {
            Some(t) => {
                let fresh = t.on_frame(h.seq.get(), h.ts_ns.get(), now, scratch, &mut self.next_loss_id);
                if !fresh {
                    self.stats.duplicate_frames.inc();
                }
                fresh
            }
            // Untracked (a cap refused the stream, or a closed epoch): still delivered.
            None => true,
        }
    }

    /// One end-to-end observation per stream of the batch (its oldest frame).
    fn observe_end_to_end(&mut self, now: u64, node: NodeId, batch: &BatchView<'_>) {
        let Some(clock) = self.nodes.get(&node).map(|n| &n.clock) else { return };
        let class = usize::from(batch.lane().code()).min(3);
        // P1 carries the shipper's own records (loss records stamped with the lost
        // frames' time, takeovers): no frame's way through the pipeline.
        if class == 1 {
            return;
        }
        for e in batch.summary.iter() {
            if !clock.is_synced() {
                self.e2e.unsynced.inc();
                continue;
            }
            let at = clock.to_cluster(e.first_ts.get());
            let ns = i64::try_from(now).unwrap_or(i64::MAX).saturating_sub(at);
            self.e2e.observe(class, u64::try_from(ns).unwrap_or(0));
        }
    }

    /// P0 and bulk lanes: the seq scan (and lifecycle records for P0).
    fn ingest_frames(
        &mut self,
        now: u64,
        node: NodeId,
        epoch: u64,
        batch: &BatchView<'_>,
        lifecycle: bool,
        scratch: &mut Vec<LossInterval>,
    ) {
        if !lifecycle {
            // Bulk: frames grouped by stream (the summary names the streams), then one
            // tracker lookup per stream, its frames in their order.
            let mut bulk = std::mem::take(&mut self.bulk);
            bulk.sids.clear();
            bulk.sids.extend(batch.summary.iter().map(|e| e.stream_id.get()));
            bulk.index = [u16::MAX; 64];
            let streams = bulk.sids.len();
            if bulk.by_stream.len() < streams {
                bulk.by_stream.resize_with(streams, Vec::new);
            }
            for v in bulk.by_stream.iter_mut().take(streams) {
                v.clear();
            }
            let mut frames = 0u64;
            let mut last = 0usize;
            for item in batch.headers() {
                let Ok((h, _)) = item else { break };
                frames.inc();
                let sid = h.stream_id.get();
                // A validated batch names every stream of its frames in its summary.
                if let Some(i) = bulk.find(sid, last) {
                    last = i;
                    if let Some(v) = bulk.by_stream.get_mut(i) {
                        v.push((h.seq.get(), h.ts_ns.get()));
                    }
                } else if let Some(t) =
                    Self::tracker_mut(&mut self.nodes, &self.config, &mut self.stats, node, epoch, sid)
                {
                    t.on_frame(h.seq.get(), h.ts_ns.get(), now, scratch, &mut self.next_loss_id);
                }
            }
            for (sid, seqs) in bulk.sids.iter().zip(bulk.by_stream.iter()) {
                if seqs.is_empty() {
                    continue;
                }
                if let Some(t) = Self::tracker_mut(&mut self.nodes, &self.config, &mut self.stats, node, epoch, *sid) {
                    // Runs of consecutive seqs go in whole.
                    let mut from = 0usize;
                    while let Some(&(first, _)) = seqs.get(from) {
                        let mut to = from.saturating_add(1);
                        while seqs.get(to).is_some_and(|&(s, _)| {
                            Some(s) == first.checked_add(u64::try_from(to.saturating_sub(from)).unwrap_or(u64::MAX))
                        }) {
                            to = to.saturating_add(1);
                        }
                        t.on_run(first, seqs.get(from..to).unwrap_or(&[]), now, scratch, &mut self.next_loss_id);
                        from = to;
                    }
                }
            }
            self.bulk = bulk;
            self.stats.frames.grow(frames);
            return;
        }
        let offset = self.nodes.get(&node).map_or(ClockEstimate::default(), |n| n.clock.clone());
        for item in batch.frames() {
            let Ok(frame) = item else { break };
            let h = frame.header();
            if !self.account_frame(now, node, epoch, h, scratch) {
                continue;
            }
            let stream = StreamKey { node, epoch, stream_id: h.stream_id.get() };
            // The fields collective and P2P frames share, read the same way from both.
            macro_rules! lifecycle {
                ($f:expr, $kind:expr) => {
                    Some(Lifecycle {
                        stream,
                        seq: h.seq.get(),
                        flags: h.flags.get(),
                        ts_node_ns: h.ts_ns.get(),
                        ts_cluster_ns: if offset.is_synced() { offset.to_cluster(h.ts_ns.get()) } else { 0 },
                        comm: Comm {
                            hash: $f.comm_hash.get(),
                            disambiguator: $f.comm_disambiguator.get(),
                            instance: $f.comm_instance.get(),
                        },
                        local_op_seq: $f.local_op_seq.get(),
                        rank: $f.rank.get(),
                        pid: $f.pid.get(),
                        op: $f.op,
                        dtype: $f.dtype,
                        phase: $f.phase,
                        count: $f.count.get(),
                        group_id: $f.group_id.get(),
                        status: $f.status.get(),
                        channel: $f.channel.get(),
                        n_channels: $f.n_channels.get(),
                        kind: $kind,
                    })
                };
            }
            let record = match frame {
                Frame::Collective(f) => lifecycle!(
                    f,
                    LifecycleKind::Collective {
                        comm_op_seq: f.comm_op_seq.get(),
                        nccl_seq: f.nccl_seq.get(),
                        nranks: f.nranks.get(),
                        root: f.root.get(),
                        local_rank: f.local_rank.get(),
                        cuda_dev: f.cuda_dev.get(),
                        graph_id: f.graph_id.get(),
                        graph_node: f.graph_node.get(),
                        replay_idx: f.replay_idx.get(),
                    }
                ),
                Frame::P2p(f) => {
                    lifecycle!(f, LifecycleKind::P2p { src: f.src.get(), dst: f.dst.get(), p2p_seq: f.p2p_seq.get() })
                }
                Frame::Unknown { .. } => {
                    self.stats.unknown_frames.inc();
                    None
                }
                Frame::Malformed { .. } => {
                    self.stats.malformed_frames.inc();
                    None
                }
                _ => None,
            };
            if let Some(r) = record {
                self.stats.lifecycle_records.inc();
                self.out.push(Record::Lifecycle(r));
            }
        }
    }

    /// A heartbeat's owner entries joined to its PROGRESS entries by pid: one row per
    /// (GPU, communicator, rank, process), at most [`MAX_OWNERS_PER_NODE`] (the rest
    /// counted `owners_turned_away`). Linear in both sections.
    fn join_owners(&mut self, ranks: &[&ProgressEntry], owners: &[OwnerEntry]) -> Vec<GpuOwner> {
        let mut by_pid: HashMap<u32, &OwnerEntry> = HashMap::with_capacity(owners.len());
        for e in owners {
            if e.pid.get() != 0 {
                by_pid.entry(e.pid.get()).or_insert(e);
            }
        }
        let mut v = Vec::new();
        for p in ranks {
            let Some(e) = by_pid.get(&p.pid.get()) else { continue };
            if v.len() >= MAX_OWNERS_PER_NODE {
                self.stats.owners_turned_away.inc();
                break;
            }
            let flags = e.flags.get();
            v.push(GpuOwner {
                gpu_uuid: p.gpu_uuid,
                comm_hash: p.comm_hash.get(),
                comm_disambiguator: p.comm_disambiguator.get(),
                rank: p.rank.get(),
                pid: p.pid.get(),
                pod_uid: (flags & OWNER_POD != 0).then_some(e.pod_uid),
                container_id: (flags & OWNER_CONTAINER != 0).then_some(e.container_id),
                slurm_job_id: (flags & OWNER_SLURM_JOB != 0).then(|| e.slurm_job_id.get()),
            });
        }
        v.sort_unstable_by_key(|o| (o.gpu_uuid, o.comm_hash, o.comm_disambiguator, o.rank, o.pid));
        v.dedup_by_key(|o| (o.gpu_uuid, o.comm_hash, o.comm_disambiguator, o.rank, o.pid));
        v
    }

    /// P1 lane: heartbeats, loss records, session and epoch frames. Never inlined: a P1
    /// batch comes about once a second, and inlined, its code sat in the bulk lane's
    /// per-frame path (+2–4 % ns/frame in the ingest bench).
    #[inline(never)]
    fn ingest_p1(
        &mut self,
        now: u64,
        node: NodeId,
        epoch: u64,
        rtt_ns: u64,
        batch: &BatchView<'_>,
        scratch: &mut Vec<LossInterval>,
    ) {
        for item in batch.frames() {
            let Ok(frame) = item else { break };
            let h = frame.header();
            if !self.account_frame(now, node, epoch, h, scratch) {
                continue;
            }
            match frame {
                Frame::Heartbeat(hb) => {
                    let snapshot = hb.head.snapshot_ns.get();
                    if let Some(n) = self.nodes.get_mut(&node)
                        && !n.clock.on_heartbeat(h.ts_ns.get(), now, rtt_ns)
                    {
                        self.stats.clock_samples_stale.inc();
                    }
                    let clock = self.nodes.get(&node).map(|n| n.clock.clone()).unwrap_or_default();
                    // The heartbeat's (pid, GPU, rank)s, for its `owner` section.
                    let mut ranks: Vec<&ProgressEntry> = Vec::new();
                    let mut owners: Option<Vec<OwnerEntry>> = None;
                    let mut saw_interfaces = false;
                    for section in hb.sections() {
                        match section {
                            Section::Streams(entries) => {
                                for e in entries.iter() {
                                    let counters = HeartbeatCounters {
                                        attempted: e.attempted_seq.get(),
                                        held_from: e.held_from_seq.get(),
                                        kernel_ring_full: e.drops_for(LossCause::KernelRingFull),
                                        kernel_oversized: e.drops_for(LossCause::Oversized),
                                        sampled_out: e.sampled_out.get(),
                                        snapshot_node_ns: snapshot,
                                    };
                                    let sid = e.stream_id.get();
                                    if let Some(t) = Self::tracker_mut(
                                        &mut self.nodes,
                                        &self.config,
                                        &mut self.stats,
                                        node,
                                        epoch,
                                        sid,
                                    ) {
                                        t.on_heartbeat(counters);
                                        let due = now.saturating_add(self.config.reorder_timeout_ns);
                                        if self.settles.len() >= MAX_PENDING_SETTLES {
                                            self.stats.settles_refused.inc();
                                            continue;
                                        }
                                        self.settles.insert(
                                            (due, self.next_order),
                                            Settle {
                                                node,
                                                epoch,
                                                stream_id: sid,
                                                hb: counters,
                                                announced_ns: now,
                                                close: false,
                                            },
                                        );
                                        self.next_order.inc();
                                    }
                                }
                                if let Some(n) = self.nodes.get_mut(&node) {
                                    // Every event the kernel counted on the bulk streams
                                    // of this epoch (latest heartbeat numbers per stream).
                                    let events = n
                                        .trackers
                                        .range((epoch, 0)..=(epoch, u32::MAX))
                                        .filter(|((_, sid), _)| proto_flat::StreamId(*sid).class() == Class::P2)
                                        .filter_map(|(_, t)| t.heartbeat())
                                        .fold(0u64, |a, hb| {
                                            a.saturating_add(hb.attempted).saturating_add(hb.sampled_out)
                                        });
                                    n.bulk_rate.on_heartbeat(epoch, snapshot, events);
                                }
                            }
                            Section::Interfaces(entries) => {
                                saw_interfaces = true;
                                if let Some(n) = self.nodes.get_mut(&node) {
                                    n.interfaces.on_heartbeat(
                                        epoch,
                                        snapshot,
                                        entries.iter().map(|e| (e.ifindex.get(), e.packets.get(), e.bytes.get())),
                                    );
                                }
                            }
                            Section::Progress(entries) => {
                                ranks.extend(entries.iter());
                                for p in entries.iter() {
                                    self.out.push(Record::Progress(Progress {
                                        node,
                                        epoch,
                                        comm: Comm {
                                            hash: p.comm_hash.get(),
                                            disambiguator: p.comm_disambiguator.get(),
                                            instance: p.comm_instance.get(),
                                        },
                                        rank: p.rank.get(),
                                        pid: p.pid.get(),
                                        proc_state: p.proc_state,
                                        exit_code: p.exit_code.get(),
                                        gpu_uuid: p.gpu_uuid,
                                        cgroup_id: p.cgroup_id.get(),
                                        activation_mask: p.activation_mask.get(),
                                        last_enqueued_op: p.last_enqueued_op.get(),
                                        last_kernel_started_op: p.last_kernel_started_op.get(),
                                        last_completed_op: p.last_completed_op.get(),
                                        last_update_node_ns: p.last_update_ns.get(),
                                        snapshot_node_ns: snapshot,
                                        snapshot_cluster_ns: clock.to_cluster(snapshot),
                                        received_at_ns: now,
                                    }));
                                }
                            }
                            Section::ShipperState(entries) => {
                                if let (Some(e), Some(n)) = (entries.iter().next(), self.nodes.get_mut(&node)) {
                                    n.shipper = Some(ShipperState {
                                        spool_bytes: e.spool_bytes.get(),
                                        spool_cap_bytes: e.spool_cap_bytes.get(),
                                        psi_some_avg10_ppm: e.psi_some_avg10_ppm.get(),
                                        psi_full_avg10_ppm: e.psi_full_avg10_ppm.get(),
                                        shed_tier: e.shed_tier,
                                        sampling_level: e.sampling_level,
                                        at_ns: now,
                                    });
                                }
                            }
                            Section::Owner(entries) => {
                                // Joined once every section is read (any order); a
                                // process's first entry counts.
                                let v = owners.get_or_insert_with(Vec::new);
                                for e in entries.iter() {
                                    if v.len() >= MAX_OWNERS_PER_NODE {
                                        self.stats.owners_turned_away.inc();
                                        break;
                                    }
                                    v.push(*e);
                                }
                            }
                            _ => {}
                        }
                    }
                    let joined = owners.map(|o| self.join_owners(&ranks, &o)).unwrap_or_default();
                    if let Some(n) = self.nodes.get_mut(&node) {
                        n.owners = joined;
                        if !saw_interfaces {
                            // No section: the node counts no interfaces (now).
                            n.interfaces.on_heartbeat(epoch, snapshot, []);
                        }
                    }
                }
                Frame::LossRecord(r) => {
                    let sid = r.stream_id.get();
                    // A report for a batch that was applied after all (sent, then evicted
                    // before its ack) is dropped: its frames were delivered. batch_seq 0:
                    // not a batch loss.
                    let batch_seq = r.batch_seq.get();
                    if batch_seq != 0 && !self.dedup.settle_lost(node, r.shipper_session.get(), batch_seq) {
                        continue;
                    }
                    if let Some(t) = Self::tracker_mut(&mut self.nodes, &self.config, &mut self.stats, node, epoch, sid)
                    {
                        t.on_loss_record(
                            r.first_seq.get(),
                            r.last_seq.get(),
                            r.count.get(),
                            r.cause(),
                            r.reason.get(),
                            now,
                            scratch,
                            &mut self.next_loss_id,
                        );
                    }
                }
                Frame::SessionStart(s) => {
                    for section in s.sections() {
                        if let Section::SessionStreams(entries) = section {
                            for e in entries.iter() {
                                let sid = e.stream_id.get();
                                if let Some(t) =
                                    Self::tracker_mut(&mut self.nodes, &self.config, &mut self.stats, node, epoch, sid)
                                {
                                    t.on_session_start(e.attempted_seq.get());
                                }
                            }
                        }
                    }
                }
                Frame::ShipperGap(g) => self.out.push(Record::ShipperGap(ShipperGap {
                    node,
                    epoch,
                    from_node_ns: g.from_ns.get(),
                    to_node_ns: g.to_ns.get(),
                    reason: g.reason.get(),
                })),
                Frame::EpochStart(e) => {
                    self.maybe_new_epoch(now, node, e.epoch.get(), e.boot_id);
                }
                Frame::Unknown { .. } => self.stats.unknown_frames.inc(),
                Frame::Malformed { .. } => self.stats.malformed_frames.inc(),
                _ => {}
            }
        }
    }

    fn update_watermarks(&mut self, now: u64, node: NodeId) {
        let Some(n) = self.nodes.get_mut(&node) else { return };
        // A watermark is a cluster time: none before the node's clock is estimated.
        if !n.clock.is_synced() {
            return;
        }
        for class in [Class::P0, Class::P2] {
            let c = usize::from(class.code());
            let wm = n
                .trackers
                .iter()
                .filter(|((e, sid), _)| *e == n.epoch && proto_flat::StreamId(*sid).class_code() == class.code())
                .map(|(_, t)| t.watermark_ns())
                .min();
            if let Some(wm) = wm
                && wm > n.watermark_ns[c]
            {
                n.watermark_ns[c] = wm;
                // Everything stamped up to the watermark has arrived, so it happened by
                // now: a clock estimate that says otherwise is clamped, never trusted
                // into the future.
                let cluster_ns = n.clock.to_cluster(wm).min(i64::try_from(now).unwrap_or(i64::MAX));
                self.out.push(Record::Watermark(Watermark {
                    node,
                    class: class.code(),
                    node_ns: wm,
                    cluster_ns,
                    epsilon_ns: n.clock.epsilon_ns(now).unwrap_or(u64::MAX),
                }));
            }
        }
    }

    // ---------------------------------------------------------------- snapshots

    /// Marks every node as not heard from since `snapshot_ns` (after a restore: the
    /// knowledge gap runs from the snapshot to each node's first batch). `crash`: this
    /// state is the snapshot's own (restored, not started fresh in its place), so what it
    /// misses below a shipper's resume floor is `aggregator_crash`.
    pub fn restart_knowledge(&mut self, snapshot_ns: u64, crash: bool) {
        self.known_since_ns = snapshot_ns;
        self.restored = true;
        self.resume_crash = crash;
        for n in self.nodes.values_mut() {
            n.heard_since_start = false;
        }
    }
}
