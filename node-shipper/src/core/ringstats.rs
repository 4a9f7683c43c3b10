//! What the ring reader measures at every drain, for `/metrics`: the fill each drain
//! found, the gaps between drains, and the kernel's drop bursts as the reader sees them
//! — runs of seqs missing between consecutive frames of one stream. Every event that
//! took a seq was written to the ring or counted as a kernel drop (ring full,
//! oversized), and one stream's frames are written in seq order, so a run of missing
//! seqs is a run of consecutive failed reserves: how drops cluster (a congested ring
//! loses bursts, not single frames). A burst still open when the reader last looked
//! (no frame after it yet) is not counted until one comes.
//!
//! Pure: observations in, fixed-bound histograms out ([`Buckets`]: a scan of a dozen
//! bounds per observation, no allocation on the hot path).

use ringwatch_transport::metrics::Buckets;

/// Fill at a drain, ratio of the ring.
pub const FILL_BOUNDS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 1.0];
/// Frames lost in one burst.
pub const BURST_FRAMES_BOUNDS: &[f64] = &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16_384.0, 65_536.0, 262_144.0];
/// Time between the frames either side of a burst, seconds.
pub const BURST_SECONDS_BOUNDS: &[f64] = &[0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0];
/// Time between the starts of consecutive drain passes, seconds.
pub const DRAIN_GAP_BOUNDS: &[f64] =
    &[0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];

/// The reader's ring figures (index 0: the P0 ring, 1: bulk).
#[derive(Debug, Clone, PartialEq)]
pub struct RingMetrics {
    pub fill: [Buckets; 2],
    pub burst_frames: [Buckets; 2],
    pub burst_seconds: [Buckets; 2],
    pub drain_gap: Buckets,
    /// Each ring's size, and the record bytes read from it (8-byte record headers
    /// included: how far the consumer position advanced).
    pub ring_bytes: [u32; 2],
    pub read_bytes: [u64; 2],
}

impl RingMetrics {
    #[must_use]
    pub fn new(ring_bytes: [u32; 2]) -> Self {
        let b = Buckets::new;
        RingMetrics {
            fill: [b(FILL_BOUNDS), b(FILL_BOUNDS)],
            burst_frames: [b(BURST_FRAMES_BOUNDS), b(BURST_FRAMES_BOUNDS)],
            burst_seconds: [b(BURST_SECONDS_BOUNDS), b(BURST_SECONDS_BOUNDS)],
            drain_gap: b(DRAIN_GAP_BOUNDS),
            ring_bytes,
            read_bytes: [0; 2],
        }
    }

    /// A drain pass of `ring` ended at an empty ring, having found `bytes` of records.
    #[allow(clippy::cast_precision_loss, reason = "a ratio")]
    pub fn on_drained(&mut self, ring: usize, bytes: u64) {
        let size = self.ring_bytes.get(ring).copied().unwrap_or(0).max(1);
        if let Some(f) = self.fill.get_mut(ring) {
            f.observe((bytes as f64 / f64::from(size)).min(1.0));
        }
    }

    /// A burst of `frames` missing seqs on `ring`, `ns` between the frames either side.
    #[allow(clippy::cast_precision_loss, reason = "histogram values")]
    pub fn on_burst(&mut self, ring: usize, frames: u64, ns: u64) {
        if let (Some(f), Some(s)) = (self.burst_frames.get_mut(ring), self.burst_seconds.get_mut(ring)) {
            f.observe(frames as f64);
            s.observe(ns as f64 / 1e9);
        }
    }

    /// The gap since the previous drain pass began.
    #[allow(clippy::cast_precision_loss, reason = "histogram values")]
    pub fn on_drain_gap(&mut self, ns: u64) {
        self.drain_gap.observe(ns as f64 / 1e9);
    }
}

/// Per stream of one ring, the last seq and timestamp read: a frame whose seq is more
/// than one past its stream's last is the end of a burst. Streams are keyed by
/// `cpu × 4 + class`, at most [`BurstTracker::MAX_KEYS`] (CPUs past 8,191 are not
/// tracked).
#[derive(Debug, Clone, Default)]
pub struct BurstTracker {
    last: Vec<(u64, u64)>,
}

const NONE: u64 = u64::MAX;

impl BurstTracker {
    pub const MAX_KEYS: usize = 4 * 8192;

    /// A frame of stream `key` with `seq` and `ts`: the burst it ends, as (frames
    /// missing, ns since the stream's previous frame). A seq at or below the last one
    /// (a new epoch's streams start again) starts the stream afresh.
    #[inline]
    pub fn on_frame(&mut self, key: usize, seq: u64, ts: u64) -> Option<(u64, u64)> {
        if key >= Self::MAX_KEYS {
            return None;
        }
        if self.last.len() <= key {
            self.last.resize(key + 1, (NONE, 0));
        }
        let slot = self.last.get_mut(key)?;
        let (last_seq, last_ts) = *slot;
        *slot = (seq, ts);
        (last_seq != NONE && seq > last_seq.saturating_add(1)).then(|| (seq - last_seq - 1, ts.saturating_sub(last_ts)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_missing_seqs_is_one_burst_and_a_new_epoch_is_none() {
        let mut t = BurstTracker::default();
        let seen: Vec<_> = [(0, 1, 10), (0, 2, 20), (1, 1, 25), (0, 7, 70), (0, 8, 80), (1, 2, 90), (0, 10, 100)]
            .into_iter()
            .filter_map(|(k, s, ts)| t.on_frame(k, s, ts))
            .collect();
        assert_eq!(seen, vec![(4, 50), (1, 20)], "seqs 3..=6 of stream 0 (50 ns), then seq 9");
        assert_eq!(t.on_frame(0, 1, 200), None, "seqs started again: no burst");
        assert_eq!(t.on_frame(0, 3, 210), Some((1, 10)));
        assert_eq!(t.on_frame(BurstTracker::MAX_KEYS, 1, 0), None);
        assert_eq!(t.on_frame(BurstTracker::MAX_KEYS, 9, 0), None, "keys past the cap are not tracked");
    }

    #[test]
    fn fills_and_bursts_land_in_their_buckets() {
        let mut m = RingMetrics::new([1 << 20, 4096]);
        m.on_drained(1, 4096);
        m.on_drained(1, 8192);
        m.on_drained(0, 1 << 18);
        m.on_burst(1, 100, 20_000_000);
        m.on_drain_gap(300_000);
        assert_eq!(m.fill[1].cumulative().last(), Some(&(1.0, 2)), "a full ring reads 1, never more");
        assert_eq!(m.fill[0].cumulative()[3], (0.25, 1));
        assert_eq!(m.burst_frames[1].cumulative()[4], (256.0, 1));
        assert_eq!(m.burst_seconds[1].cumulative()[4], (0.025, 1));
        assert_eq!(m.burst_seconds[1].cumulative()[3], (0.01, 0));
        assert_eq!(m.drain_gap.cumulative()[2], (0.000_5, 1));
    }
}
