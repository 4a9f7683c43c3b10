//! `SeqTracker`: exact loss accounting for one stream `(node, epoch, stream_id)`.
//!
//! Every seq below `attempted_seq` ends in exactly one state:
//! - **received** (duplicates are ignored and counted);
//! - **pending**: a gap below the highest seq seen, waiting for a late frame, a loss
//!   record, or settlement;
//! - **in transit**: above the highest seq seen, below the heartbeat's `attempted_seq`
//!   (the shipper has it, or it is still in the ring);
//! - **lost(cause)**, as a [`LossInterval`].
//!
//! Resolution rules:
//! - a late frame fills its gap; a frame for a seq already declared lost *revives* it
//!   (the loss is taken back and counted in `revived`), so the counts end exact;
//! - a shipper loss record `(first..=last, count, cause)` declares `count` pending seqs in
//!   its range lost with its cause (the rest of the range are kernel holes the shipper
//!   never saw; they stay pending); seqs of its range already settled as `unknown` (the
//!   reorder timeout ran out first) take its cause instead, up to its count;
//! - **settlement**, `reorder_timeout` after a heartbeat `(A, H, drops)` arrived: every
//!   gap below `min(A, H)` is lost. `A` because the kernel had attempted those seqs when
//!   it read its drop counters; `H` (`held_from_seq`) because it is the lowest seq the
//!   shipper still held unacked, so a gap at or above it may still be filled or reported
//!   (issue 16: a backlog resent out of order, a batch given up at shutdown). Causes:
//!   first the kernel's unexplained drop counts (`kernel_ring_full`, then `oversized`),
//!   the rest `prior_instance` (or `aggregator_crash`) below a resume floor,
//!   `shipper_restart` below a session's
//!   takeover floor, else `unknown`. The tail `[high, A)` is in transit (in the spool,
//!   however long a partition lasts) while the shipper still holds something of the
//!   stream (`H < A`); once it holds nothing, everything it read was applied or reported,
//!   so the tail is a hole like any other. Counts are exact; where one range mixes causes,
//!   causes are placed in seq order;
//! - an epoch change settles everything below the last `attempted_seq` and emits an
//!   explicitly unknown tail above it;
//! - a shipper's `resume` floor above `high` (another aggregator instance received or
//!   resolved seqs this one never saw, issue 16) becomes a pending gap; held frames and
//!   loss records still fill it, settlement places the kernel's unexplained drops on holes
//!   above the floor first, then in it, and what is left below the floor is counted
//!   `prior_instance` — not loss, no loss interval — or, where the floor came to an
//!   aggregator restored from its own snapshot (it knew the stream up to the snapshot,
//!   and the instance that crashed after it acked the rest), lost as `aggregator_crash`.
//!
//! Conservation (tested): `attempted + sampled_out = received + lost + prior_instance +
//! pending + in_transit + sampled_out`, per stream, at every step.
//!
//! Memory: at most `max_gaps` gaps (beyond, the oldest is declared lost(unknown) and
//! counted in `gaps_evicted`) and `max_recent_lost` remembered loss ranges for revival.

use std::collections::BTreeMap;

use proto_flat::codes::{LOSS_CAUSES, LossCause, WireEnum};
use rkyv::{Archive, Deserialize, Serialize};

use crate::records::{LossInterval, StreamKey};
use crate::tally::Tally;

/// A pending hole `[start, end)` (start is the map key).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    pub end: u64,
    /// Node time of the frame below and above the hole.
    pub lo_ts: u64,
    pub hi_ts: u64,
    pub created_at_ns: u64,
}

/// The last heartbeat's counters for the stream.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeartbeatCounters {
    pub attempted: u64,
    pub held_from: u64,
    pub kernel_ring_full: u64,
    pub kernel_oversized: u64,
    pub sampled_out: u64,
    pub snapshot_node_ns: u64,
}

/// A range already declared lost, kept for revival.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostRange {
    pub start: u64,
    pub end: u64,
    pub slot: u8,
}

/// Per-stream counters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamCounts {
    pub received: u64,
    pub duplicates: u64,
    /// Lost by cause slot (`LossCause::cause_slot`).
    pub lost: [u64; LOSS_CAUSES],
    /// Seqs declared lost that arrived after all.
    pub revived: u64,
    pub gaps_evicted: u64,
    /// Seqs below a resume floor that another aggregator instance received or resolved
    /// (this one never saw them): not loss.
    pub prior_instance: u64,
}

impl StreamCounts {
    /// Total lost, all causes.
    #[must_use]
    pub fn lost_total(&self) -> u64 {
        self.lost.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// Limits.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrackerLimits {
    pub max_gaps: usize,
    pub max_recent_lost: usize,
}

impl Default for TrackerLimits {
    fn default() -> Self {
        // 4,096 gaps ≈ 200 KiB per stream at worst; 256 remembered losses cover a
        // reorder window many batches wide.
        Self { max_gaps: 4096, max_recent_lost: 256 }
    }
}

/// Sequence accounting for one stream. Method groups: getters (`high`, `pending`,
/// `counts`, `watermark_ns`, `in_transit`), inputs (`on_frame`, `on_loss_record`,
/// `on_heartbeat`, `on_session_start`), resolution (`settle`, `close_epoch`). Inputs that
/// resolve loss push [`LossInterval`]s into the caller's `out`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct SeqTracker {
    pub key: StreamKey,
    high: u64,
    gaps: BTreeMap<u64, Gap>,
    pending: u64,
    counts: StreamCounts,
    kernel_attributed: [u64; 2],
    hb: Option<HeartbeatCounters>,
    ts_high: u64,
    wm_ns: u64,
    restart_floor: u64,
    /// Below it, what no other cause explains is `prior_instance` (a shipper's resume) —
    /// or `aggregator_crash` when `resume_crash`.
    resume_floor: u64,
    /// The resume floor came to an aggregator restored from its own snapshot: what it
    /// misses below the floor was acked by the instance that crashed.
    resume_crash: bool,
    recent_lost: Vec<LostRange>,
    closed: bool,
    limits: TrackerLimits,
}

const RING_FULL_SLOT: usize = 0;
const OVERSIZED_SLOT: usize = 1;
/// Not a loss cause: the `prior_instance` count (outside `StreamCounts::lost`).
const PRIOR_SLOT: usize = LOSS_CAUSES;
/// Where a cause this build does not know is counted.
const UNKNOWN_SLOT: usize = 7;
const _: () = assert!(LossCause::Unknown.code_const() as usize == UNKNOWN_SLOT + 1);

fn slot(cause: LossCause) -> usize {
    cause.cause_slot().filter(|&s| s < LOSS_CAUSES).unwrap_or(UNKNOWN_SLOT)
}

impl SeqTracker {
    /// A tracker for a stream with nothing seen yet.
    #[must_use]
    pub fn new(key: StreamKey, limits: TrackerLimits) -> Self {
        Self {
            key,
            high: 0,
            gaps: BTreeMap::new(),
            pending: 0,
            counts: StreamCounts::default(),
            kernel_attributed: [0; 2],
            hb: None,
            ts_high: 0,
            wm_ns: 0,
            restart_floor: 0,
            resume_floor: 0,
            resume_crash: false,
            recent_lost: Vec::new(),
            closed: false,
            limits,
        }
    }

    // ---------------------------------------------------------------- getters

    /// One past the highest seq received or covered.
    #[must_use]
    pub fn high(&self) -> u64 {
        self.high
    }
    /// Seqs in pending gaps.
    #[must_use]
    pub fn pending(&self) -> u64 {
        self.pending
    }
    /// The pending gaps, `(start, end)`.
    pub fn gaps(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.gaps.iter().map(|(s, g)| (*s, g.end))
    }
    /// Counters.
    #[must_use]
    pub fn counts(&self) -> &StreamCounts {
        &self.counts
    }
    /// The last heartbeat's counters.
    #[must_use]
    pub fn heartbeat(&self) -> Option<&HeartbeatCounters> {
        self.hb.as_ref()
    }
    /// Seqs the kernel attempted that are neither received, pending nor lost yet.
    #[must_use]
    pub fn in_transit(&self) -> u64 {
        self.hb.map_or(0, |h| h.attempted.saturating_sub(self.high))
    }
    /// Node time through which every seq of this stream is received or resolved.
    #[must_use]
    pub fn watermark_ns(&self) -> u64 {
        self.wm_ns
    }
    /// Whether the epoch of this stream has ended.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.closed
    }
    /// `attempted + sampled_out` as the last heartbeat said (0 before one).
    #[must_use]
    pub fn generated(&self) -> u64 {
        self.hb.map_or(0, |h| h.attempted.saturating_add(h.sampled_out))
    }

    // ---------------------------------------------------------------- inputs

    /// A frame with `seq` and node time `ts` arrived; returns false for a duplicate
    /// (counted, to be ignored by the caller). The hot path (the next seq) is a compare
    /// and two increments.
    #[inline]
    pub fn on_frame(&mut self, seq: u64, ts: u64, now: u64, out: &mut Vec<LossInterval>, ids: &mut u64) -> bool {
        if seq == self.high {
            self.high = self.high.saturating_add(1);
            self.counts.received.inc();
            self.ts_high = ts;
            if self.gaps.is_empty() {
                self.wm_ns = self.wm_ns.max(ts);
            }
            return true;
        }
        self.on_frame_slow(seq, ts, now, out, ids)
    }

    /// `run.len()` frames with consecutive seqs from `first` (their times in order): the
    /// same as [`Self::on_frame`] for each, with one map operation for the run where it
    /// continues the stream or fills a gap from its start (a batch applied out of order
    /// fills the hole the batches after it left). Returns how many were duplicates.
    pub fn on_run(
        &mut self,
        first: u64,
        run: &[(u64, u64)],
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) -> u64 {
        let n = run.len() as u64;
        let (Some(&(_, ts_last)), true) = (run.last(), n > 1) else {
            return run.iter().map(|&(seq, ts)| u64::from(!self.on_frame(seq, ts, now, out, ids))).sum();
        };
        let end = first.saturating_add(n);
        let ts_max = run.iter().map(|r| r.1).max().unwrap_or(ts_last);
        if first == self.high {
            self.high = end;
            self.counts.received.grow(n);
            self.ts_high = ts_last;
            if self.gaps.is_empty() {
                self.wm_ns = self.wm_ns.max(ts_max);
            }
            return 0;
        }
        if let Some(&gap) = self.gaps.get(&first)
            && end <= gap.end
        {
            let was_first = self.gaps.keys().next() == Some(&first);
            self.gaps.remove(&first);
            if end < gap.end {
                self.gaps.insert(end, Gap { lo_ts: ts_last, ..gap });
            }
            self.pending.shrink(n);
            self.counts.received.grow(n);
            if was_first {
                // Frame by frame the first gap's start (and so the candidate) moved
                // through every time but the last before the final state below.
                let but_last = run.iter().take(run.len().saturating_sub(1)).map(|r| r.1).max().unwrap_or(0);
                self.wm_ns = self.wm_ns.max(but_last);
            }
            self.update_watermark();
            return 0;
        }
        run.iter().map(|&(seq, ts)| u64::from(!self.on_frame(seq, ts, now, out, ids))).sum()
    }

    fn on_frame_slow(&mut self, seq: u64, ts: u64, now: u64, out: &mut Vec<LossInterval>, ids: &mut u64) -> bool {
        if seq > self.high {
            let gap = Gap { end: seq, lo_ts: self.ts_high, hi_ts: ts, created_at_ns: now };
            self.pending.grow(seq.saturating_sub(self.high));
            self.gaps.insert(self.high, gap);
            self.high = seq.saturating_add(1);
            self.counts.received.inc();
            self.ts_high = ts;
            self.enforce_gap_cap(now, out, ids);
            return true;
        }
        // Below high: a late frame, a revival, or a duplicate.
        if let Some((&start, &gap)) = self.gaps.range(..=seq).next_back()
            && seq < gap.end
        {
            self.gaps.remove(&start);
            if start < seq {
                self.gaps.insert(start, Gap { end: seq, hi_ts: ts, ..gap });
            }
            if seq.saturating_add(1) < gap.end {
                self.gaps.insert(seq.saturating_add(1), Gap { lo_ts: ts, ..gap });
            }
            self.pending.shrink(1);
            self.counts.received.inc();
            self.update_watermark();
            return true;
        }
        if let Some(i) = self.recent_lost.iter().position(|r| r.start <= seq && seq < r.end) {
            let r = self.recent_lost.remove(i);
            if r.start < seq {
                self.recent_lost.push(LostRange { end: seq, ..r });
            }
            if seq.saturating_add(1) < r.end {
                self.recent_lost.push(LostRange { start: seq.saturating_add(1), ..r });
            }
            let s = usize::from(r.slot);
            if s == PRIOR_SLOT {
                self.counts.prior_instance = self.counts.prior_instance.saturating_sub(1);
            } else if let Some(l) = self.counts.lost.get_mut(s) {
                *l = l.saturating_sub(1);
            }
            if s == RING_FULL_SLOT || s == OVERSIZED_SLOT {
                self.kernel_attributed[s] = self.kernel_attributed[s].saturating_sub(1);
            }
            self.counts.received.inc();
            self.counts.revived.inc();
            return true;
        }
        self.counts.duplicates.inc();
        false
    }

    /// A shipper loss record: `count` frames of `first..=last` will never arrive.
    #[allow(clippy::too_many_arguments, reason = "one loss record's fields")]
    pub fn on_loss_record(
        &mut self,
        first: u64,
        last: u64,
        count: u64,
        cause: LossCause,
        reason: u16,
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) {
        if last < first {
            return;
        }
        let mut remaining = count;
        // One past the range (a checked batch has `last < 2^62`; saturating for direct
        // callers).
        let end = last.saturating_add(1);
        // Beyond what was seen: the range's upper part becomes a gap first.
        if last >= self.high {
            let start = self.high.max(first);
            if start > self.high {
                // Seqs between high and the record's range: unknown yet, pending.
                self.gaps.insert(self.high, Gap { end: start, lo_ts: self.ts_high, hi_ts: 0, created_at_ns: now });
                self.pending.grow(start.saturating_sub(self.high));
            }
            self.gaps.insert(start, Gap { end, lo_ts: self.ts_high, hi_ts: 0, created_at_ns: now });
            self.pending.grow(end.saturating_sub(start));
            self.high = end;
        }
        let starts: Vec<u64> = self.gaps.range(..=last).map(|(s, _)| *s).collect();
        for start in starts {
            if remaining == 0 {
                break;
            }
            let Some(gap) = self.gaps.get(&start).copied() else { continue };
            let lo = start.max(first);
            let hi = gap.end.min(end);
            if lo >= hi {
                continue;
            }
            let n = hi.saturating_sub(lo).min(remaining);
            remaining.shrink(n);
            self.declare(start, lo, lo.saturating_add(n), slot(cause), reason, now, out, ids);
        }
        if remaining > 0 {
            self.reclassify_unknown(first, last, remaining, slot(cause), reason, now, out, ids);
        }
        self.update_watermark();
        self.enforce_gap_cap(now, out, ids);
    }

    /// A loss record names seqs already settled as `unknown` (their batch was still on
    /// its way when the reorder timeout ran out, then never came: a shipper gave it up at
    /// shutdown, issue 16): the record knows why, so up to `count` of them move to its
    /// cause — counts stay exact, a loss interval with the cause is emitted.
    #[allow(clippy::too_many_arguments, reason = "one loss record's fields")]
    fn reclassify_unknown(
        &mut self,
        first: u64,
        last: u64,
        count: u64,
        to_slot: usize,
        reason: u16,
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) {
        let unknown = slot(LossCause::Unknown);
        if to_slot == unknown {
            return;
        }
        let mut remaining = count;
        let mut i = 0;
        while i < self.recent_lost.len() && remaining > 0 {
            let r = self.recent_lost[i];
            let (lo, hi) = (r.start.max(first), r.end.min(last.saturating_add(1)));
            if usize::from(r.slot) != unknown || lo >= hi {
                i = i.saturating_add(1);
                continue;
            }
            let hi = hi.min(lo.saturating_add(remaining));
            let n = hi.saturating_sub(lo);
            remaining.shrink(n);
            // Split the remembered range: the piece takes the record's cause.
            self.recent_lost.remove(i);
            for (a, b, sl) in
                [(r.start, lo, r.slot), (lo, hi, u8::try_from(to_slot).unwrap_or(u8::MAX)), (hi, r.end, r.slot)]
            {
                if a < b {
                    self.recent_lost.push(LostRange { start: a, end: b, slot: sl });
                }
            }
            if let Some(u) = self.counts.lost.get_mut(unknown) {
                *u = u.saturating_sub(n);
            }
            if let Some(l) = self.counts.lost.get_mut(to_slot) {
                l.grow(n);
            }
            out.push(self.interval(ids, (lo, hi), to_slot, reason, (self.ts_high, 0), now));
        }
    }

    /// A heartbeat's counters for this stream. Schedules nothing itself: the caller
    /// calls [`Self::settle`] with these counters `reorder_timeout` later.
    pub fn on_heartbeat(&mut self, hb: HeartbeatCounters) {
        if self.closed {
            return;
        }
        let prev = self.hb.unwrap_or_default();
        // Counters are cumulative within an epoch; never go back.
        self.hb = Some(HeartbeatCounters {
            attempted: hb.attempted.max(prev.attempted),
            held_from: hb.held_from.max(prev.held_from),
            kernel_ring_full: hb.kernel_ring_full.max(prev.kernel_ring_full),
            kernel_oversized: hb.kernel_oversized.max(prev.kernel_oversized),
            sampled_out: hb.sampled_out.max(prev.sampled_out),
            snapshot_node_ns: hb.snapshot_node_ns.max(prev.snapshot_node_ns),
        });
        self.update_watermark();
    }

    /// A shipper's `resume` floor: every seq below `floor` was received or resolved by
    /// some aggregator instance, or will still arrive (held frames, loss records). If it
    /// lies above what this tracker has seen, this instance missed part of the stream: the
    /// seqs up to it become a pending gap whose unexplained rest is `prior_instance` at
    /// settlement — `aggregator_crash` loss instead when `crash` (this instance was
    /// restored from its own snapshot, so the instance that acked them crashed before a
    /// snapshot held them). Returns whether it did (false: this instance already knows
    /// that far).
    pub fn on_resume(&mut self, floor: u64, crash: bool, now: u64) -> bool {
        if self.closed || floor <= self.high {
            return false;
        }
        let start = self.high;
        self.gaps.insert(start, Gap { end: floor, lo_ts: self.ts_high, hi_ts: 0, created_at_ns: now });
        self.pending.grow(floor.saturating_sub(start));
        self.high = floor;
        self.resume_floor = floor;
        self.resume_crash = crash;
        if proto_flat::StreamId(self.key.stream_id).class_code() == proto_flat::Class::P1.code() {
            // The shipper's own stream: no heartbeat counts it (nothing would ever settle
            // the window) and no kernel drops it. Counted at once; a held frame that
            // still arrives is revived from it.
            let mut scratch = Vec::new();
            let mut ids = 0;
            self.declare(start, start, floor, self.resume_slot(), 0, now, &mut scratch, &mut ids);
            self.update_watermark();
        }
        true
    }

    /// A new shipper session took over at `attempted` for this stream: seqs below it
    /// that nobody ships are `shipper_restart` losses at the next settlement.
    pub fn on_session_start(&mut self, attempted: u64) {
        self.restart_floor = self.restart_floor.max(attempted);
    }

    // ---------------------------------------------------------------- resolution

    /// Settles with the counters of a heartbeat that arrived at `announced_ns`, now that
    /// `reorder_timeout` has passed: every gap below its `attempted_seq` and its
    /// `held_from_seq` is lost — kernel drops first (`kernel_ring_full`, then `oversized`),
    /// then `prior_instance` / `shipper_restart` below their floors, then `unknown`. The
    /// never-received tail `[high, attempted)` is in transit while the shipper holds
    /// something of the stream, and a hole like any other once it holds nothing (or the
    /// epoch ended).
    pub fn settle(
        &mut self,
        hb: &HeartbeatCounters,
        announced_ns: u64,
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) {
        let mut unexplained = [
            hb.kernel_ring_full.saturating_sub(self.kernel_attributed[0]),
            hb.kernel_oversized.saturating_sub(self.kernel_attributed[1]),
        ];
        // A gap is settled by a heartbeat only below that heartbeat's attempted_seq: the
        // kernel had attempted those seqs when it snapshotted its drop counters, so the
        // counters already include any drop among them.
        // And only below the lowest seq the shipper still held: at or above it a frame or a
        // loss record may still come (a backlog after a partition arrives out of order; a
        // batch given up at shutdown is reported after), so a hole there is in transit.
        let limit = if self.closed { u64::MAX } else { hb.attempted.min(hb.held_from) };
        // When the shipper held nothing (`held_from ≥ attempted`), everything it read left
        // its spool acked — so was applied here — or named in an acked loss record: the
        // never-received tail is not in transit, it is a hole like any other (kernel drops
        // placed above the floors first, then the floors' causes). An epoch's end settles
        // the whole tail the same way.
        let tail_end = if self.closed { hb.attempted.max(self.high) } else { hb.attempted };
        if (self.closed || hb.held_from >= hb.attempted) && tail_end > self.high {
            self.gaps.insert(
                self.high,
                Gap { end: tail_end, lo_ts: self.ts_high, hi_ts: hb.snapshot_node_ns, created_at_ns: now },
            );
            self.pending.grow(tail_end.saturating_sub(self.high));
            self.high = tail_end;
        }
        let _ = announced_ns;
        // Kernel counts go first to holes at or above a session's takeover floor: the
        // session that reads there ships or reports everything it reads, so only the
        // kernel can have made them. Below the floor a hole may also be the last
        // session's unshipped tail (`shipper_restart`). Without a restart the floor is 0
        // and this is one pass in seq order.
        // A resume floor works the same way: below it a hole may be what another
        // aggregator instance received.
        let floor = self.restart_floor.max(self.resume_floor);
        let above: Vec<u64> = self.gaps.range(..limit).filter(|(_, g)| g.end > floor).map(|(s, _)| *s).collect();
        for start in above {
            let Some(gap) = self.gaps.get(&start).copied() else { continue };
            self.resolve_from(start, start.max(floor), gap.end.min(limit), &mut unexplained, now, out, ids);
        }
        // Below the floor only once no hole above it waits on the shipper any more: the
        // kernel's unexplained count may belong to those, and a hole below the floor given
        // a drop that was not its own would leave theirs `unknown` later.
        let waiting_above = self.gaps.iter().any(|(s, g)| g.end > floor && g.end > limit && *s < hb.attempted);
        let below: Vec<u64> =
            if waiting_above { Vec::new() } else { self.gaps.range(..limit.min(floor)).map(|(s, _)| *s).collect() };
        for start in below {
            let Some(gap) = self.gaps.get(&start).copied() else { continue };
            self.resolve(start, gap.end.min(limit), &mut unexplained, now, out, ids);
        }
        self.update_watermark();
    }

    /// Declares the whole gap `[start, end)` lost, causes in order: kernel counts, then
    /// the fallback.
    fn resolve(
        &mut self,
        start: u64,
        end: u64,
        unexplained: &mut [u64; 2],
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) {
        self.resolve_from(start, start, end, unexplained, now, out, ids);
    }

    /// Declares `[from, end)` of the gap that starts at `gap_start` lost (the part below
    /// `from` stays pending), causes in order: kernel counts, then the fallback.
    #[allow(clippy::too_many_arguments, reason = "the settle loop's state, passed through")]
    fn resolve_from(
        &mut self,
        gap_start: u64,
        from: u64,
        end: u64,
        unexplained: &mut [u64; 2],
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) {
        let mut lo = from;
        // After the first piece the rest of the gap starts where that piece ended.
        let mut at = gap_start;
        while lo < end {
            // `lo < end` here, and every bound below is above `lo`: no difference is
            // negative, and `n ≥ 1`, so the loop ends.
            let left = end.saturating_sub(lo);
            let (slot_now, n) = if unexplained[0] > 0 {
                (RING_FULL_SLOT, left.min(unexplained[0]))
            } else if unexplained[1] > 0 {
                (OVERSIZED_SLOT, left.min(unexplained[1]))
            } else if lo < self.resume_floor {
                (self.resume_slot(), end.min(self.resume_floor).saturating_sub(lo))
            } else if lo < self.restart_floor {
                (slot(LossCause::ShipperRestart), end.min(self.restart_floor).saturating_sub(lo))
            } else {
                (slot(LossCause::Unknown), left)
            };
            if let Some(u) = unexplained.get_mut(slot_now) {
                u.shrink(n);
            }
            self.declare(at, lo, lo.saturating_add(n), slot_now, 0, now, out, ids);
            lo = lo.saturating_add(n);
            at = lo;
        }
    }

    /// The epoch ended: settle everything below the last `attempted_seq`, then emit the
    /// explicitly unknown tail above it. The tracker takes no more input.
    pub fn close_epoch(&mut self, now: u64, out: &mut Vec<LossInterval>, ids: &mut u64) {
        if self.closed {
            return;
        }
        self.closed = true;
        let hb = self.hb.unwrap_or_default();
        self.settle(&hb, now, now, out, ids);
        let from = self.high.max(hb.attempted);
        ids.inc();
        out.push(LossInterval {
            id: *ids,
            stream: self.key,
            first_seq: from,
            last_seq: u64::MAX,
            count: None,
            cause: LossCause::Unknown.code(),
            reason: 0,
            from_node_ns: hb.snapshot_node_ns,
            to_node_ns: 0,
            decided_at_ns: now,
        });
    }

    /// Declares `[lo, hi)` of the gap at `gap_start` lost with the cause in `slot`.
    #[allow(clippy::too_many_arguments, reason = "internal; the gap split needs all of it")]
    fn declare(
        &mut self,
        gap_start: u64,
        lo: u64,
        hi: u64,
        cause_slot: usize,
        reason: u16,
        now: u64,
        out: &mut Vec<LossInterval>,
        ids: &mut u64,
    ) {
        let Some(gap) = self.gaps.remove(&gap_start) else { return };
        if gap_start < lo {
            self.gaps.insert(gap_start, Gap { end: lo, ..gap });
        }
        if hi < gap.end {
            self.gaps.insert(hi, gap);
        }
        let n = hi.saturating_sub(lo);
        self.pending.shrink(n);
        if cause_slot == PRIOR_SLOT {
            // Not loss: counted, remembered for revival, no loss interval.
            self.counts.prior_instance.grow(n);
            self.remember_lost(lo, hi, cause_slot);
            return;
        }
        if let Some(l) = self.counts.lost.get_mut(cause_slot) {
            l.grow(n);
        }
        if let Some(k) = self.kernel_attributed.get_mut(cause_slot) {
            k.grow(n);
        }
        self.remember_lost(lo, hi, cause_slot);
        out.push(self.interval(ids, (lo, hi), cause_slot, reason, (gap.lo_ts, gap.hi_ts), now));
    }

    /// The loss interval `[lo, hi)` with the cause of `cause_slot`, numbered from `ids`.
    fn interval(
        &self,
        ids: &mut u64,
        (lo, hi): (u64, u64),
        cause_slot: usize,
        reason: u16,
        (from_node_ns, to_node_ns): (u64, u64),
        now: u64,
    ) -> LossInterval {
        ids.inc();
        let cause = LossCause::from_cause_slot(cause_slot).unwrap_or(LossCause::Unknown);
        LossInterval {
            id: *ids,
            stream: self.key,
            first_seq: lo,
            // `lo < hi` for every interval declared.
            last_seq: hi.saturating_sub(1),
            count: Some(hi.saturating_sub(lo)),
            cause: cause.code(),
            reason,
            from_node_ns,
            to_node_ns,
            decided_at_ns: now,
        }
    }

    /// Where seqs below the resume floor that nothing else explains are counted.
    fn resume_slot(&self) -> usize {
        if self.resume_crash { slot(LossCause::AggregatorCrash) } else { PRIOR_SLOT }
    }

    fn remember_lost(&mut self, lo: u64, hi: u64, cause_slot: usize) {
        if self.recent_lost.len() >= self.limits.max_recent_lost {
            self.recent_lost.remove(0);
        }
        let slot_u8 = u8::try_from(cause_slot).unwrap_or(u8::MAX);
        self.recent_lost.push(LostRange { start: lo, end: hi, slot: slot_u8 });
    }

    fn enforce_gap_cap(&mut self, now: u64, out: &mut Vec<LossInterval>, ids: &mut u64) {
        while self.gaps.len() > self.limits.max_gaps {
            let Some((&start, &gap)) = self.gaps.iter().next() else { break };
            self.counts.gaps_evicted.inc();
            self.declare(start, start, gap.end, slot(LossCause::Unknown), 0, now, out, ids);
        }
        self.update_watermark();
    }

    fn update_watermark(&mut self) {
        let candidate = match self.gaps.values().next() {
            Some(first) => first.lo_ts,
            None => match self.hb {
                // Idle: everything the kernel attempted is resolved, so the stream is
                // known through the heartbeat's snapshot.
                Some(hb) if self.high >= hb.attempted => self.ts_high.max(hb.snapshot_node_ns),
                _ => self.ts_high,
            },
        };
        self.wm_ns = self.wm_ns.max(candidate);
    }
}
