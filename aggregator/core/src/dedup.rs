//! Batch dedup: which `(node, shipper_session, batch_seq)` the aggregator has settled.
//!
//! A shipper resends every unacked batch after a reconnect, so the same batch may arrive
//! twice; it must be acked again (`duplicate`) but applied once. A batch is *settled*
//! when it was applied, or when the shipper reported it lost (evicted from its spool,
//! nacked, unflushed at shutdown — loss records carry `(shipper_session, batch_seq)`).
//!
//! Per session the state is the highest settled `batch_seq` (`high`; batch_seqs start
//! at 1) and the *holes* below it — the seqs not settled yet — as inclusive ranges, at most
//! `window` of them. A batch that would open a new hole beyond that is refused
//! (`nack dedup_window_full`, which the shipper turns into loss records) rather than
//! applied without being remembered; a hole is never closed over an unseen batch, because
//! that batch, arriving later, would be acked as a duplicate and lost silently.
//!
//! Holes only persist for batches that will never come; the shipper's `resume` at every
//! connection ([`BatchDedup::resume`]) says which those are: everything below its
//! `next_batch_seq` that it does not hold left its spool for good. Resume closes those
//! holes, so the window fills only from real disorder, never from an aggregator restart
//! (issue 16: a restarted instance used to wait forever for batches the previous one
//! had acked). Batches settled by a resume were not applied here, so a shipper's loss
//! report for one of them is applied. Sessions per node are capped too: the least
//! recently used old session is forgotten (counted), never the one being admitted.
//!
//! Method groups: inputs [`BatchDedup::resume`] (a connection's `resume`, before its
//! batches), [`BatchDedup::check`] then [`BatchDedup::mark_applied`] (a batch arrived and
//! was applied; [`BatchDedup::admit`] does both) and [`BatchDedup::settle_lost`] (the
//! shipper reported it lost); getters [`BatchDedup::is_settled`], [`BatchDedup::stats`].
//! Pure: no clock, no I/O; part of the core's snapshot.

use std::collections::{BTreeMap, BTreeSet};

use rkyv::{Archive, Deserialize, Serialize};

use crate::records::NodeId;
use crate::tally::Tally;

/// Dedup limits.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupConfig {
    /// Holes (ranges of unsettled batch_seqs below the highest settled one) remembered
    /// per session; a batch that would open one more is refused. Resume keeps holes to
    /// what the shipper still holds, so only real disorder fills this.
    pub window: u32,
    /// Shipper sessions remembered per node (restarts open new ones).
    pub sessions_per_node: u32,
}

impl Default for DedupConfig {
    fn default() -> Self {
        Self { window: 8192, sessions_per_node: 4 }
    }
}

/// What to do with an arriving batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Not seen before: apply it, then ack `applied`. It is now settled.
    New,
    /// Already settled: ack `duplicate`, do not apply.
    Duplicate,
    /// The session's window is full: nack `dedup_window_full`, do not apply.
    WindowFull,
}

/// Counters (the aggregator serves `resumes`, `resume_settled` and `window_full` in
/// `/v1/ingest` and `/metrics`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DedupStats {
    pub new: u64,
    pub duplicates: u64,
    pub window_full: u64,
    /// Loss reports for batches already applied (the report is ignored: the frames were
    /// delivered).
    pub lost_but_applied: u64,
    /// Lost-batch marks dropped by the window cap (a later report for such a batch
    /// would be taken for one about an applied batch and ignored).
    pub lost_marks_forgotten: u64,
    pub sessions_forgotten: u64,
    /// `resume` messages applied.
    pub resumes: u64,
    /// Batches a resume settled that this instance had not seen (acked by another
    /// instance, or reported lost).
    pub resume_settled: u64,
    /// Resumes that showed batches this instance never saw (a restart forgot them).
    pub resumes_with_gap: u64,
    /// Resume ranges forgotten by the per-session cap (a loss report for a batch in one
    /// would then be taken for one about an applied batch and ignored).
    pub resumed_ranges_forgotten: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
struct Session {
    /// Highest settled batch_seq (0: none).
    high: u64,
    /// Unsettled batch_seqs below `high`: start → end, inclusive, disjoint.
    holes: BTreeMap<u64, u64>,
    /// Settled by a loss report (a lost batch has one report per stream it carried, so
    /// later reports for it must still apply). The newest `window` are kept.
    lost: BTreeSet<u64>,
    /// Inclusive ranges a resume settled without this instance applying them (start →
    /// end): loss reports for batches in them are applied. The lowest are forgotten
    /// (counted) beyond `window` ranges — the same bound as the holes they came from: a
    /// partition that evicted every other batch leaves one range per eviction, and
    /// forgetting one turns its loss report into `unknown` loss.
    resumed: BTreeMap<u64, u64>,
    last_used: u64,
}

impl Session {
    /// The hole containing `seq`, as `(start, end)`.
    fn hole_of(&self, seq: u64) -> Option<(u64, u64)> {
        self.holes.range(..=seq).next_back().filter(|(_, e)| seq <= **e).map(|(s, e)| (*s, *e))
    }

    fn settled(&self, seq: u64) -> bool {
        seq <= self.high && self.hole_of(seq).is_none()
    }

    /// Whether settling `seq` keeps the holes within `window` (a new hole above `high`,
    /// or a split of one, each adds one).
    fn fits(&self, seq: u64, window: usize) -> bool {
        let adds = if seq > self.high {
            seq > self.high.saturating_add(1)
        } else {
            self.hole_of(seq).is_some_and(|(s, e)| s < seq && seq < e)
        };
        !adds || self.holes.len() < window
    }

    fn settle(&mut self, seq: u64) {
        if seq > self.high {
            if seq > self.high.saturating_add(1) {
                // `high + 1 < seq`: neither end overflows.
                self.holes.insert(self.high.saturating_add(1), seq.saturating_sub(1));
            }
            self.high = seq;
        } else if let Some((s, e)) = self.hole_of(seq) {
            self.holes.remove(&s);
            if s < seq {
                self.holes.insert(s, seq.saturating_sub(1));
            }
            if seq < e {
                self.holes.insert(seq.saturating_add(1), e);
            }
        }
    }

    fn was_resumed(&self, seq: u64) -> bool {
        self.resumed.range(..=seq).next_back().is_some_and(|(_, &end)| seq <= end)
    }
}

/// The dedup state. See the module docs.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct BatchDedup {
    config: DedupConfig,
    sessions: BTreeMap<(NodeId, u64), Session>,
    uses: u64,
    stats: DedupStats,
}

impl BatchDedup {
    /// Empty state.
    #[must_use]
    pub fn new(config: DedupConfig) -> Self {
        Self { config, sessions: BTreeMap::new(), uses: 0, stats: DedupStats::default() }
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &DedupStats {
        &self.stats
    }

    /// Its maps with their sizes and caps (see [`crate::bounds`]), for `max_nodes` nodes:
    /// sessions (per node), and the holes, loss marks and resumed ranges of all of them
    /// (each at most `window` per session).
    #[must_use]
    pub fn map_sizes(&self, max_nodes: usize) -> Vec<crate::MapSize> {
        let sessions_cap = max_nodes.saturating_mul(self.config.sessions_per_node as usize);
        let per_session = sessions_cap.saturating_mul(self.config.window as usize);
        let sum = |f: fn(&Session) -> usize| self.sessions.values().map(f).sum::<usize>();
        vec![
            crate::MapSize::new("dedup.sessions", self.sessions.len(), sessions_cap),
            crate::MapSize::new("dedup.holes", sum(|s| s.holes.len()), per_session),
            crate::MapSize::new("dedup.lost", sum(|s| s.lost.len()), per_session),
            crate::MapSize::new("dedup.resumed", sum(|s| s.resumed.len()), per_session),
        ]
    }

    /// Whether the batch is settled (applied or reported lost).
    #[must_use]
    pub fn is_settled(&self, node: NodeId, session: u64, batch_seq: u64) -> bool {
        self.sessions.get(&(node, session)).is_some_and(|s| s.settled(batch_seq))
    }

    /// A batch arrived: what to do with it. Nothing is settled yet — call
    /// [`BatchDedup::mark_applied`] once it was applied.
    pub fn check(&mut self, node: NodeId, session: u64, batch_seq: u64) -> Admit {
        let window = self.config.window as usize;
        let s = self.session(node, session);
        let verdict = if s.settled(batch_seq) {
            Admit::Duplicate
        } else if !s.fits(batch_seq, window) {
            Admit::WindowFull
        } else {
            Admit::New
        };
        match verdict {
            Admit::New => {}
            Admit::Duplicate => self.stats.duplicates.inc(),
            Admit::WindowFull => self.stats.window_full.inc(),
        }
        verdict
    }

    /// A batch [`BatchDedup::check`] called `New` was applied.
    pub fn mark_applied(&mut self, node: NodeId, session: u64, batch_seq: u64) {
        let s = self.session(node, session);
        if !s.settled(batch_seq) {
            s.settle(batch_seq);
            self.stats.new.inc();
        }
    }

    /// `check`, then `mark_applied` when new (for callers that apply unconditionally).
    pub fn admit(&mut self, node: NodeId, session: u64, batch_seq: u64) -> Admit {
        let verdict = self.check(node, session, batch_seq);
        if verdict == Admit::New {
            self.mark_applied(node, session, batch_seq);
        }
        verdict
    }

    /// The shipper reported the batch lost. Returns whether the loss report should be
    /// applied: `false` when the batch was applied already (a sent-but-unacked batch the
    /// shipper later evicted) — its frames were delivered, so counting them lost too
    /// would break conservation.
    ///
    /// A loss report that would overflow the window still settles nothing (the loss is
    /// applied; the hole waits), so it is always applied. A report for a batch a resume
    /// settled is applied: this instance never applied that batch.
    pub fn settle_lost(&mut self, node: NodeId, session: u64, batch_seq: u64) -> bool {
        let window = self.config.window as usize;
        let s = self.session(node, session);
        if s.lost.contains(&batch_seq) {
            return true;
        }
        if s.settled(batch_seq) && !s.was_resumed(batch_seq) {
            self.stats.lost_but_applied.inc();
            return false;
        }
        if s.fits(batch_seq, window) {
            s.settle(batch_seq);
        }
        s.lost.insert(batch_seq);
        if s.lost.len() > window {
            s.lost.pop_first();
            self.stats.lost_marks_forgotten.inc();
        }
        true
    }

    /// A connection's `resume` (before any of its batches): every batch_seq below
    /// `next_batch_seq` not in `held` (inclusive ranges) will never be sent again, so it
    /// is settled here; held ones stay expected. Returns how many batches this settled
    /// that this instance had not seen (0 when it saw everything: a plain reconnect).
    pub fn resume(&mut self, node: NodeId, session: u64, next_batch_seq: u64, held: &[(u64, u64)]) -> u64 {
        self.stats.resumes.inc();
        let window = self.config.window as usize;
        let through = next_batch_seq.saturating_sub(1);
        let s = self.session(node, session);
        // Held ranges sorted and merged (a peer's list is not trusted to be either).
        let mut held: Vec<(u64, u64)> = held.iter().copied().filter(|(x, y)| x <= y).collect();
        held.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(held.len());
        for (x, y) in held {
            match merged.last_mut() {
                Some(last) if x <= last.1.saturating_add(1) => last.1 = last.1.max(y),
                _ => merged.push((x, y)),
            }
        }
        // Candidate holes: the old ones, and everything between `high` and `through`.
        let mut candidates: Vec<(u64, u64)> = s.holes.iter().map(|(a, b)| (*a, *b)).collect();
        if through > s.high {
            candidates.push((s.high.saturating_add(1), through));
            s.high = through;
        }
        // Bounded: at most one hole per held range plus one per candidate.
        let mut holes = BTreeMap::new();
        let mut settled_now = 0u64;
        let mut newly_resumed = Vec::new();
        for (a, b) in candidates {
            // Keep the parts of [a, b] that are held; the rest is settled by the resume.
            let mut at = Some(a);
            for &(x, y) in merged.iter().filter(|&&(x, y)| x <= b && a <= y) {
                let (lo, hi) = (x.max(a), y.min(b));
                if let Some(from) = at
                    && from < lo
                {
                    newly_resumed.push((from, lo.saturating_sub(1)));
                    settled_now = settled_now.saturating_add(lo.saturating_sub(from));
                }
                holes.insert(lo, hi);
                at = hi.checked_add(1).filter(|&n| n <= b);
            }
            if let Some(from) = at {
                newly_resumed.push((from, b));
                settled_now = settled_now.saturating_add(b.saturating_sub(from).saturating_add(1));
            }
        }
        s.holes = holes;
        let mut forgotten = 0u64;
        for (a, b) in newly_resumed {
            s.resumed.insert(a, b);
            if s.resumed.len() > window.max(1) {
                s.resumed.pop_first();
                forgotten.inc();
            }
        }
        self.stats.resumed_ranges_forgotten.grow(forgotten);
        self.stats.resume_settled = self.stats.resume_settled.saturating_add(settled_now);
        if settled_now > 0 {
            self.stats.resumes_with_gap.inc();
        }
        settled_now
    }

    fn session(&mut self, node: NodeId, session: u64) -> &mut Session {
        self.uses.inc();
        let key = (node, session);
        if !self.sessions.contains_key(&key) {
            let of_node: Vec<(u64, u64)> =
                self.sessions.range((node, 0)..=(node, u64::MAX)).map(|(k, s)| (s.last_used, k.1)).collect();
            if of_node.len() >= self.config.sessions_per_node.max(1) as usize
                && let Some(&(_, oldest)) = of_node.iter().min()
            {
                self.sessions.remove(&(node, oldest));
                self.stats.sessions_forgotten.inc();
            }
        }
        let uses = self.uses;
        let s = self.sessions.entry(key).or_default();
        s.last_used = uses;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: NodeId = NodeId(7);

    #[test]
    fn resent_batches_are_duplicates_and_holes_close_once_filled() {
        let mut d = BatchDedup::new(DedupConfig::default());
        assert_eq!(d.admit(N, 1, 1), Admit::New);
        assert_eq!(d.admit(N, 1, 3), Admit::New);
        assert_eq!(d.admit(N, 1, 1), Admit::Duplicate);
        assert_eq!(d.admit(N, 1, 3), Admit::Duplicate);
        assert!(!d.is_settled(N, 1, 2));
        assert_eq!(d.admit(N, 1, 2), Admit::New);
        assert!(d.sessions[&(N, 1)].holes.is_empty(), "2 filled the only hole");
        assert_eq!(d.sessions[&(N, 1)].high, 3);
        assert_eq!(d.admit(N, 2, 1), Admit::New, "another session is another key");
        assert_eq!(d.admit(NodeId(8), 1, 1), Admit::New, "another node too");
        assert_eq!((d.stats().new, d.stats().duplicates), (5, 2));
    }

    #[test]
    fn a_full_window_refuses_instead_of_forgetting() {
        let mut d = BatchDedup::new(DedupConfig { window: 2, sessions_per_node: 4 });
        // Batches 1 and 3 never arrive: two holes fill the window.
        assert_eq!(d.admit(N, 1, 2), Admit::New);
        assert_eq!(d.admit(N, 1, 4), Admit::New);
        assert_eq!(d.admit(N, 1, 5), Admit::New, "the next seq opens no hole");
        assert_eq!(d.admit(N, 1, 7), Admit::WindowFull);
        assert_eq!(d.admit(N, 1, 7), Admit::WindowFull, "still not applied, still refused");
        // A missing batch arrives: a hole closes, 7 is admitted.
        assert_eq!(d.admit(N, 1, 1), Admit::New);
        assert_eq!(d.admit(N, 1, 7), Admit::New);
        assert_eq!(d.stats().window_full, 2);
    }

    #[test]
    fn loss_reports_settle_holes_and_are_ignored_for_applied_batches() {
        let mut d = BatchDedup::new(DedupConfig::default());
        d.admit(N, 1, 1);
        d.admit(N, 1, 3);
        // Batch 2 was evicted from the shipper's spool: its loss report settles it; it
        // carried two streams, so a second report for it applies too.
        assert!(d.settle_lost(N, 1, 2));
        assert!(d.settle_lost(N, 1, 2));
        assert!(d.sessions[&(N, 1)].holes.is_empty());
        // Batch 3 was applied, then evicted unacked: the report must not count it lost.
        assert!(!d.settle_lost(N, 1, 3));
        assert_eq!(d.stats().lost_but_applied, 1);
        // A resend of a batch reported lost is a duplicate (its frames are counted lost).
        assert_eq!(d.admit(N, 1, 2), Admit::Duplicate);
    }

    /// A partition evicted every other batch while P0/P1 batches between them stayed held:
    /// the reconnect's resume settles one range per eviction. Loss reports for all of them
    /// must still apply (with 64 remembered ranges, CI saw 11,102 bulk frames of such
    /// reports become `unknown` in the partition test).
    #[test]
    fn loss_reports_apply_for_every_range_a_fragmented_resume_settled() {
        let mut d = BatchDedup::new(DedupConfig { window: 1024, sessions_per_node: 2 });
        assert_eq!(d.admit(N, 1, 1), Admit::New);
        // Held: every even batch 2..=1000; odd ones were evicted (their reports still queued).
        let held: Vec<(u64, u64)> = (1..=500).map(|i| (2 * i, 2 * i)).collect();
        assert_eq!(d.resume(N, 1, 1001, &held), 499, "the odd batches 3..=999");
        for seq in (3..1000).step_by(2) {
            assert!(d.settle_lost(N, 1, seq), "the report for evicted batch {seq} applies");
        }
        assert_eq!(d.stats().resumed_ranges_forgotten, 0);
        assert_eq!(d.stats().lost_but_applied, 0);
        assert!(!d.settle_lost(N, 1, 1), "a report for the applied batch does not");
    }

    /// Issue 16: an aggregator restarted without state saw batch 12345 first and waited
    /// forever for 1..12344, which the previous instance had acked; after `window` more
    /// batches every batch was refused. The shipper's resume settles what it no longer
    /// holds.
    #[test]
    fn resume_settles_what_the_shipper_no_longer_holds_regression_issue_16() {
        let mut d = BatchDedup::new(DedupConfig { window: 4, sessions_per_node: 4 });
        // Fresh instance; the shipper holds 100, 102..=103 and will cut 110 next.
        assert_eq!(d.resume(N, 1, 110, &[(102, 103), (100, 100)]), 106);
        assert_eq!(d.admit(N, 1, 99), Admit::Duplicate, "acked by the previous instance");
        for seq in [100, 102, 103] {
            assert_eq!(d.admit(N, 1, seq), Admit::New, "held batch {seq} is still expected");
        }
        for seq in 110..200 {
            assert_eq!(d.admit(N, 1, seq), Admit::New, "never refused after a restart");
        }
        assert_eq!(d.stats().window_full, 0);
        // A loss report for a batch the resume settled (evicted, its report not yet
        // delivered anywhere) is applied; one for an applied batch is not.
        assert!(d.settle_lost(N, 1, 50));
        assert!(!d.settle_lost(N, 1, 150));
        // A plain reconnect to the same instance settles nothing new.
        assert_eq!(d.resume(N, 1, 200, &[]), 0);
        assert_eq!(d.stats().resumes_with_gap, 1);
        // Holes of disorder the shipper still holds stay; the rest close.
        assert_eq!(d.admit(N, 1, 203), Admit::New);
        assert_eq!(d.admit(N, 1, 206), Admit::New);
        assert_eq!(d.resume(N, 1, 210, &[(201, 201)]), 7, "200, 202, 204..=205 and 207..=209");
        assert!(!d.is_settled(N, 1, 201));
        assert!(d.is_settled(N, 1, 202) && d.is_settled(N, 1, 209));
        // A hostile list (unsorted, overlapping, reversed) cannot make overlapping holes.
        d.resume(N, 2, u64::MAX, &[(9, 5), (10, 20), (15, 30), (1, 2)]);
        let s = &d.sessions[&(N, 2)];
        assert_eq!(s.holes.iter().map(|(a, b)| (*a, *b)).collect::<Vec<_>>(), vec![(1, 2), (10, 30)]);
        assert_eq!(d.admit(N, 2, 25), Admit::New);
        assert_eq!(d.admit(N, 2, u64::MAX - 1), Admit::Duplicate);
        assert_eq!(d.admit(N, 2, u64::MAX), Admit::New, "no arithmetic overflows at the top");
    }

    #[test]
    fn old_sessions_are_forgotten_least_recently_used_first() {
        let mut d = BatchDedup::new(DedupConfig { window: 16, sessions_per_node: 2 });
        d.admit(N, 1, 1);
        d.admit(N, 2, 1);
        d.admit(N, 1, 2); // session 1 used more recently than 2
        d.admit(N, 3, 1); // forgets session 2
        assert!(d.is_settled(N, 1, 2));
        assert!(!d.is_settled(N, 2, 1));
        assert!(d.is_settled(N, 3, 1));
        assert_eq!(d.stats().sessions_forgotten, 1);
        d.admit(NodeId(9), 1, 1);
        assert_eq!(d.stats().sessions_forgotten, 1, "the cap is per node");
    }

    proptest::proptest! {
        /// Whatever the arrival order and repetition, every batch is applied exactly once
        /// (or refused while the window is full), and the state stays within its window.
        #[test]
        fn each_batch_applied_at_most_once(arrivals in proptest::collection::vec(1u64..64, 1..400)) {
            let mut d = BatchDedup::new(DedupConfig { window: 8, sessions_per_node: 2 });
            let mut applied = BTreeSet::new();
            for seq in arrivals {
                let before = d.is_settled(N, 1, seq);
                match d.admit(N, 1, seq) {
                    Admit::New => {
                        proptest::prop_assert!(!before);
                        proptest::prop_assert!(applied.insert(seq), "batch {} applied twice", seq);
                    }
                    Admit::Duplicate => proptest::prop_assert!(applied.contains(&seq)),
                    Admit::WindowFull => proptest::prop_assert!(!applied.contains(&seq)),
                }
                let s = &d.sessions[&(N, 1)];
                proptest::prop_assert!(s.holes.len() <= 8);
                // Settled ⇔ applied, for every seq.
                proptest::prop_assert!((1..64).all(|q| d.is_settled(N, 1, q) == applied.contains(&q)));
            }
        }
    }
}
