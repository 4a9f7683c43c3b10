//! The driver: the simulated kernel side of every node (per (ring, CPU) counters,
//! sampling before the seq, overflow windows, PROGRESS) and the emission of frames and
//! counter snapshots in time order.
//!
//! Call order: [`Simulation::new`], then [`Simulation::step`] with increasing times (or
//! [`Simulation::run`] to the end), then [`Simulation::ground_truth`]. Time is simulated:
//! nothing here reads a clock. The same scenario, seed, options and sequence of `step`
//! calls give the same output byte for byte.
//!
//! Invariants:
//! - a sampled-out event takes no seq; every other event takes the next seq of its
//!   stream before the (simulated) ring reserve, so each drop leaves an exact hole and
//!   bumps `drops[kernel_ring_full]`: per stream, attempted = delivered + dropped;
//! - a snapshot at time t reflects exactly the events before t; snapshots come at every
//!   heartbeat and at the end of the run;
//! - a counter reset starts a new epoch with seqs from 0, announced through
//!   [`Sink::epoch`] before the first frame of the epoch.

use std::collections::{BTreeMap, HashMap};

use proto_flat::codes::{Class, DROP_SLOTS, LossCause, Phase, ProcState, WireEnum, flags};
use proto_flat::frames::{BulkPacketFrame, BulkProxyFrame, CollectiveFrame, FixedFrame, P2pFrame};
use proto_flat::header::StreamId;
use proto_flat::sections::{InterfaceEntry, ProgressEntry, StreamEntry};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zerocopy::little_endian::{I32, U16, U32, U64};
use zerocopy::{FromZeros, IntoBytes};

use crate::model::{Model, OpKind};
use crate::scenario::{BulkKind, Fault, JoinReason, MismatchField, RingKind, Scenario, ScenarioError, mask};
use crate::truth::{GroundTruth, InterfaceTruth, StreamTruth};

/// Ring numbers of the simulated node.
pub const P0_RING: u8 = 0;
/// Ring number of the bulk ring.
pub const BULK_RING: u8 = 1;

/// Base of every node's monotonic clock (so offsets may be negative), ns.
const MONO_BASE_NS: u64 = 1_000_000_000_000;
/// Wall-clock time of the run's start, ns since the Unix epoch (2026-11-18).
pub const REALTIME_BASE_NS: u64 = 1_795_000_000_000_000_000;

/// Options that do not change the scenario's physics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimOptions {
    /// Multiplies every node's bulk event rate (1.0 = the scenario's link rate).
    pub bulk_scale: f64,
    /// Replaces the scenario's seed.
    pub seed: Option<u64>,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self { bulk_scale: 1.0, seed: None }
    }
}

/// Counters a heartbeat would carry, at one instant.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    pub epoch: u64,
    /// Node monotonic time of the snapshot.
    pub mono_ns: u64,
    /// Node wall-clock time of the snapshot.
    pub realtime_ns: u64,
    /// Every (ring, CPU) stream of the node (`held_from_seq` is left 0: that is
    /// the shipper's to fill).
    pub streams: &'a [StreamEntry],
    /// PROGRESS entries of the node's instrumented ranks, one per (rank, communicator).
    pub progress: &'a [ProgressEntry],
    /// The per-interface counters of the bulk packet producer this epoch (empty for
    /// proxy bulk), in ifindex order.
    pub interfaces: &'a [InterfaceEntry],
}

/// A new epoch on a node (counters created).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochInfo {
    pub epoch: u64,
    pub boot_id: [u8; 16],
    pub mono_ns: u64,
    pub start_realtime_ns: u64,
}

/// Where the simulation writes. Frames are ring records exactly as the shipper reads
/// them (unparsed proto-flat bytes).
pub trait Sink {
    fn frame(&mut self, node: u32, frame: &[u8]);
    fn snapshot(&mut self, node: u32, snapshot: &Snapshot<'_>);
    fn epoch(&mut self, node: u32, info: &EpochInfo);
}

#[derive(Debug, Clone)]
struct Counters {
    stream: StreamId,
    attempted: u64,
    drops: [u64; DROP_SLOTS],
    sampled_out: u64,
    delivered: u64,
    dropped_since_snapshot: bool,
}

impl Counters {
    fn new(stream: StreamId) -> Self {
        Self {
            stream,
            attempted: 0,
            drops: [0; DROP_SLOTS],
            sampled_out: 0,
            delivered: 0,
            dropped_since_snapshot: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct P0Event {
    t: u64,
    op: u32,
    part: u16,
    phase: Phase,
    /// Per-channel event on this channel.
    channel: Option<u16>,
}

#[derive(Debug, Clone)]
struct Track {
    rank: u32,
    comm: usize,
    /// (time, comm_op_seq) sorted by time: enqueued, kernel started, completed.
    lists: [Vec<(u64, u64)>; 3],
    cursor: [usize; 3],
    max: [u64; 3],
    last_update: u64,
}

#[derive(Debug)]
struct NodeState {
    epoch: u64,
    p0: Vec<Counters>,
    bulk: Vec<Counters>,
    events: Vec<P0Event>,
    next_event: usize,
    bulk_next: u64,
    bulk_period_ns: f64,
    offset_ns: f64,
    drift: f64,
    overflow: Vec<(RingKind, u64, u64, f64)>,
    reorder: Vec<(u64, u64)>,
    resets: Vec<u64>,
    dead_at: u64,
    tracks: Vec<Track>,
    exits: Vec<(u32, u64, i32)>,
    rng: ChaCha8Rng,
    alternate: u64,
    /// Bulk packets and bytes per ifindex this epoch, counted before sampling.
    ifaces: BTreeMap<u32, (u64, u64)>,
}

/// A running simulation.
#[derive(Debug)]
pub struct Simulation {
    scenario: Scenario,
    options: SimOptions,
    model: Model,
    nodes: Vec<NodeState>,
    now: u64,
    finished_streams: Vec<StreamTruth>,
    finished_interfaces: Vec<InterfaceTruth>,
    /// (op id, participant index) → frames of it the kernel dropped.
    lost_p0: HashMap<(u32, u16), u32>,
    frame_buf: Vec<u8>,
    pending: Vec<(u32, Vec<u8>)>,
    stream_scratch: Vec<StreamEntry>,
    progress_scratch: Vec<ProgressEntry>,
    interface_scratch: Vec<InterfaceEntry>,
    /// The first epochs were announced (by the first `step`, whatever its horizon).
    started: bool,
    done: bool,
}

fn node_streams(class: Class, ring: u8, cpus: u16) -> Vec<Counters> {
    (0..cpus).map(|cpu| Counters::new(StreamId::new(class, ring, cpu))).collect()
}

impl Simulation {
    /// Validates the scenario and computes the physical timeline.
    pub fn new(scenario: &Scenario, options: SimOptions) -> Result<Self, ScenarioError> {
        let mut scenario = scenario.clone();
        if let Some(seed) = options.seed {
            scenario.seed = seed;
        }
        scenario.validate()?;
        if !(options.bulk_scale >= 0.0 && options.bulk_scale.is_finite()) {
            return Err(ScenarioError { name: scenario.name, problems: vec!["bulk_scale must be ≥ 0".into()] });
        }
        let model = Model::build(&scenario);
        let cpus = scenario.cluster.cpus_per_node;
        let mask = scenario.cluster.activation_mask;
        let horizon = model.horizon_ns;
        let mut nodes: Vec<NodeState> = (0..scenario.cluster.nodes)
            .map(|n| {
                let clock = scenario.cluster.clocks.iter().find(|c| c.node == n);
                let rate = scenario.bulk.events_per_sec() * options.bulk_scale;
                NodeState {
                    epoch: 1,
                    p0: node_streams(Class::P0, P0_RING, cpus),
                    bulk: node_streams(Class::P2, BULK_RING, cpus),
                    events: Vec::new(),
                    next_event: 0,
                    bulk_next: 0,
                    bulk_period_ns: if rate > 0.0 { 1e9 / rate } else { 0.0 },
                    offset_ns: clock.map_or(0.0, |c| c.offset_ms * 1e6),
                    drift: clock.map_or(0.0, |c| c.drift_ppm * 1e-6),
                    overflow: Vec::new(),
                    reorder: Vec::new(),
                    resets: Vec::new(),
                    dead_at: model.dead_at[n as usize],
                    tracks: Vec::new(),
                    exits: Vec::new(),
                    rng: ChaCha8Rng::seed_from_u64(crate::model::mix(scenario.seed ^ (u64::from(n) << 32))),
                    alternate: 0,
                    ifaces: BTreeMap::new(),
                }
            })
            .collect();
        for f in &scenario.faults {
            match *f {
                Fault::RingOverflow { node, ring, from_ms, until_ms, fraction } => {
                    nodes[node as usize].overflow.push((ring, ns(from_ms), ns(until_ms), fraction));
                }
                Fault::Reorder { node, from_ms, until_ms } => {
                    nodes[node as usize].reorder.push((ns(from_ms), ns(until_ms)));
                }
                Fault::CounterReset { node, at_ms } => nodes[node as usize].resets.push(ns(at_ms)),
                Fault::NotJoined { node, gpu, from_ms, reason: JoinReason::Exited, exit_code, .. } => {
                    nodes[node as usize].exits.push((gpu, ns(from_ms), exit_code));
                }
                _ => {}
            }
        }
        for n in &mut nodes {
            n.resets.sort_unstable();
        }

        // P0 events per node, and PROGRESS tracks per (rank, comm).
        let mut tracks: HashMap<(u32, usize), Track> = HashMap::new();
        for op in &model.ops {
            let coll = matches!(op.kind, OpKind::Coll { .. });
            for (pi, p) in op.participants.iter().enumerate() {
                let rank = &model.ranks[p.rank as usize];
                if !rank.instrumented {
                    continue;
                }
                if coll && op.graph.is_none() {
                    let t = tracks.entry((p.rank, op.comm)).or_insert_with(|| Track {
                        rank: p.rank,
                        comm: op.comm,
                        lists: [Vec::new(), Vec::new(), Vec::new()],
                        cursor: [0; 3],
                        max: [0; 3],
                        last_update: 0,
                    });
                    // PROGRESS advances only on events the profiler reports.
                    let sources = [
                        p.enq_start.filter(|_| mask & mask::COLL != 0),
                        p.k_start.filter(|_| mask & mask::KERNEL_CH != 0),
                        p.end.filter(|_| mask & (mask::KERNEL_CH | mask::PROXY) != 0),
                    ];
                    for (i, time) in sources.into_iter().enumerate() {
                        if let Some(time) = time {
                            t.lists[i].push((time, op.comm_op_seq));
                        }
                    }
                }
                let node = &mut nodes[rank.node as usize];
                let mut push = |t: Option<u64>, phase: Phase, channel: Option<u16>| {
                    if let Some(t) = t
                        && t < horizon
                        && t < node.dead_at
                    {
                        let (op, part) = (u32::try_from(op.id).unwrap_or(u32::MAX), u16::try_from(pi).unwrap_or(0));
                        node.events.push(P0Event { t, op, part, phase, channel });
                    }
                };
                let channels = op.channels;
                if op.graph.is_none() && mask & mask::COLL != 0 {
                    push(p.enq_start, Phase::EnqueueStart, None);
                    push(p.enq_end, Phase::EnqueueEnd, None);
                }
                if mask & mask::KERNEL_CH != 0 {
                    for ch in 0..channels {
                        push(p.k_start.map(|t| t + u64::from(ch) * 150), Phase::KernelStart, Some(ch));
                        if op.hung_channel != Some(ch) {
                            let back = u64::from(channels - ch) * 100;
                            push(p.chan_end.map(|t| t.saturating_sub(back)), Phase::KernelEnd, Some(ch));
                        }
                    }
                    if op.graph.is_none() {
                        push(p.k_start, Phase::KernelStart, None);
                        push(p.end, Phase::KernelEnd, None);
                    }
                }
                if op.graph.is_none() && mask & mask::PROXY != 0 {
                    push(p.end.map(|t| t + 5_000), Phase::ProxyDone, None);
                }
            }
        }
        for n in &mut nodes {
            n.events.sort_by_key(|e| (e.t, e.op, e.part));
        }
        for ((rank, _), mut track) in tracks {
            for l in &mut track.lists {
                l.sort_unstable();
            }
            let node = model.ranks[rank as usize].node as usize;
            nodes[node].tracks.push(track);
        }
        for n in &mut nodes {
            n.tracks.sort_by_key(|t| (t.rank, t.comm));
        }
        Ok(Self {
            scenario,
            options,
            model,
            nodes,
            now: 0,
            finished_streams: Vec::new(),
            finished_interfaces: Vec::new(),
            lost_p0: HashMap::new(),
            frame_buf: Vec::with_capacity(256),
            pending: Vec::new(),
            stream_scratch: Vec::new(),
            interface_scratch: Vec::new(),
            progress_scratch: Vec::new(),
            started: false,
            done: false,
        })
    }

    /// The scenario (with the options' seed applied).
    #[must_use]
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// The topology and physical timeline.
    #[must_use]
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The end of the run, ns of simulated time.
    #[must_use]
    pub fn horizon_ns(&self) -> u64 {
        self.model.horizon_ns
    }

    /// Simulated time reached so far.
    #[must_use]
    pub fn now_ns(&self) -> u64 {
        self.now
    }

    /// Whether the run reached its end (the final snapshots are out).
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// A node's name (the DNS SAN its certificate would carry).
    #[must_use]
    pub fn node_name(node: u32) -> String {
        format!("node-{node:02}")
    }

    /// Node monotonic time for true time `t`.
    #[must_use]
    pub fn node_mono(&self, node: u32, t: u64) -> u64 {
        let n = &self.nodes[node as usize];
        node_clock(n, t, MONO_BASE_NS + u64::from(node) * 7_000_000_000)
    }

    /// Runs to the end.
    pub fn run(&mut self, sink: &mut impl Sink) {
        self.step(u64::MAX, sink);
    }

    /// Emits everything that happens before `until_ns` (capped at the horizon). At the
    /// horizon, each live node's final snapshot is emitted and the run is done.
    pub fn step(&mut self, until_ns: u64, sink: &mut impl Sink) {
        if self.done {
            return;
        }
        // Once: `step(0)` (or any step that does not move time) must not announce the
        // first epochs again.
        if !self.started {
            self.started = true;
            for node in 0..self.nodes.len() {
                self.announce_epoch(node, 0, sink);
            }
        }
        let horizon = self.model.horizon_ns;
        let until = until_ns.min(horizon);
        let hb = ns(self.scenario.timers.heartbeat_ms).max(1);
        while self.now < until {
            let next_hb = (self.now / hb).saturating_add(1).saturating_mul(hb);
            let next_reset = self.nodes.iter().flat_map(|n| n.resets.iter().copied()).filter(|&r| r > self.now).min();
            let boundary = next_hb.min(next_reset.unwrap_or(u64::MAX)).min(until);
            for node in 0..self.nodes.len() {
                self.emit_until(node, boundary, sink);
            }
            self.now = boundary;
            // A heartbeat boundary snapshots every live node; a reset snapshots its node
            // first: the old epoch's last counters, read as the counters are recreated,
            // close its streams exactly (tail drops included).
            let every = boundary.is_multiple_of(hb) || boundary == horizon;
            for node in 0..self.nodes.len() {
                let resets = self.nodes[node].resets.contains(&boundary) && boundary < horizon;
                if (every || resets) && self.nodes[node].dead_at > boundary {
                    self.snapshot(node, boundary, sink);
                }
            }
            for node in 0..self.nodes.len() {
                if self.nodes[node].resets.contains(&boundary) && boundary < horizon {
                    self.reset(node, boundary, sink);
                }
            }
        }
        if self.now >= horizon {
            self.done = true;
        }
    }

    fn announce_epoch(&self, node: usize, t: u64, sink: &mut impl Sink) {
        let n = &self.nodes[node];
        let mut boot_id = [0u8; 16];
        boot_id[..8].copy_from_slice(&crate::model::mix(self.scenario.seed ^ node as u64).to_le_bytes());
        boot_id[8..].copy_from_slice(&n.epoch.to_le_bytes());
        let info = EpochInfo {
            epoch: n.epoch,
            boot_id,
            mono_ns: self.node_mono(node as u32, t),
            start_realtime_ns: node_clock(n, t, REALTIME_BASE_NS),
        };
        sink.epoch(node as u32, &info);
    }

    fn reset(&mut self, node: usize, t: u64, sink: &mut impl Sink) {
        self.finish_streams(node);
        let cpus = self.scenario.cluster.cpus_per_node;
        let n = &mut self.nodes[node];
        n.epoch += 1;
        n.p0 = node_streams(Class::P0, P0_RING, cpus);
        n.bulk = node_streams(Class::P2, BULK_RING, cpus);
        self.announce_epoch(node, t, sink);
    }

    fn finish_streams(&mut self, node: usize) {
        let truths: Vec<StreamTruth> = stream_truths(node, &self.nodes[node]).collect();
        self.finished_streams.extend(truths);
        self.finished_interfaces.extend(interface_truths(node, &self.nodes[node]));
        self.nodes[node].ifaces.clear();
    }

    /// Emits node `node`'s events before `until`, P0 and bulk merged in time order, so
    /// a node's output does not depend on how the run is sliced into steps.
    fn emit_until(&mut self, node: usize, until: u64, sink: &mut impl Sink) {
        let until = until.min(self.nodes[node].dead_at);
        let period = self.nodes[node].bulk_period_ns;
        let every = u64::from(self.scenario.bulk.sample_every.max(1));
        let cpus = u64::from(self.scenario.cluster.cpus_per_node);
        loop {
            let n = &self.nodes[node];
            let p0 = n.events.get(n.next_event).map(|e| e.t).filter(|&t| t < until);
            let bulk = (period > 0.0).then(|| bulk_time(n.bulk_next, period)).filter(|&t| t < until);
            match (p0, bulk) {
                (Some(tp), Some(tb)) if tb < tp => self.next_bulk(node, tb, every, cpus, sink),
                (Some(_), _) => {
                    let ev = self.nodes[node].events[self.nodes[node].next_event];
                    self.nodes[node].next_event += 1;
                    self.emit_p0(node, ev, sink);
                }
                (None, Some(tb)) => self.next_bulk(node, tb, every, cpus, sink),
                (None, None) => break,
            }
        }
        self.flush_pending(node, sink);
    }

    fn next_bulk(&mut self, node: usize, t: u64, every: u64, cpus: u64, sink: &mut impl Sink) {
        let i = self.nodes[node].bulk_next;
        self.nodes[node].bulk_next += 1;
        self.emit_bulk(node, i, t, every, cpus, sink);
    }

    fn emit_bulk(&mut self, node: usize, i: u64, t: u64, every: u64, cpus: u64, sink: &mut impl Sink) {
        let n = &mut self.nodes[node];
        let ifindex = 2 + u32::try_from(i % 8).unwrap_or(0);
        if self.scenario.bulk.kind == BulkKind::Packet {
            // The kernel counts every packet on its interface before sampling.
            let e = n.ifaces.entry(ifindex).or_default();
            *e = (e.0 + 1, e.1 + u64::from(self.scenario.bulk.packet_bytes));
        }
        let cpu = (i % cpus) as usize;
        let Some(c) = n.bulk.get_mut(cpu) else { return };
        if !i.is_multiple_of(every) {
            c.sampled_out += 1;
            return;
        }
        let Some(seq) = reserve(c, &n.overflow, RingKind::Bulk, t, &mut n.rng) else { return };
        let stream = c.stream;
        let ts = node_clock(n, t, MONO_BASE_NS + node as u64 * 7_000_000_000);
        let (flags, weight) =
            if every > 1 { (flags::SAMPLED, u16::try_from(every).unwrap_or(u16::MAX)) } else { (0, 1) };
        match self.scenario.bulk.kind {
            BulkKind::Packet => {
                let mut f = BulkPacketFrame::new_zeroed();
                f.hdr = BulkPacketFrame::make_header(flags, stream, seq, ts);
                f.ifindex = U32::new(ifindex);
                f.pkt_len = U32::new(self.scenario.bulk.packet_bytes);
                f.flow_hash = U32::new(u32::try_from(crate::model::mix(i) >> 32).unwrap_or(0));
                f.weight = U16::new(weight);
                f.queue = U16::new(u16::try_from(i % 16).unwrap_or(0));
                sink.frame(node as u32, f.as_bytes());
            }
            BulkKind::Proxy => {
                let mut f = BulkProxyFrame::new_zeroed();
                f.hdr = BulkProxyFrame::make_header(flags, stream, seq, ts);
                f.step = U64::new(i);
                f.bytes = U64::new(u64::from(self.scenario.bulk.packet_bytes));
                f.weight = U16::new(weight);
                sink.frame(node as u32, f.as_bytes());
            }
        }
    }

    fn emit_p0(&mut self, node: usize, ev: P0Event, sink: &mut impl Sink) {
        let op = &self.model.ops[ev.op as usize];
        let p = &op.participants[ev.part as usize];
        let rank = &self.model.ranks[p.rank as usize];
        let comm = &self.model.comms[op.comm];
        let n = &mut self.nodes[node];
        let cpus = u64::from(self.scenario.cluster.cpus_per_node);
        let reordering = n.reorder.iter().any(|w| w.0 <= ev.t && ev.t < w.1);
        let cpu = if reordering {
            n.alternate += 1;
            ((u64::from(rank.cpu) + n.alternate) % cpus) as usize
        } else {
            usize::from(rank.cpu)
        };
        let Some(c) = n.p0.get_mut(cpu) else { return };
        let Some(seq) = reserve(c, &n.overflow, RingKind::P0, ev.t, &mut n.rng) else {
            *self.lost_p0.entry((ev.op, ev.part)).or_default() += 1;
            return;
        };
        let stream = c.stream;
        let ts = node_clock(n, ev.t, MONO_BASE_NS + node as u64 * 7_000_000_000);
        let mut fl = 0;
        if ev.channel.is_some() {
            fl |= flags::PER_CHANNEL;
        }
        if op.graph.is_some() {
            fl |= flags::GRAPH_CAPTURED;
        }
        let nranks = u32::try_from(comm.members.len()).unwrap_or(u32::MAX);
        self.frame_buf.clear();
        match op.kind {
            OpKind::Coll { op: kind, dtype, count, root } => {
                let mut f = CollectiveFrame::new_zeroed();
                f.hdr = CollectiveFrame::make_header(fl, stream, seq, ts);
                f.comm_hash = U64::new(comm.key.comm_hash);
                f.comm_disambiguator = U64::new(comm.key.comm_disambiguator);
                f.comm_instance = U64::new(comm.key.comm_instance);
                f.comm_op_seq = U64::new(op.comm_op_seq);
                f.local_op_seq = U64::new(p.local_op_seq);
                f.nccl_seq = U64::new(op.comm_op_seq.saturating_sub(1));
                let (mut kind, mut dtype, mut count) = (kind, dtype, count);
                match p.mismatch {
                    Some(MismatchField::Op) => {
                        kind = if kind == proto_flat::codes::Op::AllGather {
                            proto_flat::codes::Op::AllReduce
                        } else {
                            proto_flat::codes::Op::AllGather
                        };
                    }
                    Some(MismatchField::Dtype) => {
                        dtype = if dtype == proto_flat::codes::DType::Float32 {
                            proto_flat::codes::DType::Bfloat16
                        } else {
                            proto_flat::codes::DType::Float32
                        };
                    }
                    Some(MismatchField::Count) => count = count * 2 + 1,
                    None => {}
                }
                f.count = U64::new(count);
                if let Some(g) = op.graph {
                    f.graph_id = U64::new(g.graph_id);
                    f.graph_node = U32::new(g.graph_node);
                    f.replay_idx = U32::new(g.replay_idx);
                }
                f.rank = U32::new(p.pos);
                f.nranks = U32::new(nranks);
                f.root = U32::new(root);
                f.pid = U32::new(rank.pid);
                f.status = I32::new(0);
                f.local_rank = U16::new(u16::try_from(rank.gpu).unwrap_or(u16::MAX));
                f.cuda_dev = U16::new(
                    u16::try_from(
                        rank.gpu % (self.scenario.cluster.gpus_per_node / self.scenario.cluster.pods_per_node).max(1),
                    )
                    .unwrap_or(0),
                );
                f.channel = U16::new(ev.channel.unwrap_or(0));
                f.n_channels = U16::new(op.channels);
                f.op = kind.code();
                f.dtype = dtype.code();
                f.phase = ev.phase.code();
                self.frame_buf.extend_from_slice(f.as_bytes());
            }
            OpKind::P2p { src, dst, p2p_seq, dtype, count } => {
                let mut f = P2pFrame::new_zeroed();
                f.hdr = P2pFrame::make_header(fl, stream, seq, ts);
                f.comm_hash = U64::new(comm.key.comm_hash);
                f.comm_disambiguator = U64::new(comm.key.comm_disambiguator);
                f.comm_instance = U64::new(comm.key.comm_instance);
                f.local_op_seq = U64::new(p.local_op_seq);
                f.p2p_seq = U64::new(p2p_seq);
                f.count = U64::new(count);
                f.rank = U32::new(p.pos);
                f.src = U32::new(src);
                f.dst = U32::new(dst);
                f.pid = U32::new(rank.pid);
                f.channel = U16::new(ev.channel.unwrap_or(0));
                f.n_channels = U16::new(op.channels);
                f.op =
                    if p.pos == src { proto_flat::codes::Op::Send.code() } else { proto_flat::codes::Op::Recv.code() };
                f.phase = ev.phase.code();
                f.dtype = dtype.code();
                self.frame_buf.extend_from_slice(f.as_bytes());
            }
        }
        if reordering {
            // Out-of-order commits: hold the frame and let the next one overtake it
            // sometimes (a preempted BPF program commits late).
            let overtake = n.rng.random::<f64>() < 0.3;
            let frame = self.frame_buf.clone();
            if overtake && !self.pending.is_empty() {
                sink.frame(node as u32, &frame);
            } else {
                self.flush_pending(node, sink);
                self.pending.push((node as u32, frame));
            }
        } else {
            self.flush_pending(node, sink);
            sink.frame(node as u32, &self.frame_buf);
        }
    }

    fn flush_pending(&mut self, node: usize, sink: &mut impl Sink) {
        for (n, frame) in self.pending.drain(..) {
            debug_assert_eq!(n as usize, node);
            sink.frame(n, &frame);
        }
    }

    fn snapshot(&mut self, node: usize, t: u64, sink: &mut impl Sink) {
        let mono = self.node_mono(node as u32, t);
        let n = &mut self.nodes[node];
        self.stream_scratch.clear();
        for c in n.p0.iter_mut().chain(n.bulk.iter_mut()) {
            let mut e = StreamEntry::new_zeroed();
            e.stream_id = U32::new(c.stream.0);
            e.fill_max_ppm = U32::new(if c.dropped_since_snapshot { 1_000_000 } else { 0 });
            e.attempted_seq = U64::new(c.attempted);
            for (dst, src) in e.drops.iter_mut().zip(c.drops.iter()) {
                *dst = U64::new(*src);
            }
            e.sampled_out = U64::new(c.sampled_out);
            c.dropped_since_snapshot = false;
            self.stream_scratch.push(e);
        }
        self.progress_scratch.clear();
        let (drift, offset) = (n.drift, n.offset_ns);
        for track in &mut n.tracks {
            for i in 0..3 {
                while let Some(&(time, seq)) = track.lists[i].get(track.cursor[i]) {
                    if time >= t {
                        break;
                    }
                    track.cursor[i] += 1;
                    track.max[i] = track.max[i].max(seq);
                    track.last_update = track.last_update.max(time);
                }
            }
            let rank = &self.model.ranks[track.rank as usize];
            let comm = &self.model.comms[track.comm];
            let exit = n.exits.iter().find(|e| e.0 == rank.gpu && e.1 <= t);
            let mut p = ProgressEntry::new_zeroed();
            p.comm_hash = U64::new(comm.key.comm_hash);
            p.comm_disambiguator = U64::new(comm.key.comm_disambiguator);
            p.comm_instance = U64::new(comm.key.comm_instance);
            p.cgroup_id = U64::new(rank.cgroup_id);
            p.last_enqueued_op = U64::new(track.max[0]);
            p.last_kernel_started_op = U64::new(track.max[1]);
            p.last_completed_op = U64::new(track.max[2]);
            p.last_update_ns =
                U64::new(clock(drift, offset, track.last_update, MONO_BASE_NS + node as u64 * 7_000_000_000));
            p.gpu_uuid = rank.gpu_uuid;
            p.rank = U32::new(
                comm.members.iter().position(|&m| m == track.rank).and_then(|x| u32::try_from(x).ok()).unwrap_or(0),
            );
            p.pid = U32::new(rank.pid);
            p.exit_code = I32::new(exit.map_or(0, |e| e.2));
            p.activation_mask = U32::new(self.scenario.cluster.activation_mask);
            p.proc_state = if exit.is_some() { ProcState::Exited.code() } else { ProcState::Running.code() };
            self.progress_scratch.push(p);
        }
        self.interface_scratch.clear();
        self.interface_scratch.extend(n.ifaces.iter().map(|(&ifindex, &(packets, bytes))| InterfaceEntry {
            ifindex: U32::new(ifindex),
            _reserved0: U32::new(0),
            packets: U64::new(packets),
            bytes: U64::new(bytes),
        }));
        let snap = Snapshot {
            epoch: n.epoch,
            mono_ns: mono,
            realtime_ns: node_clock(n, t, REALTIME_BASE_NS),
            streams: &self.stream_scratch,
            progress: &self.progress_scratch,
            interfaces: &self.interface_scratch,
        };
        sink.snapshot(node as u32, &snap);
    }

    /// Ground truth. Complete once [`Self::is_done`]; before that it covers what has
    /// been simulated so far.
    #[must_use]
    pub fn ground_truth(&self) -> GroundTruth {
        let mut streams = self.finished_streams.clone();
        let mut interfaces = self.finished_interfaces.clone();
        for (node, n) in self.nodes.iter().enumerate() {
            streams.extend(stream_truths(node, n));
            interfaces.extend(interface_truths(node, n));
        }
        crate::truth::build(&self.scenario, &self.options, &self.model, &self.lost_p0, streams, interfaces)
    }
}

/// Interface truth of a node's current epoch.
fn interface_truths(node: usize, n: &NodeState) -> impl Iterator<Item = InterfaceTruth> + '_ {
    n.ifaces.iter().map(move |(&ifindex, &(packets, bytes))| InterfaceTruth {
        node: node as u32,
        epoch: n.epoch,
        ifindex,
        packets,
        bytes,
    })
}

/// Conservation truth of a node's streams in its current epoch.
fn stream_truths(node: usize, n: &NodeState) -> impl Iterator<Item = StreamTruth> + '_ {
    n.p0.iter().chain(n.bulk.iter()).map(move |c| {
        StreamTruth::from_counters(node as u32, n.epoch, c.stream, c.attempted, c.delivered, c.drops, c.sampled_out)
    })
}

/// The kernel's order for one event that passed sampling: take the next seq, then try to
/// reserve ring space; inside an overflow window the reserve fails (with the window's
/// probability), the seq is a hole and `drops[kernel_ring_full]` counts it. Returns the
/// seq of a written record.
fn reserve(
    c: &mut Counters,
    overflow: &[(RingKind, u64, u64, f64)],
    ring: RingKind,
    t: u64,
    rng: &mut ChaCha8Rng,
) -> Option<u64> {
    let seq = c.attempted;
    c.attempted += 1;
    if let Some(&(_, _, _, fraction)) = overflow.iter().find(|w| w.0 == ring && w.1 <= t && t < w.2)
        && (fraction >= 1.0 || rng.random::<f64>() < fraction)
    {
        if let Some(d) = LossCause::KernelRingFull.drop_slot().and_then(|s| c.drops.get_mut(s)) {
            *d += 1;
        }
        c.dropped_since_snapshot = true;
        return None;
    }
    c.delivered += 1;
    Some(seq)
}

/// Time of the `i`-th bulk event of a node.
fn bulk_time(i: u64, period_ns: f64) -> u64 {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "event times fit u64 ns"
    )]
    let t = (i as f64 * period_ns) as u64;
    t
}

fn node_clock(n: &NodeState, t: u64, base: u64) -> u64 {
    clock(n.drift, n.offset_ns, t, base)
}

/// Node clock for true time `t`: `base + t·(1 + drift) + offset`.
fn clock(drift: f64, offset_ns: f64, t: u64, base: u64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss, reason = "clock model in f64; saturating")]
    let err = (t as f64 * drift + offset_ns) as i64;
    base.saturating_add(t).saturating_add_signed(err)
}

/// Scenario milliseconds to nanoseconds, saturating (values come from a file).
fn ns(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}
