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

/// (synthesized, restored, turned away).
fn counts(core: &Core) -> (u64, u64, u64) {
    let c = core.bus_liveness_counts();
    (c.synthesized, c.restored, c.turned_away)
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
    assert_eq!(counts(&core), (0, 0, 0));
    // The next deadline is a's unreachable time: a timer, not a poll.
    assert_eq!(core.poll_timeout().map(|t| t <= 5000 * MS), Some(true));
    now = 5000 * MS;
    core.apply_records(now, &[watermark(b, now)]);
    core.handle_timeout(now);
    assert_eq!(health(&core, now, a), Health::Unreachable);
    assert_eq!(counts(&core), (1, 0, 0));
    // a's shipper failed over: the other ingest shard's first record about it.
    now += 10 * MS;
    core.apply_records(now, &[watermark(a, now)]);
    assert_eq!(health(&core, now, a), Health::Healthy, "what its ingest shard said (fresh) stands again");
    assert_eq!(counts(&core), (1, 1, 0));
    // An ingest shard's own word is never overridden while records come: a node it
    // says is unreachable stays so, with no timer of this core's for it.
    let gone =
        Record::Liveness(Liveness { node: b, state: LivenessState::Unreachable, at_ns: now, last_heard_ns: now });
    core.apply_records(now, &[gone]);
    core.handle_timeout(now + 10_000 * MS);
    assert_eq!(health(&core, now + 10_000 * MS, b), Health::Unreachable);
    assert_eq!(
        core.bus_liveness_counts().synthesized,
        2,
        "a unreachable again (nothing more said of it); b not touched"
    );
}

#[test]
fn another_role_keeps_no_bus_timers() {
    let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
    let rec = Record::Liveness(Liveness { node: NodeId(1), state: LivenessState::Fresh, at_ns: 0, last_heard_ns: 0 });
    core.apply_records(0, &[rec]);
    core.handle_timeout(u64::MAX / 2);
    assert_eq!(counts(&core), (0, 0, 0));
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

#[test]
fn a_stale_unreachable_from_the_shard_a_node_left_is_ignored_and_its_own_shards_word_is_not() {
    let mut core = matcher_core();
    let a = NodeId(1);
    let live = |state, at_ns, last_heard_ns| Record::Liveness(Liveness { node: a, state, at_ns, last_heard_ns });
    // Shard A took the node at 0 and heard it last at 900 ms.
    core.apply_records(0, &[live(LivenessState::Fresh, 0, 0), watermark(a, 900 * MS)]);
    // The node failed over: shard B's first batch from it at 1,000 ms says fresh.
    core.apply_records(1000 * MS, &[live(LivenessState::Fresh, 1000 * MS, 1000 * MS)]);
    // Shard A's connection times out later: unreachable, last heard at 900 ms: stale.
    core.apply_records(1500 * MS, &[live(LivenessState::Unreachable, 1500 * MS, 900 * MS)]);
    core.handle_timeout(1500 * MS);
    assert_eq!(health(&core, 1500 * MS, a), Health::Healthy, "the node lives on shard B");
    assert_eq!(core.bus_liveness_counts().stale_ignored, 1);
    // Shard B loses it: last heard at 2,000 ms, after its own fresh statement: taken.
    core.apply_records(2500 * MS, &[live(LivenessState::Unreachable, 2500 * MS, 2000 * MS)]);
    core.handle_timeout(2500 * MS);
    assert_eq!(health(&core, 2500 * MS, a), Health::Unreachable);
    assert_eq!(core.bus_liveness_counts().stale_ignored, 1);
    // And the ignored statement survives a snapshot, as the rest of the bus liveness.
    let bytes = ringwatch_core::snapshot::write(&core).expect("snapshot");
    let back = ringwatch_core::snapshot::read(&bytes, 2500 * MS).expect("restore");
    assert_eq!(back.bus_liveness_counts(), core.bus_liveness_counts());
}
