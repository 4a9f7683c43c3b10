//! A batch feed for the core's pure-logic tests (a fake, beside the real thing): turns
//! the simulator's ring records and counter snapshots into proto-flat batches (lanes by
//! class, heartbeats from the snapshots, loss records for batches it drops, a
//! `session_start` after a restart it is told to make) and delivers them with drops,
//! duplicates and delays at rates the test picks — patterns the real shipper over QUIC
//! never produces but which ingest's accounting must survive exactly. It is not a model
//! of the shipper: how the real `ShipperCore` and `Core` behave together is tested by the
//! pair harness (`tests/src/pair.rs`; `tests/tests/matcher_scenarios.rs`,
//! `tests/tests/sim_pair.rs`).

#![allow(dead_code, unreachable_pub, reason = "shared by several test binaries")]

use std::collections::{BTreeMap, HashMap};

use loadgen_sim::sim::{EpochInfo, Sink, Snapshot};
use loadgen_sim::{Scenario, SimOptions, Simulation};
use proto_flat::batch::{BatchMeta, BatchView, BatchWriter, RunningTotals, SummaryCheck};
use proto_flat::codes::{Class, LossCause, WireEnum};
use proto_flat::encode::SectionedFrameWriter;
use proto_flat::frames::{FixedFrame, LossRecordFrame};
use proto_flat::header::StreamId;
use proto_flat::sections::{SessionStreamEntry, StreamEntry};
use rand::{Rng, SeedableRng};
use ringwatch_core::{Ingest, IngestConfig, MatcherConfig, NodeId, Record};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromZeros, IntoBytes};

pub const SHIPPER_STREAM: StreamId = StreamId::new(Class::P1, StreamId::SHIPPER_RING, 0);

/// How the network treats data batches (heartbeats and loss records are never dropped).
#[derive(Debug, Clone, Copy, Default)]
pub struct Net {
    pub drop: f64,
    pub duplicate: f64,
    pub max_delay_ms: u64,
    pub seed: u64,
}

#[derive(Default)]
struct NodeShip {
    epoch: u64,
    session: u64,
    batch_seq: u64,
    p1_seq: u64,
    open: BTreeMap<u8, Vec<Vec<u8>>>,
    attempted: HashMap<u32, u64>,
    /// The last heartbeat's sections (streams, progress), to repeat while idle.
    last_hb: Option<(Vec<StreamEntry>, Vec<proto_flat::sections::ProgressEntry>, u64)>,
}

/// What the feed sent, with the sim time it was cut.
pub struct Sent {
    pub node: u32,
    pub at_ns: u64,
    pub bytes: Vec<u8>,
    pub data: bool,
}

pub struct BatchFeed {
    nodes: Vec<NodeShip>,
    pub now_ns: u64,
    pub batch_frames: usize,
    pub sent: Vec<Sent>,
    /// Frames the feed dropped (in dropped batches or at a restart), per (node, epoch,
    /// stream) → seqs.
    pub shipper_lost: BTreeMap<(u32, u64, u32), Vec<u64>>,
    pub net: Net,
    rng: rand_chacha::ChaCha8Rng,
    /// (node, sim time) of scheduled shipper restarts.
    pub restarts: Vec<(u32, u64)>,
}

pub fn node_id(node: u32) -> NodeId {
    NodeId(0x5eed_0000 + u64::from(node))
}

impl BatchFeed {
    pub fn new(nodes: u32, net: Net) -> Self {
        Self {
            nodes: (0..nodes).map(|_| NodeShip { session: 1, ..Default::default() }).collect(),
            now_ns: 0,
            batch_frames: 64,
            sent: Vec::new(),
            shipper_lost: BTreeMap::new(),
            net,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(net.seed),
            restarts: Vec::new(),
        }
    }

    fn cut(&mut self, node: u32, lane: u8) {
        let n = &mut self.nodes[node as usize];
        let Some(frames) = n.open.remove(&lane) else { return };
        if frames.is_empty() {
            return;
        }
        n.batch_seq += 1;
        let bytes = batch(node, n.epoch, n.session, n.batch_seq, lane, &frames);
        let drop = lane == Class::P2.code() && self.rng.random::<f64>() < self.net.drop;
        if drop {
            // The shipper turns the dropped batch into loss records, one per stream.
            let view = BatchView::parse(&bytes).unwrap();
            let mut records = Vec::new();
            for e in view.summary.iter() {
                n.p1_seq += 1;
                let mut r = LossRecordFrame::new_zeroed();
                r.hdr = LossRecordFrame::make_header(0, SHIPPER_STREAM, n.p1_seq - 1, 0);
                r.first_seq = e.first_seq;
                r.last_seq = e.last_seq;
                r.count = U64::new(u64::from(e.frame_count.get()));
                r.cause = U16::new(LossCause::ShipperSpoolFull.code());
                r.stream_id = e.stream_id;
                r.shipper_session = U64::new(n.session);
                r.batch_seq = U64::new(n.batch_seq);
                records.push(r.as_bytes().to_vec());
            }
            for f in view.headers() {
                let (h, _) = f.unwrap();
                self.shipper_lost.entry((node, n.epoch, h.stream_id.get())).or_default().push(h.seq.get());
            }
            n.batch_seq += 1;
            let lr = batch(node, n.epoch, n.session, n.batch_seq, Class::P1.code(), &records);
            self.sent.push(Sent { node, at_ns: self.now_ns, bytes: lr, data: false });
            return;
        }
        self.sent.push(Sent { node, at_ns: self.now_ns, bytes, data: lane != Class::P1.code() });
    }

    /// Sends the node's last heartbeat again (an idle shipper keeps heartbeating).
    pub fn heartbeat(&mut self, node: u32) {
        let n = &mut self.nodes[node as usize];
        let Some((streams, progress, mono)) = n.last_hb.clone() else { return };
        n.p1_seq += 1;
        let mut w = SectionedFrameWriter::heartbeat(SHIPPER_STREAM, n.p1_seq - 1, mono, mono);
        w.section(&streams).section(&progress);
        n.batch_seq += 1;
        let b = batch(node, n.epoch, n.session, n.batch_seq, Class::P1.code(), &[w.finish()]);
        self.sent.push(Sent { node, at_ns: self.now_ns, bytes: b, data: false });
    }

    fn cut_all(&mut self, node: u32) {
        for lane in [0u8, 2] {
            self.cut(node, lane);
        }
    }

    /// A shipper restart: the open (unshipped) batches are gone; the new session
    /// announces the kernel counters at takeover.
    pub fn restart(&mut self, node: u32) {
        let n = &mut self.nodes[node as usize];
        for (_, frames) in std::mem::take(&mut n.open) {
            for f in frames {
                let h = proto_flat::decode::split_frame(&f, 0).unwrap().0;
                self.shipper_lost.entry((node, n.epoch, h.stream_id.get())).or_default().push(h.seq.get());
            }
        }
        n.session += 1;
        n.batch_seq = 0;
        let entries: Vec<SessionStreamEntry> = n
            .attempted
            .iter()
            .map(|(&sid, &a)| SessionStreamEntry {
                stream_id: U32::new(sid),
                _reserved0: [0; 4],
                attempted_seq: U64::new(a),
            })
            .collect();
        n.p1_seq += 1;
        let mut w = SectionedFrameWriter::session_start(SHIPPER_STREAM, n.p1_seq - 1, 0, n.session);
        w.section(&entries);
        n.batch_seq += 1;
        let b = batch(node, n.epoch, n.session, n.batch_seq, Class::P1.code(), &[w.finish()]);
        self.sent.push(Sent { node, at_ns: self.now_ns, bytes: b, data: false });
    }
}

pub fn batch(node: u32, epoch: u64, session: u64, batch_seq: u64, lane: u8, frames: &[Vec<u8>]) -> Vec<u8> {
    let mut w = BatchWriter::with_capacity(16 * 1024);
    w.begin(&BatchMeta {
        node_id: node_id(node).0,
        epoch,
        shipper_session: session,
        batch_seq,
        lane,
        clock_mono_ns: 0,
        clock_realtime_ns: 0,
    });
    for f in frames {
        w.push_frame(f).unwrap();
    }
    w.finish(&RunningTotals::default()).to_vec()
}

impl Sink for BatchFeed {
    fn frame(&mut self, node: u32, frame: &[u8]) {
        let h = proto_flat::decode::split_frame(frame, 0).unwrap().0;
        let lane = h.stream().class_code();
        let n = &mut self.nodes[node as usize];
        let a = n.attempted.entry(h.stream_id.get()).or_default();
        *a = (*a).max(h.seq.get() + 1);
        let open = n.open.entry(lane).or_default();
        open.push(frame.to_vec());
        if open.len() >= self.batch_frames {
            self.cut(node, lane);
        }
    }

    fn snapshot(&mut self, node: u32, s: &Snapshot<'_>) {
        if let Some(&(_, at)) = self.restarts.iter().find(|(n, at)| *n == node && *at <= self.now_ns) {
            self.restarts.retain(|r| *r != (node, at));
            self.restart(node);
        }
        // Everything read off the ring is cut, so the shipper spooled through attempted.
        self.cut_all(node);
        let n = &mut self.nodes[node as usize];
        let streams: Vec<StreamEntry> = s
            .streams
            .iter()
            .map(|e| {
                let mut e = *e;
                e.held_from_seq = e.attempted_seq;
                n.attempted.insert(e.stream_id.get(), e.attempted_seq.get());
                e
            })
            .collect();
        n.last_hb = Some((streams, s.progress.to_vec(), s.mono_ns));
        self.heartbeat(node);
    }

    fn epoch(&mut self, node: u32, info: &EpochInfo) {
        self.cut_all(node);
        let n = &mut self.nodes[node as usize];
        n.epoch = info.epoch;
        n.attempted.clear();
        n.p1_seq = 0;
        // The shipper's own stream restarts at seq 0 with the epoch frame (a capture
        // file numbers its epoch records by epoch instead).
        let mut f = loadgen_sim::capture::epoch_frame(info);
        f.hdr = proto_flat::frames::EpochStartFrame::make_header(0, SHIPPER_STREAM, 0, info.mono_ns);
        n.p1_seq += 1;
        n.batch_seq += 1;
        let b = batch(node, n.epoch, n.session, n.batch_seq, Class::P1.code(), &[f.as_bytes().to_vec()]);
        self.sent.push(Sent { node, at_ns: self.now_ns, bytes: b, data: false });
    }
}

/// Runs a scenario through the feed into an ingest. Returns
/// the records, the ingest, the simulation and the feed.
pub struct Run {
    pub ingest: Ingest,
    pub records: Vec<Record>,
    pub sim: Simulation,
    pub feed: BatchFeed,
    /// Seqs each stream delivered to ingest at least once.
    pub delivered: BTreeMap<(u32, u64, u32), Vec<u64>>,
    /// Every record with the aggregator time it was produced.
    pub timed: Vec<(u64, Record)>,
    /// Aggregator time at the end of the delivery.
    pub end_ns: u64,
}

pub fn run(scenario: &Scenario, seed: Option<u64>, scale: f64, net: Net, restarts: &[(u32, u64)]) -> Run {
    let mut sim = Simulation::new(scenario, SimOptions { bulk_scale: scale, seed }).unwrap();
    let mut feed = BatchFeed::new(scenario.cluster.nodes, net);
    feed.restarts = restarts.to_vec();
    let step = 10_000_000;
    let dead_at: Vec<u64> = sim.model().dead_at.clone();
    let mut flushed = vec![false; dead_at.len()];
    while !sim.is_done() {
        feed.now_ns += step;
        sim.step(feed.now_ns, &mut feed);
        // A dead node's shipper dies with it: what it had read goes out at the death.
        for (node, &d) in dead_at.iter().enumerate() {
            if !flushed[node] && feed.now_ns >= d {
                flushed[node] = true;
                feed.cut_all(u32::try_from(node).unwrap());
            }
        }
    }
    for node in 0..scenario.cluster.nodes {
        if !flushed[node as usize] {
            feed.cut_all(node);
        }
    }
    // Live shippers keep heartbeating after the run: one, after every delayed batch has
    // arrived, lets the last gaps settle; then one a second until a dead node is
    // unreachable (a silent node still gates its peers' verdicts), so live nodes stay
    // fresh meanwhile, as real shippers do.
    feed.now_ns += 2 * (net.max_delay_ms + 10) * 1_000_000 + 1_000_000_000;
    let dead: Vec<bool> = sim.model().dead_at.iter().map(|&d| d != u64::MAX).collect();
    let last_death = sim.model().dead_at.iter().copied().filter(|&d| d != u64::MAX).max();
    // Unreachable, a dead node still gates finality until it is presumed dead.
    let until = last_death.map_or(0, |d| {
        d + IngestConfig::default().unreachable_ns + MatcherConfig::default().dead_after_ns + 2_000_000_000
    });
    loop {
        for node in 0..scenario.cluster.nodes {
            if !dead[node as usize] {
                feed.heartbeat(node);
            }
        }
        if feed.now_ns >= until {
            break;
        }
        feed.now_ns += 1_000_000_000;
    }
    deliver(sim, feed, net)
}

fn deliver(sim: Simulation, feed: BatchFeed, net: Net) -> Run {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(net.seed ^ 0xdead);
    let mut arrivals: Vec<(u64, usize)> = Vec::new();
    for (i, s) in feed.sent.iter().enumerate() {
        let delay = if net.max_delay_ms > 0 { rng.random_range(0..net.max_delay_ms) * 1_000_000 } else { 0 };
        arrivals.push((s.at_ns + 1_000_000 + delay, i));
        if s.data && rng.random::<f64>() < net.duplicate {
            arrivals.push((s.at_ns + 2_000_000 + delay * 2, i));
        }
    }
    arrivals.sort();
    let mut ingest = Ingest::new(IngestConfig::default(), 0);
    let mut records = Vec::new();
    let mut delivered: BTreeMap<(u32, u64, u32), Vec<u64>> = BTreeMap::new();
    let mut scratch = SummaryCheck::default();
    let mut timed = Vec::new();
    for (t, i) in arrivals {
        // Drive timers as the aggregator's event loop does: at each due time.
        while let Some(due) = ingest.poll_timeout().filter(|&d| d <= t) {
            ingest.handle_timeout(due);
            while let Some(r) = ingest.poll_record() {
                timed.push((due, r));
                records.push(r);
            }
        }
        let s = &feed.sent[i];
        let view = BatchView::parse(&s.bytes).unwrap();
        view.validate(&mut scratch).unwrap();
        for h in view.headers() {
            let (h, _) = h.unwrap();
            delivered.entry((s.node, view.header.epoch.get(), h.stream_id.get())).or_default().push(h.seq.get());
        }
        ingest.handle_batch(t, node_id(s.node), 200_000, &view);
        while let Some(r) = ingest.poll_record() {
            timed.push((t, r));
            records.push(r);
        }
    }
    // Let every settlement fall due (but not past the liveness timers' interest).
    let end = feed.now_ns + 120_000_000_000;
    while let Some(due) = ingest.poll_timeout().filter(|&d| d <= end) {
        ingest.handle_timeout(due);
        while let Some(r) = ingest.poll_record() {
            timed.push((due, r));
            records.push(r);
        }
    }
    Run { ingest, records, sim, feed, delivered, timed, end_ns: end }
}
