//! A sink that decodes everything the simulator writes, the way a shipper and an
//! aggregator would, and counts per stream what arrived.

#![allow(dead_code, unreachable_pub, reason = "shared by several test binaries, each using a part")]

use std::collections::{BTreeMap, HashMap};

use loadgen_sim::sim::{EpochInfo, Sink, Snapshot};
use loadgen_sim::{GroundTruth, Scenario, SimOptions, Simulation};
use proto_flat::decode::{Frame, FrameIter};
use proto_flat::sections::{InterfaceEntry, ProgressEntry, StreamEntry};

#[derive(Debug, Default, Clone)]
pub struct StreamSeen {
    pub seqs: Vec<bool>,
    pub distinct: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    pub last: Option<u64>,
}

#[derive(Debug, Default)]
pub struct Checker {
    pub epoch: HashMap<u32, u64>,
    /// (node, epoch, stream) → what arrived.
    pub seen: BTreeMap<(u32, u64, u32), StreamSeen>,
    /// (node, epoch) → the last snapshot's stream entries.
    pub last_streams: HashMap<(u32, u64), Vec<StreamEntry>>,
    /// (node, epoch) → the last snapshot's interface entries.
    pub last_interfaces: HashMap<(u32, u64), Vec<InterfaceEntry>>,
    pub progress: Vec<(u32, ProgressEntry)>,
    pub frames: Vec<(u32, Vec<u8>)>,
    pub keep_frames: bool,
    pub malformed: u64,
    pub unknown: u64,
    pub snapshots: u64,
    pub epochs: Vec<(u32, EpochInfo)>,
    pub last_ts: HashMap<u32, u64>,
}

impl Sink for Checker {
    fn frame(&mut self, node: u32, frame: &[u8]) {
        let epoch = *self.epoch.get(&node).expect("epoch announced before frames");
        let mut it = FrameIter::new(frame);
        let decoded = it.next().expect("one frame").expect("frames are well framed");
        assert!(it.next().is_none(), "exactly one frame per ring record");
        match decoded {
            Frame::Malformed { .. } => self.malformed += 1,
            Frame::Unknown { .. } => self.unknown += 1,
            _ => {}
        }
        let h = decoded.header();
        let seq = h.seq.get();
        let s = self.seen.entry((node, epoch, h.stream_id.get())).or_default();
        let i = usize::try_from(seq).unwrap();
        if s.seqs.len() <= i {
            s.seqs.resize(i + 1, false);
        }
        if s.seqs[i] {
            s.duplicates += 1;
        } else {
            s.seqs[i] = true;
            s.distinct += 1;
        }
        if s.last.is_some_and(|l| seq < l) {
            s.out_of_order += 1;
        }
        s.last = Some(seq);
        if self.keep_frames {
            self.frames.push((node, frame.to_vec()));
        }
    }

    fn snapshot(&mut self, node: u32, snapshot: &Snapshot<'_>) {
        self.snapshots += 1;
        assert_eq!(Some(&snapshot.epoch), self.epoch.get(&node), "snapshot of the current epoch");
        self.last_streams.insert((node, snapshot.epoch), snapshot.streams.to_vec());
        self.last_interfaces.insert((node, snapshot.epoch), snapshot.interfaces.to_vec());
        for p in snapshot.progress {
            self.progress.push((node, *p));
        }
    }

    fn epoch(&mut self, node: u32, info: &EpochInfo) {
        self.epoch.insert(node, info.epoch);
        self.epochs.push((node, *info));
    }
}

pub fn run(scenario: &Scenario, seed: Option<u64>, bulk_scale: f64) -> (Simulation, Checker, GroundTruth) {
    let mut sim = Simulation::new(scenario, SimOptions { bulk_scale, seed }).expect("valid scenario");
    let mut check = Checker::default();
    sim.run(&mut check);
    assert!(sim.is_done());
    let truth = sim.ground_truth();
    (sim, check, truth)
}

/// Conservation counted from the decoded output against the kernel counters and the
/// ground truth, per (node, epoch, stream).
pub fn assert_conservation(check: &Checker, truth: &GroundTruth) {
    assert!(!truth.streams.is_empty());
    for st in &truth.streams {
        assert!(st.conserved(), "truth not conserved: {st:?}");
        let seen = check.seen.get(&(st.node, st.epoch, st.stream_id)).cloned().unwrap_or_default();
        assert_eq!(seen.duplicates, 0, "{st:?}");
        assert_eq!(seen.distinct, st.delivered, "delivered frames counted from the output: {st:?}");
        assert!(seen.seqs.len() as u64 <= st.attempted, "a seq at or past attempted_seq: {st:?}");
        let holes = st.attempted - seen.distinct;
        let dropped: u64 = st.dropped.values().sum();
        assert_eq!(holes, dropped, "seq holes must equal the kernel drop counters: {st:?}");
        // The last snapshot of the epoch (if the epoch ran to the end) agrees exactly.
        if let Some(entries) = check.last_streams.get(&(st.node, st.epoch))
            && let Some(e) = entries.iter().find(|e| e.stream_id.get() == st.stream_id)
            && check.epoch.get(&st.node) == Some(&st.epoch)
            && truth.nodes[st.node as usize].dead_at_ms.is_none()
        {
            assert_eq!(e.attempted_seq.get(), st.attempted, "{st:?}");
            assert_eq!(e.sampled_out.get(), st.sampled_out, "{st:?}");
            assert_eq!(e.drops.iter().map(|d| d.get()).sum::<u64>(), dropped, "{st:?}");
        }
    }
    // Per interface: every bulk packet event counted once, sampled out or not, and the
    // last snapshot of an epoch that ran to the end says the same.
    for ifs in truth.interfaces.chunk_by(|a, b| (a.node, a.epoch) == (b.node, b.epoch)) {
        let (node, epoch) = (ifs[0].node, ifs[0].epoch);
        let packets: u64 = ifs.iter().map(|i| i.packets).sum();
        let generated: u64 = truth
            .streams
            .iter()
            .filter(|st| (st.node, st.epoch, st.class.as_str()) == (node, epoch, "p2"))
            .map(|st| st.generated)
            .sum();
        assert_eq!(packets, generated, "node {node} epoch {epoch}: interface packets = bulk events");
        if let Some(entries) = check.last_interfaces.get(&(node, epoch))
            && check.epoch.get(&node) == Some(&epoch)
            && truth.nodes[node as usize].dead_at_ms.is_none()
        {
            let got: Vec<(u32, u64, u64)> =
                entries.iter().map(|e| (e.ifindex.get(), e.packets.get(), e.bytes.get())).collect();
            let want: Vec<(u32, u64, u64)> = ifs.iter().map(|i| (i.ifindex, i.packets, i.bytes)).collect();
            assert_eq!(got, want, "node {node} epoch {epoch}: the last snapshot's interfaces");
        }
    }
    // Nothing arrived on a stream the truth does not know.
    for key in check.seen.keys() {
        assert!(
            truth.streams.iter().any(|st| (st.node, st.epoch, st.stream_id) == *key),
            "frames on an unknown stream {key:?}"
        );
    }
    assert_eq!(check.malformed, 0);
    assert_eq!(check.unknown, 0);
}
