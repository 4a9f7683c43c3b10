//! Batch dedup: which `(node, shipper_session, batch_seq)` the aggregator has settled.
//!
//! A shipper resends every unacked batch after a reconnect, so the same batch may arrive
//! twice; it must be acked again (`duplicate`) but applied once. A batch is *settled*
//! when it was applied, or when the shipper reported it lost (evicted from its spool,
//! nacked, unflushed at shutdown — loss records carry `(shipper_session, batch_seq)`).
//!
//! Per session the state is a floor (every `batch_seq ≤ floor` settled; batch_seq starts
//! at 1) plus the settled seqs above it, at most `window` of them. A batch above the floor
//! that would overflow the window is refused (`nack dedup_window_full`, which the shipper
//! turns into loss records) rather than applied without being remembered; the floor is
//! never forced past an unseen batch, because that batch, arriving later, would be acked
//! as a duplicate and lost silently. Sessions per node are capped too: the least recently
//! used old session is forgotten (counted), never the one being admitted.
//!
//! Method groups: inputs [`BatchDedup::check`] then [`BatchDedup::mark_applied`] (a batch
//! arrived and was applied; [`BatchDedup::admit`] does both) and
//! [`BatchDedup::settle_lost`] (the shipper reported it lost); getters
//! [`BatchDedup::is_settled`], [`BatchDedup::stats`]. Pure: no clock, no I/O; part of the
//! core's snapshot.

use std::collections::{BTreeMap, BTreeSet};

use rkyv::{Archive, Deserialize, Serialize};

use crate::records::NodeId;

/// Dedup limits.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupConfig {
    /// Settled batch_seqs remembered above a session's floor (the shipper's unacked
    /// window: its spool holds at most a few thousand 64 KiB batches).
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

/// Counters (exported as metrics by the aggregator).
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
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
struct Session {
    floor: u64,
    above: BTreeSet<u64>,
    /// Settled by a loss report (a lost batch has one report per stream it carried, so
    /// later reports for it must still apply). The newest `window` are kept.
    lost: BTreeSet<u64>,
    last_used: u64,
}

impl Session {
    fn settled(&self, seq: u64) -> bool {
        seq <= self.floor || self.above.contains(&seq)
    }

    fn settle(&mut self, seq: u64) {
        if seq == self.floor + 1 {
            self.floor = seq;
            while self.above.remove(&(self.floor + 1)) {
                self.floor += 1;
            }
        } else if seq > self.floor {
            self.above.insert(seq);
        }
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
        } else if batch_seq != s.floor + 1 && s.above.len() >= window {
            Admit::WindowFull
        } else {
            Admit::New
        };
        match verdict {
            Admit::New => {}
            Admit::Duplicate => self.stats.duplicates += 1,
            Admit::WindowFull => self.stats.window_full += 1,
        }
        verdict
    }

    /// A batch [`BatchDedup::check`] called `New` was applied.
    pub fn mark_applied(&mut self, node: NodeId, session: u64, batch_seq: u64) {
        let s = self.session(node, session);
        if !s.settled(batch_seq) {
            s.settle(batch_seq);
            self.stats.new += 1;
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
    /// A loss report above a full window still settles nothing beyond the window (the
    /// loss is applied; only the floor's progress waits), so it is always applied.
    pub fn settle_lost(&mut self, node: NodeId, session: u64, batch_seq: u64) -> bool {
        let window = self.config.window as usize;
        let s = self.session(node, session);
        if s.lost.contains(&batch_seq) {
            return true;
        }
        if s.settled(batch_seq) {
            self.stats.lost_but_applied += 1;
            return false;
        }
        if batch_seq == s.floor + 1 || s.above.len() < window {
            s.settle(batch_seq);
        }
        s.lost.insert(batch_seq);
        if s.lost.len() > window {
            s.lost.pop_first();
            self.stats.lost_marks_forgotten += 1;
        }
        true
    }

    fn session(&mut self, node: NodeId, session: u64) -> &mut Session {
        self.uses += 1;
        let key = (node, session);
        if !self.sessions.contains_key(&key) {
            let of_node: Vec<(u64, u64)> =
                self.sessions.range((node, 0)..=(node, u64::MAX)).map(|(k, s)| (s.last_used, k.1)).collect();
            if of_node.len() >= self.config.sessions_per_node.max(1) as usize
                && let Some(&(_, oldest)) = of_node.iter().min()
            {
                self.sessions.remove(&(node, oldest));
                self.stats.sessions_forgotten += 1;
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
    fn resent_batches_are_duplicates_and_the_floor_advances_over_gaps_once_filled() {
        let mut d = BatchDedup::new(DedupConfig::default());
        assert_eq!(d.admit(N, 1, 1), Admit::New);
        assert_eq!(d.admit(N, 1, 3), Admit::New);
        assert_eq!(d.admit(N, 1, 1), Admit::Duplicate);
        assert_eq!(d.admit(N, 1, 3), Admit::Duplicate);
        assert!(!d.is_settled(N, 1, 2));
        assert_eq!(d.admit(N, 1, 2), Admit::New);
        assert!(d.sessions[&(N, 1)].above.is_empty(), "floor swallowed 2 and 3");
        assert_eq!(d.sessions[&(N, 1)].floor, 3);
        assert_eq!(d.admit(N, 2, 1), Admit::New, "another session is another key");
        assert_eq!(d.admit(NodeId(8), 1, 1), Admit::New, "another node too");
        assert_eq!((d.stats().new, d.stats().duplicates), (5, 2));
    }

    #[test]
    fn a_full_window_refuses_instead_of_forgetting() {
        let mut d = BatchDedup::new(DedupConfig { window: 3, sessions_per_node: 4 });
        // Batch 1 never arrives; 2..=4 fill the window.
        for seq in 2..=4 {
            assert_eq!(d.admit(N, 1, seq), Admit::New);
        }
        assert_eq!(d.admit(N, 1, 5), Admit::WindowFull);
        assert_eq!(d.admit(N, 1, 5), Admit::WindowFull, "still not applied, still refused");
        // The missing batch arrives: the floor jumps, the window empties, 5 is admitted.
        assert_eq!(d.admit(N, 1, 1), Admit::New);
        assert_eq!(d.admit(N, 1, 5), Admit::New);
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
        assert_eq!(d.sessions[&(N, 1)].floor, 3);
        // Batch 3 was applied, then evicted unacked: the report must not count it lost.
        assert!(!d.settle_lost(N, 1, 3));
        assert_eq!(d.stats().lost_but_applied, 1);
        // A resend of a batch reported lost is a duplicate (its frames are counted lost).
        assert_eq!(d.admit(N, 1, 2), Admit::Duplicate);
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
                proptest::prop_assert!(s.above.len() <= 8);
                proptest::prop_assert!((1..=s.floor).all(|q| applied.contains(&q)));
                proptest::prop_assert!(!s.above.contains(&(s.floor + 1)));
            }
        }
    }
}
