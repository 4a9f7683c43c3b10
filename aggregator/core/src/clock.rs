//! Cluster-time estimate per node from heartbeat send/receive times.
//!
//! Each heartbeat gives a sample: sent at node time `s`, received at aggregator time `r`
//! over a path with round-trip `rtt`. The one-way delay is unknown within `[0, rtt]`, so
//! `offset = r − rtt/2 − s` with error `±rtt/2`. The estimate keeps the sample with the
//! smallest `r − s` among the last [`WINDOW`] (the least queued one) and widens its error
//! by the drift allowance since it was taken. Refinement from collective completion
//! residuals comes with the matcher.

use rkyv::{Archive, Deserialize, Serialize};

/// Samples considered.
pub const WINDOW: usize = 16;
/// Drift allowance: 100 ppm of the sample's age.
pub const DRIFT_PPM: u64 = 100;

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
struct Sample {
    sent_node_ns: u64,
    received_ns: u64,
    rtt_ns: u64,
}

/// Offset and uncertainty of one node's clock against cluster (aggregator) time.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct ClockEstimate {
    samples: Vec<Sample>,
}

impl ClockEstimate {
    /// Adds a heartbeat sample.
    pub fn on_heartbeat(&mut self, sent_node_ns: u64, received_ns: u64, rtt_ns: u64) {
        if self.samples.len() >= WINDOW {
            self.samples.remove(0);
        }
        self.samples.push(Sample { sent_node_ns, received_ns, rtt_ns });
    }

    fn best(&self) -> Option<&Sample> {
        self.samples.iter().min_by_key(|s| (i128::from(s.received_ns) - i128::from(s.sent_node_ns), s.rtt_ns))
    }

    /// `cluster = node + offset`; `None` before the first heartbeat.
    #[must_use]
    pub fn offset_ns(&self) -> Option<i64> {
        self.best().map(|s| {
            let off = i128::from(s.received_ns) - i128::from(s.rtt_ns / 2) - i128::from(s.sent_node_ns);
            i64::try_from(off).unwrap_or(if off < 0 { i64::MIN } else { i64::MAX })
        })
    }

    /// The uncertainty ε at aggregator time `now`: half the sample's RTT plus drift.
    #[must_use]
    pub fn epsilon_ns(&self, now: u64) -> Option<u64> {
        self.best().map(|s| s.rtt_ns / 2 + now.saturating_sub(s.received_ns) / 1_000_000 * DRIFT_PPM)
    }

    /// Whether a heartbeat sample exists (cluster times mean something).
    #[must_use]
    pub fn is_synced(&self) -> bool {
        !self.samples.is_empty()
    }

    /// Cluster time of a node time (the node time itself before any heartbeat).
    #[must_use]
    pub fn to_cluster(&self, node_ns: u64) -> i64 {
        let node = i64::try_from(node_ns).unwrap_or(i64::MAX);
        node.saturating_add(self.offset_ns().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_delayed_sample_wins_and_error_grows_with_age() {
        let mut c = ClockEstimate::default();
        assert_eq!(c.offset_ns(), None);
        // Node clock is 40 ms ahead of the aggregator: node = cluster + 40 ms.
        let skew = 40_000_000u64;
        c.on_heartbeat(1_000_000_000 + skew, 1_000_000_000 + 3_000_000, 2_000_000); // queued 3 ms
        c.on_heartbeat(2_000_000_000 + skew, 2_000_000_000 + 1_000_000, 2_000_000); // 1 ms
        let off = c.offset_ns().unwrap();
        assert_eq!(off, -(skew as i64), "1 ms one-way minus rtt/2 = 0 error");
        assert_eq!(c.epsilon_ns(2_001_000_000), Some(1_000_000));
        assert_eq!(c.epsilon_ns(12_001_000_000), Some(1_000_000 + 10_000 * DRIFT_PPM));
        assert_eq!(c.to_cluster(5_000_000_000 + skew), 5_000_000_000);
    }
}
