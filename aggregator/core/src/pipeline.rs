//! `Core`: ingest and matcher wired together — the whole pure core of one aggregator.
//!
//! Call order: `handle_batch` / `handle_connection_closed` as input arrives,
//! `handle_timeout` when `poll_timeout` says, `poll_event` until `None` after each.
//! Records flow from ingest to the matcher inside; the seam stays visible
//! (`Core::ingest`, `Core::matcher`: read-only views, every change goes through `Core`)
//! for a distributed log between them later.

use proto_flat::batch::BatchView;
use rkyv::{Archive, Deserialize, Serialize};

use crate::dedup::Admit;
use crate::ingest::{Ingest, IngestConfig};
use std::collections::BTreeMap;

use crate::matcher::{CollectiveMatcher, Health, MatcherConfig};
use crate::plausible::Implausible;
use crate::records::{Liveness, LivenessState, NodeId, Record};
use crate::shard::{Role, ShardHealth};
use crate::verdict::MatcherEvent;

/// The pure core.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Core {
    ingest: Ingest,
    matcher: CollectiveMatcher,
    records: u64,
    /// Which part of the pipeline this core runs ([`Role`]; `All` unless set).
    role: Role,
    /// Ingest role: records produced and not yet published, with their index (the
    /// value of `records` when each was produced) and the aggregator time they were
    /// produced at. Snapshotted: a restored shard publishes them again under the same
    /// indices.
    unpublished: Vec<(u64, u64, Record)>,
    /// API role: what the matcher shards published.
    mirror: Mirror,
    /// Matcher role: the stream sequence of the last bus message applied (a restored
    /// shard reads on from the next), and the events drained and not yet on the bus
    /// (snapshotted with the state that produced them, so a restored shard sends them).
    bus_position: u64,
    for_bus: Vec<MatcherEvent>,
    /// Matcher role: when each node was last spoken of on the bus.
    bus_liveness: BusLiveness,
}

/// Matcher role: when each node was last spoken of on the bus, and what its ingest shard
/// last said of its liveness. An ingest shard that dies without a word (SIGKILL, a lost
/// machine) says nothing more of its nodes — neither that they went silent nor that
/// they are unreachable. A live node's ingest shard speaks of it at every heartbeat (its
/// P0 watermark goes to every matcher shard), so a node nothing is said of while the bus
/// carried the ingest's `unreachable_ns` of records about others is taken as unreachable
/// here — the timer one process applies to a node it hears nothing from (never as
/// merely silent: a bus stall longer than `silent_ns` is no sign of the node). The time
/// is the records': each carries the aggregator time its ingest shard produced it at
/// (shards share the cluster clock), a node was last spoken of at its latest record's
/// time and the bus stands at the latest time applied — never this process's clock. So
/// a bus that carries nothing (a JetStream server lost and its streams electing a
/// leader, a consumer stalled) says nothing of any node, and a matcher reading a backlog
/// (restored from a snapshot, or behind after a stall) judges each node's silence as it
/// was when the records were made, not by how long it took to read them. (Timed by the
/// clock, a matcher that applied nothing for a minute of aggregator time — a JetStream
/// server killed, then its consumer stalled — took every node unreachable and made an op
/// final `completed_inferred` whose completion was the next message; a matcher restarted
/// after SIGKILL took live nodes unreachable while it read its backlog, likewise.)
/// The first record about it again (from the
/// ingest shard it failed over to, or the bus back after a stall) restores what its
/// ingest shard last said. A `silent` or `unreachable` statement from a shard that has
/// not heard the node since another shard said it was fresh is stale and ignored
/// (counted): the node failed over, and its old shard's connection timed out after.
/// Bounded by the ingest's `max_nodes` (turned away counted).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
struct BusLiveness {
    nodes: BTreeMap<NodeId, Heard>,
    /// The bus's time: the latest production time of a record applied.
    bus_ns: u64,
    /// No node's timer is due before this (0: none kept).
    next_due: u64,
    turned_away: u64,
    /// Liveness changes this core made for nodes nothing was said of, and restorations.
    synthesized: u64,
    restored: u64,
    /// `silent` / `unreachable` statements ignored as stale: the ingest shard that made
    /// them had not heard the node since another said it was fresh (it failed over).
    stale_ignored: u64,
}

/// [`Core::bus_liveness_counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BusLivenessCounts {
    /// Nodes nothing was said of for the ingest's unreachable time, taken unreachable.
    pub synthesized: u64,
    /// What their ingest shard said, restored by the next record about them.
    pub restored: u64,
    /// Nodes past the ingest's `max_nodes` (not tracked).
    pub turned_away: u64,
    /// `silent` / `unreachable` statements from an ingest shard that had not heard the
    /// node since another said it was fresh: ignored.
    pub stale_ignored: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
struct Heard {
    /// When a record about the node was last applied.
    at_ns: u64,
    /// What its ingest shard last said, and what this core says meanwhile (`None`:
    /// the ingest shard's word stands).
    stated: LivenessState,
    own: Option<LivenessState>,
    /// The latest `at_ns` of a `fresh` statement about the node (from any ingest shard).
    fresh_at_ns: u64,
}

/// The API role's copy of what the matcher shards published: their events, not yet
/// polled, and each shard's latest health.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
struct Mirror {
    events: crate::outbox::Outbox<MatcherEvent>,
    health: BTreeMap<u32, ShardHealth>,
}

/// What became of a batch handed to [`Core::receive_batch`], i.e. what to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// Applied: ack `applied`.
    Applied,
    /// Applied before: ack `duplicate`.
    Duplicate,
    /// Refused, nothing applied: nack `dedup_window_full`.
    DedupWindowFull,
    /// Refused, nothing applied: ingest's node cap is reached (counted in
    /// `IngestStats::nodes_refused_batches`); the shell closes the connection.
    NodeCapReached,
    /// Refused, nothing applied: a field no real shipper sends (see
    /// [`crate::plausible`]; counted in `IngestStats::implausible_batches`): nack
    /// `malformed_frame`.
    Implausible(Implausible),
}

/// What a `resume` did ([`Core::handle_resume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Resumed {
    /// The node cap refused the node: nothing applied; the shell closes the connection.
    pub refused: bool,
    /// Batches settled that this instance had not applied (acked elsewhere or lost).
    pub batches_settled: u64,
    /// Streams this instance had missed part of.
    pub stream_windows: u64,
}

impl Core {
    /// A fresh core started at `now`.
    #[must_use]
    pub fn new(ingest: IngestConfig, matcher: MatcherConfig, now: u64) -> Self {
        Self {
            ingest: Ingest::new(ingest, now),
            matcher: CollectiveMatcher::new(matcher),
            records: 0,
            role: Role::All,
            unpublished: Vec::new(),
            mirror: Mirror::default(),
            bus_position: 0,
            for_bus: Vec::new(),
            bus_liveness: BusLiveness::default(),
        }
    }

    /// Runs this core as `role` (see [`crate::shard`]). An ingest shard numbers its loss
    /// intervals from [`crate::shard::loss_id_base`] of its index, so ids stay unique
    /// across the shards a matcher hears from.
    pub fn set_role(&mut self, role: Role) {
        if let Role::Ingest { shard } = role {
            self.ingest.reserve_loss_ids(crate::shard::loss_id_base(shard));
            self.ingest.announce_new_nodes();
        }
        self.role = role;
    }

    /// The role this core runs.
    #[must_use]
    pub fn role(&self) -> Role {
        self.role
    }

    /// Ingest role: the records produced and not yet published, oldest first, each with
    /// its index and the aggregator time it was produced at.
    #[must_use]
    pub fn unpublished(&self) -> &[(u64, u64, Record)] {
        &self.unpublished
    }

    /// Ingest role: every record up to index `through` is published (the bus has it).
    pub fn mark_published(&mut self, through: u64) {
        let n = self.unpublished.partition_point(|(i, _, _)| *i <= through);
        self.unpublished.drain(..n);
    }

    /// Matcher role: records from the bus, in the order the shard's stream holds them,
    /// each taken as produced `now` (see [`Self::apply_bus_records`] for a bus batch).
    /// Records this shard does not own (another shard's communicators) are skipped and
    /// counted in the second number; the first is how many were applied.
    pub fn apply_records<'a>(&mut self, now: u64, records: impl IntoIterator<Item = &'a Record>) -> (u64, u64) {
        self.apply_timed(now, records.into_iter().map(|r| (now, r)))
    }

    /// Matcher role: a bus batch's records, `(index, production time, record)` as the
    /// ingest shard published them — the production time is the bus's time for each
    /// node's silence (see [`BusLiveness`]); one later than `now` (another machine's
    /// clock ahead, a corrupt message) counts as `now`. Returns what
    /// [`Self::apply_records`] does.
    pub fn apply_bus_records(&mut self, now: u64, records: &[(u64, u64, Record)]) -> (u64, u64) {
        self.apply_timed(now, records.iter().map(|(_, at, r)| ((*at).min(now), r)))
    }

    fn apply_timed<'a>(&mut self, now: u64, records: impl IntoIterator<Item = (u64, &'a Record)>) -> (u64, u64) {
        let (shard, shards) = match self.role {
            Role::Matcher { shard, shards } => (shard, shards),
            _ => (0, 1),
        };
        let (mut applied, mut skipped) = (0u64, 0u64);
        let matcher_role = matches!(self.role, Role::Matcher { .. });
        for (at, r) in records {
            if crate::shard::takes(r, shard, shards) {
                self.records = self.records.saturating_add(1);
                if !matcher_role || self.heard_on_bus(now, at, r) {
                    self.matcher.handle_record(now, r);
                }
                applied = applied.saturating_add(1);
            } else {
                skipped = skipped.saturating_add(1);
            }
        }
        if matcher_role {
            // The bus's time moved: a node it said nothing of may be due.
            self.bus_silence(now);
        }
        (applied, skipped)
    }

    /// Matcher role: a record about `r.node()` came off the bus (see [`BusLiveness`]).
    /// Returns whether to apply it: a `silent` or `unreachable` statement from an ingest
    /// shard that has not heard the node since another shard said it was fresh is stale
    /// (the node failed over, and its old shard's connection timed out later): applied,
    /// it would make a live node unreachable, then presumed dead, and its ranks final
    /// `unknown_silent`. Within one ingest shard such a statement's `last_heard_ns` is
    /// never before its own `fresh` statement's `at_ns` (both are its clock). Across
    /// shards the clocks differ by their skew: a statement misjudged stale for that only
    /// waits for this core's own timer below. `at`: when the ingest shard produced it.
    fn heard_on_bus(&mut self, now: u64, at: u64, r: &Record) -> bool {
        let node = r.node();
        self.bus_liveness.bus_ns = self.bus_liveness.bus_ns.max(at);
        if let Record::Liveness(l) = r
            && l.state != LivenessState::Fresh
            && self.bus_liveness.nodes.get(&node).is_some_and(|h| l.last_heard_ns < h.fresh_at_ns)
        {
            self.bus_liveness.stale_ignored = self.bus_liveness.stale_ignored.saturating_add(1);
            return false;
        }
        let cap = self.ingest.config().max_nodes;
        let due = at.saturating_add(self.ingest.config().silent_ns);
        let b = &mut self.bus_liveness;
        let len = b.nodes.len();
        let h = match b.nodes.entry(node) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                if len >= cap {
                    b.turned_away = b.turned_away.saturating_add(1);
                    return true;
                }
                v.insert(Heard { at_ns: at, stated: LivenessState::Fresh, own: None, fresh_at_ns: 0 })
            }
        };
        // A node failed over: its old shard's last records may come after the new one's.
        h.at_ns = h.at_ns.max(at);
        if b.next_due == 0 || due < b.next_due {
            b.next_due = due;
        }
        match r {
            Record::Liveness(l) => {
                h.stated = l.state;
                h.own = None;
                if l.state == LivenessState::Fresh {
                    h.fresh_at_ns = h.fresh_at_ns.max(l.at_ns);
                }
            }
            _ => {
                if h.own.take().is_some() {
                    b.restored = b.restored.saturating_add(1);
                    let back = Liveness { node, state: h.stated, at_ns: at, last_heard_ns: at };
                    self.matcher.handle_record(now, &Record::Liveness(back));
                }
            }
        }
        true
    }

    /// Matcher role: nodes nothing was said of while the bus carried the ingest's
    /// unreachable time of records are taken as unreachable — see [`BusLiveness`]. Due
    /// only once the bus's time (records applied) has moved that far.
    fn bus_silence(&mut self, now: u64) {
        let b = &mut self.bus_liveness;
        if b.next_due == 0 || b.bus_ns < b.next_due {
            return;
        }
        let cfg = self.ingest.config();
        let silent = cfg.silent_ns.saturating_add(cfg.reorder_timeout_ns);
        let unreachable = cfg.unreachable_ns.max(silent);
        let mut next = 0u64;
        for (&node, h) in &mut b.nodes {
            if h.stated == LivenessState::Unreachable {
                continue;
            }
            let quiet = b.bus_ns.saturating_sub(h.at_ns);
            // Unreachable only: a node taken silent here lets the matcher judge its ranks
            // `unknown_silent`, and a bus stall longer than `silent_ns` (seconds on a
            // loaded machine) is no sign of the node — that gave wrong final verdicts.
            let want = (quiet >= unreachable).then_some(LivenessState::Unreachable);
            if let Some(w) = want
                && w > h.stated
                && h.own.is_none_or(|o| w > o)
            {
                h.own = Some(w);
                b.synthesized = b.synthesized.saturating_add(1);
                let rec = Liveness { node, state: w, at_ns: b.bus_ns, last_heard_ns: h.at_ns };
                self.matcher.handle_record(now, &Record::Liveness(rec));
            }
            let due = match h.own.max(Some(h.stated)) {
                Some(LivenessState::Unreachable) => continue,
                _ => h.at_ns.saturating_add(unreachable),
            };
            if next == 0 || due < next {
                next = due;
            }
        }
        b.next_due = next;
    }

    /// Matcher role: nodes taken as unreachable because nothing was said of them on the
    /// bus, restorations of what their ingest shard said, nodes past the cap, and stale
    /// statements ignored (see [`BusLiveness`]).
    #[must_use]
    pub fn bus_liveness_counts(&self) -> BusLivenessCounts {
        let b = &self.bus_liveness;
        BusLivenessCounts {
            synthesized: b.synthesized,
            restored: b.restored,
            turned_away: b.turned_away,
            stale_ignored: b.stale_ignored,
        }
    }

    /// Matcher role: the stream sequence of the last bus message applied (0: none).
    #[must_use]
    pub fn bus_position(&self) -> u64 {
        self.bus_position
    }

    /// Matcher role: the bus message at stream sequence `seq` is applied.
    pub fn set_bus_position(&mut self, seq: u64) {
        self.bus_position = self.bus_position.max(seq);
    }

    /// Matcher role: events drained from this core, to go on the bus.
    pub fn keep_for_bus(&mut self, events: impl IntoIterator<Item = MatcherEvent>) {
        self.for_bus.extend(events);
    }

    /// Matcher role: the events not yet on the bus, oldest first.
    #[must_use]
    pub fn for_bus(&self) -> &[MatcherEvent] {
        &self.for_bus
    }

    /// Matcher role: the oldest `n` events are on the bus.
    pub fn mark_sent(&mut self, n: usize) {
        self.for_bus.drain(..n.min(self.for_bus.len()));
    }

    /// API role: a node's ingest state as its ingest shard published it (replacing what
    /// was held; an older summary than the one held — by the node's last-heard time — is
    /// ignored and `false` returned). Its bulk and interface rates are not carried: the
    /// API role shows none.
    pub fn install_node(&mut self, node: NodeId, summary: crate::shard::NodeSummary) -> bool {
        self.ingest.install_node(node, summary.state, summary.shipper, summary.owners)
    }

    /// API role: events a matcher shard published, to be polled by [`Self::poll_event`].
    pub fn inject_events(&mut self, events: impl IntoIterator<Item = MatcherEvent>) {
        self.mirror.events.extend(events);
    }

    /// API role: a matcher shard's latest health (an older one than held is ignored).
    pub fn set_shard_health(&mut self, health: ShardHealth) {
        let newer = self.mirror.health.get(&health.shard).is_none_or(|h| h.at_ns <= health.at_ns);
        if newer {
            self.mirror.health.insert(health.shard, health);
        }
    }

    /// The matcher's own node and GPU health (no telemetry-loss adjustment): what a
    /// matcher shard publishes.
    #[must_use]
    pub fn shard_health(&self, shard: u32, now: u64) -> ShardHealth {
        ShardHealth {
            shard,
            at_ns: now,
            nodes: self.matcher.node_health(now).into_iter().collect(),
            gpus: self.matcher.health(now).into_iter().map(|((n, g), h)| (n, g, h)).collect(),
        }
    }

    /// Node health before the P0-loss adjustment: the matcher's, or in the API role the
    /// worst any matcher shard reported.
    fn raw_node_health(&self, now: u64) -> BTreeMap<NodeId, Health> {
        if self.role != Role::Api {
            return self.matcher.node_health(now);
        }
        let mut out: BTreeMap<NodeId, Health> = BTreeMap::new();
        for h in self.mirror.health.values() {
            for (n, x) in &h.nodes {
                let e = out.entry(*n).or_insert(*x);
                *e = (*e).max(*x);
            }
        }
        out
    }

    fn raw_gpu_health(&self, now: u64) -> BTreeMap<(NodeId, [u8; 16]), Health> {
        if self.role != Role::Api {
            return self.matcher.health(now);
        }
        let mut out: BTreeMap<(NodeId, [u8; 16]), Health> = BTreeMap::new();
        for h in self.mirror.health.values() {
            for (n, g, x) in &h.gpus {
                let e = out.entry((*n, *g)).or_insert(*x);
                *e = (*e).max(*x);
            }
        }
        out
    }

    /// Ingest's state, to read (stats, node states, stream trackers).
    #[must_use]
    pub fn ingest(&self) -> &Ingest {
        &self.ingest
    }

    /// The matcher's state, to read (stats, knowledge gaps).
    #[must_use]
    pub fn matcher(&self) -> &CollectiveMatcher {
        &self.matcher
    }

    /// Every counter: ingest's, the matcher's and the batch dedup's.
    #[must_use]
    pub fn stats(&self) -> (crate::IngestStats, crate::matcher::MatcherStats, crate::dedup::DedupStats) {
        (*self.ingest.stats(), *self.matcher.stats(), *self.ingest.dedup().stats())
    }

    /// What ingest knows of a node (liveness, watermarks, clock), if anything.
    #[must_use]
    pub fn node_state(&self, node: NodeId) -> Option<&crate::ingest::NodeState> {
        self.ingest.node(node)
    }

    /// Every node ingest knows, restored ones included.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.ingest.node_ids()
    }

    /// A node's stream trackers, every epoch still held.
    pub fn trackers(&self, node: NodeId) -> impl Iterator<Item = &crate::loss::SeqTracker> {
        self.ingest.trackers(node)
    }

    /// The aggregator's own knowledge gaps about a node (see
    /// [`CollectiveMatcher::knowledge_gaps`]).
    #[must_use]
    pub fn knowledge_gaps(&self, node: NodeId) -> &[(u64, u64)] {
        self.matcher.knowledge_gaps(node)
    }

    /// Takes this run's configuration: timers and caps are configuration, not state, so a
    /// core restored from a snapshot runs with the service's flags, not the snapshot's.
    /// Ingest's tracker limits and dedup window stay the snapshot's: they shape state
    /// already held (a window narrowed under held batches would forget them).
    pub fn reconfigure(&mut self, ingest: IngestConfig, matcher: MatcherConfig) {
        self.ingest.reconfigure(ingest);
        self.matcher.reconfigure(matcher);
    }

    /// Every map the core keeps, with its size now and its cap (see [`crate::bounds`]).
    #[must_use]
    pub fn map_sizes(&self) -> Vec<crate::MapSize> {
        let mut out = self.ingest.map_sizes();
        out.extend(self.matcher.map_sizes());
        match self.role {
            Role::Ingest { .. } => out.push(crate::MapSize {
                name: "core.unpublished",
                len: self.unpublished.len(),
                cap: crate::shard::MAX_UNPUBLISHED,
            }),
            Role::Matcher { .. } => {
                out.push(crate::MapSize {
                    name: "core.for_bus",
                    len: self.for_bus.len(),
                    cap: crate::shard::MAX_UNPUBLISHED_EVENTS,
                });
                out.push(crate::MapSize {
                    name: "core.bus_liveness",
                    len: self.bus_liveness.nodes.len(),
                    cap: self.ingest.config().max_nodes,
                });
            }
            Role::All | Role::Api => {}
        }
        out
    }

    /// What every cap and retention turned away, by name (the counters behind
    /// [`Self::map_sizes`]'s caps).
    #[must_use]
    pub fn evictions(&self) -> Vec<(&'static str, u64)> {
        let i = self.ingest.stats();
        let m = self.matcher.stats();
        let d = self.ingest.dedup().stats();
        vec![
            ("ingest.trackers_retired", i.trackers_retired),
            ("ingest.settles_refused", i.settles_refused),
            ("ingest.streams_refused_frames", i.streams_refused_frames),
            ("ingest.nodes_refused_batches", i.nodes_refused_batches),
            ("ingest.dedup_sessions_forgotten", d.sessions_forgotten),
            ("matcher.ops_evicted", m.ops_evicted),
            ("matcher.recoverable_evicted", m.recoverable_evicted),
            ("matcher.final_stuck_evicted", m.final_stuck_evicted),
            ("matcher.groups_forgotten", m.groups_forgotten),
            ("matcher.comms_retired", m.comms_retired),
            ("matcher.comms_evicted", m.comms_evicted),
            ("matcher.procs_retired", m.procs_retired),
            ("matcher.procs_evicted", m.procs_evicted),
            ("matcher.gpus_evicted", m.gpus_evicted),
            ("matcher.nodes_evicted", m.nodes_evicted),
            ("matcher.homes_refused", m.homes_refused),
            ("matcher.seq_gap_ops_skipped", m.seq_gap_ops_skipped),
        ]
    }

    /// Records ingest has produced so far.
    #[must_use]
    pub fn records(&self) -> u64 {
        self.records
    }

    /// A validated batch from the network: applied once, however often it is resent
    /// (dedup key `(node, shipper_session, batch_seq)`).
    /// A batch whose fields are past what any shipper sends is refused whole, before
    /// dedup sees it ([`crate::plausible`]).
    pub fn receive_batch(&mut self, now: u64, node: NodeId, rtt_ns: u64, batch: &BatchView<'_>) -> Receipt {
        if let Err(why) = self.ingest.check_batch(batch) {
            return Receipt::Implausible(why);
        }
        let (session, seq) = (batch.header.shipper_session.get(), batch.header.batch_seq.get());
        match self.ingest.dedup_mut().check(node, session, seq) {
            Admit::Duplicate => return Receipt::Duplicate,
            Admit::WindowFull => return Receipt::DedupWindowFull,
            Admit::New => {}
        }
        if !self.apply_batch(now, node, rtt_ns, batch) {
            return Receipt::NodeCapReached;
        }
        self.ingest.dedup_mut().mark_applied(node, session, seq);
        Receipt::Applied
    }

    /// A connection's `resume`, applied before any of its batches: the session's dedup
    /// state settles what the shipper no longer holds, and every stream floor above what
    /// this instance saw opens a window that only held frames, loss records, kernel drop
    /// counts or `prior_instance` close (see [`crate::dedup`], [`crate::loss`]). `clock` is
    /// `(sent_ns, rtt_ns)`: the resume's node time and the connection's RTT.
    #[allow(clippy::too_many_arguments, reason = "one resume message's fields")]
    pub fn handle_resume(
        &mut self,
        now: u64,
        node: NodeId,
        session: u64,
        epoch: u64,
        next_batch_seq: u64,
        clock: (u64, u64),
        held: &[(u64, u64)],
        floors: &[(u32, u64)],
    ) -> Result<Resumed, Implausible> {
        self.ingest.check_resume(next_batch_seq, clock.0, held, floors)?;
        let Some(windows) = self.ingest.handle_resume(now, node, epoch, clock, floors) else {
            return Ok(Resumed { refused: true, ..Resumed::default() });
        };
        let batches_settled = self.ingest.dedup_mut().resume(node, session, next_batch_seq, held);
        self.pump(now);
        Ok(Resumed { refused: false, batches_settled, stream_windows: windows })
    }

    /// A validated batch, applied without dedup (see [`Ingest::handle_batch`]); refused
    /// whole, like [`Self::receive_batch`], when a field is implausible.
    pub fn handle_batch(&mut self, now: u64, node: NodeId, rtt_ns: u64, batch: &BatchView<'_>) -> Receipt {
        if let Err(why) = self.ingest.check_batch(batch) {
            return Receipt::Implausible(why);
        }
        if self.apply_batch(now, node, rtt_ns, batch) { Receipt::Applied } else { Receipt::NodeCapReached }
    }

    fn apply_batch(&mut self, now: u64, node: NodeId, rtt_ns: u64, batch: &BatchView<'_>) -> bool {
        let ok = self.ingest.handle_batch(now, node, rtt_ns, batch);
        self.pump(now);
        ok
    }

    /// A node's connection closed.
    pub fn handle_connection_closed(&mut self, now: u64, node: NodeId) {
        self.ingest.handle_connection_closed(now, node);
        self.pump(now);
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: u64) {
        self.ingest.handle_timeout(now);
        self.pump(now);
        self.matcher.handle_timeout(now);
    }

    /// When to call `handle_timeout` next. (A matcher's bus liveness keeps no timer: the
    /// bus's time moves only as records are applied.)
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        [self.ingest.poll_timeout(), self.matcher.poll_timeout()].into_iter().flatten().min()
    }

    /// Frames of `node`'s P0 (lifecycle) streams lost by any cause, net of revivals, and
    /// how many its P0 streams attempted as far as this instance knows (received, lost,
    /// another instance's, pending or in transit), over every epoch (retired ones from
    /// their totals).
    #[must_use]
    pub fn p0_loss(&self, node: NodeId) -> (u64, u64) {
        let retired = self.ingest.node(node).map(|n| n.retired).unwrap_or_default();
        let start = (retired.p0_lost, retired.p0_known);
        self.ingest.trackers(node).filter(|t| t.key.stream_id >> 24 == 0).fold(start, |(lost, seen), t| {
            // Counts rest on heartbeat numbers from the wire (`attempted` may be anything
            // up to u64::MAX): saturate, never overflow.
            (lost.saturating_add(t.counts().lost_total()), seen.saturating_add(crate::ingest::p0_known(t)))
        })
    }

    /// Node health: the matcher's (its worst GPU, or its liveness), and `healthy_lossy`
    /// for an otherwise healthy node whose P0 telemetry lost frames — telemetry loss is
    /// what the operator is told, whether or not a verdict had to infer around it (and
    /// whatever the order in which the loss and the verdicts it touches were learnt).
    #[must_use]
    pub fn node_health(&self, now: u64) -> BTreeMap<NodeId, Health> {
        let mut out = self.raw_node_health(now);
        for (node, h) in &mut out {
            *h = self.with_p0_loss(*node, *h);
        }
        out
    }

    /// GPU health, `(node, gpu_uuid)`: the matcher's, with `healthy_lossy` for an
    /// otherwise healthy GPU of a node whose P0 telemetry lost frames (a node's P0 streams
    /// are per CPU and carry every rank of it).
    #[must_use]
    pub fn gpu_health(&self, now: u64) -> BTreeMap<(NodeId, [u8; 16]), Health> {
        let mut out = self.raw_gpu_health(now);
        let mut lossy: BTreeMap<NodeId, bool> = BTreeMap::new();
        for ((node, _), h) in &mut out {
            let l = *lossy.entry(*node).or_insert_with(|| self.p0_loss(*node).0 > 0);
            if *h == Health::Healthy && l {
                *h = Health::HealthyLossy;
            }
        }
        out
    }

    fn with_p0_loss(&self, node: NodeId, h: Health) -> Health {
        if h == Health::Healthy && self.p0_loss(node).0 > 0 { Health::HealthyLossy } else { h }
    }

    /// The next verdict or recovery event.
    pub fn poll_event(&mut self) -> Option<MatcherEvent> {
        if self.role == Role::Api {
            return self.mirror.events.poll();
        }
        self.matcher.poll_event()
    }

    fn pump(&mut self, now: u64) {
        while let Some(r) = self.ingest.poll_record() {
            let index = self.records;
            self.records = self.records.saturating_add(1);
            match self.role {
                Role::Ingest { .. } => self.unpublished.push((index, now, r)),
                // The API role's ingest holds installed node states only: what its own
                // timers derive from them is no telemetry (the matcher shards decide).
                Role::Api => {}
                Role::All | Role::Matcher { .. } => self.matcher.handle_record(now, &r),
            }
        }
    }

    pub(crate) fn restart_knowledge(&mut self, snapshot_ns: u64) {
        self.ingest.restart_knowledge(snapshot_ns, true);
    }

    /// This fresh core stands in for a snapshot taken at `snapshot_ns` that could not be
    /// restored (another build's format): every node gets a knowledge gap from then to
    /// its first batch, as after a restore; what the shippers' resume floors say an
    /// earlier instance had is `prior_instance`, as after a start without state.
    pub fn forget_since(&mut self, snapshot_ns: u64) {
        self.ingest.restart_knowledge(snapshot_ns, false);
    }
}
