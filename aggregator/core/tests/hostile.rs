//! Hostile numbers from a certified peer (issue 18): each input that once panicked the
//! core is refused whole, counted, and changes nothing; the largest plausible values go
//! through every path (frames, heartbeats, settlement, the matcher, the API's reads)
//! without overflow (test builds check overflow); and the structure-aware generator the
//! `hostile` fuzz target uses runs here over seeded inputs on stable.

mod hostile_input;

use arbitrary::{Arbitrary, Unstructured};
use proto_flat::batch::BatchView;
use proto_flat::codes::{Class, LossCause, Phase, WireEnum};
use proto_flat::encode::SectionedFrameWriter;
use proto_flat::header::StreamId;
use proto_flat::sample;
use proto_flat::sections::{ProgressEntry, StreamEntry};
use rand::{RngCore, SeedableRng};
use ringwatch_core::plausible::{MAX_NODE_NS, MAX_SEQ};
use ringwatch_core::{Core, IngestConfig, MatcherConfig, NodeId, Receipt};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromZeros, IntoBytes};

const NODE: NodeId = NodeId(1);
const P0: StreamId = StreamId::new(Class::P0, 0, 0);

fn batch(batch_seq: u64, lane: Class, frames: &[Vec<u8>]) -> Vec<u8> {
    batch_of(NODE, batch_seq, lane, frames)
}

fn batch_of(node: NodeId, batch_seq: u64, lane: Class, frames: &[Vec<u8>]) -> Vec<u8> {
    use proto_flat::batch::{BatchMeta, BatchWriter, RunningTotals};
    let mut w = BatchWriter::with_capacity(16 * 1024);
    w.begin(&BatchMeta {
        node_id: node.0,
        epoch: 1,
        shipper_session: 5,
        batch_seq,
        lane: lane.code(),
        clock_mono_ns: 0,
        clock_realtime_ns: 0,
    });
    for f in frames {
        w.push_frame(f).expect("fits");
    }
    w.finish(&RunningTotals::default()).to_vec()
}

fn heartbeat(seq: u64, ts: u64, entries: &[StreamEntry], progress: &[ProgressEntry]) -> Vec<u8> {
    let mut w = SectionedFrameWriter::heartbeat(sample::SHIPPER_STREAM, seq, ts, ts);
    w.section(entries).section(progress);
    w.finish()
}

fn entry(stream: StreamId, attempted: u64, held_from: u64, ring_full: u64, oversized: u64) -> StreamEntry {
    let mut e = StreamEntry::new_zeroed();
    e.stream_id = U32::new(stream.0);
    e.attempted_seq = U64::new(attempted);
    e.held_from_seq = U64::new(held_from);
    e.drops[LossCause::KernelRingFull.drop_slot().expect("slot")] = U64::new(ring_full);
    e.drops[LossCause::Oversized.drop_slot().expect("slot")] = U64::new(oversized);
    e
}

fn receive(core: &mut Core, now: u64, bytes: &[u8]) -> Receipt {
    core.receive_batch(now, NODE, 100_000, &BatchView::parse(bytes).expect("parses"))
}

/// Runs every timer due up to `until` (the aggregator's timer task), draining events.
fn run_timers(core: &mut Core, until: u64) -> u64 {
    let mut events = 0;
    let mut turns = 0u32;
    while let Some(due) = core.poll_timeout().filter(|&d| d <= until) {
        // Each turn must move time on (a deadline at or before `due` again is a spin).
        turns += 1;
        assert!(turns < 100_000, "the timers do not move on: due {due}");
        core.handle_timeout(due);
        while core.poll_event().is_some() {
            events += 1;
        }
    }
    core.handle_timeout(until);
    while core.poll_event().is_some() {
        events += 1;
    }
    events
}

/// A core that has applied one honest P0 batch and one honest heartbeat: the state a
/// hostile input meets.
fn honest_core() -> Core {
    let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
    let frames: Vec<Vec<u8>> =
        (0..3).map(|q| sample::collective(P0, q, 1_000 + q, 1, Phase::EnqueueStart).as_bytes().to_vec()).collect();
    assert_eq!(receive(&mut core, 1_000_000, &batch(1, Class::P0, &frames)), Receipt::Applied);
    let hb = heartbeat(0, 2_000, &[entry(P0, 3, 3, 0, 0)], &[]);
    assert_eq!(receive(&mut core, 2_000_000, &batch(2, Class::P1, &[hb])), Receipt::Applied);
    run_timers(&mut core, 1_000_000_000);
    core
}

fn refused(core: &mut Core, bytes: &[u8], field: &str) {
    let before = core.clone();
    match receive(core, 1_500_000_000, bytes) {
        Receipt::Implausible(why) => assert_eq!(why.field, field, "{why}"),
        other => panic!("expected {field} refused, got {other:?}"),
    }
    let mut after = core.clone();
    // Only the count moved: nothing of the batch was applied (not even its dedup mark).
    assert_eq!(after.ingest().stats().implausible_batches, before.ingest().stats().implausible_batches + 1);
    let mut before = before;
    run_timers(&mut after, 3_000_000_000);
    run_timers(&mut before, 3_000_000_000);
    assert_eq!(after.ingest().trackers(NODE).collect::<Vec<_>>(), before.ingest().trackers(NODE).collect::<Vec<_>>());
    assert_eq!(after.ingest().dedup().stats(), before.ingest().dedup().stats());
}

/// The heartbeat that stopped every verdict: `attempted`, `held_from` (spooled through)
/// and both kernel drop counters at u64::MAX overflowed `SeqTracker::settle` on the timer
/// task. Now refused whole, before anything of it is applied; the timers run on.
#[test]
fn a_heartbeat_with_every_counter_at_u64_max_is_refused_regression_issue_18() {
    let mut core = honest_core();
    let hb = heartbeat(1, 3_000, &[entry(P0, u64::MAX, u64::MAX, u64::MAX, u64::MAX)], &[]);
    refused(&mut core, &batch(3, Class::P1, &[hb]), "heartbeat.attempted_seq");
    // Each counter alone, and a held seq the kernel never attempted.
    for (i, (e, field)) in [
        (entry(P0, 10, 10, u64::MAX, 0), "heartbeat.drops"),
        (entry(P0, 10, 10, 0, MAX_SEQ + 1), "heartbeat.drops"),
        (entry(P0, 10, 11, 0, 0), "heartbeat.held_from_seq"),
    ]
    .into_iter()
    .enumerate()
    {
        let hb = heartbeat(1, 3_000, &[e], &[]);
        refused(&mut core, &batch(4 + i as u64, Class::P1, &[hb]), field);
    }
    // Verdicts keep flowing: an honest batch after them is applied.
    let more = sample::collective(P0, 3, 1_003, 1, Phase::EnqueueStart).as_bytes().to_vec();
    assert_eq!(receive(&mut core, 2_000_000_000, &batch(10, Class::P0, &[more])), Receipt::Applied);
}

/// Per-interface counters (issue 25): packets past MAX_SEQ, or more bytes than that
/// many of the largest packets carry, are refused whole like any other counter.
#[test]
fn interface_counters_past_the_limits_are_refused() {
    use proto_flat::sections::InterfaceEntry;
    let mut core = honest_core();
    let iface = |packets: u64, bytes: u64| InterfaceEntry {
        ifindex: U32::new(2),
        _reserved0: U32::new(0),
        packets: U64::new(packets),
        bytes: U64::new(bytes),
    };
    let hb_with = |seq: u64, e: InterfaceEntry| {
        let mut w = SectionedFrameWriter::heartbeat(sample::SHIPPER_STREAM, seq, 3_000, 3_000);
        w.section(&[entry(P0, 10, 10, 0, 0)]).section(&[e]);
        w.finish()
    };
    let max_bytes = ringwatch_core::plausible::MAX_PACKET_BYTES;
    for (i, (e, field)) in [
        (iface(u64::MAX, u64::MAX), "interfaces.packets"),
        (iface(MAX_SEQ + 1, 0), "interfaces.packets"),
        (iface(10, 10 * max_bytes + 1), "interfaces.bytes"),
        (iface(0, 1), "interfaces.bytes"),
    ]
    .into_iter()
    .enumerate()
    {
        refused(&mut core, &batch(3 + i as u64, Class::P1, &[hb_with(1 + i as u64, e)]), field);
    }
    // At the limits: applied.
    let ok = hb_with(9, iface(MAX_SEQ, MAX_SEQ));
    assert_eq!(receive(&mut core, 2_000_000_000, &batch(9, Class::P1, &[ok])), Receipt::Applied);
}

/// A frame with seq u64::MAX panicked at `high = seq + 1` on the batch path (no ack, no
/// nack, and the stream showed `pending: 18446744073709551614`): on every lane, refused.
#[test]
fn a_frame_with_seq_u64_max_is_refused_regression_issue_18() {
    let mut core = honest_core();
    let p0: Vec<Vec<u8>> = [3, u64::MAX]
        .iter()
        .map(|&q| sample::collective(P0, q, 5_000, 2, Phase::EnqueueStart).as_bytes().to_vec())
        .collect();
    refused(&mut core, &batch(3, Class::P0, &p0), "frame.seq");
    let bulk = StreamId::new(Class::P2, 1, 0);
    let b = vec![sample::bulk_packet(bulk, u64::MAX, 5_000).as_bytes().to_vec()];
    refused(&mut core, &batch(4, Class::P2, &b), "frame.seq");
    // MAX_SEQ itself is past the limit; one below it is the largest seq there is.
    let b = vec![sample::bulk_packet(bulk, MAX_SEQ, 5_000).as_bytes().to_vec()];
    refused(&mut core, &batch(5, Class::P2, &b), "frame.seq");
    let b = vec![sample::bulk_packet(bulk, MAX_SEQ - 1, 5_000).as_bytes().to_vec()];
    assert_eq!(receive(&mut core, 2_000_000_000, &batch(6, Class::P2, &b)), Receipt::Applied);
    // A node clock past 2^62 ns.
    let b = vec![sample::bulk_packet(bulk, 7, MAX_NODE_NS).as_bytes().to_vec()];
    refused(&mut core, &batch(7, Class::P2, &b), "frame.ts_ns");
}

/// A loss record ending at u64::MAX panicked at `last + 1`; records that lose more seqs
/// than their range holds, or whose range runs backwards, are nonsense too.
#[test]
fn a_loss_record_ending_at_u64_max_is_refused_regression_issue_18() {
    let mut core = honest_core();
    let record = |first: u64, last: u64, count: u64| {
        let mut r = sample::loss_record(1, 3_000, P0, first, last, LossCause::ShipperSpoolFull);
        r.count = U64::new(count);
        r.batch_seq = U64::new(0);
        r.as_bytes().to_vec()
    };
    refused(&mut core, &batch(3, Class::P1, &[record(5, u64::MAX, 1)]), "loss_record.last_seq");
    refused(&mut core, &batch(4, Class::P1, &[record(9, 5, 1)]), "loss_record.first_seq");
    refused(&mut core, &batch(5, Class::P1, &[record(5, 9, 6)]), "loss_record.count");
    refused(&mut core, &batch(6, Class::P1, &[record(5, 9, 0)]), "loss_record.count");
    assert_eq!(receive(&mut core, 2_000_000_000, &batch(7, Class::P1, &[record(5, 9, 5)])), Receipt::Applied);
}

/// The largest values a real stream can reach go through every path — frames at the
/// top of the seq range, heartbeats with every counter at 2^62, loss records there,
/// settlement, epoch close, the API's sums — without overflow (this test build checks).
#[test]
fn the_largest_plausible_counters_settle_without_overflow() {
    let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
    let top = MAX_SEQ - 1;
    let streams: Vec<StreamId> = (0..6).map(|cpu| StreamId::new(Class::P0, 0, cpu)).collect();
    for (i, &s) in streams.iter().enumerate() {
        let f = vec![
            sample::collective(s, 0, 1_000, 1, Phase::EnqueueStart).as_bytes().to_vec(),
            sample::collective(s, top, MAX_NODE_NS - 1, top, Phase::KernelEnd).as_bytes().to_vec(),
        ];
        assert_eq!(receive(&mut core, 1_000_000, &batch(1 + i as u64, Class::P0, &f)), Receipt::Applied);
    }
    let entries: Vec<StreamEntry> = streams.iter().map(|&s| entry(s, MAX_SEQ, MAX_SEQ, MAX_SEQ, MAX_SEQ)).collect();
    let mut p = ProgressEntry::new_zeroed();
    p.comm_hash = U64::new(0x9e37_79b9_7f4a_7c15);
    p.comm_instance = U64::new(1);
    p.last_enqueued_op = U64::new(top);
    p.last_kernel_started_op = U64::new(top);
    p.last_completed_op = U64::new(top);
    p.last_update_ns = U64::new(MAX_NODE_NS - 1);
    let hb = heartbeat(0, MAX_NODE_NS - 1, &entries, &[p]);
    assert_eq!(receive(&mut core, 2_000_000, &batch(20, Class::P1, &[hb])), Receipt::Applied);
    let mut r = sample::loss_record(1, MAX_NODE_NS - 1, streams[0], 1, top - 1, LossCause::ShipperSpoolFull);
    r.batch_seq = U64::new(0);
    assert_eq!(receive(&mut core, 3_000_000, &batch(21, Class::P1, &[r.as_bytes().to_vec()])), Receipt::Applied);
    run_timers(&mut core, 10_000_000_000);
    // An epoch change closes every tracker (the unknown tail above the last attempted).
    let e = sample::epoch_start(2, MAX_NODE_NS - 1, 2).as_bytes().to_vec();
    assert_eq!(receive(&mut core, 11_000_000_000, &batch(22, Class::P1, &[e])), Receipt::Applied);
    run_timers(&mut core, 400_000_000_000);
    let (lost, seen) = core.p0_loss(NODE);
    assert!(seen >= MAX_SEQ && lost > 0, "{lost} {seen}");
    for t in core.ingest().trackers(NODE).filter(|t| StreamId(t.key.stream_id).class_code() == Class::P0.code()) {
        let c = t.counts();
        // Every seq of the stream accounted for, exactly (the sums fit: each < 2^62).
        assert_eq!(c.received + c.lost_total() + c.prior_instance + t.pending() + t.in_transit(), MAX_SEQ, "{t:?}");
    }
    let _ = core.node_health(400_000_000_000);
    let _ = core.gpu_health(400_000_000_000);
}

/// Cluster times at the clamps: one node's clock sample says its clock is 2^62 ns behind
/// the aggregator's, another's that it is 2^62 ahead, so their frames' cluster times sit
/// at opposite ends of i64 — the matcher's durations, lags and residuals subtract them
/// (once in plain i64) and must saturate.
#[test]
fn cluster_times_at_the_clamps_never_overflow_the_matcher_regression_issue_18() {
    let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
    let nodes = [NodeId(1), NodeId(2), NodeId(3), NodeId(4)];
    let node_ts = [MAX_NODE_NS - 4, 0, MAX_NODE_NS / 2, 1];
    let now0 = u64::try_from(i64::MAX).expect("fits") - 1;
    for (i, (&node, &ts)) in (0u32..).zip(nodes.iter().zip(&node_ts)) {
        // A clock sample (heartbeat sent at `ts`, received at `now0`).
        let hb = heartbeat(0, ts, &[entry(P0, 0, 0, 0, 0)], &[]);
        let b = batch_of(node, 1, Class::P1, &[hb]);
        let _ = core.receive_batch(now0, node, 0, &BatchView::parse(&b).expect("parses"));
        // Rank i of a 4-rank all-reduce, every phase, kernel times at the node clock's ends.
        let mut frames = Vec::new();
        for (q, phase) in [Phase::EnqueueStart, Phase::KernelStart, Phase::KernelEnd].into_iter().enumerate() {
            let mut f = sample::collective(P0, q as u64, ts.saturating_add(q as u64), 1, phase);
            f.rank = U32::new(i);
            f.nranks = U32::new(4);
            f.pid = U32::new(100 + i);
            frames.push(f.as_bytes().to_vec());
        }
        let b = batch_of(node, 2, Class::P0, &frames);
        assert_eq!(core.receive_batch(now0, node, 0, &BatchView::parse(&b).expect("parses")), Receipt::Applied);
    }
    let events = run_timers(&mut core, u64::MAX - 1);
    assert!(events > 0, "verdicts were produced");
    let _ = core.node_health(u64::MAX);
}

/// A resume whose numbers no shipper sends is refused (the shell closes the connection)
/// and applies nothing: no dedup hole, no stream window.
#[test]
fn an_implausible_resume_is_refused_and_changes_nothing() {
    let mut core = honest_core();
    let before = core.clone();
    type Case = (u64, u64, Vec<(u64, u64)>, Vec<(u32, u64)>, &'static str);
    let cases: [Case; 4] = [
        (MAX_SEQ + 1, 0, vec![], vec![], "resume.next_batch_seq"),
        (10, u64::MAX, vec![], vec![], "resume.sent_ns"),
        (10, 0, vec![(3, u64::MAX)], vec![], "resume.held.last"),
        (10, 0, vec![], vec![(P0.0, u64::MAX)], "resume.floor_seq"),
    ];
    for (next, sent, held, floors, field) in cases {
        let r = core.handle_resume(1_000_000_000, NODE, 5, 1, next, (sent, 0), &held, &floors);
        assert_eq!(r.map_err(|e| e.field), Err(field));
    }
    assert_eq!(core.ingest().stats().implausible_resumes, 4);
    assert_eq!(core.ingest().trackers(NODE).collect::<Vec<_>>(), before.ingest().trackers(NODE).collect::<Vec<_>>());
    assert_eq!(core.ingest().dedup().stats(), before.ingest().dedup().stats());
}

/// The `hostile` fuzz target's generator, on stable with overflow checks: seeded byte
/// strings become scripts of batches (all of which pass `validate`), resumes, time and
/// disconnects, fed to one core per 8 scripts. Nothing panics; the generator reaches
/// both applied and refused batches.
#[test]
fn generated_hostile_scripts_never_panic_the_core() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(18);
    let mut total = hostile_input::Outcome::default();
    let mut bytes = vec![0u8; 8 * 1024];
    for round in 0..400 {
        let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
        let mut now = 0u64;
        let mut honest = hostile_input::Honest::default();
        for _ in 0..8 {
            rng.fill_bytes(&mut bytes);
            let Ok(script) = hostile_input::Script::arbitrary(&mut Unstructured::new(&bytes)) else { continue };
            let o = hostile_input::run(&mut core, &mut now, &mut honest, &script);
            total.batches += o.batches;
            total.invalid += o.invalid;
            total.applied += o.applied;
            total.implausible += o.implausible;
            total.resumes += o.resumes;
            total.resumes_implausible += o.resumes_implausible;
            total.events += o.events;
            total.honest += o.honest;
        }
        let _ = round;
    }
    println!("{total:?}");
    assert_eq!(total.invalid, 0, "every generated batch passes validate");
    assert!(total.applied > 0 && total.implausible > 0, "{total:?}");
    assert!(total.resumes > total.resumes_implausible && total.resumes_implausible > 0, "{total:?}");
    assert!(total.honest > 0 && total.events > 0, "the matcher judged something: {total:?}");
}
