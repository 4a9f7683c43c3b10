//! Cluster-time estimate per node from heartbeat send/receive times.
//!
//! Each heartbeat gives a sample: sent at node time `s`, received at aggregator time `r`
//! over a path with round-trip `rtt`. The one-way delay is unknown within `[0, rtt]`, so
//! `offset = r − rtt/2 − s` with error `±rtt/2`. The estimate keeps the sample with the
//! smallest `r − s` among the last [`WINDOW`] (the least queued one) and widens its error
//! by the drift allowance since it was taken. Refinement from collective completion
//! residuals is the matcher's (`learn_residuals`).
//!
//! A sample is only as good as its send time: a heartbeat that waited in the shipper's
//! spool (written while the shipper was disconnected, sent on reconnect) looks delayed by
//! the whole wait, and as the first sample of a node it would put the node's clock (and
//! so its watermarks) seconds in the future. So each connection's `resume` carries the
//! node's clock at connection time: it is a fresh sample, and heartbeats written before
//! it are not samples at all ([`ClockEstimate::on_resume`]).

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
    /// Node time of the latest connection's `resume`: heartbeats sent before it are stale.
    fresh_from_node_ns: u64,
}

impl ClockEstimate {
    /// Adds a heartbeat sample; false (nothing added) when the heartbeat was written
    /// before the current connection began (it may have waited in the spool).
    pub fn on_heartbeat(&mut self, sent_node_ns: u64, received_ns: u64, rtt_ns: u64) -> bool {
        if sent_node_ns < self.fresh_from_node_ns {
            return false;
        }
        self.add(Sample { sent_node_ns, received_ns, rtt_ns });
        true
    }

    /// A connection's `resume`, written at node time `sent_node_ns` (0: the shipper sent
    /// no clock): a fresh sample, and the floor below which heartbeats are stale.
    pub fn on_resume(&mut self, sent_node_ns: u64, received_ns: u64, rtt_ns: u64) {
        if sent_node_ns == 0 {
            return;
        }
        self.fresh_from_node_ns = sent_node_ns;
        self.add(Sample { sent_node_ns, received_ns, rtt_ns });
    }

    fn add(&mut self, sample: Sample) {
        if self.samples.len() >= WINDOW {
            self.samples.remove(0);
        }
        self.samples.push(sample);
    }

    fn best(&self) -> Option<&Sample> {
        // i128 holds any difference of two u64s.
        self.samples
            .iter()
            .min_by_key(|s| (i128::from(s.received_ns).saturating_sub(i128::from(s.sent_node_ns)), s.rtt_ns))
    }

    /// `cluster = node + offset`; `None` before the first heartbeat.
    #[must_use]
    pub fn offset_ns(&self) -> Option<i64> {
        self.best().map(|s| {
            let off = i128::from(s.received_ns)
                .saturating_sub(i128::from(s.rtt_ns / 2))
                .saturating_sub(i128::from(s.sent_node_ns));
            i64::try_from(off).unwrap_or(if off < 0 { i64::MIN } else { i64::MAX })
        })
    }

    /// The uncertainty ε at aggregator time `now`: half the sample's RTT plus drift.
    #[must_use]
    pub fn epsilon_ns(&self, now: u64) -> Option<u64> {
        self.best().map(|s| {
            (s.rtt_ns / 2).saturating_add((now.saturating_sub(s.received_ns) / 1_000_000).saturating_mul(DRIFT_PPM))
        })
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

    #[test]
    fn heartbeats_written_before_the_connection_are_not_samples_regression_issue_17() {
        // A shipper heartbeated for 8 s while it could not connect; on connecting it sent
        // its resume (node time 8 s, received at 8.001 s) and then its backlog.
        let mut c = ClockEstimate::default();
        c.on_resume(8_000_000_000, 8_001_000_000, 1_000_000);
        assert_eq!(c.offset_ns(), Some(500_000));
        for i in 0..8u64 {
            // Written at i s, all received at 8.002 s: as samples they would say the
            // node's clock is up to 8 s behind.
            assert!(!c.on_heartbeat(i * 1_000_000_000, 8_002_000_000, 1_000_000));
        }
        assert_eq!(c.offset_ns(), Some(500_000), "the backlog does not move the estimate");
        assert!(c.on_heartbeat(8_100_000_000, 8_101_000_000, 1_000_000));

        // Without the resume's sample the first backlog heartbeat alone would have set
        // the node's clock 8 s ahead of the truth (the failure CI saw).
        let mut blind = ClockEstimate::default();
        blind.on_heartbeat(0, 8_002_000_000, 1_000_000);
        assert!(blind.offset_ns().unwrap() > 7_900_000_000);
        // A shipper that sends no clock changes nothing.
        blind.on_resume(0, 9_000_000_000, 1_000_000);
        assert!(blind.on_heartbeat(1, 9_000_000_000, 1_000_000));
    }
}
