//! Scale-out's ordering rule, as a property (issue 28): the records of a run, split over
//! two ingest shards by node and routed to two matcher shards by communicator
//! (`ringwatch_core::shard::route`), give the same final verdicts whatever the
//! interleaving of the two ingest shards' publishes on each matcher shard's stream —
//! each ingest shard's own order kept, as one publisher per (ingest, matcher) shard pair
//! keeps it on the bus — and the same as one matcher given them all in order.
//!
//! The records come from a real run: every node's `ShipperCore` and an ingest-role
//! `Core` wired by the pair harness in simulated time; the ingest core keeps what it
//! produced unpublished, each record with its index and time.

use std::collections::BTreeMap;

use loadgen_sim::builtin;
use proptest::prelude::*;
use ringwatch_core::records::{NodeId, Record};
use ringwatch_core::shard::{Role, Route, route};
use ringwatch_core::verdict::{MatcherEvent, OpRef, VerdictTag};
use ringwatch_core::{Core, IngestConfig, MatcherConfig};
use ringwatch_tests::pair::{Pair, PairConfig};

/// One record as the ingest core produced it: time, record.
type Timed = (u64, Record);

/// A final verdict, without what depends on when it was decided.
type Final = (Option<NodeId>, [u8; 16], String, Vec<String>);
/// Every (op, rank)'s last final verdict.
type Finals = BTreeMap<(OpRef, u32), Final>;

struct Run {
    records: Vec<Timed>,
    /// The ingest shard of each node (two shards).
    shard_of: BTreeMap<NodeId, u32>,
    ingest: IngestConfig,
    matcher: MatcherConfig,
    end_ns: u64,
}

fn run(name: &str) -> Run {
    let s = builtin::builtin(name).expect("built in").expect("parses");
    let cfg = PairConfig { role: Role::Ingest { shard: 0 }, ..PairConfig::verdicts_of(s.clone(), 1e-5) };
    let r = Pair::new(cfg).run();
    let records: Vec<Timed> = r.core.unpublished().iter().map(|(_, t, rec)| (*t, *rec)).collect();
    assert!(records.len() > 1000, "{name}: a run with records: {}", records.len());
    let indices: Vec<u64> = r.core.unpublished().iter().map(|(i, _, _)| *i).collect();
    assert!(indices.windows(2).all(|w| w[0] < w[1]), "indices rise");
    let nodes: std::collections::BTreeSet<NodeId> = records.iter().map(|(_, r)| r.node()).collect();
    assert!(nodes.len() >= 2, "{name}: records of several nodes");
    // Nodes alternate between the two ingest shards (by id order), so each shard has some.
    let shard_of = nodes.iter().enumerate().map(|(i, n)| (*n, u32::try_from(i % 2).unwrap())).collect();
    let agg = loadgen::cluster::aggregator_config(
        &aggregator::certs::CertSet::at(std::path::Path::new("/nonexistent")),
        &s,
        1.0,
    );
    let mut matcher = agg.matcher;
    matcher.dead_after_ns = MatcherConfig::default().dead_after_ns;
    let end_ns = records.last().map_or(0, |r| r.0);
    Run { records, shard_of, ingest: agg.ingest, matcher, end_ns }
}

/// Feeds a matcher core records in the given order: time is the latest record's (a
/// record's own time, never back), timers run as they fall due; then on past the end
/// until nothing is due. Returns every (op, rank)'s last final verdict.
fn replay(run: &Run, role: Role, order: &[&Timed]) -> BTreeMap<(OpRef, u32), Final> {
    let mut core = Core::new(run.ingest, run.matcher, 0);
    core.set_role(role);
    let mut now = 0u64;
    let mut out = BTreeMap::new();
    let drain = |core: &mut Core, out: &mut BTreeMap<(OpRef, u32), Final>| {
        while let Some(e) = core.poll_event() {
            if let MatcherEvent::Verdict(v) = e
                && v.is_final
            {
                let tags = v
                    .tags
                    .iter()
                    .map(|t| match t {
                        VerdictTag::TelemetryLoss { ids } => format!("telemetry_loss{ids:?}"),
                        other => format!("{other:?}"),
                    })
                    .collect();
                out.insert((v.op, v.rank), (v.node, v.gpu_uuid, v.outcome.name(), tags));
            }
        }
    };
    let timers = |core: &mut Core, now: &mut u64, until: u64| {
        while let Some(due) = core.poll_timeout() {
            if due > until {
                break;
            }
            *now = (*now).max(due);
            core.handle_timeout(*now);
            if core.poll_timeout().is_some_and(|d| d <= *now) {
                // Due again at once (dirty ops): one more turn at the same time.
                core.handle_timeout(*now);
                if core.poll_timeout().is_some_and(|d| d <= *now) {
                    break;
                }
            }
        }
    };
    for (t, r) in order {
        timers(&mut core, &mut now, *t);
        now = now.max(*t);
        core.apply_records(now, std::iter::once(r));
        drain(&mut core, &mut out);
    }
    let settle = run.end_ns.saturating_add(run.matcher.dead_after_ns).saturating_add(600_000_000_000);
    let mut t = now;
    while t < settle {
        t = t.saturating_add(1_000_000_000);
        timers(&mut core, &mut now, t);
        now = now.max(t);
        core.handle_timeout(now);
        drain(&mut core, &mut out);
    }
    out
}

/// How far one ingest shard's publishes may run ahead of the other's on a matcher
/// shard's stream, in the records' own time. The bus delivers in milliseconds; a shard
/// minutes behind is a shard down, whose nodes the matcher's timers rightly stop waiting
/// for (ops retired, finality no longer gated), so no rule could make verdicts the same
/// under unbounded skew.
const MAX_SKEW_NS: u64 = 2_000_000_000;

/// One matcher shard's stream: the two ingest shards' records for it, interleaved as
/// `picks` says (true: the next of ingest shard 1) within [`MAX_SKEW_NS`], each shard's
/// order kept.
fn interleave<'a>(run: &'a Run, shard: u32, shards: u32, picks: &[bool]) -> Vec<&'a Timed> {
    let mut per: [Vec<&Timed>; 2] = [Vec::new(), Vec::new()];
    for rec in &run.records {
        if ringwatch_core::shard::takes(&rec.1, shard, shards) {
            per[run.shard_of[&rec.1.node()] as usize].push(rec);
        }
    }
    let (mut a, mut b) = (per[0].iter().peekable(), per[1].iter().peekable());
    let mut out = Vec::with_capacity(per[0].len() + per[1].len());
    let mut k = 0usize;
    loop {
        let one = picks.get(k % picks.len().max(1)).copied().unwrap_or(false);
        k += 1;
        let next = match (a.peek().map(|r| r.0), b.peek().map(|r| r.0)) {
            (None, None) => break,
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            // Too far ahead of the other: the other goes first.
            (Some(ta), Some(tb)) if ta > tb.saturating_add(MAX_SKEW_NS) => b.next(),
            (Some(ta), Some(tb)) if tb > ta.saturating_add(MAX_SKEW_NS) => a.next(),
            _ if one => b.next(),
            _ => a.next(),
        };
        out.extend(next.copied());
    }
    out
}

fn reference(run: &Run) -> BTreeMap<(OpRef, u32), Final> {
    let all: Vec<&Timed> = run.records.iter().collect();
    replay(run, Role::Matcher { shard: 0, shards: 1 }, &all)
}

fn sharded(run: &Run, picks: &[bool]) -> BTreeMap<(OpRef, u32), Final> {
    let mut out = BTreeMap::new();
    for shard in 0..2 {
        let stream = interleave(run, shard, 2, picks);
        out.extend(replay(run, Role::Matcher { shard, shards: 2 }, &stream));
    }
    out
}

fn comm_of(op: &OpRef) -> u64 {
    match op {
        OpRef::Coll { comm, .. } | OpRef::P2p { comm, .. } | OpRef::Graph { comm, .. } => comm.hash,
    }
}

/// Communicators with a `key_collision` verdict in either map: two communicators under
/// one key (the scenario injects one) are told apart by who claims a rank first, which
/// depends on arrival order in one process too (network timing), so they are left out.
fn collided(a: &BTreeMap<(OpRef, u32), Final>, b: &BTreeMap<(OpRef, u32), Final>) -> std::collections::BTreeSet<u64> {
    a.iter().chain(b.iter()).filter(|(_, f)| f.2.contains("key_collision")).map(|(k, _)| comm_of(&k.0)).collect()
}

fn diff(a: &BTreeMap<(OpRef, u32), Final>, b: &BTreeMap<(OpRef, u32), Final>) -> Vec<String> {
    let keys: std::collections::BTreeSet<_> = a.keys().chain(b.keys()).collect();
    let skip = collided(a, b);
    assert!(skip.len() <= 1, "one colliding communicator at most: {skip:?}");
    keys.into_iter()
        .filter(|k| !skip.contains(&comm_of(&k.0)))
        .filter(|k| a.get(k) != b.get(k))
        .take(10)
        .map(|k| format!("{k:?}: {:?} vs {:?}", a.get(k), b.get(k)))
        .collect()
}

static MIXED: std::sync::LazyLock<(Run, Finals)> = std::sync::LazyLock::new(|| {
    let run = run("mixed");
    let reference = reference(&run);
    (run, reference)
});

#[test]
fn one_matcher_fed_every_record_in_order_decides_every_op() {
    let (run, reference) = &*MIXED;
    assert!(reference.len() > 100, "final verdicts: {}", reference.len());
    // Both matcher shards own some communicators.
    let owners: std::collections::BTreeSet<u32> = run
        .records
        .iter()
        .filter_map(|(_, r)| match route(r, 2) {
            Route::One(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(owners.len(), 2, "communicators on both shards");
    // What a matcher shard is sent, per node-second of this run (ARCHITECTURE.md's
    // scaling estimate: node records go to every shard, lifecycle to one).
    let (mut one, mut all, mut local) = (0u64, 0u64, 0u64);
    for (_, r) in &run.records {
        match route(r, 2) {
            Route::One(_) => one += 1,
            Route::All => all += 1,
            Route::Nowhere => local += 1,
        }
    }
    let nodes = run.shard_of.len() as f64;
    #[allow(clippy::cast_precision_loss, reason = "a printed rate")]
    let per = |n: u64| n as f64 / nodes / (run.end_ns as f64 / 1e9);
    println!(
        "records per node-second: {:.0} to one matcher shard (lifecycle, PROGRESS), {:.0} to every shard (watermarks, liveness, loss, gaps), {:.0} kept local",
        per(one),
        per(all),
        per(local)
    );
}

#[test]
fn a_watermark_published_before_its_records_would_change_verdicts() {
    // The rule matters: move every watermark of one node ahead of that node's records
    // by a few positions and a matcher decides differently (or decides early) somewhere.
    let (run, reference) = &*MIXED;
    let node = run.records.iter().find_map(|(_, r)| matches!(r, Record::Lifecycle(_)).then(|| r.node())).unwrap();
    let mut broken: Vec<&Timed> = run.records.iter().collect();
    let mut i = 0;
    while i < broken.len() {
        if matches!(broken[i].1, Record::Watermark(w) if w.node == node) {
            let to = i.saturating_sub(50);
            let w = broken.remove(i);
            broken.insert(to, w);
        }
        i += 1;
    }
    let got = replay(run, Role::Matcher { shard: 0, shards: 1 }, &broken);
    assert!(!diff(reference, &got).is_empty(), "watermarks ahead of their records must show");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn any_interleaving_of_two_ingest_shards_gives_the_same_final_verdicts(
        picks in prop::collection::vec(any::<bool>(), 1..400),
    ) {
        let (run, reference) = &*MIXED;
        let got = sharded(run, &picks);
        let d = diff(reference, &got);
        prop_assert!(d.is_empty(), "differences: {:#?}", d);
    }
}

#[test]
fn one_ingest_shard_as_far_behind_as_allowed_gives_the_same_final_verdicts() {
    let (run, reference) = &*MIXED;
    for picks in [[false], [true]] {
        let got = sharded(run, &picks);
        let d = diff(reference, &got);
        assert!(d.is_empty(), "picks {picks:?}: of {} final verdicts these differ: {d:#?}", reference.len());
    }
}
