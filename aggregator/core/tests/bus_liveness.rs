//! A matcher shard's view of a node whose ingest shard died without a word (issue 29):
//! nothing said of it on the bus for the ingest's unreachable time makes it unreachable
//! (so a dead node is presumed dead at last, as one process would) — never merely silent
//! (a bus stall is no sign of the node); the first record about it again restores what
//! its ingest shard said.

use ringwatch_core::records::{Liveness, LivenessState, Record, Watermark};
use ringwatch_core::shard::Role;
use ringwatch_core::{Core, Health, IngestConfig, MatcherConfig, NodeId};

const MS: u64 = 1_000_000;

fn watermark(node: NodeId, at: u64) -> Record {
    Record::Watermark(Watermark { node, class: 0, node_ns: at, cluster_ns: i64::try_from(at).unwrap(), epsilon_ns: 0 })
}

fn health(core: &Core, now: u64, node: NodeId) -> Health {
    core.node_health(now).get(&node).copied().expect("the node is known")
}

/// A matcher-role core whose ingest timers are silent 1 s, unreachable 5 s.
fn matcher_core() -> Core {
    let ingest = IngestConfig {
        silent_ns: 1000 * MS,
        unreachable_ns: 5000 * MS,
        reorder_timeout_ns: 100 * MS,
        ..IngestConfig::default()
    };
    let mut core = Core::new(ingest, MatcherConfig::default(), 0);
    core.set_role(Role::Matcher { shard: 0, shards: 1 });
    core
}

#[test]
fn a_node_nothing_is_said_of_goes_silent_then_unreachable_and_comes_back_with_its_next_record() {
    let mut core = matcher_core();
    let (a, b) = (NodeId(1), NodeId(2));
    let fresh = |node| Record::Liveness(Liveness { node, state: LivenessState::Fresh, at_ns: 0, last_heard_ns: 0 });
    core.apply_records(0, &[fresh(a), fresh(b)]);
    // Node b keeps being spoken of (a live shard's watermarks); node a's shard died.
    let mut now = 0;
    while now < 1100 * MS {
        now += 100 * MS;
        core.apply_records(now, &[watermark(b, now)]);
        core.handle_timeout(now);
    }
    assert_eq!(health(&core, now, a), Health::Healthy, "a bus quiet past silent_ns is no sign of the node");
    assert_eq!(health(&core, now, b), Health::Healthy);
    assert_eq!(core.bus_liveness_counts(), (0, 0, 0));
    // The next deadline is a's unreachable time: a timer, not a poll.
    assert_eq!(core.poll_timeout().map(|t| t <= 5000 * MS), Some(true));
    now = 5000 * MS;
    core.apply_records(now, &[watermark(b, now)]);
    core.handle_timeout(now);
    assert_eq!(health(&core, now, a), Health::Unreachable);
    assert_eq!(core.bus_liveness_counts(), (1, 0, 0));
    // a's shipper failed over: the other ingest shard's first record about it.
    now += 10 * MS;
    core.apply_records(now, &[watermark(a, now)]);
    assert_eq!(health(&core, now, a), Health::Healthy, "what its ingest shard said (fresh) stands again");
    assert_eq!(core.bus_liveness_counts(), (1, 1, 0));
    // An ingest shard's own word is never overridden while records come: a node it
    // says is unreachable stays so, with no timer of this core's for it.
    let gone =
        Record::Liveness(Liveness { node: b, state: LivenessState::Unreachable, at_ns: now, last_heard_ns: now });
    core.apply_records(now, &[gone]);
    core.handle_timeout(now + 10_000 * MS);
    assert_eq!(health(&core, now + 10_000 * MS, b), Health::Unreachable);
    assert_eq!(core.bus_liveness_counts().0, 2, "a unreachable again (nothing more said of it); b not touched");
}

#[test]
fn another_role_keeps_no_bus_timers() {
    let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
    let rec = Record::Liveness(Liveness { node: NodeId(1), state: LivenessState::Fresh, at_ns: 0, last_heard_ns: 0 });
    core.apply_records(0, &[rec]);
    core.handle_timeout(u64::MAX / 2);
    assert_eq!(core.bus_liveness_counts(), (0, 0, 0));
}

#[test]
fn a_restarted_matcher_times_silence_from_its_restart() {
    let mut core = matcher_core();
    let a = NodeId(1);
    core.apply_records(0, &[watermark(a, 0)]);
    // Down for 10 s (past unreachable): back, it has heard nothing yet, and the node's
    // silence starts now.
    let back = 10_000 * MS;
    core.restart_bus_clock(back);
    core.handle_timeout(back);
    assert_eq!(health(&core, back, a), Health::Healthy);
    core.handle_timeout(back + 5200 * MS);
    assert_eq!(health(&core, back + 5200 * MS, a), Health::Unreachable, "then its own timer runs");
}
