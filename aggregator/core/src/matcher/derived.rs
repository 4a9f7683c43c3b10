//! Loss-aware derived numbers of final collectives (issue 25): per op kind, kernel
//! duration, start skew and bus bandwidth — observed only from ops whose every rank's
//! kernel start and completion frames arrived (complete timing) — beside the count of
//! ops decided, so that `complete ÷ decided` (the coverage) says how much of the work the
//! histograms describe. When a congested P0 ring drops the frames of slow ops, the
//! histograms lean fast; the coverage shows by how much they could. Ranks whose
//! completion was inferred (their frames lost) are counted apart, never timed. And
//! every final op's time from first sight to final verdict.
//!
//! Pure: observed by the matcher when an op becomes final (once per op), read by the
//! aggregator's `/metrics`. Not kept in snapshots (a restart starts afresh, as
//! Prometheus expects of counters and histograms).

use proto_flat::codes::{DType, Op, WireEnum};

/// Duration and skew bucket bounds (seconds).
pub const SECONDS_BOUNDS: [f64; 16] =
    [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];
/// Bus-bandwidth bucket bounds (bytes per second: 100 MB/s .. 1 TB/s).
pub const BUSBW_BOUNDS: [f64; 13] = [1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11, 2.5e11, 5e11, 1e12];
/// Time-to-final bucket bounds (seconds).
pub const TO_FINAL_BOUNDS: [f64; 13] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0];

/// Op kinds with figures: the collective op codes 1..=10; index 0 holds unknown codes.
pub const OP_KINDS: usize = 11;

/// A fixed-bound histogram: counts per bound (not cumulative), one above the last.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hist {
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Hist {
    fn observe(&mut self, bounds: &[f64], v: f64) {
        let slots = bounds.len().saturating_add(1);
        if self.counts.len() != slots {
            self.counts = vec![0; slots];
        }
        let i = bounds.iter().position(|&le| v <= le).unwrap_or(bounds.len());
        if let Some(c) = self.counts.get_mut(i) {
            *c = c.saturating_add(1);
        }
        self.sum += v;
        self.count = self.count.saturating_add(1);
    }

    /// (upper bound, cumulative count), ascending, without `+Inf`.
    #[must_use]
    pub fn cumulative(&self, bounds: &[f64]) -> Vec<(f64, u64)> {
        let mut n = 0u64;
        bounds
            .iter()
            .enumerate()
            .map(|(i, &le)| {
                n = n.saturating_add(self.counts.get(i).copied().unwrap_or(0));
                (le, n)
            })
            .collect()
    }

    /// The mean observation (`None` when empty).
    #[must_use]
    pub fn mean(&self) -> Option<f64> {
        #[allow(clippy::cast_precision_loss, reason = "a mean for a dashboard or a test")]
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// One op kind's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpFigures {
    /// Ops that became final.
    pub decided: u64,
    /// Of those, ops with complete timing (every participant's kernel start and
    /// completion arrived): the only ones in the histograms.
    pub complete: u64,
    /// Rank verdicts of final ops, and those whose completion was inferred.
    pub ranks_decided: u64,
    pub ranks_inferred: u64,
    /// Per rank of a complete op: kernel start to completion on its node's own clock.
    pub duration: Hist,
    /// Per complete op: latest minus earliest kernel start, in cluster time.
    pub skew: Hist,
    /// Per rank of a complete op with a known size: bus bandwidth (nccl-tests).
    pub busbw: Hist,
    /// Per final op: first sight to final verdict (aggregator time).
    pub time_to_final: Hist,
}

impl OpFigures {
    /// `complete ÷ decided` (`None` before any op was decided).
    #[must_use]
    pub fn coverage(&self) -> Option<f64> {
        #[allow(clippy::cast_precision_loss, reason = "a ratio")]
        (self.decided > 0).then(|| self.complete as f64 / self.decided as f64)
    }
}

/// All op kinds' figures.
#[derive(Debug, Clone)]
pub struct Derived {
    pub by_op: Vec<OpFigures>,
}

impl PartialEq for Derived {
    /// Figures of this process, not state (snapshots leave them out): any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Default for Derived {
    fn default() -> Self {
        Derived { by_op: vec![OpFigures::default(); OP_KINDS] }
    }
}

/// One rank's timing facts, as the matcher holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankTiming {
    /// Kernel start and completion on the node's clock (0: not seen).
    pub started_node_ns: u64,
    pub completed_node_ns: u64,
    /// Kernel start in cluster time (meaningful when `started_node_ns > 0`).
    pub started_cluster_ns: i64,
    pub inferred: bool,
}

/// A final op, as [`Derived::observe`] reads it.
#[derive(Debug, Clone, Copy)]
pub struct FinalOp<'a> {
    pub op: u8,
    pub dtype: u8,
    pub count: u64,
    pub nranks: u32,
    /// One per participant, in order; a participant none of whose frames arrived is a
    /// `RankTiming::default()`.
    pub ranks: &'a [RankTiming],
    pub first_seen_ns: u64,
    pub final_ns: u64,
}

/// The nccl-tests bus-bandwidth factor and size for `op` over `n` ranks: `busbw =
/// bytes × factor / time`, where NCCL's `count` is per rank for all-gather,
/// reduce-scatter and all-to-all (their total size is `count × n`) and the whole buffer
/// for all-reduce, broadcast and reduce. `None` for ops nccl-tests gives no bus
/// bandwidth (gather, scatter, barrier, all-to-allv, unknown).
#[must_use]
pub fn busbw_bytes(op: Op, bytes: f64, n: u32) -> Option<f64> {
    if n == 0 {
        return None;
    }
    let n = f64::from(n);
    match op {
        // algbw = bytes / t; busbw = algbw × 2(n−1)/n.
        Op::AllReduce => Some(bytes * 2.0 * (n - 1.0) / n),
        // size = count × n; busbw = (size / t) × (n−1)/n = count × (n−1) / t.
        Op::AllGather | Op::ReduceScatter | Op::AllToAll => Some(bytes * (n - 1.0)),
        Op::Broadcast | Op::Reduce => Some(bytes),
        _ => None,
    }
}

impl Derived {
    /// The figures of op code `op` (unknown codes share index 0).
    #[must_use]
    pub fn of(&self, op: u8) -> Option<&OpFigures> {
        self.by_op.get(index(op))
    }

    /// Name of index `i`'s op kind (`unknown` for 0).
    #[must_use]
    pub fn name(i: usize) -> &'static str {
        u8::try_from(i).ok().filter(|&c| c > 0).and_then(|c| Op::from_code(c).name()).unwrap_or("unknown")
    }

    /// One op that became final (called once per op).
    pub fn observe(&mut self, f: &FinalOp<'_>) {
        let Some(fig) = self.by_op.get_mut(index(f.op)) else { return };
        fig.decided = fig.decided.saturating_add(1);
        let ranks = u64::try_from(f.ranks.len()).unwrap_or(u64::MAX);
        fig.ranks_decided = fig.ranks_decided.saturating_add(ranks);
        let inferred = f.ranks.iter().filter(|r| r.inferred).count();
        fig.ranks_inferred = fig.ranks_inferred.saturating_add(u64::try_from(inferred).unwrap_or(u64::MAX));
        #[allow(clippy::cast_precision_loss, reason = "seconds")]
        fig.time_to_final.observe(&TO_FINAL_BOUNDS, f.final_ns.saturating_sub(f.first_seen_ns) as f64 / 1e9);
        let timed = |r: &RankTiming| !r.inferred && r.started_node_ns > 0 && r.completed_node_ns > r.started_node_ns;
        if f.ranks.is_empty() || !f.ranks.iter().all(timed) {
            return;
        }
        fig.complete = fig.complete.saturating_add(1);
        let elem = DType::from_code(f.dtype).bytes();
        #[allow(clippy::cast_precision_loss, reason = "bytes for a bandwidth")]
        let bus =
            elem.and_then(|e| busbw_bytes(Op::from_code(f.op), (f.count.saturating_mul(e)) as f64, f.nranks.max(1)));
        for r in f.ranks {
            let ns = r.completed_node_ns.saturating_sub(r.started_node_ns);
            #[allow(clippy::cast_precision_loss, reason = "seconds")]
            let s = ns as f64 / 1e9;
            fig.duration.observe(&SECONDS_BOUNDS, s);
            if let Some(b) = bus {
                fig.busbw.observe(&BUSBW_BOUNDS, b / s);
            }
        }
        // Per-channel kernel starts (graph replays) carry no rank-level start in cluster
        // time (0): no skew then.
        if f.ranks.iter().all(|r| r.started_cluster_ns != 0) {
            let starts = f.ranks.iter().map(|r| r.started_cluster_ns);
            let (lo, hi) = (starts.clone().min().unwrap_or(0), starts.max().unwrap_or(0));
            #[allow(clippy::cast_precision_loss, reason = "seconds")]
            fig.skew.observe(&SECONDS_BOUNDS, hi.saturating_sub(lo).max(0) as f64 / 1e9);
        }
    }
}

fn index(op: u8) -> usize {
    if (1..=10).contains(&op) { usize::from(op) } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(start: u64, end: u64, cluster: i64) -> RankTiming {
        RankTiming { started_node_ns: start, completed_node_ns: end, started_cluster_ns: cluster, inferred: false }
    }

    #[test]
    fn only_complete_ops_are_timed_and_inferred_ranks_are_counted_apart() {
        let mut d = Derived::default();
        // An 8-rank all-reduce of 64 MiB (bfloat16), 10 ms on every rank, starts 2 ms apart.
        let ranks: Vec<RankTiming> = (0..8).map(|i| rank(1_000, 10_001_000, 5 + i * 2_000_000 / 7)).collect();
        let f = FinalOp {
            op: Op::AllReduce.code(),
            dtype: DType::Bfloat16.code(),
            count: 32 << 20,
            nranks: 8,
            ranks: &ranks,
            first_seen_ns: 1_000_000_000,
            final_ns: 1_500_000_000,
        };
        d.observe(&f);
        // The same op with one rank's completion inferred: decided, not timed.
        let mut lossy = ranks.clone();
        lossy[3] = RankTiming { inferred: true, completed_node_ns: 0, ..lossy[3] };
        d.observe(&FinalOp { ranks: &lossy, ..f });
        let a = d.of(Op::AllReduce.code()).unwrap();
        assert_eq!((a.decided, a.complete, a.ranks_decided, a.ranks_inferred), (2, 1, 16, 1));
        assert_eq!(a.coverage(), Some(0.5));
        assert_eq!((a.duration.count, a.skew.count, a.busbw.count, a.time_to_final.count), (8, 1, 8, 2));
        assert!((a.duration.mean().unwrap() - 0.01).abs() < 1e-12);
        // busbw = 64 MiB × 2 × 7/8 / 10 ms.
        let want = f64::from(64u32 << 20) * 2.0 * 7.0 / 8.0 / 0.01;
        assert!((a.busbw.mean().unwrap() - want).abs() < 1.0, "{:?}", a.busbw.mean());
        assert!((a.skew.mean().unwrap() - 0.002).abs() < 1e-12);
        assert!((a.time_to_final.mean().unwrap() - 0.5).abs() < 1e-12);
        // 10 ms lands at le=0.01, 2 ms at le=0.0025.
        assert_eq!(a.duration.cumulative(&SECONDS_BOUNDS)[6], (0.01, 8));
        assert_eq!(a.duration.cumulative(&SECONDS_BOUNDS)[5], (0.005, 0));
        assert_eq!(a.skew.cumulative(&SECONDS_BOUNDS)[4], (0.0025, 1));
        assert_eq!(Derived::name(1), "all_reduce");
        assert_eq!(Derived::name(0), "unknown");
    }

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        assert_eq!(busbw_bytes(Op::AllReduce, 8.0, 4), Some(12.0));
        assert_eq!(busbw_bytes(Op::AllGather, 8.0, 4), Some(24.0));
        assert_eq!(busbw_bytes(Op::Broadcast, 8.0, 4), Some(8.0));
        assert_eq!(busbw_bytes(Op::Barrier, 8.0, 4), None);
        assert_eq!(busbw_bytes(Op::AllReduce, 8.0, 0), None);
        // A rank missing entirely is no timing either; an unknown dtype is timed without
        // a bandwidth.
        let mut d = Derived::default();
        let ranks = [rank(1, 5_000_001, 1), RankTiming::default()];
        let f = FinalOp { op: 2, dtype: 0, count: 1, nranks: 2, ranks: &ranks, first_seen_ns: 0, final_ns: 0 };
        d.observe(&f);
        let one = [rank(1, 5_000_001, 1)];
        d.observe(&FinalOp { ranks: &one, nranks: 1, ..f });
        let g = d.of(2).unwrap();
        assert_eq!((g.decided, g.complete, g.duration.count, g.busbw.count), (2, 1, 1, 0));
        d.observe(&FinalOp { op: 200, ..f });
        assert_eq!(d.of(200).unwrap().decided, 1);
    }
}
