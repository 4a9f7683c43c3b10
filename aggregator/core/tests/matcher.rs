//! The matcher's order independence: one record log, replayed in order and shuffled
//! across its partitions, gives the same final verdicts. (The verdicts themselves are
//! judged against the simulator's truth through the real shipper and core, by the pair
//! harness: `tests/tests/matcher_scenarios.rs`.)

mod common;

use std::collections::BTreeMap;

use common::{Net, run};
use loadgen_sim::{Scenario, builtin};
use ringwatch_core::records::NodeId;
use ringwatch_core::verdict::{MatcherEvent, OpRef, Outcome, VerdictTag};
use ringwatch_core::{CollectiveMatcher, MatcherConfig};

const DEGRADED_CLEAR_NS: u64 = 300_000_000_000;

fn config(s: &Scenario) -> MatcherConfig {
    MatcherConfig {
        stuck_min_ns: s.timers.stuck_deadline_ms * 1_000_000,
        join_deadline_ns: s.timers.join_deadline_ms * 1_000_000,
        straggler_threshold_ns: straggler_threshold_ns(s),
        expected_nodes: s.cluster.nodes,
        // The scenario's clear time when it sets one (the aggregator is given it).
        degraded_clear_ns: s.timers.degraded_clear_ms.map_or(DEGRADED_CLEAR_NS, |c| c * 1_000_000),
        ..MatcherConfig::default()
    }
}

#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "ms to ns, non-negative")]
fn straggler_threshold_ns(s: &Scenario) -> u64 {
    (s.timers.straggler_threshold_ms.max(0.0) * 1e6) as u64
}

fn scenario(name: &str) -> Scenario {
    builtin::builtin(name).unwrap().unwrap()
}

/// Replays `records` into a fresh matcher; `now` never goes back. Returns the final
/// verdicts `(op, rank) → (outcome, tags)`.
/// Replays `records`, evaluating ops every `eval_every_ns` of record time (the
/// aggregator's timer; under load it fires seldom, so one evaluation sees a burst).
fn replay(
    s: &Scenario,
    records: &[(u64, ringwatch_core::Record)],
    eval_every_ns: u64,
) -> BTreeMap<(OpRef, u32), (Outcome, Vec<VerdictTag>)> {
    let mut m = CollectiveMatcher::new(config(s));
    let mut finals = BTreeMap::new();
    let mut collect = |m: &mut CollectiveMatcher| {
        while let Some(e) = m.poll_event() {
            if let MatcherEvent::Verdict(v) = e
                && v.is_final
            {
                finals.insert((v.op, v.rank), (v.outcome, v.tags));
            }
        }
    };
    let (mut now, mut last_eval) = (0u64, 0u64);
    for (t, rec) in records {
        now = now.max(*t);
        if now >= last_eval + eval_every_ns {
            m.handle_timeout(now);
            collect(&mut m);
            last_eval = now;
        }
        m.handle_record(now, rec);
    }
    // The cluster goes on after the log: every node's data through its end has landed
    // (idle heartbeats move watermarks), so a decision reached late in a replay — its
    // evidence arrived late in this order — becomes final too. Finality must not depend
    // on which order the same records came in, only on the watermarks passing.
    let mut nodes: Vec<(NodeId, u64)> = records
        .iter()
        .filter_map(|(_, r)| match r {
            ringwatch_core::Record::Watermark(w) if w.class == 0 => Some((w.node, w.epsilon_ns)),
            _ => None,
        })
        .collect();
    nodes.sort_unstable_by_key(|n| n.0);
    nodes.dedup_by_key(|n| n.0);
    let end = now + 30_000_000_000;
    for (node, epsilon_ns) in nodes {
        m.handle_record(
            now,
            &ringwatch_core::Record::Watermark(ringwatch_core::records::Watermark {
                node,
                class: 0,
                node_ns: end,
                cluster_ns: i64::try_from(end).unwrap_or(i64::MAX),
                epsilon_ns,
            }),
        );
    }
    for _ in 0..400 {
        now += 250_000_000;
        m.handle_timeout(now);
        collect(&mut m);
    }
    finals
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 10, ..Default::default() })]

    /// The contract for matcher shards: one record log, its inputs shuffled across their
    /// partitions (lifecycle by communicator; node-state records — progress, watermarks,
    /// losses, gaps — in theirs), gives identical final verdicts; and so does the log
    /// with old PROGRESS records applied again late. (Liveness is the aggregator's own
    /// view, not part of the log.)
    #[test]
    fn shuffled_partitions_give_identical_final_verdicts(
        idx in 0usize..SHUFFLED.len(),
        shuffle in proptest::prelude::any::<u64>(),
    ) {
        shuffled_partitions(idx, shuffle)?;
    }
}

/// A case the property found (issue 16's stale PROGRESS: `counter-case`, every PROGRESS
/// record of the hung rank re-applied late, evaluated every 50 ms): fails without the
/// PROGRESS recency rule.
#[test]
fn shuffled_partitions_with_late_progress_regression_issue_16() {
    shuffled_partitions(1, 9_558_675_776_944_377_270).unwrap();
}

/// (scenario, how far lifecycle records may run ahead of node-state records, in record
/// time). A GPU pause is `stuck` (final, then recovered) only if the completion that ends
/// it is not in before the stuck verdict's watermarks pass: with a 16 s pause, a 5 s
/// deadline and a 0.5 s reorder timeout, lifecycle data running more than ~9 s ahead of
/// every heartbeat makes it `completed` instead — arrival order decides there (ARCHITECTURE
/// "Verdict finality"). Real runs keep a node's heartbeats within a few seconds of its
/// frames; 3 s is tested.
const SHUFFLED: [(&str, u64); 9] = [
    ("seed-case", u64::MAX),
    ("counter-case", u64::MAX),
    ("exited-process", u64::MAX),
    ("host-straggler", u64::MAX),
    ("gpu-straggler-skew", u64::MAX),
    ("mismatch", u64::MAX),
    ("pipeline-p2p", u64::MAX),
    ("host-pause", u64::MAX),
    ("gpu-pause", 3_000_000_000),
];

/// The property's body: scenario `SHUFFLED[idx]`, shuffled with seed `shuffle`.
fn shuffled_partitions(idx: usize, shuffle: u64) -> Result<(), proptest::test_runner::TestCaseError> {
    use rand::{Rng, SeedableRng};
    let (name, max_lead_ns) = SHUFFLED[idx];
    let s = scenario(name);
    let r = run(&s, None, 1e-5, Net::default(), &[]);
    let log: Vec<(u64, ringwatch_core::Record)> =
        r.timed.iter().filter(|(_, rec)| !matches!(rec, ringwatch_core::Record::Liveness(_))).cloned().collect();
    let in_order = replay(&s, &log, 50_000_000);
    // Partitions, each in log order: lifecycle by communicator (they interleave
    // freely), node-state records in one (delayed at random, never ahead of the
    // lifecycle records logged before them: a shard consumes a watermark only after
    // what it covers).
    let mut parts: BTreeMap<u64, std::collections::VecDeque<(usize, u64, ringwatch_core::Record)>> = BTreeMap::new();
    for (i, (t, rec)) in log.iter().enumerate() {
        let p = match rec {
            ringwatch_core::Record::Lifecycle(l) => l.comm.hash | 1,
            _ => 0,
        };
        parts.entry(p).or_default().push_back((i, *t, *rec));
    }
    let lifecycle_left = |parts: &BTreeMap<u64, std::collections::VecDeque<(usize, u64, ringwatch_core::Record)>>| {
        parts.iter().filter(|(k, _)| **k != 0).filter_map(|(_, q)| q.front().map(|x| x.0)).min()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(shuffle);
    let mut shuffled = Vec::with_capacity(log.len());
    loop {
        let keys: Vec<u64> = parts.iter().filter(|(_, q)| !q.is_empty()).map(|(k, _)| *k).collect();
        if keys.is_empty() {
            break;
        }
        let k = keys[rng.random_range(0..keys.len())];
        for _ in 0..rng.random_range(1..64) {
            let oldest_lifecycle = lifecycle_left(&parts).unwrap_or(usize::MAX);
            let node_state_at = parts.get(&0).and_then(|q| q.front()).map(|x| x.1);
            let q = parts.get_mut(&k).unwrap();
            match q.front() {
                Some(&(i, _, _)) if k == 0 && i > oldest_lifecycle => break,
                Some(&(_, t, _)) if k != 0 && node_state_at.is_some_and(|n| t > n.saturating_add(max_lead_ns)) => {
                    break;
                }
                Some(_) => {
                    let (_, t, rec) = q.pop_front().unwrap();
                    shuffled.push((t, rec));
                }
                None => break,
            }
        }
    }
    let moved = shuffled.iter().zip(log.iter()).filter(|(a, b)| a.0 != b.0).count();
    proptest::prop_assert!(moved > 0, "{name}: the shuffle must actually reorder: {moved} of {}", log.len());
    // What real runs add (issue 16: `demo` beside a CPU hog): a heartbeat applied again
    // long after newer ones — a batch resent, or held up on its stream. Before every
    // other watermark (what makes ops final), a copy of a PROGRESS record from 200 to
    // 4,000 records earlier is applied again. And the evaluation timer fires seldom
    // (a loaded aggregator: 50 ms to 8 s of record time between evaluations), so the
    // one evaluation after a deadline can have a stale entry in hand — with frequent
    // evaluation a stale entry is healed before finality even without the recency rule.
    let progress_at: Vec<usize> = shuffled
        .iter()
        .enumerate()
        .filter(|(_, (_, rec))| matches!(rec, ringwatch_core::Record::Progress(_)))
        .map(|(i, _)| i)
        .collect();
    let mut late: Vec<(usize, (u64, ringwatch_core::Record))> = Vec::new();
    for (i, (t, rec)) in shuffled.iter().enumerate() {
        if !matches!(rec, ringwatch_core::Record::Watermark(_)) || rng.random_range(0..2) == 0 {
            continue;
        }
        let window: Vec<usize> = progress_at.iter().copied().filter(|&j| j + 200 <= i && i <= j + 4_000).collect();
        if !window.is_empty() {
            let j = window[rng.random_range(0..window.len())];
            late.push((i, (*t, shuffled[j].1)));
        }
    }
    proptest::prop_assert!(!late.is_empty());
    late.sort_by_key(|x| std::cmp::Reverse(x.0));
    for (at, old) in late {
        // Applied at the time of the watermark it now precedes.
        shuffled.insert(at, old);
    }
    let eval_every_ns = [50_000_000, 1_000_000_000, 3_000_000_000, 8_000_000_000][rng.random_range(0..4)];
    let mixed = replay(&s, &shuffled, eval_every_ns);
    proptest::prop_assert!(!in_order.is_empty());
    let only_a: Vec<_> = in_order.keys().filter(|k| !mixed.contains_key(k)).take(3).collect();
    let only_b: Vec<_> = mixed.keys().filter(|k| !in_order.contains_key(k)).take(3).collect();
    proptest::prop_assert!(
        only_a.is_empty() && only_b.is_empty(),
        "{name}: final sets differ: {only_a:?} / {only_b:?}"
    );
    for (k, v) in &in_order {
        proptest::prop_assert_eq!(v, &mixed[k], "{} {:?} (evaluated every {} ms)", name, k, eval_every_ns / 1_000_000);
    }
    Ok(())
}
