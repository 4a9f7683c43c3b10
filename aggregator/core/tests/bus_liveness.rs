//! A matcher shard's view of a node whose ingest shard died without a word (issue 29):
//! nothing said of it on the bus for the ingest's unreachable time makes it unreachable
//! (so a dead node is presumed dead at last, as one process would) — never merely silent
//! (a bus stall is no sign of the node); the first record about it again restores what
//! its ingest shard said. The time is the records' own (when their ingest shard made
//! them), never the matcher's clock: a stalled bus, or a backlog read slowly, says
//! nothing of any node.

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

/// Records read off the bus at `now`, made then.
fn read(core: &mut Core, now: u64, records: &[Record]) {
    core.apply_records(now, records);
}

/// A bus batch read at `now` whose records were made at the times given.
fn read_made(core: &mut Core, now: u64, records: &[(u64, Record)]) {
    let batch: Vec<(u64, u64, Record)> = records.iter().map(|(at, r)| (0, *at, *r)).collect();
    core.apply_bus_records(now, &batch);
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
    read(&mut core, 0, &[fresh(a), fresh(b)]);
    // Node b keeps being spoken of (a live shard's watermarks); node a's shard died.
    let mut now = 0;
    while now < 1100 * MS {
        now += 100 * MS;
        read(&mut core, now, &[watermark(b, now)]);
        core.handle_timeout(now);
    }
    assert_eq!(health(&core, now, a), Health::Healthy, "a bus quiet past silent_ns is no sign of the node");
    assert_eq!(health(&core, now, b), Health::Healthy);
    assert_eq!(counts(&core), (0, 0, 0));
    // The bus carries nothing at all for 20 s (a JetStream server lost, a consumer
    // stalled): that says nothing of any node — the bus's time stands still.
    core.handle_timeout(20_000 * MS);
    assert_eq!(health(&core, 20_000 * MS, a), Health::Healthy, "a stalled bus is no sign of the node");
    assert_eq!(counts(&core), (0, 0, 0));
    // It carries b's records again, and nothing of a: a is unreachable.
    now = 20_000 * MS;
    read(&mut core, now, &[watermark(b, now)]);
    core.handle_timeout(now);
    assert_eq!(health(&core, now, a), Health::Unreachable);
    assert_eq!(counts(&core), (1, 0, 0));
    // a's shipper failed over: the other ingest shard's first record about it.
    now += 10 * MS;
    read(&mut core, now, &[watermark(a, now)]);
    assert_eq!(health(&core, now, a), Health::Healthy, "what its ingest shard said (fresh) stands again");
    assert_eq!(counts(&core), (1, 1, 0));
    // An ingest shard's own word is never overridden while records come: a node it
    // says is unreachable stays so, with no timer of this core's for it.
    let gone =
        Record::Liveness(Liveness { node: b, state: LivenessState::Unreachable, at_ns: now, last_heard_ns: now });
    read(&mut core, now, &[gone]);
    let c = NodeId(3);
    read(&mut core, now + 10_000 * MS, &[watermark(c, now + 10_000 * MS)]);
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

/// A matcher restored from a snapshot reads its stream on from there: the backlog's
/// records carry when they were made, and silence is judged by that, however late they
/// are read. (In the issue-29 fault test a matcher restarted after SIGKILL, judging by
/// its clock while it read its backlog, took seven live nodes unreachable; an op of one
/// of them was made final `completed_inferred` before the record of its completion — a
/// few messages on in the backlog — was read.)
#[test]
fn a_restored_matcher_reading_a_backlog_judges_silence_by_when_the_records_were_made() {
    let mut core = matcher_core();
    let (a, b) = (NodeId(1), NodeId(2));
    read(&mut core, 0, &[watermark(a, 0), watermark(b, 0)]);
    let bytes = ringwatch_core::snapshot::write(&core).expect("a snapshot");
    // Back 60 s later (past unreachable); its timers run before it has read anything.
    let mut now = 60_000 * MS;
    let mut core = ringwatch_core::snapshot::read(&bytes, now).expect("restored");
    core.handle_timeout(now);
    // The backlog: both nodes spoken of every 500 ms of the 20 s it was down, read
    // slowly (1 s a message).
    let mut made = 0;
    while made < 20_000 * MS {
        made += 500 * MS;
        now += 1000 * MS;
        core.handle_timeout(now);
        read_made(&mut core, now, &[(made, watermark(a, made)), (made, watermark(b, made))]);
    }
    assert_eq!(health(&core, now, a), Health::Healthy);
    assert_eq!(health(&core, now, b), Health::Healthy, "spoken of all along, however late read");
    assert_eq!(counts(&core), (0, 0, 0));
    // Then the backlog says nothing of b for longer than unreachable: b is unreachable.
    while made < 25_500 * MS {
        made += 500 * MS;
        read_made(&mut core, now, &[(made, watermark(a, made))]);
    }
    assert_eq!(health(&core, now, a), Health::Healthy);
    assert_eq!(health(&core, now, b), Health::Unreachable);
    assert_eq!(counts(&core), (1, 0, 0));
}

/// The bus stalls (a JetStream server killed: no stream leader, then a consumer that
/// waits), and the ingest shards' records of the stall arrive after it, in order: no
/// node was silent. (Timed by the matcher's clock, every node was taken unreachable at
/// the first message after the stall, and an op made final `completed_inferred` whose
/// completion was the next message.)
#[test]
fn a_bus_stall_then_its_backlog_judges_no_node() {
    let mut core = matcher_core();
    let (a, b) = (NodeId(1), NodeId(2));
    read(&mut core, 0, &[watermark(a, 0), watermark(b, 0)]);
    // Nothing read for 60 s.
    let now = 60_000 * MS;
    core.handle_timeout(now);
    // The first message after the stall holds only a's records of the stall's first
    // seconds; b's come in the next.
    read_made(&mut core, now, &[(100 * MS, watermark(a, 100 * MS)), (2000 * MS, watermark(a, 2000 * MS))]);
    assert_eq!(health(&core, now, b), Health::Healthy, "b's records of then are still to come");
    read_made(&mut core, now, &[(2100 * MS, watermark(b, 2100 * MS))]);
    assert_eq!(counts(&core), (0, 0, 0));
    // A record claiming a time after the reading's (a corrupt message, a clock far
    // ahead) counts as made now: it cannot move the bus's time past the clock.
    read_made(&mut core, now, &[(u64::MAX, watermark(a, 0))]);
    assert_eq!(health(&core, now, b), Health::Unreachable, "nearly 58 s of bus time with nothing of b");
    assert_eq!(counts(&core), (1, 0, 0));
}

#[test]
fn a_stale_unreachable_from_the_shard_a_node_left_is_ignored_and_its_own_shards_word_is_not() {
    let mut core = matcher_core();
    let a = NodeId(1);
    let live = |state, at_ns, last_heard_ns| Record::Liveness(Liveness { node: a, state, at_ns, last_heard_ns });
    // Shard A took the node at 0 and heard it last at 900 ms.
    read(&mut core, 0, &[live(LivenessState::Fresh, 0, 0), watermark(a, 900 * MS)]);
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
