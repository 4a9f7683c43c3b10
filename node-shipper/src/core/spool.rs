//! The spool: cut batches wait here until the aggregator acks them.
//!
//! Method groups and call order: inputs [`Spool::offer`] (a cut batch),
//! [`Spool::ack`] / [`Spool::nack`] (control messages), [`Spool::reconnected`];
//! outputs [`Spool::next_to_send`] (P0, then P1, then P2, oldest first, unsent only);
//! getters [`Spool::used_bytes`], [`Spool::counters`].
//!
//! Durable acks (aggregator durability `snapshot`, issue 20): with [`Spool::ack`]'s
//! `keep_p0_p1`, an applied P0/P1 batch stays, *awaiting durable* — not sent again on
//! this connection, still held (it counts in `used_bytes`, is listed in a `resume`, and is
//! sent again after a reconnect) — until [`Spool::durable`] frees it. When room is
//! needed and no bulk is left to evict, the oldest awaiting batch is released before
//! anything is refused (it was applied; only a crash of the aggregator before its next
//! snapshot could lose it): counted `released_undurable`.
//!
//! Memory pressure (issue 23): [`Spool::set_bulk_limit`] caps what bulk (P2, P3) may hold
//! while the pressure lasts; bulk over it is evicted at once (oldest unsent first) and
//! returned to the caller, whose loss records say `psi_shed`; a bulk batch offered over
//! it evicts older bulk, or is shed itself. P0 and P1 are never limited by it.
//!
//! Invariants:
//! - `used_bytes ≤ cap_bytes`, and P2 never uses the `p0_reserve + p1_reserve` room;
//! - an incoming P0/P1 batch evicts P2 batches (oldest first) before it can be refused;
//! - every batch that leaves the spool without an ack (evicted, refused, nacked) is
//!   returned to the caller to become loss records — nothing leaves silently;
//! - unacked batches stay, and are all sent again after a reconnect;
//! - in each lane the sent batches are a prefix (sent oldest first, new ones pushed at the
//!   back, removals keep the order), so a count per lane says which are sent.

use std::collections::VecDeque;

use proto_flat::codes::{Class, WireEnum};

use super::batcher::Batch;

/// Spool limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpoolConfig {
    pub cap_bytes: usize,
    /// Room only P0 may use.
    pub p0_reserve_bytes: usize,
    /// Room only P1 may use.
    pub p1_reserve_bytes: usize,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        // 256 MiB holds ~4 s of one node's full bulk rate at 66.7 M × 48 B/s, or minutes
        // of P0; 8 MiB each for P0 and P1 is hundreds of batches of lifecycle events.
        Self { cap_bytes: 256 << 20, p0_reserve_bytes: 8 << 20, p1_reserve_bytes: 8 << 20 }
    }
}

/// What the spool did with what it was offered.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Whether the offered batch is in the spool.
    pub accepted: bool,
    /// Batches that left without an ack (evicted P2, or the refused batch itself): the
    /// caller turns each into loss records (`shipper_spool_full`) and recycles it.
    pub dropped: Vec<Batch>,
    /// Applied batches that were awaiting a durable ack, released to make room: they
    /// leave as acked.
    pub released: Vec<Batch>,
    /// Bulk batches shed for the pressure limit ([`Spool::set_bulk_limit`]; the offered
    /// batch itself when it alone is over it): loss records of cause `psi_shed`.
    pub shed: Vec<Batch>,
}

/// A batch an applied ack moved to *awaiting durable*.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    pub lane: Class,
    pub batch_seq: u64,
    pub frames: u32,
    pub opened_ns: u64,
    pub stages: crate::core::batcher::StageTimes,
}

/// Counters (in the shipper's report).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpoolCounters {
    pub accepted: u64,
    pub evicted: u64,
    /// Bulk batches shed for the memory-pressure limit (evicted or refused).
    pub shed_pressure: u64,
    pub refused_p0: u64,
    pub refused_p1: u64,
    pub refused_p2: u64,
    pub acked: u64,
    pub nacked: u64,
    pub resent: u64,
    /// Applied P0/P1 batches kept until a durable ack, and those of them freed by one.
    pub kept_for_durable: u64,
    pub durable: u64,
    /// Awaiting batches released to make room before their durable ack came.
    pub released_undurable: u64,
}

/// The spool. See the module docs.
#[derive(Debug)]
pub struct Spool {
    config: SpoolConfig,
    lanes: [VecDeque<Batch>; 4],
    lane_bytes: [usize; 4],
    /// How many batches at the front of each lane have been sent.
    sent: [usize; 4],
    /// Bytes of those sent (and not yet acked) batches, per lane.
    sent_bytes: [usize; 4],
    /// P0 and P1 batches applied and awaiting a durable ack, oldest applied first (their
    /// bytes count in `lane_bytes` and `used`).
    awaiting: [VecDeque<Batch>; 2],
    used: usize,
    /// What bulk may hold while memory pressure lasts (`None`: only the cap).
    bulk_limit: Option<usize>,
    counters: SpoolCounters,
}

fn lane_of(class: Class) -> usize {
    usize::from(class.code()).min(3)
}

impl Spool {
    /// An empty spool.
    #[must_use]
    pub fn new(config: SpoolConfig) -> Self {
        Self {
            config,
            lanes: Default::default(),
            lane_bytes: [0; 4],
            sent: [0; 4],
            sent_bytes: [0; 4],
            awaiting: Default::default(),
            used: 0,
            bulk_limit: None,
            counters: SpoolCounters::default(),
        }
    }

    /// Batches awaiting a durable ack (applied, still held).
    #[must_use]
    pub fn awaiting_durable(&self) -> usize {
        self.awaiting.iter().map(VecDeque::len).sum()
    }

    /// Bytes held.
    #[must_use]
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    /// The cap in force.
    #[must_use]
    pub fn cap_bytes(&self) -> usize {
        self.config.cap_bytes
    }

    /// Bytes held per lane (P0, P1, P2, P3).
    #[must_use]
    pub fn lane_bytes(&self) -> [usize; 4] {
        self.lane_bytes
    }

    /// Counters.
    #[must_use]
    pub fn counters(&self) -> &SpoolCounters {
        &self.counters
    }

    /// Batches held unacked, all lanes (not counting those awaiting a durable ack).
    #[must_use]
    pub fn len(&self) -> usize {
        self.lanes.iter().map(VecDeque::len).sum()
    }

    /// Whether it holds nothing unacked (batches awaiting a durable ack aside).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reserved room the other classes have not used yet, which `class` may not take.
    fn held_back_from(&self, class: Class) -> usize {
        let p0_left = self.config.p0_reserve_bytes.saturating_sub(self.lane_bytes[0]);
        let p1_left = self.config.p1_reserve_bytes.saturating_sub(self.lane_bytes[1]);
        match class {
            Class::P0 => p1_left,
            Class::P1 => p0_left,
            _ => p0_left + p1_left,
        }
    }

    fn account(&mut self, lane: usize, size: usize, add: bool) {
        if add {
            self.used += size;
            self.lane_bytes[lane] += size;
        } else {
            self.used -= size;
            self.lane_bytes[lane] -= size;
        }
    }

    /// Evicts a bulk batch (P3 before P2): the oldest not yet sent on this connection,
    /// or — when every bulk batch held is in flight — the oldest. A batch in flight will
    /// likely arrive (its bytes are already in the transport's buffers), and a batch
    /// never sent cannot have been applied anywhere, so its loss needs no batch_seq and
    /// merges with its neighbours' (see `ShipperCore`).
    fn evict_bulk(&mut self) -> Option<Batch> {
        for lane in [3, 2] {
            let sent = self.sent[lane];
            if self.lanes[lane].len() > sent
                && let Some(b) = self.lanes[lane].remove(sent)
            {
                self.account(lane, b.bytes.len(), false);
                return Some(b);
            }
            if let Some(b) = self.lanes[lane].pop_front() {
                if self.sent[lane] > 0 {
                    self.sent[lane] -= 1;
                    self.sent_bytes[lane] -= b.bytes.len();
                }
                self.account(lane, b.bytes.len(), false);
                return Some(b);
            }
        }
        None
    }

    /// Bytes of bulk (P2, P3) held.
    #[must_use]
    pub fn bulk_bytes(&self) -> usize {
        self.lane_bytes[2] + self.lane_bytes[3]
    }

    /// Sets what bulk may hold while memory pressure lasts (`None`: lifted). Returns the
    /// bulk batches evicted to get under a new limit (oldest unsent first, P3 before P2):
    /// the caller turns them into loss records of cause `psi_shed`.
    pub fn set_bulk_limit(&mut self, limit: Option<usize>) -> Vec<Batch> {
        self.bulk_limit = limit;
        let mut out = Vec::new();
        if let Some(limit) = limit {
            while self.bulk_bytes() > limit {
                let Some(b) = self.evict_bulk() else { break };
                self.counters.shed_pressure += 1;
                out.push(b);
            }
        }
        out
    }

    /// The pressure limit in force.
    #[must_use]
    pub fn bulk_limit(&self) -> Option<usize> {
        self.bulk_limit
    }

    /// Offers a cut batch.
    pub fn offer(&mut self, batch: Batch) -> Admission {
        let size = batch.bytes.len();
        let class = batch.lane;
        let mut out = Admission::default();
        if let (Class::P2 | Class::P3, Some(limit)) = (class, self.bulk_limit) {
            // Under memory pressure bulk keeps to its limit: older bulk goes first; a
            // batch over the limit on its own is shed.
            while self.bulk_bytes() + size > limit {
                let Some(b) = self.evict_bulk() else { break };
                self.counters.shed_pressure += 1;
                out.shed.push(b);
            }
            if self.bulk_bytes() + size > limit {
                self.counters.shed_pressure += 1;
                out.shed.push(batch);
                return out;
            }
        }
        // Make room: nobody takes another class's unused reserve; bulk is evicted (oldest,
        // P3 before P2) before anything is refused.
        while self.used + size + self.held_back_from(class) > self.config.cap_bytes {
            if let Some(b) = self.evict_bulk() {
                self.counters.evicted += 1;
                out.dropped.push(b);
                continue;
            }
            match self.release_oldest_awaiting() {
                Some(b) => out.released.push(b),
                None => {
                    match class {
                        Class::P0 => self.counters.refused_p0 += 1,
                        Class::P1 => self.counters.refused_p1 += 1,
                        _ => self.counters.refused_p2 += 1,
                    }
                    out.dropped.push(batch);
                    return out;
                }
            }
        }
        let lane = lane_of(class);
        self.account(lane, size, true);
        self.counters.accepted += 1;
        self.lanes[lane].push_back(batch);
        out.accepted = true;
        out
    }

    /// Bytes of bulk (P2, P3) batches sent and not yet acked: what bulk occupies of the
    /// connection's send window.
    #[must_use]
    pub fn bulk_in_flight_bytes(&self) -> usize {
        self.sent_bytes[2] + self.sent_bytes[3]
    }

    /// The next batch to send: P0 first, then P1, then bulk; oldest unsent first. A bulk
    /// batch is sent only while bulk's unacked bytes stay within `bulk_window_bytes` (the
    /// send window minus the P0/P1 reserve), so bulk never fills the window P0 needs.
    /// `now` stamps a batch's first send ([`crate::core::batcher::StageTimes::sent_ns`]).
    pub fn next_to_send(&mut self, bulk_window_bytes: usize, now: u64) -> Option<(Class, u64, &[u8])> {
        let lane = (0..4).find(|&l| {
            let Some(next) = self.lanes[l].get(self.sent[l]) else { return false };
            // One bulk batch may always be in flight, or an oversized one would never go.
            l < 2
                || self.bulk_in_flight_bytes() == 0
                || self.bulk_in_flight_bytes() + next.bytes.len() <= bulk_window_bytes
        })?;
        let b = self.lanes[lane].get_mut(self.sent[lane])?;
        b.ever_sent = true;
        if b.stages.sent_ns == 0 {
            b.stages.sent_ns = now.max(1);
        }
        self.sent[lane] += 1;
        self.sent_bytes[lane] += b.bytes.len();
        Some((b.lane, b.batch_seq, &b.bytes))
    }

    /// Every batch held unacked, lane by lane, oldest first (not those awaiting a
    /// durable ack).
    pub fn iter(&self) -> impl Iterator<Item = &Batch> {
        self.lanes.iter().flat_map(|l| l.iter())
    }

    /// Every batch held: unacked, and awaiting a durable ack (a `resume` lists them all:
    /// all are sent again after a reconnect).
    pub fn iter_held(&self) -> impl Iterator<Item = &Batch> {
        self.iter().chain(self.awaiting.iter().flat_map(|l| l.iter()))
    }

    /// Acked `batch_seq` ranges (inclusive, applied or duplicate): they leave the spool
    /// and are returned so their buffers can be reused — except, with `keep_p0_p1`, P0
    /// and P1 batches, which stay until [`Self::durable`] (returned as [`Kept`]).
    pub fn ack(&mut self, ranges: &[(u64, u64)], keep_p0_p1: bool) -> (Vec<Batch>, Vec<Kept>) {
        let mut freed = Vec::new();
        let mut kept = Vec::new();
        for l in 0..4 {
            let mut i = 0;
            while let Some(b) = self.lanes[l].get(i) {
                if !in_ranges(ranges, b.batch_seq) {
                    i += 1;
                    continue;
                }
                let Some(b) = self.take(l, i) else { break };
                self.counters.acked += 1;
                if keep_p0_p1 && l < 2 {
                    kept.push(Kept {
                        lane: b.lane,
                        batch_seq: b.batch_seq,
                        frames: b.frames,
                        opened_ns: b.opened_ns,
                        stages: b.stages,
                    });
                    self.counters.kept_for_durable += 1;
                    self.awaiting[l].push_back(b);
                } else {
                    self.account(l, b.bytes.len(), false);
                    freed.push(b);
                }
            }
        }
        (freed, kept)
    }

    /// Durably acked `batch_seq` ranges leave the spool: batches awaiting a durable ack
    /// (the first list), and any still unacked (the second: a durable ack is an ack).
    pub fn durable(&mut self, ranges: &[(u64, u64)]) -> (Vec<Batch>, Vec<Batch>) {
        let mut freed = Vec::new();
        for l in 0..2 {
            let mut i = 0;
            while let Some(b) = self.awaiting[l].get(i) {
                if !in_ranges(ranges, b.batch_seq) {
                    i += 1;
                    continue;
                }
                let Some(b) = self.awaiting[l].remove(i) else { break };
                self.account(l, b.bytes.len(), false);
                self.counters.durable += 1;
                freed.push(b);
            }
        }
        let (unacked, _) = self.ack(ranges, false);
        self.counters.durable += unacked.len() as u64;
        (freed, unacked)
    }

    /// The aggregator keeps nothing across a crash (`hello`: durability `none`): every
    /// batch awaiting a durable ack leaves, as acked.
    pub fn release_awaiting(&mut self) -> Vec<Batch> {
        let mut out = Vec::new();
        for l in 0..2 {
            for b in std::mem::take(&mut self.awaiting[l]) {
                self.account(l, b.bytes.len(), false);
                out.push(b);
            }
        }
        out
    }

    /// The oldest batch awaiting a durable ack (lowest `batch_seq`, either lane) leaves,
    /// to make room.
    fn release_oldest_awaiting(&mut self) -> Option<Batch> {
        let l = match (self.awaiting[0].front(), self.awaiting[1].front()) {
            (Some(a), Some(b)) => usize::from(b.batch_seq < a.batch_seq),
            (Some(_), None) => 0,
            (None, Some(_)) => 1,
            (None, None) => return None,
        };
        let b = self.awaiting[l].pop_front()?;
        self.account(l, b.bytes.len(), false);
        self.counters.released_undurable += 1;
        Some(b)
    }

    /// A nacked batch leaves the spool (the caller turns it into `rejected(reason)` loss
    /// records), so a poisoned batch never loops.
    pub fn nack(&mut self, batch_seq: u64) -> Option<Batch> {
        let (lane, i) = self
            .lanes
            .iter()
            .enumerate()
            .find_map(|(l, q)| q.iter().position(|b| b.batch_seq == batch_seq).map(|i| (l, i)))?;
        let b = self.remove(lane, i)?;
        self.counters.nacked += 1;
        Some(b)
    }

    /// Batches of `lane` sent and not yet acked.
    #[must_use]
    pub fn in_flight(&self, lane: usize) -> usize {
        self.sent.get(lane).copied().unwrap_or(0)
    }

    /// Batch `batch_seq`, sent and unacked, goes out again: it becomes its lane's next
    /// batch to send (its stream failed, or the aggregator stopped it unread). Returns its
    /// lane; `None` if it is not held as sent (acked meanwhile, or never sent).
    pub fn requeue_sent(&mut self, batch_seq: u64) -> Option<usize> {
        let (lane, i) = (0..4).find_map(|l| {
            self.lanes[l].iter().take(self.sent[l]).position(|b| b.batch_seq == batch_seq).map(|i| (l, i))
        })?;
        let b = self.lanes[lane].remove(i)?;
        self.sent[lane] -= 1;
        self.sent_bytes[lane] -= b.bytes.len();
        let at = self.sent[lane];
        self.lanes[lane].insert(at, b);
        self.counters.resent += 1;
        Some(lane)
    }

    /// Every unacked batch of `lane` is sent again on the same connection (its sends
    /// stalled: no ack for too long). The aggregator dedups the copies.
    pub fn resend_lane(&mut self, lane: usize) {
        if let (Some(s), Some(b)) = (self.sent.get_mut(lane), self.sent_bytes.get_mut(lane)) {
            self.counters.resent += *s as u64;
            *s = 0;
            *b = 0;
        }
    }

    /// After a reconnect every unacked batch is sent again (the aggregator dedups by
    /// `(node, shipper_session, batch_seq)`), and so is every batch awaiting a durable
    /// ack: the aggregator on the other end may be a restarted one that lost it.
    pub fn reconnected(&mut self) {
        self.counters.resent += self.sent.iter().sum::<usize>() as u64;
        self.sent = [0; 4];
        self.sent_bytes = [0; 4];
        for l in 0..2 {
            if self.awaiting[l].is_empty() {
                continue;
            }
            self.counters.resent += self.awaiting[l].len() as u64;
            let mut all: Vec<Batch> = self.awaiting[l].drain(..).chain(self.lanes[l].drain(..)).collect();
            all.sort_by_key(|b| b.batch_seq);
            self.lanes[l] = all.into();
        }
    }

    /// Everything still held (shutdown: what could not be flushed becomes
    /// `shipper_shutdown` loss records).
    pub fn drain(&mut self) -> Vec<Batch> {
        self.used = 0;
        self.lane_bytes = [0; 4];
        self.sent = [0; 4];
        self.sent_bytes = [0; 4];
        self.lanes.iter_mut().flat_map(|l| l.drain(..)).collect()
    }

    /// Every batch held in the given lanes (shutdown: ring frames given up as loss
    /// records while P1 stays to carry them).
    pub fn drain_lanes(&mut self, classes: &[Class]) -> Vec<Batch> {
        let mut out = Vec::new();
        for &class in classes {
            let lane = lane_of(class);
            for b in std::mem::take(&mut self.lanes[lane]) {
                self.account(lane, b.bytes.len(), false);
                out.push(b);
            }
            self.sent[lane] = 0;
            self.sent_bytes[lane] = 0;
        }
        out
    }

    /// Takes batch `i` out of `lane`, keeping the byte counts and the sent prefix right.
    fn remove(&mut self, lane: usize, i: usize) -> Option<Batch> {
        let b = self.take(lane, i)?;
        self.account(lane, b.bytes.len(), false);
        Some(b)
    }

    /// Takes batch `i` out of `lane`'s queue, keeping the sent prefix right; its bytes
    /// stay accounted (the caller frees or keeps them).
    fn take(&mut self, lane: usize, i: usize) -> Option<Batch> {
        let b = self.lanes[lane].remove(i)?;
        if i < self.sent[lane] {
            self.sent[lane] -= 1;
            self.sent_bytes[lane] -= b.bytes.len();
        }
        Some(b)
    }
}

fn in_ranges(ranges: &[(u64, u64)], seq: u64) -> bool {
    ranges.iter().any(|&(lo, hi)| lo <= seq && seq <= hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(lane: Class, seq: u64, size: usize) -> Batch {
        Batch {
            lane,
            batch_seq: seq,
            frames: 1,
            bytes: vec![0; size],
            opened_ns: 0,
            stages: Default::default(),
            ever_sent: false,
        }
    }

    fn spool() -> Spool {
        Spool::new(SpoolConfig { cap_bytes: 1000, p0_reserve_bytes: 200, p1_reserve_bytes: 100 })
    }

    #[test]
    fn bulk_never_uses_the_reserves_and_is_evicted_oldest_first() {
        let mut s = spool();
        for seq in 1..=7 {
            assert!(s.offer(batch(Class::P2, seq, 100)).accepted);
        }
        // 700 bytes of bulk fill its share: the next one evicts the oldest.
        let a = s.offer(batch(Class::P2, 8, 100));
        assert!(a.accepted);
        assert_eq!(a.dropped.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.used_bytes(), 700);
        // A bulk batch larger than its whole share is refused, evicting everything first.
        let a = s.offer(batch(Class::P2, 9, 800));
        assert!(!a.accepted);
        assert_eq!(s.counters().refused_p2, 1);
    }

    #[test]
    fn a_pressure_limit_sheds_bulk_at_once_and_on_offer_and_never_touches_p0_p1() {
        let mut s = spool();
        for seq in 1..=6 {
            s.offer(batch(Class::P2, seq, 100));
        }
        s.offer(batch(Class::P0, 7, 100));
        s.offer(batch(Class::P1, 8, 100));
        let sent = s.next_to_send(1000, 0).map(|x| x.1);
        assert_eq!(sent, Some(7), "P0 first");
        // Pressure: bulk may hold 250 bytes. Four of six bulk batches go at once, oldest
        // unsent first.
        let shed = s.set_bulk_limit(Some(250));
        assert_eq!(shed.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert_eq!((s.bulk_bytes(), s.used_bytes()), (200, 400));
        // A new bulk batch evicts the oldest held; P0 and P1 are not limited.
        let a = s.offer(batch(Class::P2, 9, 100));
        assert!(a.accepted && a.dropped.is_empty());
        assert_eq!(a.shed.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), vec![5]);
        for seq in 10..=12 {
            assert!(s.offer(batch(Class::P1, seq, 100)).accepted);
        }
        // A bulk batch over the limit on its own is shed itself, after the older bulk.
        let a = s.offer(batch(Class::P2, 13, 300));
        assert!(!a.accepted);
        assert_eq!(a.shed.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), vec![6, 9, 13]);
        assert_eq!(s.counters().shed_pressure, 4 + 1 + 3);
        assert_eq!((s.counters().evicted, s.counters().refused_p2), (0, 0), "not spool-full drops");
        // Lifted: bulk fills up to its share of the cap again.
        assert!(s.set_bulk_limit(None).is_empty());
        assert!(s.offer(batch(Class::P2, 14, 300)).accepted);
    }

    #[test]
    fn bulk_in_flight_stays_within_its_window_and_p0_passes_it() {
        let mut s = spool();
        for seq in 1..=4 {
            s.offer(batch(Class::P2, seq, 100));
        }
        let order = |s: &mut Spool| std::iter::from_fn(|| s.next_to_send(250, 0).map(|x| x.1)).collect::<Vec<_>>();
        assert_eq!(order(&mut s), vec![1, 2], "a third 100-byte bulk batch would pass 250");
        assert_eq!(s.bulk_in_flight_bytes(), 200);
        s.offer(batch(Class::P0, 9, 100));
        assert_eq!(order(&mut s), vec![9], "P0 is not held back by bulk's window");
        s.ack(&[(1, 1)], false);
        assert_eq!(order(&mut s), vec![3], "an ack opens the window");
        s.reconnected();
        assert_eq!(s.bulk_in_flight_bytes(), 0);
        assert_eq!(order(&mut s), vec![9, 2, 3]);
        // One oversized bulk batch may go when nothing bulk is in flight.
        let mut s = spool();
        s.offer(batch(Class::P2, 1, 400));
        assert_eq!(order(&mut s), vec![1]);
    }

    #[test]
    fn p0_evicts_bulk_before_it_can_be_refused() {
        let mut s = spool();
        for seq in 1..=7 {
            s.offer(batch(Class::P2, seq, 100));
        }
        // P0 uses its reserve first (no eviction needed) …
        assert!(s.offer(batch(Class::P0, 10, 200)).dropped.is_empty());
        // … then evicts bulk for more: 900 + 250 plus P1's unused 100 must fit in 1000.
        let a = s.offer(batch(Class::P0, 11, 250));
        assert!(a.accepted);
        assert_eq!(a.dropped.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(s.used_bytes(), 850);
        // P1's reserve was kept for it.
        let a = s.offer(batch(Class::P1, 12, 100));
        assert!(a.accepted);
        assert!(a.dropped.is_empty());
        assert_eq!(s.counters().refused_p0 + s.counters().refused_p1, 0);
        // Bulk now gets only what is left beyond everyone's reserves.
        let a = s.offer(batch(Class::P2, 13, 100));
        assert!(a.accepted);
        assert_eq!(a.dropped.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), vec![4]);
        // P0 may never take P1's reserve: with bulk gone, P0 stops at cap − p1_reserve.
        let mut s = spool();
        assert!(s.offer(batch(Class::P0, 20, 900)).accepted);
        let a = s.offer(batch(Class::P0, 21, 50));
        assert!(!a.accepted);
        assert_eq!(a.dropped.len(), 1, "the refused batch comes back to become loss records");
        assert_eq!(s.counters().refused_p0, 1);
        assert!(s.offer(batch(Class::P1, 22, 100)).accepted, "P1's reserve is still free");
    }

    #[test]
    fn send_order_acks_nacks_and_resend() {
        let mut s = spool();
        s.offer(batch(Class::P2, 1, 10));
        s.offer(batch(Class::P1, 2, 10));
        s.offer(batch(Class::P0, 3, 10));
        let order: Vec<u64> = std::iter::from_fn(|| s.next_to_send(usize::MAX, 0).map(|x| x.1)).collect();
        assert_eq!(order, [3, 2, 1], "P0, then P1, then bulk");
        let (freed, _) = s.ack(&[(1, 1), (3, 3)], false);
        assert_eq!(freed.len(), 2);
        assert_eq!(s.len(), 1);
        s.reconnected();
        assert_eq!(s.next_to_send(usize::MAX, 0).map(|x| x.1), Some(2), "unacked batches are sent again");
        let poisoned = s.nack(2).unwrap();
        assert_eq!(poisoned.batch_seq, 2);
        assert!(s.is_empty());
        assert_eq!(s.used_bytes(), 0);
    }

    /// Issue 20: an applied P0/P1 batch stays until its durable ack — held (in the
    /// bytes, in a resume), not sent again on the connection, sent again after a
    /// reconnect — and is released, as acked, before anything is refused for room.
    #[test]
    fn p0_p1_wait_for_the_durable_ack_and_are_released_before_a_refusal() {
        let mut s = Spool::new(SpoolConfig { cap_bytes: 1000, p0_reserve_bytes: 300, p1_reserve_bytes: 100 });
        s.offer(batch(Class::P0, 1, 500));
        s.offer(batch(Class::P1, 2, 50));
        s.offer(batch(Class::P2, 3, 100));
        while s.next_to_send(usize::MAX, 0).is_some() {}
        let (freed, kept) = s.ack(&[(1, 3)], true);
        assert_eq!(freed.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), [3], "bulk is freed when applied");
        assert_eq!(kept.iter().map(|k| k.batch_seq).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((s.len(), s.awaiting_durable(), s.used_bytes()), (0, 2, 550));
        assert!(s.is_empty(), "nothing unacked");
        assert_eq!(s.iter_held().map(|b| b.batch_seq).collect::<Vec<_>>(), [1, 2], "a resume lists them");
        assert_eq!(s.next_to_send(usize::MAX, 0), None, "not sent again on this connection");
        s.reconnected();
        let again: Vec<u64> = std::iter::from_fn(|| s.next_to_send(usize::MAX, 0).map(|x| x.1)).collect();
        assert_eq!(again, [1, 2], "sent again after a reconnect");
        let (_, kept) = s.ack(&[(1, 2)], true);
        assert_eq!(kept.len(), 2);
        let (freed, unacked) = s.durable(&[(2, 2)]);
        assert_eq!((freed.len(), unacked.len(), s.awaiting_durable(), s.used_bytes()), (1, 0, 1, 500));
        // Room for P1 beyond its reserve: no bulk to evict, so the awaiting P0 batch goes.
        let a = s.offer(batch(Class::P1, 4, 700));
        assert!(a.accepted && a.dropped.is_empty());
        assert_eq!(a.released.iter().map(|b| b.batch_seq).collect::<Vec<_>>(), [1]);
        assert_eq!(s.counters().released_undurable, 1);
        assert_eq!(s.used_bytes(), 700);
        // `none`: everything awaiting leaves as acked.
        while s.next_to_send(usize::MAX, 0).is_some() {}
        s.ack(&[(4, 4)], true);
        assert_eq!(s.release_awaiting().len(), 1);
        assert_eq!(s.used_bytes(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Offer(u8, usize),
        Send,
        Ack(u64, u64, bool),
        Durable(u64, u64),
        Nack(u64),
        Reconnect,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0u8..4, 1usize..400).prop_map(|(c, n)| Op::Offer(c, n)),
            2 => Just(Op::Send),
            1 => (0u64..60, 0u64..8, proptest::bool::ANY).prop_map(|(a, w, k)| Op::Ack(a, a + w, k)),
            1 => (0u64..60, 0u64..8).prop_map(|(a, w)| Op::Durable(a, a + w)),
            1 => (0u64..60).prop_map(Op::Nack),
            1 => Just(Op::Reconnect),
        ]
    }

    proptest::proptest! {
        /// Every offered batch is, at every step, in exactly one place: held (unacked, or
        /// awaiting a durable ack), dropped (evicted or refused), left acked (freed by an
        /// ack or a durable ack, or released for room) or nacked; bytes never exceed the
        /// cap, and each class's unused reserve stays free of the others.
        #[test]
        fn every_batch_is_accounted_for(ops in proptest::collection::vec(op(), 1..200)) {
            let cfg = SpoolConfig { cap_bytes: 2000, p0_reserve_bytes: 300, p1_reserve_bytes: 200 };
            let mut s = Spool::new(cfg);
            let (mut offered, mut dropped, mut acked, mut nacked) = (0u64, 0u64, 0u64, 0u64);
            let mut seq = 0;
            let mut sent = std::collections::BTreeSet::new();
            for op in ops {
                match op {
                    Op::Offer(c, n) => {
                        let class = Class::from_code(c);
                        offered += 1;
                        seq += 1;
                        let a = s.offer(batch(class, seq, n));
                        dropped += a.dropped.len() as u64;
                        acked += a.released.len() as u64;
                        proptest::prop_assert_eq!(a.accepted, !a.dropped.iter().any(|b| b.batch_seq == seq));
                    }
                    Op::Send => match s.next_to_send(usize::MAX, 0).map(|x| x.1) {
                        Some(q) => proptest::prop_assert!(sent.insert(q), "batch {} sent twice without a reconnect", q),
                        None => proptest::prop_assert!(
                            s.lanes.iter().flatten().all(|b| sent.contains(&b.batch_seq)),
                            "an unsent batch was not offered"
                        ),
                    },
                    Op::Ack(a, b, keep) => acked += s.ack(&[(a, b)], keep).0.len() as u64,
                    Op::Durable(a, b) => {
                        let (freed, unacked) = s.durable(&[(a, b)]);
                        acked += (freed.len() + unacked.len()) as u64;
                    }
                    Op::Nack(q) => nacked += u64::from(s.nack(q).is_some()),
                    Op::Reconnect => {
                        s.reconnected();
                        sent.clear();
                    }
                }
                proptest::prop_assert_eq!(
                    offered,
                    s.len() as u64 + s.awaiting_durable() as u64 + dropped + acked + nacked
                );
                proptest::prop_assert!(s.used_bytes() <= cfg.cap_bytes);
                let held: usize = s.iter_held().map(|b| b.bytes.len()).sum();
                proptest::prop_assert_eq!(held, s.used_bytes());
                let bulk = s.lane_bytes[2] + s.lane_bytes[3];
                let p0 = s.lane_bytes[0].max(cfg.p0_reserve_bytes);
                let p1 = s.lane_bytes[1].max(cfg.p1_reserve_bytes);
                proptest::prop_assert!(bulk + p0 + p1 <= cfg.cap_bytes, "a reserve was taken: {:?}", s.lane_bytes);
            }
            let c = *s.counters();
            proptest::prop_assert_eq!(c.accepted + c.refused_p0 + c.refused_p1 + c.refused_p2, offered);
            proptest::prop_assert_eq!(c.evicted + c.refused_p0 + c.refused_p1 + c.refused_p2, dropped);
        }
    }
}
