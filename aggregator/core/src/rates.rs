//! A node's bulk event rate from the exact counters (issue 25): every heartbeat says, per
//! stream, how many events took a seq (`attempted`) and how many the kernel sampled out
//! — counted in the kernel whether or not their frames ever arrived. Their sum over the
//! node's bulk (P2) streams, sampled at each heartbeat's node time, gives a rate that
//! does not drop with the telemetry: a congested ring loses frames, not counts. Frames
//! are never parsed for it.
//!
//! Per network interface the same, from the heartbeats' `interfaces` section: the
//! packets and bytes the kernel's XDP program counted on each interface, every packet
//! before sampling and before the ring ([`InterfaceRates`]).
//!
//! Pure: the ingest feeds it at each heartbeat; the API reads it.

use std::collections::{BTreeMap, VecDeque};

/// The rate spans at least this much node time when the samples allow (10 s: ten
/// heartbeats at the default period).
pub const RATE_WINDOW_NS: u64 = 10_000_000_000;
/// Samples kept (a heartbeat each).
pub const MAX_SAMPLES: usize = 64;
/// A sample this close to the last one is skipped (so a window holds about 16).
pub const MIN_SPACING_NS: u64 = RATE_WINDOW_NS / 16;

/// Samples of `N` running counters of one epoch: `(node ns, values)`.
#[derive(Debug, Clone)]
pub struct WindowRate<const N: usize> {
    epoch: u64,
    samples: VecDeque<(u64, [u64; N])>,
}

impl<const N: usize> Default for WindowRate<N> {
    fn default() -> Self {
        Self { epoch: 0, samples: VecDeque::new() }
    }
}

/// A node's bulk counters: `attempted + sampled out` of its bulk streams.
pub type BulkRate = WindowRate<1>;

impl<const N: usize> PartialEq for WindowRate<N> {
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
    /// streams (see [`WindowRate::on_sample`]).
    pub fn on_heartbeat(&mut self, epoch: u64, node_ns: u64, events: u64) {
        self.on_sample(epoch, node_ns, [events]);
    }

    /// Events per second over the samples held (`None` before two heartbeats).
    #[must_use]
    pub fn rate(&self) -> Option<Rate> {
        self.rates().map(|([events_per_second], window_ns)| Rate { events_per_second, window_ns })
    }
}

impl<const N: usize> WindowRate<N> {
    /// A heartbeat of `epoch` taken at `node_ns` read the counters `values`. A newer
    /// epoch or a counter that went back (the kernel's counters restarted) starts a
    /// fresh window; a heartbeat of an older epoch (a straggler: a node's epochs only
    /// grow) or no newer than the last sample (out of order) is ignored, and so is one
    /// within [`MIN_SPACING_NS`] of the last (heartbeats sent early, or a peer sending
    /// many, cannot fill the window with samples).
    pub fn on_sample(&mut self, epoch: u64, node_ns: u64, values: [u64; N]) {
        match self.samples.back() {
            Some(_) if epoch < self.epoch => return,
            Some(_) if epoch > self.epoch => self.samples.clear(),
            Some(&(t, _)) if node_ns <= t.saturating_add(MIN_SPACING_NS) => return,
            Some((_, e)) if values.iter().zip(e).any(|(v, e)| v < e) => self.samples.clear(),
            _ => {}
        }
        self.epoch = epoch;
        self.samples.push_back((node_ns, values));
        // Keep the newest sample at least a window back, and nothing older.
        while self.samples.len() > MAX_SAMPLES
            || self.samples.get(1).is_some_and(|&(t, _)| node_ns.saturating_sub(t) >= RATE_WINDOW_NS)
        {
            self.samples.pop_front();
        }
    }

    /// Each counter's rate per second over the samples held, and the window (`None`
    /// before two samples).
    #[must_use]
    pub fn rates(&self) -> Option<([f64; N], u64)> {
        let ((t0, e0), (t1, e1)) = (self.samples.front()?, self.samples.back()?);
        let window_ns = t1.checked_sub(*t0).filter(|&w| w > 0)?;
        #[allow(clippy::cast_precision_loss, reason = "a rate for a dashboard")]
        let per_second = core::array::from_fn(|i| e1[i].saturating_sub(e0[i]) as f64 * 1e9 / window_ns as f64);
        Some((per_second, window_ns))
    }

    /// The newest sample's counters.
    #[must_use]
    pub fn latest(&self) -> Option<[u64; N]> {
        self.samples.back().map(|&(_, v)| v)
    }
}

/// The most interfaces a node keeps rates for: the kernel map's cap and its overflow
/// entry.
pub const MAX_INTERFACES_PER_NODE: usize = proto_flat::kernel::MAX_INTERFACES as usize + 1;

/// A node's per-interface packet and byte rates, by ifindex
/// ([`proto_flat::sections::IFINDEX_OVERFLOW`]: the interfaces beyond the kernel map's
/// cap). At most [`MAX_INTERFACES_PER_NODE`]; what a heartbeat names beyond that is
/// counted in `turned_away`, not kept.
#[derive(Debug, Clone, Default)]
pub struct InterfaceRates {
    epoch: u64,
    by_ifindex: BTreeMap<u32, WindowRate<2>>,
    /// Interface entries refused for the cap (running total).
    pub turned_away: u64,
}

impl PartialEq for InterfaceRates {
    /// Figures of this process, not state (snapshots leave them out): any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// One interface's rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InterfaceRate {
    pub ifindex: u32,
    /// Running totals of the epoch, from the latest sample kept (see [`MIN_SPACING_NS`]).
    pub packets: u64,
    pub bytes: u64,
    /// Per second over `window_ns` (`None` before two heartbeats).
    pub packets_per_second: Option<f64>,
    pub bytes_per_second: Option<f64>,
    pub window_ns: u64,
}

impl InterfaceRates {
    /// A heartbeat of `epoch` at `node_ns` said `(ifindex, packets, bytes)` for each
    /// interface (none: a heartbeat without the section). An interface it does not name
    /// is forgotten (the kernel's map never drops one within an epoch: the shipper could
    /// not read it, or the counters were created afresh); a newer epoch forgets the old
    /// one's; a heartbeat of an older epoch (a straggler) is ignored.
    pub fn on_heartbeat(&mut self, epoch: u64, node_ns: u64, entries: impl IntoIterator<Item = (u32, u64, u64)>) {
        if epoch < self.epoch {
            return;
        }
        if epoch > self.epoch {
            self.by_ifindex.clear();
            self.epoch = epoch;
        }
        // What this heartbeat named and is kept (at most the cap).
        let mut named = std::collections::BTreeSet::new();
        for (ifindex, packets, bytes) in entries {
            let full = self.by_ifindex.len() >= MAX_INTERFACES_PER_NODE;
            match self.by_ifindex.get_mut(&ifindex) {
                Some(r) => r.on_sample(epoch, node_ns, [packets, bytes]),
                None if full => self.turned_away = self.turned_away.saturating_add(1),
                None => self.by_ifindex.entry(ifindex).or_default().on_sample(epoch, node_ns, [packets, bytes]),
            }
            if self.by_ifindex.contains_key(&ifindex) {
                named.insert(ifindex);
            }
        }
        self.by_ifindex.retain(|i, _| named.contains(i));
    }

    /// Every interface's rates, in ifindex order.
    pub fn iter(&self) -> impl Iterator<Item = InterfaceRate> + '_ {
        self.by_ifindex.iter().map(|(&ifindex, r)| {
            let [packets, bytes] = r.latest().unwrap_or_default();
            let rates = r.rates();
            InterfaceRate {
                ifindex,
                packets,
                bytes,
                packets_per_second: rates.map(|([p, _], _)| p),
                bytes_per_second: rates.map(|([_, b], _)| b),
                window_ns: rates.map_or(0, |(_, w)| w),
            }
        })
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
        // An older epoch's straggler: ignored.
        r.on_heartbeat(0, 33 * S, 1);
        assert_eq!(r.latest(), Some([5]));
        // A new epoch: fresh too.
        r.on_heartbeat(2, 40 * S, 100);
        r.on_heartbeat(2, 41 * S, 600);
        assert_eq!(r.rate(), Some(Rate { events_per_second: 500.0, window_ns: S }));
        r.on_heartbeat(3, 42 * S, 700);
        assert_eq!(r.rate(), None);
    }

    #[test]
    fn interfaces_keep_their_own_rates_forget_an_old_epoch_and_stop_at_the_cap() {
        let mut r = InterfaceRates::default();
        r.on_heartbeat(1, S, [(2, 0, 0), (3, 10, 1_000)]);
        r.on_heartbeat(1, 3 * S, [(2, 200, 30_000), (3, 30, 3_000), (4, 5, 500)]);
        let got: Vec<InterfaceRate> = r.iter().collect();
        assert_eq!(got.len(), 3);
        assert_eq!(
            (got[0].ifindex, got[0].packets_per_second, got[0].bytes_per_second),
            (2, Some(100.0), Some(15_000.0))
        );
        assert_eq!((got[1].ifindex, got[1].packets, got[1].packets_per_second), (3, 30, Some(10.0)));
        assert_eq!(
            (got[2].ifindex, got[2].packets, got[2].packets_per_second),
            (4, 5, None),
            "one sample: no rate yet"
        );
        // Bytes that went back restart that interface's window only.
        r.on_heartbeat(1, 4 * S, [(2, 300, 10), (3, 40, 4_000)]);
        let got: Vec<InterfaceRate> = r.iter().collect();
        assert_eq!(got[0].packets_per_second, None);
        assert_eq!(got[1].packets_per_second, Some(10.0));
        // A heartbeat that names fewer: the others are forgotten.
        r.on_heartbeat(1, 5 * S, [(3, 50, 5_000)]);
        assert_eq!(r.iter().map(|i| i.ifindex).collect::<Vec<_>>(), [3]);
        // A new epoch: only what it names; a straggler of the old one changes nothing.
        r.on_heartbeat(2, 5 * S, [(7, 1, 64)]);
        assert_eq!(r.iter().map(|i| i.ifindex).collect::<Vec<_>>(), [7]);
        r.on_heartbeat(1, 9 * S, [(3, 90, 9_000)]);
        assert_eq!(r.iter().map(|i| (i.ifindex, i.packets)).collect::<Vec<_>>(), [(7, 1)]);
        // Samples closer than MIN_SPACING_NS to the last one are skipped.
        r.on_heartbeat(2, 5 * S + MIN_SPACING_NS, [(7, 2, 128)]);
        assert_eq!(r.iter().next().map(|i| i.packets), Some(1));
        // None named (a heartbeat without the section): nothing known.
        r.on_heartbeat(2, 6 * S, []);
        assert_eq!(r.iter().count(), 0);
        // The cap: further interfaces are counted, not kept.
        let many = (0..proto_flat::kernel::MAX_INTERFACES + 6).map(|i| (100 + i, 1, 1));
        r.on_heartbeat(2, 7 * S, many);
        assert_eq!(r.iter().count(), MAX_INTERFACES_PER_NODE);
        assert_eq!(r.turned_away, 5);
    }
}
