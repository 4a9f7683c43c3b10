//! Counters that never overflow: every `+ 1` on a statistic or a count goes through here,
//! saturating (the core forbids unchecked arithmetic, `clippy::arithmetic_side_effects`).
//! A u64 counted once per event cannot reach its limit in practice; saturating says so
//! in the type instead of in a comment at each site.
//!
//! `grow` and `shrink` are also used on the accounting's own quantities (pending seqs,
//! unexplained kernel drops, what a loss record has left to place), where reaching a
//! limit means an invariant broke: debug builds — the tests and the fuzz targets —
//! assert it, so saturation cannot hide a wrong count there.

/// Saturating increments of a counter.
pub(crate) trait Tally {
    /// Adds one.
    fn inc(&mut self);
    /// Adds `n`.
    fn grow(&mut self, n: Self);
    /// Takes `n` away, stopping at zero.
    fn shrink(&mut self, n: Self);
}

impl Tally for u64 {
    #[inline]
    fn inc(&mut self) {
        *self = self.saturating_add(1);
    }
    #[inline]
    fn grow(&mut self, n: u64) {
        debug_assert!(self.checked_add(n).is_some(), "count overflow: {self} + {n}");
        *self = self.saturating_add(n);
    }
    #[inline]
    fn shrink(&mut self, n: u64) {
        debug_assert!(*self >= n, "count underflow: {self} - {n}");
        *self = self.saturating_sub(n);
    }
}
