//! `VerdictStore`: compaction, limits, pages and recoveries.

use ringwatch_core::records::{Comm, NodeId};
use ringwatch_core::verdict::{Evidence, FrameRef, MatcherEvent, OpRef, Outcome, Verdict, VerdictTag};
use ringwatch_core::{Cursor, StoreConfig, VerdictStore};

const S: u64 = 1_000_000_000;

fn comm() -> Comm {
    Comm { hash: 7, disambiguator: 0, instance: 1 }
}

fn verdict(seq: u64, rank: u32, outcome: Outcome, is_final: bool) -> Verdict {
    let node = NodeId(u64::from(rank % 4));
    Verdict {
        op: OpRef::Coll { comm: comm(), seq },
        rank,
        node: Some(node),
        gpu_uuid: [u8::try_from(rank % 8).unwrap_or(0); 16],
        outcome,
        tags: Vec::new(),
        is_final,
        decided_at_ns: seq,
        evidence: Evidence {
            frames: (0..3).map(|i| FrameRef { node, stream_id: 1, seq: seq * 3 + i, phase: 3 }).collect(),
            watermarks: vec![(node, 1)],
            ..Evidence::default()
        },
        revision: 0,
    }
}

fn op_events(seq: u64, ranks: u32, outcome: Outcome) -> Vec<MatcherEvent> {
    (0..ranks).map(|r| MatcherEvent::Verdict(verdict(seq, r, outcome, true))).collect()
}

/// Final, untagged `completed` ops are compacted; anything else is kept whole. Prints the
/// bytes per rank verdict of each form.
#[test]
fn completed_ops_are_compacted_and_the_rest_kept_whole() {
    let mut full = VerdictStore::new(StoreConfig::default());
    full.apply(S, op_events(1, 64, Outcome::Stuck));
    let mut compact = VerdictStore::new(StoreConfig::default());
    compact.apply(S, op_events(1, 64, Outcome::Completed));
    println!(
        "bytes per rank verdict: whole {} B, compacted {} B (64-rank op)",
        full.bytes() / full.len(),
        compact.bytes() / compact.len()
    );
    assert_eq!(compact.stats().ops_compacted, 1);
    assert_eq!(full.stats().ops_compacted, 0);
    assert!(compact.bytes() * 4 < full.bytes(), "{} vs {}", compact.bytes(), full.bytes());
    let c = compact.get(OpRef::Coll { comm: comm(), seq: 1 }, 5).expect("held");
    assert!(c.compacted);
    assert_eq!(c.stored.verdict.outcome, Outcome::Completed);
    assert_eq!(c.stored.verdict.node, Some(NodeId(1)));
    assert_eq!(c.stored.final_at_ns, Some(S));
    // A tagged completion keeps its evidence.
    let mut tagged = VerdictStore::new(StoreConfig::default());
    let mut v = verdict(2, 0, Outcome::Completed, true);
    v.tags.push(VerdictTag::TelemetryLoss { ids: vec![3] });
    tagged.apply(S, [MatcherEvent::Verdict(v.clone())]);
    assert_eq!(tagged.get(v.op, 0).map(|i| i.stored.verdict), Some(v));
    // A non-final completion is not compacted until final.
    let mut pending = VerdictStore::new(StoreConfig::default());
    pending.apply(S, [MatcherEvent::Verdict(verdict(3, 0, Outcome::Completed, false))]);
    assert_eq!(pending.stats().ops_compacted, 0);
    pending.apply(2 * S, [MatcherEvent::Verdict(verdict(3, 0, Outcome::Completed, true))]);
    assert_eq!(pending.stats().ops_compacted, 1);
    assert_eq!(pending.len(), 1);
}

/// Ops age out `retention_ns` after their last update, and the least recently updated go
/// first over `max_bytes`; both counted, the held count and bytes kept exact.
#[test]
fn retention_and_the_byte_cap_evict_oldest_first_and_count() {
    let mut s = VerdictStore::new(StoreConfig { retention_ns: 10 * S, max_bytes: u64::MAX });
    for seq in 1..=20 {
        s.apply(seq * S, op_events(seq, 8, Outcome::Stuck));
    }
    s.expire(25 * S);
    // Updated at 15..=20 s: within 10 s of 25 s.
    assert_eq!(s.ops(), 6);
    assert_eq!(s.len(), 6 * 8);
    assert_eq!(s.stats().ops_aged_out, 14);
    assert_eq!(s.stats().verdicts_aged_out, 14 * 8);
    let per_op = s.bytes() / 6;
    let mut capped = VerdictStore::new(StoreConfig { retention_ns: u64::MAX, max_bytes: per_op * 5 });
    for seq in 1..=20 {
        capped.apply(seq * S, op_events(seq, 8, Outcome::Stuck));
        assert!(capped.bytes() <= per_op * 5);
    }
    assert_eq!(capped.ops(), 5);
    assert_eq!(capped.stats().ops_evicted_bytes, 15);
    assert!(capped.get(OpRef::Coll { comm: comm(), seq: 20 }, 0).is_some(), "the newest is kept");
    assert!(capped.get(OpRef::Coll { comm: comm(), seq: 15 }, 0).is_none(), "the oldest went first");
    for seq in 16..=20 {
        capped.apply(30 * S, op_events(seq, 8, Outcome::Completed));
    }
    assert!(capped.map_sizes().iter().all(ringwatch_core::MapSize::within));
}

/// Paging by cursor visits every held verdict once, in order, whatever the limit, the
/// scan budget and the filter; compacted ops page like the rest.
#[test]
fn pages_visit_every_verdict_once() {
    let mut s = VerdictStore::new(StoreConfig::default());
    for seq in 1..=30 {
        let outcome = if seq % 3 == 0 { Outcome::Stuck } else { Outcome::Completed };
        s.apply(seq * S, op_events(seq, 5, outcome));
    }
    let all: Vec<(u64, u32)> = (1..=30).flat_map(|seq| (0..5).map(move |r| (seq, r))).collect();
    let key = |i: &ringwatch_core::PageItem| match i.stored.verdict.op {
        OpRef::Coll { seq, .. } => (seq, i.stored.verdict.rank),
        _ => unreachable!(),
    };
    for (limit, budget) in [(1, usize::MAX), (7, usize::MAX), (1000, usize::MAX), (3, 4), (10, 1)] {
        for stuck_only in [false, true] {
            let mut got = Vec::new();
            let mut after: Option<Cursor> = None;
            let mut pages = 0;
            loop {
                let p = s.page(after, limit, budget, |st| !stuck_only || st.verdict.outcome == Outcome::Stuck);
                assert!(p.items.len() <= limit && p.scanned <= budget);
                got.extend(p.items.iter().map(key));
                pages += 1;
                assert!(pages < 10_000);
                match p.next {
                    Some(c) => after = Some(c),
                    None => break,
                }
            }
            let want: Vec<(u64, u32)> = all.iter().copied().filter(|(seq, _)| !stuck_only || seq % 3 == 0).collect();
            assert_eq!(got, want, "limit {limit}, budget {budget}, stuck only {stuck_only}");
        }
    }
}

/// A recovery reaches the held verdict (its time kept); one for a verdict no longer
/// held is counted.
#[test]
fn recoveries_are_delivered_to_held_verdicts() {
    let mut s = VerdictStore::new(StoreConfig::default());
    s.apply(S, op_events(1, 2, Outcome::Stuck));
    let op = OpRef::Coll { comm: comm(), seq: 1 };
    s.apply(5 * S, [MatcherEvent::Recovered { op, rank: 1, node: Some(NodeId(1)), after_ms: 4_000 }]);
    s.apply(
        6 * S,
        [MatcherEvent::Recovered { op: OpRef::Coll { comm: comm(), seq: 9 }, rank: 0, node: None, after_ms: 1 }],
    );
    assert_eq!(s.get(op, 1).and_then(|i| i.stored.recovered_at_ns), Some(5 * S));
    assert_eq!(s.get(op, 0).and_then(|i| i.stored.recovered_at_ns), None);
    assert_eq!((s.stats().recoveries, s.stats().recoveries_unheld), (1, 1));
}

/// Cursor tokens round-trip for every kind of op; anything else is a clear error.
#[test]
fn cursor_tokens_round_trip_and_bad_ones_are_refused() {
    let comm = Comm { hash: u64::MAX, disambiguator: 0, instance: 3 };
    for op in [
        OpRef::Coll { comm, seq: 77 },
        OpRef::P2p { comm, src: 1, dst: u32::MAX, p2p_seq: 9 },
        OpRef::Graph { comm, graph_id: 5, graph_node: 6, replay_idx: 7 },
    ] {
        let c = Cursor { op, rank: 12 };
        assert_eq!(Cursor::decode(&c.encode()), Ok(c), "{}", c.encode());
    }
    for bad in ["", "x", "c.1.2.3", "c.1.2.3.4.5.6", "c.zz.2.3.4.5", "p.1.2.3.4.100000000.6.7", "c.1.2.3.4.-5"] {
        let e = Cursor::decode(bad).expect_err(bad);
        assert!(e.contains("cursor"), "{e}");
    }
    let mut s = VerdictStore::new(StoreConfig::default());
    s.apply(S, op_events(1, 3, Outcome::Stuck));
    s.apply(S, op_events(2, 3, Outcome::Completed));
    assert_eq!((s.len(), s.finals()), (6, 6));
    s.apply(S, [MatcherEvent::Verdict(verdict(3, 0, Outcome::InFlight, false))]);
    assert_eq!((s.len(), s.finals()), (7, 6));
}

/// Memory pressure (the aggregator's P3): both limits drop to a quarter at once, what
/// goes only for that is counted apart from retention and the byte cap, and once it eases
/// the configured limits apply again (nothing more is shed).
#[test]
fn pressure_keeps_a_quarter_of_the_limits_and_counts_what_it_shed() {
    let mut s = VerdictStore::new(StoreConfig { retention_ns: 100 * S, max_bytes: u64::MAX / 2 });
    for seq in 1..=40 {
        s.apply(seq * S, op_events(seq, 8, Outcome::Stuck));
    }
    assert_eq!((s.ops(), s.stats().ops_aged_out), (40, 0));
    // At 40 s, a quarter of 100 s keeps what was updated in the last 25 s: ops 15..=40.
    s.set_pressure(true, 40 * S);
    let p = s.pressure();
    assert!(p.on);
    assert_eq!((p.ops, p.verdicts), (14, 14 * 8), "ops 1..=14 shed for pressure");
    assert_eq!(s.ops(), 26);
    assert_eq!((s.stats().ops_aged_out, s.stats().ops_evicted_bytes), (0, 0), "not counted as retention or bytes");
    assert_eq!(s.len(), 26 * 8);
    // New ops under pressure: the quarter keeps applying.
    s.apply(41 * S, op_events(41, 8, Outcome::Stuck));
    assert_eq!(s.pressure().ops, 15);
    // Eased: the configured limits again; nothing more goes until 100 s of age.
    s.set_pressure(false, 42 * S);
    s.apply(60 * S, op_events(60, 8, Outcome::Stuck));
    assert_eq!((s.pressure().ops, s.stats().ops_aged_out), (15, 0));
    assert!(!s.pressure().on);
}
