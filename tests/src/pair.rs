//! A deterministic harness of the real state machines, in simulated time (after
//! quinn-proto's `Pair` test harness): one real [`ShipperCore`] per simulated node and
//! one real [`Core`], wired as their I/O shells wire them — `node-shipper/src/driver.rs`
//! (the reader loop, the network task, the control reader), `aggregator/src/ingest/mod.rs`
//! (resume, batches, answers, connection close) and the aggregator's timer task — over a
//! modelled QUIC network, fed by one [`Simulation`]. The harness is the shell: time is
//! one `u64` ns clock it advances from event to event; nothing sleeps or reads a clock,
//! so a run is a function of its [`PairConfig`] (seeds included).
//!
//! The network is what QUIC gives each connection: every batch on its own stream (a
//! one-way delay plus seeded jitter each, so batches of one connection reorder only by
//! that jitter), the control streams ordered (the shipper's preface and `resume`; the
//! aggregator's `hello`, acks and nacks, each message no earlier than the one before
//! it), no datagram loss. Faults ([`NetFault`]): a partition delivers nothing whose
//! flight overlaps its window, and closes the connection at its end (or at the idle
//! timeout, when that comes first, as QUIC's does); a handshake tried during it completes
//! once it heals if that is within the idle timeout, and fails at the idle timeout
//! otherwise; a reset loses everything in flight on the connection. Both ends learn of
//! either at once (the aggregator runs `Core::handle_connection_closed`); a node that dies
//! closes its endpoint, which the aggregator learns a one-way delay later. After a close
//! the shipper reconnects
//! after the driver's backoff (100 ms doubling to 5 s, equal jitter), sends its `resume`,
//! and sends again everything unacked (`ShipperCore::reconnected`).
//!
//! Verdicts are judged as [`Core::poll_event`] yields them and then dropped (see
//! [`Judge`]); maps are checked against their caps every [`PairConfig::map_check_ns`].
//!
//! Not modelled: a batch stream that fails alone (`ShipperCore::handle_send_failed`; here
//! streams fail only with their connection), the aggregator stopping a stream that
//! stalls, flow-control windows (the spool's bulk window still bounds what is in
//! flight), processing time (the aggregator answers the instant a batch arrives), shipper
//! and aggregator restarts.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use loadgen::score::{NodeFate, agrees};
use loadgen_sim::expect::Table;
use loadgen_sim::sim::{EpochInfo, Sink, Snapshot};
use loadgen_sim::{GroundTruth, Scenario, SimOptions, Simulation};
use node_shipper::core::backoff::Backoff;
use node_shipper::core::batcher::SessionMeta;
use node_shipper::core::{
    EpochStart, SamplingConfig, SamplingPolicy, ShipperCore, ShipperStats, SourceCounters, Unflushed,
};
use proto_flat::batch::{BatchHeader, BatchView, SummaryCheck};
use proto_flat::codes::{AckStatus, Durability, NackReason, WireEnum};
use proto_flat::control::{
    CONTROL_VERSION, ControlMessage, encode_ack, encode_hello, encode_nack, encode_resume, parse_control,
};
use ringwatch_core::matcher::MatcherStats;
use ringwatch_core::verdict::{MatcherEvent, OpRef, Verdict};
use ringwatch_core::{Core, Health, IngestStats, NodeId, Receipt};
use ringwatch_transport::CONTROL_PREFACE;
use zerocopy::FromBytes;

const MS: u64 = 1_000_000;

/// A network fault on one node's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetFault {
    /// Nothing in flight in `[from_ns, until_ns)` is delivered, either way; the
    /// connection is reset at `until_ns`, or at `from_ns` + the idle timeout if sooner.
    Partition { node: u32, from_ns: u64, until_ns: u64 },
    /// The connection is reset at `at_ns`: everything in flight on it is lost.
    Reset { node: u32, at_ns: u64 },
}

/// The modelled network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// One-way delay of every message.
    pub one_way_ns: u64,
    /// Each message is delayed a further uniform `[0, jitter_ns)`.
    pub jitter_ns: u64,
    /// QUIC's idle timeout (`Tuning::idle_timeout_ms`): a partition closes a connection
    /// after this long, and a handshake that cannot complete fails after it.
    pub idle_timeout_ns: u64,
    /// Seeds the jitter, the session ids and the backoff draws.
    pub seed: u64,
}

impl Default for NetConfig {
    fn default() -> Self {
        let idle = u64::from(ringwatch_transport::Tuning::default().idle_timeout_ms) * MS;
        Self { one_way_ns: 200_000, jitter_ns: 300_000, idle_timeout_ns: idle, seed: 1 }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct PairConfig {
    /// The workload (the simulator's scenario; its timers configure the aggregator as
    /// `loadgen::cluster::aggregator_config` does at time scale 1).
    pub scenario: Scenario,
    pub options: SimOptions,
    pub net: NetConfig,
    pub faults: Vec<NetFault>,
    /// Simulated time run after the simulation's end: the shippers keep heartbeating
    /// with their final counters (a finished source, as the driver does), so the last
    /// gaps settle and the last verdicts become final.
    pub settle_ns: u64,
    /// How often each shipper's reader polls the simulator and runs the core's timers
    /// (the driver's reader loop turns about every millisecond).
    pub poll_ns: u64,
    /// How often [`Core::map_sizes`] is checked against the caps.
    pub map_check_ns: u64,
    /// Keep the last verdict of every (op, rank) for [`Report::last_verdicts`] (short
    /// runs that look at verdicts one by one; a long run judges and drops them).
    pub keep_verdicts: bool,
    /// The aggregator core's role (`All` for every verdict test; `Ingest` keeps its
    /// records unpublished in [`Report::core`] for the shard tests to replay).
    pub role: ringwatch_core::shard::Role,
}

impl PairConfig {
    /// A short run of `scenario` for tests that look at its verdicts: the default
    /// network, no faults, verdicts kept, and a settle time long enough for everything
    /// owed to become final (a dead node gates finality until it is presumed dead:
    /// the unreachable timer plus `MatcherConfig::dead_after_ns` after its death).
    #[must_use]
    pub fn verdicts_of(scenario: Scenario, bulk_scale: f64) -> Self {
        let (last_death, horizon) = Simulation::new(&scenario, SimOptions { bulk_scale, seed: None })
            .map_or((None, 0), |sim| {
                (sim.model().dead_at.iter().copied().filter(|&d| d != u64::MAX).max(), sim.horizon_ns())
            });
        let settle_ns = 60_000 * MS
            + last_death.map_or(0, |d| {
                d.saturating_sub(horizon)
                    + ringwatch_core::IngestConfig::default().unreachable_ns
                    + ringwatch_core::MatcherConfig::default().dead_after_ns
            });
        Self {
            scenario,
            options: SimOptions { bulk_scale, seed: None },
            net: NetConfig::default(),
            faults: Vec::new(),
            settle_ns,
            poll_ns: MS,
            map_check_ns: 60_000 * MS,
            keep_verdicts: true,
            role: ringwatch_core::shard::Role::All,
        }
    }
}

/// The node id the harness gives simulated node `node` (its shipper's node name's id).
#[must_use]
pub fn node_id(node: u32) -> NodeId {
    NodeId(proto_flat::node_id_of(&aggregator::certs::node_name(node)))
}

/// How long after the simulation's end [`Report::health_at_sim_end`] is read (the
/// shippers are still heartbeating then; the last ops are still settling).
pub const HEALTH_AFTER_SIM_NS: u64 = 2_000 * MS;

/// One map's largest size seen, and its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MapWater {
    pub high: usize,
    pub cap: usize,
}

/// How the verdicts fared.
#[derive(Debug, Clone, Default)]
pub struct VerdictScore {
    /// Ranks the truth owes a verdict by the run's end (`decidable`), of ops some rank
    /// entered.
    pub decidable_ranks: u64,
    /// Ops of the schedule no rank entered (nothing of them on the wire): not scored.
    pub ops_never_issued: u64,
    /// First final verdicts of decidable ranks, judged.
    pub judged: u64,
    pub right: u64,
    pub wrong: u64,
    /// Right verdicts by outcome (base name).
    pub right_by_outcome: BTreeMap<String, u64>,
    /// Wrong verdicts by `owed → got` (base names), and by the node of the rank.
    pub wrong_by_kind: BTreeMap<String, u64>,
    pub wrong_by_node: BTreeMap<u32, u64>,
    /// The first wrong ones, described.
    pub wrong_examples: Vec<String>,
    /// Judged right only because the truth says the rank lost frames (settled at the end,
    /// from the simulator's final truth).
    pub right_by_lost_frames: u64,
    /// Final verdicts again for a rank already judged (an outcome or tags changed after
    /// final), judged again.
    pub refinals: u64,
    pub refinals_wrong: u64,
    /// Final verdicts of ranks the truth does not call decidable by the run's end (the
    /// aggregator decided them while the run settled), and of graph replays: not scored.
    pub not_scored: u64,
    /// Final verdicts of ops the truth does not know, or re-finals of ranks judged too
    /// long ago to be judged again.
    pub unknown: u64,
    /// Non-final verdict events, and `Recovered` events.
    pub non_final_events: u64,
    pub recovered_events: u64,
    /// Decidable ranks with no final verdict at the end; those whose op was scheduled
    /// before the end minus (stuck deadline + reorder timeout + 2 heartbeats); and how
    /// many of those a dead node gates.
    pub non_final: u64,
    pub non_final_old: u64,
    pub non_final_old_gated_by_dead: u64,
    pub non_final_examples: Vec<String>,
}

/// What one shipper did.
#[derive(Debug, Clone)]
pub struct ShipperSummary {
    pub node: u32,
    pub stats: ShipperStats,
    pub unacked: Unflushed,
    pub connections: u64,
    pub connect_failures: u64,
    /// Frames the simulator gave it.
    pub frames_from_sim: u64,
    pub dead: bool,
}

/// Network counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    pub batches_sent: u64,
    pub batches_delivered: u64,
    pub batches_lost: u64,
    pub control_sent: u64,
    pub control_lost: u64,
    pub connections: u64,
    pub handshakes_failed: u64,
    pub resets: u64,
    pub partition_closes: u64,
    pub acks_applied_batches: u64,
    pub answers_duplicate: u64,
    pub nacks: u64,
}

/// Everything a run produced.
#[derive(Debug, Clone)]
pub struct Report {
    /// Simulated time at the end of the simulation, and of the run.
    pub sim_end_ns: u64,
    pub end_ns: u64,
    pub verdicts: VerdictScore,
    /// Per map name: the largest size seen, and its cap.
    pub maps: BTreeMap<&'static str, MapWater>,
    /// Checks of `map_sizes`, and every `len > cap` seen (name, len, cap, time).
    pub map_checks: u64,
    pub map_violations: Vec<(&'static str, usize, usize, u64)>,
    /// The project's conservation rule (`loadgen::score::conservation`) per node.
    pub conservation: Vec<loadgen::score::NodeConservation>,
    pub shippers: Vec<ShipperSummary>,
    pub ingest: IngestStats,
    pub matcher: MatcherStats,
    pub records: u64,
    pub net: NetStats,
    /// Aggregator timer turns (`Core::handle_timeout` calls).
    pub timer_turns: u64,
    /// The last verdict of every (op, rank), with [`PairConfig::keep_verdicts`].
    pub last_verdicts: BTreeMap<(OpRef, u32), Verdict>,
    /// `Core::node_health` [`HEALTH_AFTER_SIM_NS`] after the simulation's end.
    pub health_at_sim_end: BTreeMap<NodeId, Health>,
    /// Each node's bulk event rate as the aggregator estimated it at the simulation's
    /// end (the settle time after it has no events: the rate falls to 0 there).
    pub bulk_rates_at_sim_end: BTreeMap<NodeId, Option<ringwatch_core::rates::Rate>>,
    /// Each node's per-interface rates at the same moment.
    pub interface_rates_at_sim_end: BTreeMap<NodeId, Vec<ringwatch_core::rates::InterfaceRate>>,
    /// The aggregator's core as the run left it.
    pub core: Core,
    /// The simulator's truth (its collectives only with [`PairConfig::keep_verdicts`]).
    pub truth: GroundTruth,
}

// ------------------------------------------------------------------ the simulator sink

#[derive(Debug, Clone, Copy)]
enum SimEvent {
    Frame(usize, usize),
    Epoch(EpochStart),
    Counters(usize),
}

/// One simulation step's output, per node, in order.
#[derive(Debug, Default)]
struct Collect {
    arena: Vec<u8>,
    events: Vec<Vec<SimEvent>>,
    counters: Vec<SourceCounters>,
    frames: Vec<u64>,
}

impl Sink for Collect {
    fn frame(&mut self, node: u32, frame: &[u8]) {
        let start = self.arena.len();
        self.arena.extend_from_slice(frame);
        if let Some(e) = self.events.get_mut(node as usize) {
            e.push(SimEvent::Frame(start, self.arena.len()));
        }
        if let Some(n) = self.frames.get_mut(node as usize) {
            *n += 1;
        }
    }

    fn snapshot(&mut self, node: u32, s: &Snapshot<'_>) {
        self.counters.push(SourceCounters {
            epoch: s.epoch,
            mono_ns: s.mono_ns,
            streams: s.streams.to_vec(),
            progress: s.progress.to_vec(),
            owners: Vec::new(),
            interfaces: s.interfaces.to_vec(),
        });
        let i = self.counters.len() - 1;
        if let Some(e) = self.events.get_mut(node as usize) {
            e.push(SimEvent::Counters(i));
        }
    }

    fn epoch(&mut self, node: u32, info: &EpochInfo) {
        if let Some(e) = self.events.get_mut(node as usize) {
            e.push(SimEvent::Epoch(EpochStart {
                epoch: info.epoch,
                boot_id: info.boot_id,
                mono_ns: info.mono_ns,
                start_realtime_ns: info.start_realtime_ns,
            }));
        }
    }
}

// ------------------------------------------------------------------ the network

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The control stream's preface and `resume` (shipper → aggregator).
    Resume,
    /// One batch stream (shipper → aggregator).
    Batch,
    /// Control messages (aggregator → shipper).
    Control,
    /// The shipper closed its endpoint (its node died): the aggregator learns it.
    Close,
}

#[derive(Debug)]
struct Flight {
    at: u64,
    order: u64,
    sent: u64,
    conn: u64,
    kind: Kind,
    bytes: Vec<u8>,
}

impl PartialEq for Flight {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.order) == (other.at, other.order)
    }
}
impl Eq for Flight {}
impl PartialOrd for Flight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Flight {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.order).cmp(&(other.at, other.order))
    }
}

/// One connection as both ends see it.
#[derive(Debug)]
struct Conn {
    node: u32,
    open_shipper: bool,
    open_aggregator: bool,
    /// When its `resume` reaches the aggregator (batches are read only after it).
    resume_at: u64,
    resumed: bool,
    /// The last control message's arrival at the shipper (the stream is ordered).
    control_last: u64,
    /// Answers produced this turn, written at its end (the control writer).
    answers: Vec<Answer>,
    rejected: u64,
}

#[derive(Debug, Clone, Copy)]
enum Answer {
    Ack(u64, AckStatus, u64),
    Nack(u64, u64, NackReason),
}

// ------------------------------------------------------------------ the shipper side

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Waiting to connect.
    Down {
        retry_at: u64,
    },
    /// A handshake in progress: it completes (`ok`) or fails at `done_at`.
    Handshake {
        done_at: u64,
        ok: bool,
    },
    Up {
        conn: u64,
    },
    /// The node died: the shipper is gone.
    Gone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SourceState {
    Running,
    Finished,
}

#[derive(Debug)]
struct Shipper {
    node: u32,
    id: NodeId,
    core: ShipperCore,
    sampling: SamplingPolicy,
    /// The source's latest counters (a finished source keeps heartbeating with them).
    counters: SourceCounters,
    source: SourceState,
    link: Link,
    backoff: Backoff,
    /// The driver's xorshift for the backoff's jitter draw.
    rng_state: u64,
    connections: u64,
    connect_failures: u64,
    dead_at: u64,
}

impl Shipper {
    /// The driver's reconnect delay: backoff with a uniform draw.
    fn backoff_ns(&mut self) -> u64 {
        let mut s = self.rng_state;
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        self.rng_state = s;
        #[allow(clippy::cast_precision_loss, reason = "a uniform draw needs 53 bits")]
        let unit = (s >> 11) as f64 / (1u64 << 53) as f64;
        self.backoff.next_ms(unit) * MS
    }
}

// ------------------------------------------------------------------ the judge

const COMPLETED: u8 = 1;
const GATED_BY_DEAD: u8 = 2;
const UNDECIDABLE: u8 = 4;
const NO_ALT: u32 = u32::MAX;

/// What the truth owes one rank of one op (interned outcome names).
#[derive(Debug, Clone, Copy)]
struct Owed {
    outcome: u32,
    alternative: u32,
    flags: u8,
    node: u32,
    sched_ms: u64,
}

/// `(kind: 0 collective / 1 p2p, comm hash, seq, rank)`, as the scorer keys ops.
type Key = (u8, u64, u64, u32);

/// Judges final verdicts as they come: what each rank is owed is computed once, before
/// the run, from the simulator's truth (the simulator computes its whole
/// timeline up front; it has no incremental truth) with the scorer's table
/// (`loadgen_sim::expect::Table`) and compared with the scorer's equivalences
/// (`loadgen::score::agrees`); each entry leaves the index when its rank's first final
/// verdict is judged (a short queue of judged entries stays for re-finals), and no
/// verdict is kept. The one fact the truth lacks before the run — which ranks' frames the
/// kernel dropped — settles, at the end, the few verdicts only it can make right
/// (`completed_inferred` owed `completed`).
#[derive(Debug)]
pub struct Judge {
    names: Vec<String>,
    owed: HashMap<Key, Owed>,
    /// Keys shared by more than one op (colliding communicators): right only if right
    /// for each.
    shared: HashMap<Key, Vec<Owed>>,
    judged_recent: HashMap<Key, Vec<Owed>>,
    judged_order: VecDeque<Key>,
    /// Verdicts right only if their rank lost frames: (key, verdict outcome, a re-final?,
    /// what the rank is owed).
    deferred: Vec<(Key, String, bool, Vec<Owed>)>,
    dead_at: Vec<u64>,
    score: VerdictScore,
    reorder_ms: u64,
}

/// Judged entries kept for re-final verdicts.
const JUDGED_MEMORY: usize = 1 << 16;

/// How long before its node's death an op may have frames that died with the shipper.
const DEATH_REACH_MS: u64 = 30_000;

fn base(s: &str) -> &str {
    s.split('(').next().unwrap_or("")
}

fn key_of(op: &OpRef, rank: u32) -> Option<Key> {
    match *op {
        OpRef::Coll { comm, seq } => Some((0, comm.hash, seq, rank)),
        OpRef::P2p { comm, p2p_seq, .. } => Some((1, comm.hash, p2p_seq, rank)),
        OpRef::Graph { .. } => None,
    }
}

fn truth_key(c: &loadgen_sim::truth::CollectiveTruth) -> Option<(u8, u64, u64)> {
    if c.graph_replay.is_some() {
        None
    } else if let Some(p) = c.p2p_seq {
        Some((1, c.comm_hash, p))
    } else if c.comm_op_seq > 0 {
        Some((0, c.comm_hash, c.comm_op_seq))
    } else {
        None
    }
}

impl Judge {
    /// The index of what every rank of every entered op is owed, and whether the truth
    /// calls it decidable by the run's end. `reorder_ms`: the aggregator's reorder
    /// timeout in simulated ms (the table's slack).
    fn new(truth: &GroundTruth, reorder_ms: u64, dead_at: Vec<u64>) -> Self {
        #[allow(clippy::cast_precision_loss, reason = "ms")]
        let table = Table::new(truth, reorder_ms as f64);
        let mut j = Self {
            names: Vec::new(),
            owed: HashMap::new(),
            shared: HashMap::new(),
            judged_recent: HashMap::new(),
            judged_order: VecDeque::new(),
            deferred: Vec::new(),
            dead_at,
            score: VerdictScore::default(),
            reorder_ms,
        };
        let mut intern: HashMap<String, u32> = HashMap::new();
        let mut name = |s: &str, names: &mut Vec<String>| -> u32 {
            if let Some(&i) = intern.get(s) {
                return i;
            }
            let i = u32::try_from(names.len()).unwrap_or(u32::MAX);
            names.push(s.to_owned());
            intern.insert(s.to_owned(), i);
            i
        };
        for c in &truth.collectives {
            let Some((kind, hash, seq)) = truth_key(c) else { continue };
            if !c.ranks.iter().any(|r| r.entered) {
                j.score.ops_never_issued += 1;
                continue;
            }
            let gated = c.ranks.iter().any(|r| j.dead_at.get(r.node as usize).is_some_and(|&d| d != u64::MAX));
            for r in &c.ranks {
                let e = table.expected(c, r);
                let outcome = name(&e.outcome, &mut j.names);
                let alternative = e.alternative.as_deref().map_or(NO_ALT, |a| name(a, &mut j.names));
                let mut flags = 0;
                if r.completed {
                    flags |= COMPLETED;
                }
                if gated {
                    flags |= GATED_BY_DEAD;
                }
                if !e.decidable {
                    flags |= UNDECIDABLE;
                }
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "ms of a run")]
                let sched_ms = c.sched_ms.max(0.0) as u64;
                let owed = Owed { outcome, alternative, flags, node: r.node, sched_ms };
                let key = (kind, hash, seq, r.rank);
                if let Some(first) = j.owed.get(&key).copied() {
                    j.shared.entry(key).or_insert_with(|| vec![first]).push(owed);
                } else {
                    // Counted once per key, as the scorer does.
                    if e.decidable {
                        j.score.decidable_ranks += 1;
                    }
                    j.owed.insert(key, owed);
                }
            }
        }
        j
    }

    /// What became of the node of `o`'s rank, as far as the op goes: the scorer's fate
    /// of the node, except that a node that died is alive for ops scheduled more than
    /// [`DEATH_REACH_MS`] before its death (their frames were long acked; the scorer's
    /// excuses for a dead node cover only what died with its shipper).
    fn fate(&self, o: &Owed, fate: &dyn Fn(u32) -> NodeFate) -> NodeFate {
        let dead_ms = self.dead_at.get(o.node as usize).map_or(u64::MAX, |&d| d / MS);
        if o.sched_ms.saturating_add(DEATH_REACH_MS) < dead_ms { NodeFate::Alive } else { fate(o.node) }
    }

    /// Whether `got` is right for `o`, with `lost` standing for the rank's lost frames.
    fn agrees(&self, o: &Owed, got: &str, lost: u32, fate: NodeFate) -> bool {
        let completed = o.flags & COMPLETED != 0;
        let name = |i: u32| self.names.get(i as usize).map_or("", String::as_str);
        agrees(name(o.outcome), got, lost, fate, completed)
            || (o.alternative != NO_ALT && agrees(name(o.alternative), got, lost, fate, completed))
    }

    fn describe(&self, o: &Owed) -> String {
        let name = |i: u32| self.names.get(i as usize).map_or("", String::as_str);
        if o.alternative == NO_ALT {
            name(o.outcome).to_owned()
        } else {
            format!("{} or {}", name(o.outcome), name(o.alternative))
        }
    }

    /// One verdict event, judged now and dropped. `fate` says what became of a node.
    fn on_event(&mut self, e: &MatcherEvent, fate: &dyn Fn(u32) -> NodeFate) {
        let v: &Verdict = match e {
            MatcherEvent::Verdict(v) => v,
            MatcherEvent::Recovered { .. } => {
                self.score.recovered_events += 1;
                return;
            }
        };
        if !v.is_final {
            self.score.non_final_events += 1;
            return;
        }
        let Some(key) = key_of(&v.op, v.rank) else {
            self.score.not_scored += 1;
            return;
        };
        let got = v.outcome.name();
        if let Some(list) = self.judged_recent.get(&key) {
            // A final verdict again for a rank already judged (or already not scored).
            self.score.refinals += 1;
            let list = list.clone();
            if list.iter().any(|o| o.flags & UNDECIDABLE != 0)
                || list.iter().all(|o| self.agrees(o, &got, 0, self.fate(o, fate)))
            {
                return;
            }
            if list.iter().all(|o| self.agrees(o, &got, 1, self.fate(o, fate))) {
                // Right only if the rank lost frames: settled at the end.
                self.deferred.push((key, got, true, list));
                return;
            }
            self.score.refinals_wrong += 1;
            self.note_wrong(&list, &key, &got, v);
            return;
        }
        let list: Vec<Owed> = if let Some(list) = self.shared.remove(&key) {
            self.owed.remove(&key);
            list
        } else if let Some(o) = self.owed.remove(&key) {
            vec![o]
        } else {
            // An op the truth does not know (a re-final of a rank judged long ago lands
            // here too).
            self.score.unknown += 1;
            return;
        };
        let plain = list.iter().all(|o| self.agrees(o, &got, 0, self.fate(o, fate)));
        let with_loss = list.iter().all(|o| self.agrees(o, &got, 1, self.fate(o, fate)));
        if list.iter().any(|o| o.flags & UNDECIDABLE != 0) {
            // The truth owes nothing by the run's end (the scorer does not score it).
            self.score.not_scored += 1;
        } else if plain {
            self.score.judged += 1;
            self.score.right += 1;
            *self.score.right_by_outcome.entry(base(&got).to_owned()).or_default() += 1;
        } else if with_loss {
            self.score.judged += 1;
            self.deferred.push((key, got.clone(), false, list.clone()));
        } else {
            self.score.judged += 1;
            self.score.wrong += 1;
            self.note_wrong(&list, &key, &got, v);
        }
        self.judged_recent.insert(key, list);
        self.judged_order.push_back(key);
        while self.judged_order.len() > JUDGED_MEMORY {
            if let Some(old) = self.judged_order.pop_front() {
                self.judged_recent.remove(&old);
            }
        }
    }

    fn note_wrong(&mut self, list: &[Owed], key: &Key, got: &str, v: &Verdict) {
        if let Some(o) = list.first() {
            *self.score.wrong_by_node.entry(o.node).or_default() += 1;
        }
        let owed = list.first().map(|o| self.describe(o)).unwrap_or_default();
        let kind = format!(
            "{} → {}",
            list.first().map_or("", |o| base(self.names.get(o.outcome as usize).map_or("", String::as_str))),
            base(got)
        );
        *self.score.wrong_by_kind.entry(kind).or_default() += 1;
        if self.score.wrong_examples.len() < 20 {
            self.score.wrong_examples.push(format!(
                "{}{:016x}#{} rank {}: owed {owed}, verdict {got} (decided {} ms, revision {}, tags {:?}, rule {:?})",
                if key.0 == 0 { "" } else { "p2p " },
                key.1,
                key.2,
                key.3,
                v.decided_at_ns / MS,
                v.revision,
                v.tags,
                v.evidence.rule,
            ));
        }
    }

    /// The end: deferred verdicts settled with the final truth's lost frames; what is
    /// left unjudged counted.
    fn finish(&mut self, truth: &GroundTruth, end_ns: u64, stuck_ms: u64, heartbeat_ms: u64) {
        if !self.deferred.is_empty() {
            let mut lost: HashMap<Key, u32> = HashMap::new();
            let wanted: std::collections::HashSet<Key> = self.deferred.iter().map(|d| d.0).collect();
            for c in &truth.collectives {
                let Some((kind, hash, seq)) = truth_key(c) else { continue };
                for r in &c.ranks {
                    let key = (kind, hash, seq, r.rank);
                    if wanted.contains(&key) {
                        let l = lost.entry(key).or_default();
                        *l = (*l).max(r.lost_frames);
                    }
                }
            }
            for (key, got, refinal, list) in std::mem::take(&mut self.deferred) {
                let frames = lost.get(&key).copied().unwrap_or(0);
                // Only a rank whose frames were lost makes these right (the fate of a
                // dead node was already enough otherwise, and judged then).
                let ok = frames > 0 && list.iter().all(|o| self.agrees(o, &got, frames, NodeFate::Alive));
                if ok {
                    if !refinal {
                        self.score.right += 1;
                        self.score.right_by_lost_frames += 1;
                        *self.score.right_by_outcome.entry(base(&got).to_owned()).or_default() += 1;
                    }
                } else {
                    if refinal {
                        self.score.refinals_wrong += 1;
                    } else {
                        self.score.wrong += 1;
                    }
                    let owed = list.first().map(|o| self.describe(o)).unwrap_or_default();
                    let kind = format!(
                        "{} → {} (no frame lost)",
                        list.first()
                            .map_or("", |o| base(self.names.get(o.outcome as usize).map_or("", String::as_str))),
                        base(&got)
                    );
                    *self.score.wrong_by_kind.entry(kind).or_default() += 1;
                    if let Some(o) = list.first() {
                        *self.score.wrong_by_node.entry(o.node).or_default() += 1;
                    }
                    if self.score.wrong_examples.len() < 20 {
                        self.score.wrong_examples.push(format!(
                            "{:016x}#{} rank {}: owed {owed}, verdict {got}, but the truth says it lost no frame",
                            key.1, key.2, key.3
                        ));
                    }
                }
            }
        }
        let end_ms = end_ns / MS;
        let old_before = end_ms.saturating_sub(stuck_ms + self.reorder_ms + 2 * heartbeat_ms);
        let mut left: Vec<(Key, Owed)> = self.owed.iter().map(|(k, o)| (*k, *o)).collect();
        left.sort_unstable_by_key(|(k, o)| (o.sched_ms, *k));
        for (key, o) in left.into_iter().filter(|(_, o)| o.flags & UNDECIDABLE == 0) {
            self.score.non_final += 1;
            if o.sched_ms < old_before {
                self.score.non_final_old += 1;
                if o.flags & GATED_BY_DEAD != 0 {
                    self.score.non_final_old_gated_by_dead += 1;
                } else if self.score.non_final_examples.len() < 20 {
                    self.score.non_final_examples.push(format!(
                        "{:016x}#{} rank {} (node {}, scheduled {} ms): owed {}",
                        key.1,
                        key.2,
                        key.3,
                        o.node,
                        o.sched_ms,
                        self.describe(&o)
                    ));
                }
            }
        }
        self.owed.clear();
        self.shared.clear();
    }
}

// ------------------------------------------------------------------ the harness

/// The harness. [`Pair::run`] is the whole run.
#[derive(Debug)]
pub struct Pair {
    cfg: PairConfig,
    now: u64,
    sim: Simulation,
    collect: Collect,
    shippers: Vec<Shipper>,
    core: Core,
    instance: u64,
    aggregator_epoch: u64,
    rtt_ns: u64,
    next_timer: u64,
    timer_turns: u64,
    conns: BTreeMap<u64, Conn>,
    next_conn: u64,
    queue: BinaryHeap<Reverse<Flight>>,
    order: u64,
    /// The jitter draws (splitmix64: no dependency, deterministic).
    rng: u64,
    /// `(time, node, partition?)`: when a fault closes a node's connection.
    kills: Vec<(u64, u32, bool)>,
    partitions: Vec<(u32, u64, u64)>,
    next_poll: u64,
    next_map_check: u64,
    judge: Judge,
    maps: BTreeMap<&'static str, MapWater>,
    map_checks: u64,
    map_violations: Vec<(&'static str, usize, usize, u64)>,
    net: NetStats,
    scratch: SummaryCheck,
    dead_at: Vec<u64>,
    frames_from_sim: Vec<u64>,
    last_verdicts: BTreeMap<(OpRef, u32), Verdict>,
    health_at: u64,
    health_at_sim_end: Option<BTreeMap<NodeId, Health>>,
    rates_at_sim_end: Option<BTreeMap<NodeId, Option<ringwatch_core::rates::Rate>>>,
    interface_rates_at_sim_end: BTreeMap<NodeId, Vec<ringwatch_core::rates::InterfaceRate>>,
}

/// splitmix64's finaliser: deterministic ids from the seed.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Pair {
    /// Sets up the simulation, the shippers (each about to connect) and the aggregator,
    /// and computes what every decidable rank is owed.
    ///
    /// # Panics
    /// A scenario that does not validate.
    #[must_use]
    pub fn new(cfg: PairConfig) -> Self {
        let s = &cfg.scenario;
        // Restarts are `loadgen run`'s (real time, real QUIC); this harness does not model
        // them (module docs), so a scenario naming them must not run here as if it did.
        let restarts: Vec<&str> = s.faults.iter().filter(|f| f.is_restart()).map(|f| f.kind()).collect();
        assert!(
            restarts.is_empty(),
            "the pair harness does not apply scenario restarts ({restarts:?}); loadgen run does"
        );
        let sim = Simulation::new(s, cfg.options).expect("the scenario validates");
        let nodes = s.cluster.nodes;
        let set = aggregator::certs::CertSet::at(std::path::Path::new("/nonexistent-pair-harness"));
        let mut agg = loadgen::cluster::aggregator_config(&set, s, 1.0);
        // loadgen presumes an unreachable node dead after the stuck deadline (its network
        // never cuts a live node off for long); this harness partitions live nodes past
        // the idle timeout, so it runs the production default.
        agg.matcher.dead_after_ns = ringwatch_core::MatcherConfig::default().dead_after_ns;
        let mut core = Core::new(agg.ingest, agg.matcher, 0);
        core.set_role(cfg.role);
        let reorder_ms = agg.ingest.reorder_timeout_ns / MS;
        let dead_at: Vec<u64> = sim.model().dead_at.clone();
        let truth = sim.ground_truth();
        let judge = Judge::new(&truth, reorder_ms, dead_at.clone());
        drop(truth);
        let tuning = ringwatch_transport::Tuning::default();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], 4433));
        let shippers = (0..nodes)
            .map(|node| {
                let sc = loadgen::cluster::shipper_config(&set, addr, &s.name, s.timers.heartbeat_ms, node, 1.0);
                let config = node_shipper::driver::core_config(&sc, &tuning);
                let id = proto_flat::node_id_of(&sc.node_name);
                let session = mix(cfg.net.seed ^ (u64::from(node) << 40) ^ 0x5e55).max(1);
                let meta = SessionMeta { node_id: id, epoch: 0, shipper_session: session };
                let mut core = ShipperCore::new(config, meta, 0);
                // The reader's setup: the source's shipper stream index (0 for the
                // simulator) and the sampling level it starts at.
                core.set_shipper_stream_index(0);
                let sampling = SamplingPolicy::new(SamplingConfig::default());
                Shipper {
                    node,
                    id: NodeId(id),
                    core,
                    sampling,
                    counters: SourceCounters::default(),
                    source: SourceState::Running,
                    link: Link::Down { retry_at: 0 },
                    backoff: Backoff::new(100, 5_000),
                    rng_state: mix(cfg.net.seed ^ u64::from(node) ^ 0xbac0).max(1),
                    connections: 0,
                    connect_failures: 0,
                    dead_at: dead_at.get(node as usize).copied().unwrap_or(u64::MAX),
                }
            })
            .collect();
        let mut kills = Vec::new();
        let mut partitions = Vec::new();
        for f in &cfg.faults {
            match *f {
                NetFault::Partition { node, from_ns, until_ns } => {
                    partitions.push((node, from_ns, until_ns));
                    kills.push((until_ns.min(from_ns.saturating_add(cfg.net.idle_timeout_ns)), node, true));
                }
                NetFault::Reset { node, at_ns } => kills.push((at_ns, node, false)),
            }
        }
        kills.sort_unstable();
        let rng = mix(cfg.net.seed ^ 0x6e65_7477);
        let instance = mix(cfg.net.seed ^ 0x1a57).max(1);
        Self {
            now: 0,
            collect: Collect {
                events: (0..nodes).map(|_| Vec::new()).collect(),
                frames: vec![0; nodes as usize],
                ..Collect::default()
            },
            shippers,
            core,
            instance,
            aggregator_epoch: 1,
            rtt_ns: 2 * cfg.net.one_way_ns + cfg.net.jitter_ns,
            next_timer: 0,
            timer_turns: 0,
            conns: BTreeMap::new(),
            next_conn: 1,
            queue: BinaryHeap::new(),
            order: 0,
            rng,
            kills,
            partitions,
            next_poll: 0,
            next_map_check: 0,
            judge,
            maps: BTreeMap::new(),
            map_checks: 0,
            map_violations: Vec::new(),
            net: NetStats::default(),
            scratch: SummaryCheck::default(),
            frames_from_sim: vec![0; nodes as usize],
            dead_at,
            last_verdicts: BTreeMap::new(),
            health_at: sim.horizon_ns().saturating_add(HEALTH_AFTER_SIM_NS),
            health_at_sim_end: None,
            rates_at_sim_end: None,
            interface_rates_at_sim_end: BTreeMap::new(),
            sim,
            cfg,
        }
    }

    /// Runs the simulation to its end and the settle time after it; returns the report.
    ///
    /// # Panics
    /// Only on a harness bug (an invariant of its own bookkeeping).
    #[must_use]
    pub fn run(mut self) -> Report {
        let sim_end = self.sim.horizon_ns();
        let end = sim_end.saturating_add(self.cfg.settle_ns);
        loop {
            let next = self.next_event();
            if next > end {
                break;
            }
            self.now = next;
            self.step();
        }
        self.now = end;
        self.check_maps();
        self.finish(sim_end, end)
    }

    /// The earliest time something happens.
    fn next_event(&self) -> u64 {
        let mut t = self.next_poll.min(self.next_timer).min(self.next_map_check);
        if self.health_at_sim_end.is_none() {
            t = t.min(self.health_at);
        }
        if self.rates_at_sim_end.is_none() {
            t = t.min(self.sim.horizon_ns());
        }
        if let Some(Reverse(f)) = self.queue.peek() {
            t = t.min(f.at);
        }
        if let Some(k) = self.kills.first() {
            t = t.min(k.0);
        }
        for s in &self.shippers {
            match s.link {
                Link::Down { retry_at } => t = t.min(retry_at),
                Link::Handshake { done_at, .. } => t = t.min(done_at),
                Link::Up { .. } | Link::Gone => {}
            }
        }
        t.max(self.now)
    }

    /// Everything due at `self.now`, in the order the shells would see it.
    fn step(&mut self) {
        let now = self.now;
        // Faults that close connections.
        while let Some(&(at, node, partition)) = self.kills.first() {
            if at > now {
                break;
            }
            self.kills.remove(0);
            self.kill(node, partition);
        }
        // The network.
        while self.queue.peek().is_some_and(|Reverse(f)| f.at <= now) {
            let Some(Reverse(f)) = self.queue.pop() else { break };
            self.deliver(f);
        }
        // Links: handshakes done, reconnects due.
        for i in 0..self.shippers.len() {
            self.link_turn(i);
        }
        // The readers: the simulator's output, then the shippers' timers.
        if now >= self.next_poll {
            self.poll_sources();
            self.next_poll = now + self.cfg.poll_ns;
        }
        // The aggregator's timer task.
        if now >= self.next_timer {
            self.timer_turn();
        }
        // What the shippers can send, and the aggregator's answers.
        for i in 0..self.shippers.len() {
            self.transmit(i);
        }
        self.write_answers();
        if now >= self.next_map_check {
            self.check_maps();
            self.next_map_check = now + self.cfg.map_check_ns;
        }
        if self.rates_at_sim_end.is_none() && now >= self.sim.horizon_ns() {
            let core = &self.core;
            self.rates_at_sim_end =
                Some(core.node_ids().map(|id| (id, core.node_state(id).and_then(|n| n.bulk_rate.rate()))).collect());
            self.interface_rates_at_sim_end = core
                .node_ids()
                .map(|id| (id, core.node_state(id).map(|n| n.interfaces.iter().collect()).unwrap_or_default()))
                .collect();
        }
        if self.health_at_sim_end.is_none() && now >= self.health_at {
            self.health_at_sim_end = Some(self.core.node_health(now));
        }
    }

    fn delay(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(1);
        let j = if self.cfg.net.jitter_ns > 0 { mix(self.rng) % self.cfg.net.jitter_ns } else { 0 };
        self.cfg.net.one_way_ns + j
    }

    fn send(&mut self, conn: u64, kind: Kind, bytes: Vec<u8>, at: u64) {
        self.order += 1;
        self.queue.push(Reverse(Flight { at, order: self.order, sent: self.now, conn, kind, bytes }));
    }

    /// Whether a partition of `node` cut a message in flight over `[sent, at]`.
    fn cut(&self, node: u32, sent: u64, at: u64) -> bool {
        self.partitions.iter().any(|&(n, from, until)| n == node && sent < until && at >= from)
    }

    /// When `node`'s partition covering `t` heals (`t` if none does).
    fn healed(&self, node: u32, t: u64) -> u64 {
        let mut t = t;
        loop {
            let Some(&(_, _, until)) =
                self.partitions.iter().find(|&&(n, from, until)| n == node && from <= t && t < until)
            else {
                return t;
            };
            t = until;
        }
    }

    // -------------------------------------------------------------- delivery

    fn deliver(&mut self, f: Flight) {
        let Some(c) = self.conns.get(&f.conn) else { return };
        let node = c.node;
        let lost = self.cut(node, f.sent, f.at);
        match f.kind {
            Kind::Control => {
                if lost || !c.open_shipper {
                    self.net.control_lost += 1;
                    return;
                }
                self.shipper_control(node, &f.bytes);
            }
            Kind::Resume => {
                if lost || !c.open_aggregator {
                    self.net.control_lost += 1;
                    return;
                }
                self.aggregator_resume(f.conn, node, &f.bytes);
            }
            Kind::Batch => {
                if lost || !c.open_aggregator {
                    self.net.batches_lost += 1;
                    return;
                }
                if !c.resumed {
                    // Read only once the resume is applied (it is on its way: it was sent
                    // first).
                    let at = c.resume_at.max(f.at);
                    self.order += 1;
                    self.queue.push(Reverse(Flight { at, order: self.order, ..f }));
                    return;
                }
                self.net.batches_delivered += 1;
                self.aggregator_batch(f.conn, node, &f.bytes);
            }
            Kind::Close => {
                if c.open_aggregator {
                    self.aggregator_closed(f.conn);
                }
            }
        }
    }

    // -------------------------------------------------------------- shipper side

    /// The network task's connect loop.
    fn link_turn(&mut self, i: usize) {
        let now = self.now;
        let (node, link) = (self.shippers[i].node, self.shippers[i].link);
        match link {
            Link::Down { retry_at } if retry_at <= now => {
                // A handshake: one round trip once the path is clear, within the idle
                // timeout; otherwise it fails at the idle timeout.
                let healed = self.healed(node, now);
                let done = healed + 2 * self.cfg.net.one_way_ns;
                let link = if done - now <= self.cfg.net.idle_timeout_ns {
                    Link::Handshake { done_at: done, ok: true }
                } else {
                    Link::Handshake { done_at: now + self.cfg.net.idle_timeout_ns, ok: false }
                };
                self.shippers[i].link = link;
            }
            Link::Handshake { done_at, ok } if done_at <= now => {
                if ok {
                    self.connected(i);
                } else {
                    self.net.handshakes_failed += 1;
                    let s = &mut self.shippers[i];
                    s.connect_failures += 1;
                    let d = s.backoff_ns();
                    s.link = Link::Down { retry_at: now + d };
                }
            }
            _ => {}
        }
    }

    /// A connection is up: `reconnected`, the preface and the `resume` on the control
    /// stream, then batches (driver.rs `network` and `connection`).
    fn connected(&mut self, i: usize) {
        let now = self.now;
        self.net.connections += 1;
        let conn = self.next_conn;
        self.next_conn += 1;
        let s = &mut self.shippers[i];
        s.backoff.reset();
        s.connections += 1;
        s.core.reconnected();
        s.link = Link::Up { conn };
        let r = s.core.resume();
        let mut opening = CONTROL_PREFACE.to_vec();
        encode_resume(&mut opening, r.shipper_session, r.epoch, r.next_batch_seq, r.sent_ns, &r.held, &r.floors)
            .expect("a resume within its caps (the core caps what it lists)");
        let node = s.node;
        let at = now + self.delay();
        self.conns.insert(
            conn,
            Conn {
                node,
                open_shipper: true,
                open_aggregator: true,
                resume_at: at,
                resumed: false,
                control_last: 0,
                answers: Vec::new(),
                rejected: 0,
            },
        );
        self.net.control_sent += 1;
        self.send(conn, Kind::Resume, opening, at);
        self.transmit(i);
    }

    /// The control reader: `hello`, `ack`, `nack`.
    fn shipper_control(&mut self, node: u32, bytes: &[u8]) {
        let now = self.now;
        let Some(s) = self.shippers.get_mut(node as usize) else { return };
        let mut used = 0;
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        while let Ok(Some((msg, n))) = parse_control(bytes.get(used..).unwrap_or(&[])) {
            used += n;
            match msg {
                ControlMessage::Hello { aggregator_instance, aggregator_epoch, control_version, durability } => {
                    s.core.handle_hello(aggregator_instance, aggregator_epoch, control_version, durability);
                }
                ControlMessage::Ack { shipper_session, status, ranges: r } => {
                    if shipper_session == s.core.batcher().meta().shipper_session {
                        ranges.clear();
                        ranges.extend(r.iter().map(|x| (x.first.get(), x.last.get())));
                        s.core.handle_ack(&ranges, status, now);
                    }
                }
                ControlMessage::Nack { shipper_session, batch_seq, reason } => {
                    if shipper_session == s.core.batcher().meta().shipper_session {
                        s.core.handle_nack(batch_seq, reason, now);
                    }
                }
                ControlMessage::Resume { .. } | ControlMessage::Unknown { .. } => {}
            }
        }
        assert_eq!(used, bytes.len(), "the harness writes whole control messages");
    }

    /// The reader loop, one turn for every node: the simulator to `now`, each node's
    /// output handed to its core, then the core's timers.
    fn poll_sources(&mut self) {
        let now = self.now;
        // Only forward (a step that does not move time has nothing to give).
        if !self.sim.is_done() && now > self.sim.now_ns() {
            self.sim.step(now, &mut self.collect);
        }
        let finished = self.sim.is_done();
        let Self { collect, shippers, sim, frames_from_sim, conns, order, queue, cfg, .. } = self;
        for s in shippers.iter_mut() {
            let events = collect.events.get_mut(s.node as usize).map(std::mem::take).unwrap_or_default();
            if matches!(s.link, Link::Gone) {
                continue;
            }
            let mono = sim.node_mono(s.node, now);
            let mut counters_seen = false;
            for e in events {
                match e {
                    SimEvent::Frame(a, b) => {
                        if let Some(f) = collect.arena.get(a..b) {
                            s.core.handle_frame(f, now);
                        }
                    }
                    SimEvent::Epoch(e) => {
                        s.counters = SourceCounters { epoch: e.epoch, mono_ns: e.mono_ns, ..SourceCounters::default() };
                        s.core.handle_epoch(&e, now);
                    }
                    SimEvent::Counters(i) => {
                        if let Some(c) = collect.counters.get(i) {
                            s.counters.clone_from(c);
                            counters_seen = true;
                            s.core.handle_counters(c, mono, now);
                        }
                    }
                }
            }
            if counters_seen {
                // Once per heartbeat: spool pressure moves the bulk sampling level (the
                // simulator has no such control; the core reports the level).
                let cap = s.core.spool_cap_bytes();
                let before = s.sampling.level();
                let level = s.sampling.decide(s.core.spool().used_bytes(), cap);
                if level != before {
                    s.core.set_sampling_level(level);
                }
            }
            if let Some(n) = frames_from_sim.get_mut(s.node as usize) {
                *n = collect.frames.get(s.node as usize).copied().unwrap_or(0);
            }
            if now >= s.dead_at {
                // The node died: the shipper stops at once, flushing nothing, and closes
                // its endpoint (the aggregator learns it a one-way delay later).
                if let Link::Up { conn } = s.link {
                    if let Some(c) = conns.get_mut(&conn) {
                        c.open_shipper = false;
                    }
                    *order += 1;
                    queue.push(Reverse(Flight {
                        at: now + cfg.net.one_way_ns,
                        order: *order,
                        sent: now,
                        conn,
                        kind: Kind::Close,
                        bytes: Vec::new(),
                    }));
                }
                s.link = Link::Gone;
                continue;
            }
            if finished {
                s.source = SourceState::Finished;
            }
            if s.source == SourceState::Finished && now >= s.core.next_heartbeat_ns() {
                // A finished source's counters hold as of now.
                let mut c = s.counters.clone();
                c.mono_ns = mono;
                s.core.handle_counters(&c, mono, now);
            }
            if now >= s.core.poll_timeout() {
                s.core.handle_timeout(mono, now);
            }
        }
        collect.arena.clear();
        collect.counters.clear();
    }

    /// The network task's send loop: every batch the spool offers, each on its own
    /// stream.
    fn transmit(&mut self, i: usize) {
        let Link::Up { conn } = self.shippers[i].link else { return };
        while let Some(bytes) = self.shippers[i].core.poll_transmit(self.now).map(|(_, _, b)| b.to_vec()) {
            let at = self.now + self.delay();
            let at = self.conns.get(&conn).map_or(at, |c| at.max(c.resume_at));
            self.net.batches_sent += 1;
            self.send(conn, Kind::Batch, bytes, at);
        }
    }

    /// A fault closes the node's connection (or fails its handshake).
    fn kill(&mut self, node: u32, partition: bool) {
        let now = self.now;
        let Some(i) = self.shippers.iter().position(|s| s.node == node) else { return };
        match self.shippers[i].link {
            Link::Up { conn } => {
                if partition {
                    self.net.partition_closes += 1;
                } else {
                    self.net.resets += 1;
                }
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.open_shipper = false;
                }
                self.aggregator_closed(conn);
                let s = &mut self.shippers[i];
                let d = s.backoff_ns();
                s.link = Link::Down { retry_at: now + d };
            }
            Link::Handshake { .. } => {
                if !partition {
                    self.net.resets += 1;
                }
                self.net.handshakes_failed += 1;
                let s = &mut self.shippers[i];
                s.connect_failures += 1;
                let d = s.backoff_ns();
                s.link = Link::Down { retry_at: now + d };
            }
            Link::Down { .. } | Link::Gone => {}
        }
    }

    // -------------------------------------------------------------- aggregator side

    fn drain_events(&mut self) {
        let Self { core, judge, dead_at, cfg, last_verdicts, .. } = self;
        while let Some(e) = core.poll_event() {
            if cfg.keep_verdicts
                && let MatcherEvent::Verdict(v) = &e
            {
                last_verdicts.insert((v.op, v.rank), v.clone());
            }
            let fate = |node: u32| -> NodeFate {
                if dead_at.get(node as usize).is_none_or(|&d| d == u64::MAX) {
                    return NodeFate::Alive;
                }
                let id = NodeId(proto_flat::node_id_of(&aggregator::certs::node_name(node)));
                let heard = core.trackers(id).any(|t| t.counts().received > 0 || t.counts().prior_instance > 0);
                if heard { NodeFate::Died } else { NodeFate::DiedUnheard }
            };
            judge.on_event(&e, &fate);
        }
    }

    /// The connection task's opening: preface, `resume`, `Core::handle_resume`, then the
    /// control writer's `hello`.
    fn aggregator_resume(&mut self, conn: u64, node: u32, bytes: &[u8]) {
        let now = self.now;
        let id = self.shippers.get(node as usize).map_or(NodeId(0), |s| s.id);
        let Some(rest) = bytes.strip_prefix(&CONTROL_PREFACE) else {
            self.aggregator_close(conn);
            return;
        };
        let parsed = match parse_control(rest) {
            Ok(Some((
                ControlMessage::Resume { shipper_session, epoch, next_batch_seq, sent_ns, held, streams },
                _,
            ))) => Some((
                shipper_session,
                epoch,
                next_batch_seq,
                sent_ns,
                held.iter().map(|r| (r.first.get(), r.last.get())).collect::<Vec<_>>(),
                streams.iter().map(|s| (s.stream_id.get(), s.floor_seq.get())).collect::<Vec<_>>(),
            )),
            _ => None,
        };
        let Some((session, epoch, next_batch_seq, sent_ns, held, floors)) = parsed else {
            self.aggregator_close(conn);
            return;
        };
        let done =
            self.core.handle_resume(now, id, session, epoch, next_batch_seq, (sent_ns, self.rtt_ns), &held, &floors);
        self.drain_events();
        match done {
            Ok(d) if !d.refused => {}
            _ => {
                self.aggregator_close(conn);
                return;
            }
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.resumed = true;
        }
        let mut hello = Vec::new();
        encode_hello(&mut hello, self.instance, self.aggregator_epoch, CONTROL_VERSION, Durability::None);
        self.control(conn, hello);
    }

    /// A batch stream: validated and applied as `ingest::apply` does; the answer queued
    /// for the control writer.
    fn aggregator_batch(&mut self, conn: u64, node: u32, bytes: &[u8]) {
        let now = self.now;
        let id = self.shippers.get(node as usize).map_or(NodeId(0), |s| s.id);
        let ids = BatchHeader::read_from_prefix(bytes).ok().map(|(h, _)| (h.shipper_session.get(), h.batch_seq.get()));
        let answer = match BatchView::parse(bytes) {
            Err(e) => Err((ids, e.nack_reason())),
            Ok(view) => match view.validate(&mut self.scratch) {
                Err(e) => Err((ids, e.nack_reason())),
                Ok(()) => {
                    let (session, seq) = (view.header.shipper_session.get(), view.header.batch_seq.get());
                    if view.header.node_id.get() != id.0 {
                        Err((Some((session, seq)), NackReason::NodeMismatch))
                    } else {
                        let receipt = self.core.receive_batch(now, id, self.rtt_ns, &view);
                        match receipt {
                            Receipt::Applied => Ok(Some(Answer::Ack(session, AckStatus::Applied, seq))),
                            Receipt::Duplicate => Ok(Some(Answer::Ack(session, AckStatus::Duplicate, seq))),
                            Receipt::DedupWindowFull => Err((Some((session, seq)), NackReason::DedupWindowFull)),
                            Receipt::NodeCapReached => Ok(None),
                            Receipt::Implausible(_) => Err((Some((session, seq)), NackReason::MalformedFrame)),
                        }
                    }
                }
            },
        };
        self.drain_events();
        match answer {
            Ok(Some(a)) => {
                if let Answer::Ack(_, status, _) = a {
                    if status == AckStatus::Applied {
                        self.net.acks_applied_batches += 1;
                    } else {
                        self.net.answers_duplicate += 1;
                    }
                }
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.answers.push(a);
                }
            }
            Ok(None) => self.aggregator_close(conn),
            Err((ids, reason)) => {
                self.net.nacks += 1;
                let Some(c) = self.conns.get_mut(&conn) else { return };
                if let Some((session, seq)) = ids {
                    c.answers.push(Answer::Nack(session, seq, reason));
                }
                c.rejected += 1;
                if c.rejected == aggregator::ingest::REJECT_THRESHOLD {
                    self.aggregator_close(conn);
                }
            }
        }
    }

    /// The aggregator closes a connection: `closed()` runs, the shipper learns it a
    /// one-way delay later.
    fn aggregator_close(&mut self, conn: u64) {
        let Some(c) = self.conns.get(&conn) else { return };
        let node = c.node;
        self.aggregator_closed(conn);
        let at = self.now + self.cfg.net.one_way_ns;
        // The shipper's side ends when the close arrives: modelled at once (nothing
        // more of this connection is delivered either way).
        if let Some(c) = self.conns.get_mut(&conn) {
            c.open_shipper = false;
        }
        if let Some(s) = self.shippers.get_mut(node as usize)
            && s.link == (Link::Up { conn })
        {
            let d = s.backoff_ns();
            s.link = Link::Down { retry_at: at + d };
        }
    }

    /// The connection task ended (`Registered` dropped): `Core::handle_connection_closed`.
    fn aggregator_closed(&mut self, conn: u64) {
        let now = self.now;
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if !c.open_aggregator {
            return;
        }
        c.open_aggregator = false;
        c.answers.clear();
        let node = c.node;
        let id = self.shippers.get(node as usize).map_or(NodeId(0), |s| s.id);
        self.core.handle_connection_closed(now, id);
        self.drain_events();
    }

    fn control(&mut self, conn: u64, bytes: Vec<u8>) {
        let d = self.delay();
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let at = (self.now + d).max(c.control_last);
        c.control_last = at;
        self.net.control_sent += 1;
        self.send(conn, Kind::Control, bytes, at);
    }

    /// The control writer: this turn's answers, nacks first, acks merged into ranges per
    /// session and status (`encode_answers`).
    fn write_answers(&mut self) {
        let ready: Vec<(u64, Vec<Answer>)> = self
            .conns
            .iter_mut()
            .filter(|(_, c)| !c.answers.is_empty() && c.open_aggregator)
            .map(|(id, c)| (*id, std::mem::take(&mut c.answers)))
            .collect();
        for (conn, answers) in ready {
            let mut out = Vec::new();
            let mut acks: Vec<(u64, u8, u64)> = Vec::new();
            for a in answers {
                match a {
                    Answer::Ack(session, status, seq) => acks.push((session, status.code(), seq)),
                    Answer::Nack(session, seq, reason) => encode_nack(&mut out, session, seq, reason),
                }
            }
            acks.sort_unstable();
            let mut i = 0;
            while let Some(&(session, status, _)) = acks.get(i) {
                let mut ranges: Vec<(u64, u64)> = Vec::new();
                while let Some(&(s, st, seq)) = acks.get(i) {
                    if s != session || st != status || ranges.len() >= 4000 {
                        break;
                    }
                    match ranges.last_mut() {
                        Some(r) if r.1 + 1 == seq => r.1 = seq,
                        _ => ranges.push((seq, seq)),
                    }
                    i += 1;
                }
                encode_ack(&mut out, session, AckStatus::from_code(status), &ranges)
                    .expect("at most 4,000 ranges fit a control message");
            }
            self.control(conn, out);
        }
    }

    /// The timer task: `handle_timeout` now, then again at the core's next due time,
    /// between 1 ms and 100 ms from now.
    fn timer_turn(&mut self) {
        let now = self.now;
        self.timer_turns += 1;
        self.core.handle_timeout(now);
        self.drain_events();
        let wait = self.core.poll_timeout().map_or(100 * MS, |d| d.saturating_sub(now)).clamp(MS, 100 * MS);
        self.next_timer = now + wait;
    }

    fn check_maps(&mut self) {
        self.map_checks += 1;
        for m in self.core.map_sizes() {
            let w = self.maps.entry(m.name).or_default();
            w.high = w.high.max(m.len);
            w.cap = m.cap;
            if m.len > m.cap {
                self.map_violations.push((m.name, m.len, m.cap, self.now));
            }
        }
    }

    // -------------------------------------------------------------- the end

    fn finish(mut self, sim_end: u64, end: u64) -> Report {
        let s = &self.cfg.scenario;
        // The simulator's final truth: which ranks lost frames (for the deferred
        // verdicts), and every stream's conservation.
        let truth = self.sim.ground_truth();
        self.judge.finish(&truth, end, s.timers.stuck_deadline_ms, s.timers.heartbeat_ms);
        let nodes_dto = aggregator::api::dto::NodesDto {
            api_version: String::new(),
            as_of: aggregator::api::dto::AsOfDto::default(),
            nodes: self
                .shippers
                .iter()
                .map(|sh| {
                    let name = aggregator::certs::node_name(sh.node);
                    aggregator::api::dto::NodeDto {
                        name,
                        node_id: format!("{:016x}", sh.id.0),
                        connected: false,
                        live_connections: 0,
                        liveness: String::new(),
                        health: String::new(),
                        connections: sh.connections,
                        watermark_p0_node_ns: 0,
                        watermark_bulk_node_ns: 0,
                        clock_offset_ns: None,
                        clock_epsilon_ns: None,
                        knowledge_gaps: Vec::new(),
                        gpus: Vec::new(),
                        awaiting_first_batch: false,
                        prior_instance: 0,
                        p0_frames_lost: 0,
                        p0_frames_attempted: 0,
                        shipper: None,
                        bulk: None,
                        streams: self.core.trackers(sh.id).map(aggregator::api::dto::StreamDto::from_tracker).collect(),
                    }
                })
                .collect(),
        };
        let conservation = loadgen::score::conservation(&truth, &nodes_dto);
        // A long run's collectives are many (and judged already): kept for short runs.
        let truth = if self.cfg.keep_verdicts { truth } else { GroundTruth { collectives: Vec::new(), ..truth } };

        let shippers = self
            .shippers
            .iter()
            .map(|sh| ShipperSummary {
                node: sh.node,
                stats: *sh.core.stats(),
                unacked: sh.core.unacked(),
                connections: sh.connections,
                connect_failures: sh.connect_failures,
                frames_from_sim: self.frames_from_sim.get(sh.node as usize).copied().unwrap_or(0),
                dead: sh.link == Link::Gone,
            })
            .collect();
        Report {
            sim_end_ns: sim_end,
            end_ns: end,
            verdicts: self.judge.score.clone(),
            maps: self.maps.clone(),
            map_checks: self.map_checks,
            map_violations: self.map_violations.clone(),
            conservation,
            shippers,
            ingest: *self.core.ingest().stats(),
            matcher: *self.core.matcher().stats(),
            records: self.core.records(),
            net: self.net,
            timer_turns: self.timer_turns,
            last_verdicts: std::mem::take(&mut self.last_verdicts),
            health_at_sim_end: self.health_at_sim_end.take().unwrap_or_else(|| self.core.node_health(end)),
            bulk_rates_at_sim_end: self.rates_at_sim_end.take().unwrap_or_default(),
            interface_rates_at_sim_end: std::mem::take(&mut self.interface_rates_at_sim_end),
            core: self.core,
            truth,
        }
    }
}
