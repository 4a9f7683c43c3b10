//! A node's bulk event rate from the exact counters (issue 25): every heartbeat says, per
//! stream, how many events took a seq (`attempted`) and how many the kernel sampled out
//! — counted in the kernel whether or not their frames ever arrived. Their sum over the
//! node's bulk (P2) streams, sampled at each heartbeat's node time, gives a rate that
//! does not drop with the telemetry: a congested ring loses frames, not counts. Frames
//! are never parsed for it.
//!
//! Pure: the ingest feeds it at each heartbeat; the API reads it.

use std::collections::VecDeque;

/// The rate spans at least this much node time when the samples allow (10 s: ten
/// heartbeats at the default period).
pub const RATE_WINDOW_NS: u64 = 10_000_000_000;
/// Samples kept (a heartbeat each).
pub const MAX_SAMPLES: usize = 64;

/// Samples of one node's bulk counters: `(node ns, attempted + sampled out)`.
#[derive(Debug, Clone, Default)]
pub struct BulkRate {
    epoch: u64,
    samples: VecDeque<(u64, u64)>,
}

impl PartialEq for BulkRate {
    /// Figures of this process, not state (snapshots leave them out): any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A rate over a window of node time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub events_per_second: f64,
    pub window_ns: u64,
}

impl BulkRate {
    /// A heartbeat of `epoch` taken at `node_ns` counted `events` on the node's bulk
    /// streams. A new epoch or counters that went back (the kernel's counters restarted)
    /// start a fresh window; a heartbeat no newer than the last sample (out of order) is
    /// ignored.
    pub fn on_heartbeat(&mut self, epoch: u64, node_ns: u64, events: u64) {
        match self.samples.back() {
            Some(_) if epoch != self.epoch => self.samples.clear(),
            Some(&(t, _)) if node_ns <= t => return,
            Some(&(_, e)) if events < e => self.samples.clear(),
            _ => {}
        }
        self.epoch = epoch;
        self.samples.push_back((node_ns, events));
        // Keep the newest sample at least a window back, and nothing older.
        while self.samples.len() > MAX_SAMPLES
            || self.samples.get(1).is_some_and(|&(t, _)| node_ns.saturating_sub(t) >= RATE_WINDOW_NS)
        {
            self.samples.pop_front();
        }
    }

    /// Events per second over the samples held (`None` before two heartbeats).
    #[must_use]
    pub fn rate(&self) -> Option<Rate> {
        let (&(t0, e0), &(t1, e1)) = (self.samples.front()?, self.samples.back()?);
        let window_ns = t1.checked_sub(t0).filter(|&w| w > 0)?;
        #[allow(clippy::cast_precision_loss, reason = "a rate for a dashboard")]
        let events_per_second = e1.saturating_sub(e0) as f64 * 1e9 / window_ns as f64;
        Some(Rate { events_per_second, window_ns })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_rate_spans_the_window_and_restarts_with_the_counters() {
        let mut r = BulkRate::default();
        assert_eq!(r.rate(), None);
        r.on_heartbeat(1, S, 0);
        assert_eq!(r.rate(), None, "one sample is no rate");
        for i in 2..=30 {
            r.on_heartbeat(1, i * S, (i - 1) * 1_000);
        }
        assert_eq!(r.rate(), Some(Rate { events_per_second: 1_000.0, window_ns: 10 * S }));
        // Out of order: ignored.
        r.on_heartbeat(1, 29 * S, 0);
        assert_eq!(r.rate().unwrap().events_per_second, 1_000.0);
        // A burst doubles the rate over the last 10 s in part.
        r.on_heartbeat(1, 31 * S, 29_000 + 11_000);
        assert_eq!(r.rate(), Some(Rate { events_per_second: 2_000.0, window_ns: 10 * S }));
        // Counters went back (a restarted kernel side): a fresh window.
        r.on_heartbeat(1, 32 * S, 5);
        assert_eq!(r.rate(), None);
        // A new epoch: fresh too.
        r.on_heartbeat(2, 40 * S, 100);
        r.on_heartbeat(2, 41 * S, 600);
        assert_eq!(r.rate(), Some(Rate { events_per_second: 500.0, window_ns: S }));
        r.on_heartbeat(3, 42 * S, 700);
        assert_eq!(r.rate(), None);
    }
}
