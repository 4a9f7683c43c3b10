//! Table-driven SeqTracker cases: every way a seq can end, with time passed in.

use proto_flat::codes::{LossCause, WireEnum};
use ringwatch_core::loss::{HeartbeatCounters, SeqTracker, TrackerLimits};
use ringwatch_core::records::{LossInterval, NodeId, StreamKey};

const MS: u64 = 1_000_000;

struct T {
    t: SeqTracker,
    out: Vec<LossInterval>,
    ids: u64,
}

impl T {
    fn new() -> Self {
        let key = StreamKey { node: NodeId(1), epoch: 1, stream_id: 7 };
        Self { t: SeqTracker::new(key, TrackerLimits::default()), out: Vec::new(), ids: 0 }
    }
    fn frames(&mut self, seqs: &[u64], now: u64) {
        for &s in seqs {
            self.t.on_frame(s, 1000 + s * 10, now, &mut self.out, &mut self.ids);
        }
    }
    fn hb(&mut self, attempted: u64, spooled: u64, ring_full: u64) -> HeartbeatCounters {
        let hb = HeartbeatCounters {
            attempted,
            held_from: spooled,
            kernel_ring_full: ring_full,
            kernel_oversized: 0,
            sampled_out: 0,
            snapshot_node_ns: 1000 + attempted * 10,
        };
        self.t.on_heartbeat(hb);
        hb
    }
    fn settle(&mut self, hb: HeartbeatCounters, announced: u64, now: u64) {
        self.t.settle(&hb, announced, now, &mut self.out, &mut self.ids);
    }
    /// `(first, last, count, cause name)` of every interval so far.
    fn losses(&self) -> Vec<(u64, u64, Option<u64>, String)> {
        self.out.iter().map(|l| (l.first_seq, l.last_seq, l.count, LossCause::from_code(l.cause).to_string())).collect()
    }
}

fn conserved(t: &T, attempted: u64) {
    let c = t.t.counts();
    // Every seq below high is received, lost, another instance's, or pending; above it,
    // in transit.
    assert_eq!(c.received + c.lost_total() + c.prior_instance + t.t.pending(), t.t.high());
    assert_eq!(t.t.high() + t.t.in_transit(), attempted.max(t.t.high()));
}

#[test]
fn gap_then_late_fill_is_no_loss() {
    let mut t = T::new();
    t.frames(&[0, 1, 3, 4], 0);
    assert_eq!(t.t.pending(), 1);
    assert_eq!(t.t.watermark_ns(), 1010, "the watermark stops below the hole");
    t.frames(&[2], MS);
    assert_eq!(t.t.pending(), 0);
    assert_eq!(t.t.counts().received, 5);
    assert_eq!(t.t.watermark_ns(), 1040);
    let hb = t.hb(5, 5, 0);
    t.settle(hb, 2 * MS, 600 * MS);
    assert!(t.losses().is_empty());
    conserved(&t, 5);
}

#[test]
fn gap_covered_by_kernel_drops() {
    let mut t = T::new();
    t.frames(&[0, 1, 4, 5], 0);
    let hb = t.hb(6, 6, 2);
    t.settle(hb, MS, 501 * MS);
    assert_eq!(t.losses(), vec![(2, 3, Some(2), "kernel_ring_full".into())]);
    assert_eq!(t.t.counts().lost[0], 2);
    assert_eq!(t.out[0].from_node_ns, 1010);
    assert_eq!(t.out[0].to_node_ns, 1040);
    conserved(&t, 6);
}

#[test]
fn gap_covered_by_a_loss_record() {
    let mut t = T::new();
    t.frames(&[0, 1, 2, 6], 0);
    t.t.on_loss_record(3, 5, 3, LossCause::ShipperSpoolFull, 0, MS, &mut t.out, &mut t.ids);
    assert_eq!(t.losses(), vec![(3, 5, Some(3), "shipper_spool_full".into())]);
    assert_eq!(t.t.pending(), 0);
    // A record ahead of everything seen extends the stream.
    t.t.on_loss_record(7, 9, 3, LossCause::PsiShed, 0, MS, &mut t.out, &mut t.ids);
    assert_eq!(t.t.high(), 10);
    assert_eq!(t.losses()[1], (7, 9, Some(3), "psi_shed".into()));
    // A rejected batch carries its nack reason.
    t.t.on_loss_record(10, 10, 1, LossCause::Rejected, 5, MS, &mut t.out, &mut t.ids);
    assert_eq!(t.out[2].reason, 5);
    conserved(&t, 11);
}

#[test]
fn loss_record_with_kernel_holes_inside_leaves_them_pending() {
    // A dropped batch held seqs 3, 4 and 6 (5 was a kernel hole): count 3 of range 3..=6.
    let mut t = T::new();
    t.frames(&[0, 1, 2], 0);
    t.t.on_loss_record(3, 6, 3, LossCause::ShipperSpoolFull, 0, MS, &mut t.out, &mut t.ids);
    assert_eq!(t.t.pending(), 1, "one seq of the range is not the record's");
    let hb = t.hb(7, 7, 1);
    t.settle(hb, 2 * MS, 600 * MS);
    let c = t.t.counts();
    assert_eq!((c.lost[2], c.lost[0]), (3, 1), "3 spool losses, 1 kernel drop");
    assert_eq!(t.t.pending(), 0);
}

#[test]
fn timing_out_to_unknown() {
    let mut t = T::new();
    t.frames(&[0, 2, 3], 0);
    let hb = t.hb(4, 4, 0);
    // Not yet: the gap must exist when the heartbeat arrived and the timeout pass.
    t.settle(hb, MS, 501 * MS);
    assert_eq!(t.losses(), vec![(1, 1, Some(1), "unknown".into())]);
}

#[test]
fn gaps_newer_than_the_heartbeat_wait_for_the_next_one() {
    let mut t = T::new();
    t.frames(&[0, 1], 0);
    let hb = t.hb(2, 2, 0);
    t.frames(&[3], 2 * MS); // gap [2] appears after the heartbeat arrived at 1 ms
    t.settle(hb, MS, 501 * MS);
    assert!(t.losses().is_empty());
    assert_eq!(t.t.pending(), 1);
}

#[test]
fn in_transit_is_not_lost() {
    let mut t = T::new();
    t.frames(&[0, 1], 0);
    // The shipper has read through 10 and holds it in its spool (a partition, say).
    let hb = t.hb(12, 10, 0);
    t.settle(hb, MS, 501 * MS);
    assert!(t.losses().is_empty());
    assert_eq!(t.t.in_transit(), 10);
    // Much later the spool drains.
    t.frames(&[2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 90_000 * MS);
    assert!(t.losses().is_empty());
    assert_eq!(t.t.counts().received, 12);
}

#[test]
fn tail_loss_from_attempted_seq_when_the_kernel_dropped_it() {
    let mut t = T::new();
    t.frames(&[0, 1, 2], 0);
    // The ring overflowed at the end of a burst: 3..=5 dropped, nothing after.
    let hb = t.hb(6, 6, 3);
    t.settle(hb, MS, 501 * MS);
    assert_eq!(t.losses(), vec![(3, 5, Some(3), "kernel_ring_full".into())]);
    assert_eq!(t.t.watermark_ns(), 1060, "idle and resolved: the watermark reaches the snapshot");
}

#[test]
fn duplicates_are_ignored_and_counted() {
    let mut t = T::new();
    t.frames(&[0, 1, 1, 2, 0, 2], 0);
    assert_eq!(t.t.counts().received, 3);
    assert_eq!(t.t.counts().duplicates, 3);
}

#[test]
fn a_late_frame_after_loss_revives_it() {
    let mut t = T::new();
    t.frames(&[0, 3], 0);
    let hb = t.hb(4, 4, 0);
    t.settle(hb, MS, 501 * MS);
    assert_eq!(t.t.counts().lost_total(), 2);
    t.frames(&[2], 900 * MS);
    let c = t.t.counts();
    assert_eq!((c.lost_total(), c.revived, c.received), (1, 1, 3));
}

#[test]
fn epoch_close_with_known_and_unknown_tail() {
    let mut t = T::new();
    t.frames(&[0, 1, 2], 0);
    t.hb(5, 3, 0); // the kernel attempted 5; the shipper had read 3
    t.t.close_epoch(MS, &mut t.out, &mut t.ids);
    let l = t.losses();
    assert_eq!(l[0], (3, 4, Some(2), "unknown".into()), "known tail: exact range");
    assert_eq!(l[1], (5, u64::MAX, None, "unknown".into()), "then explicitly unknown");
    assert!(t.t.is_closed());
}

#[test]
fn session_restart_loses_only_the_unshipped_gap() {
    let mut t = T::new();
    t.frames(&[0, 1, 2, 3], 0);
    // The old shipper read 4..=7 but died before shipping them; the new session takes
    // over with the kernel at 8 and reads on from the ring at 8.
    t.t.on_session_start(8);
    t.frames(&[8, 9, 10], 10 * MS);
    let hb = t.hb(11, 11, 0);
    t.settle(hb, 11 * MS, 511 * MS);
    assert_eq!(t.losses(), vec![(4, 7, Some(4), "shipper_restart".into())]);
    // Nothing above the takeover is lost: a later hole is unknown, not a restart loss.
    t.frames(&[12], 600 * MS);
    let hb = t.hb(13, 13, 0);
    t.settle(hb, 601 * MS, 1101 * MS);
    assert_eq!(t.losses()[1], (11, 11, Some(1), "unknown".into()));
}

#[test]
fn kernel_drops_and_restart_mix_in_order() {
    let mut t = T::new();
    t.frames(&[0], 0);
    t.t.on_session_start(6);
    t.frames(&[6], MS);
    let hb = t.hb(7, 7, 2); // two of 1..=5 were kernel drops
    t.settle(hb, MS, 501 * MS);
    let c = t.t.counts();
    assert_eq!((c.lost[0], c.lost[4]), (2, 3));
}

#[test]
fn gap_cap_evicts_oldest_as_unknown() {
    let key = StreamKey { node: NodeId(1), epoch: 1, stream_id: 7 };
    let mut t = SeqTracker::new(key, TrackerLimits { max_gaps: 3, max_recent_lost: 4 });
    let (mut out, mut ids) = (Vec::new(), 0);
    for s in [0, 2, 4, 6, 8, 10] {
        t.on_frame(s, s, 0, &mut out, &mut ids);
    }
    assert_eq!(t.gaps().count(), 3);
    assert_eq!(t.counts().gaps_evicted, 2);
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].first_seq, out[0].last_seq), (1, 1));
}

/// Issue 10's restart test: the kernel dropped frames both while the shipper was down
/// (below the takeover) and after the new session took over (above it). Holes above the
/// takeover can only be the kernel's (the new session reports whatever it loses), so the
/// kernel count goes there first; the rest below the takeover is the old session's
/// unshipped tail. Before: the kernel count went to the lowest holes first, and the
/// hole above the takeover was left `unknown`.
#[test]
fn kernel_drops_go_above_the_takeover_first_issue_10() {
    let mut t = T::new();
    t.frames(&[0, 1], 0);
    // Old session read 2..=4 and died with them; the ring dropped 5 while it was down.
    t.t.on_session_start(6);
    // The new session reads 6 from the ring; the kernel drops 7..=8 after the takeover.
    t.frames(&[6, 9], MS);
    let hb = t.hb(10, 10, 3); // 5, 7, 8: three kernel drops in all
    t.settle(hb, MS, 501 * MS);
    let c = t.t.counts();
    assert_eq!(c.lost[LossCause::KernelRingFull.drop_slot().unwrap()], 3);
    assert_eq!(c.lost[LossCause::ShipperRestart.drop_slot().unwrap()], 3);
    assert_eq!(c.lost[LossCause::Unknown.drop_slot().unwrap()], 0, "{:?}", t.losses());
    assert!(t.losses().contains(&(7, 8, Some(2), "kernel_ring_full".into())), "{:?}", t.losses());
    conserved(&t, 10);
}

/// Issue 16: an aggregator instance that missed part of a stream (restarted without the
/// state, or SIGKILLed after its snapshot) sees it from the shipper's resume floor: what
/// another instance received is `prior_instance`, never loss; kernel drops stay
/// `kernel_ring_full` (above the floor first); held frames below the floor are received.
#[test]
fn a_resume_floor_counts_prior_instance_not_loss_regression_issue_16() {
    let mut t = T::new();
    // Another instance received 0..=9 except 4 (a kernel drop); 10 is still held by the
    // shipper (resent); the kernel drops 12 after the restart.
    assert!(t.t.on_resume(11, false, 0));
    assert!(!t.t.on_resume(5, false, 0), "a floor below what this instance knows changes nothing");
    t.frames(&[10, 11, 13], MS);
    let hb = t.hb(14, 14, 2);
    t.settle(hb, MS, 501 * MS);
    let c = *t.t.counts();
    assert_eq!(c.received, 3);
    assert_eq!(c.lost[LossCause::KernelRingFull.drop_slot().unwrap()], 2, "{:?}", t.losses());
    assert!(t.losses().contains(&(12, 12, Some(1), "kernel_ring_full".into())), "above the floor first");
    assert_eq!(c.lost_total(), 2, "nothing unknown: {:?}", t.losses());
    assert_eq!(c.prior_instance, 9, "0..=9 less the kernel drop");
    assert_eq!(t.t.pending(), 0);
    conserved(&t, 14);
    // A held frame that arrives after settlement is revived from prior_instance.
    t.frames(&[3], 600 * MS);
    assert_eq!((t.t.counts().received, t.t.counts().prior_instance), (4, 8));
    conserved(&t, 14);
}

/// Issue 20: a floor given to an aggregator restored from its own snapshot: what it
/// misses below the floor was acked by the instance that crashed after the snapshot —
/// lost as `aggregator_crash` with a loss interval, never `prior_instance` or `unknown`;
/// kernel drops are still placed first, and a held frame still revives its seq.
#[test]
fn a_resume_floor_after_a_crash_is_aggregator_crash_loss_issue_20() {
    let mut t = T::new();
    assert!(t.t.on_resume(11, true, 0));
    t.frames(&[10, 11, 13], MS);
    let hb = t.hb(14, 14, 2);
    t.settle(hb, MS, 501 * MS);
    let c = *t.t.counts();
    let crash = LossCause::AggregatorCrash.cause_slot().unwrap();
    assert_eq!(c.lost[LossCause::KernelRingFull.drop_slot().unwrap()], 2, "{:?}", t.losses());
    assert_eq!(c.lost[crash], 9, "0..=9 less the kernel drop: {:?}", t.losses());
    assert_eq!(c.lost[LossCause::Unknown.drop_slot().unwrap()], 0);
    assert_eq!(c.prior_instance, 0);
    assert!(t.losses().iter().any(|l| l.3 == "aggregator_crash"), "{:?}", t.losses());
    conserved(&t, 14);
    t.frames(&[3], 600 * MS);
    assert_eq!((t.t.counts().received, t.t.counts().lost[crash], t.t.counts().revived), (4, 8, 1));
    conserved(&t, 14);
}

/// Issue 16: the shipper's own P1 stream has no heartbeat counters to settle a window
/// with, so its prior_instance is counted at once (and a held frame still revives it).
#[test]
fn a_resume_floor_on_the_shippers_own_stream_is_counted_at_once() {
    let sid = proto_flat::StreamId::new(proto_flat::Class::P1, proto_flat::StreamId::SHIPPER_RING, 0).0;
    let key = StreamKey { node: NodeId(1), epoch: 1, stream_id: sid };
    let mut t = T { t: SeqTracker::new(key, TrackerLimits::default()), out: Vec::new(), ids: 0 };
    assert!(t.t.on_resume(40, false, 0));
    assert_eq!((t.t.counts().prior_instance, t.t.pending()), (40, 0));
    assert!(t.losses().is_empty(), "not loss");
    t.frames(&[38, 40], MS);
    assert_eq!((t.t.counts().received, t.t.counts().prior_instance), (2, 39));
}

/// Issue 16: a batch still on its way when the reorder timeout ran out is settled
/// `unknown`; when the shipper then gives it up (shutdown) its loss record knows why, and
/// the seqs take that cause — counts exact, nothing left unknown.
#[test]
fn a_later_loss_record_names_the_cause_of_unknown_seqs() {
    let mut t = T::new();
    t.frames(&[0, 1, 5], 0);
    let hb = t.hb(6, 6, 0);
    t.settle(hb, MS, 501 * MS);
    assert_eq!(t.t.counts().lost[LossCause::Unknown.drop_slot().unwrap()], 3);
    t.t.on_loss_record(2, 4, 3, LossCause::ShipperShutdown, 0, 900 * MS, &mut t.out, &mut t.ids);
    let c = t.t.counts();
    assert_eq!(c.lost[LossCause::Unknown.drop_slot().unwrap()], 0, "{:?}", t.losses());
    assert_eq!(c.lost[LossCause::ShipperShutdown.drop_slot().unwrap()], 3);
    assert!(t.losses().contains(&(2, 4, Some(3), "shipper_shutdown".into())), "{:?}", t.losses());
    conserved(&t, 6);
    // A record naming seqs that were received changes nothing.
    t.t.on_loss_record(0, 1, 2, LossCause::ShipperShutdown, 0, 901 * MS, &mut t.out, &mut t.ids);
    assert_eq!(t.t.counts().lost_total(), 3);
}

/// Issue 16: a gap at or above the heartbeat's `held_from_seq` (the lowest seq the
/// shipper still held unacked) is in transit, not lost — a backlog resent out of order
/// after a partition fills it late; once the shipper holds nothing below it, it settles.
#[test]
fn a_gap_the_shipper_still_holds_waits_for_it() {
    let mut t = T::new();
    t.frames(&[0, 1, 5, 6], 0);
    // The shipper still holds 2..=4 (their batch is on its way): nothing is lost.
    let hb = t.hb(7, 2, 0);
    t.settle(hb, MS, 501 * MS);
    assert!(t.losses().is_empty(), "{:?}", t.losses());
    assert_eq!(t.t.pending(), 3);
    t.frames(&[2, 3], 600 * MS);
    // Now it holds nothing: 4 is gone for good (unknown: no kernel drop, no loss record).
    let hb = t.hb(7, 7, 0);
    t.settle(hb, 700 * MS, 1_201 * MS);
    assert_eq!(t.losses(), vec![(4, 4, Some(1), "unknown".into())]);
    conserved(&t, 7);
}

proptest::proptest! {
    /// Issue 21: `on_run` (a run of consecutive seqs in one call, what the bulk path
    /// does with a batch's frames of one stream) leaves the tracker exactly as the same
    /// frames one by one would — batches in any order, with holes, duplicates and
    /// revivals after a loss record.
    #[test]
    fn a_run_is_the_same_as_its_frames_one_by_one(
        batches in proptest::collection::vec((0u64..400, 1u64..40, proptest::bool::ANY), 1..40),
        lost in proptest::option::of((0u64..400, 1u64..30)),
    ) {
        let mut a = T::new();
        let mut b = T::new();
        for (i, &(first, len, backwards_ts)) in batches.iter().enumerate() {
            if i == batches.len() / 2 && let Some((lf, ln)) = lost {
                for t in [&mut a, &mut b] {
                    t.t.on_loss_record(lf, lf + ln - 1, ln, LossCause::ShipperSpoolFull, 0, 5 * MS, &mut t.out, &mut t.ids);
                }
            }
            let run: Vec<(u64, u64)> = (first..first + len)
                .map(|s| (s, if backwards_ts { 10_000 - s } else { 1000 + s * 10 }))
                .collect();
            for &(s, ts) in &run {
                a.t.on_frame(s, ts, MS, &mut a.out, &mut a.ids);
            }
            b.t.on_run(first, &run, MS, &mut b.out, &mut b.ids);
        }
        proptest::prop_assert_eq!(a.t.counts(), b.t.counts());
        proptest::prop_assert_eq!(a.t.pending(), b.t.pending());
        proptest::prop_assert_eq!(a.t.high(), b.t.high());
        proptest::prop_assert_eq!(a.t.gaps().collect::<Vec<_>>(), b.t.gaps().collect::<Vec<_>>());
        proptest::prop_assert_eq!(a.t.watermark_ns(), b.t.watermark_ns());
        proptest::prop_assert_eq!(&a.out, &b.out);
    }
}
