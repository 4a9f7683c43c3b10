//! The event stream's pure parts (`GET /v1/events`): event ids, the bounded log of the
//! last N events with resume and gap rules, and the node-state diff that turns polled
//! node state into health, liveness, P0-loss and loss-rate events. No clock, no I/O:
//! the shell (`api::events`, the `events` task) feeds it time and state.
//!
//! Call order: [`EventLog::push`] (under the core's lock, so events are in the order the
//! core produced them); a subscriber calls [`EventLog::start`] once with its
//! `Last-Event-ID`, then [`EventLog::read`] from the returned sequence number, and gets
//! a [`Gap`] whenever what it asked for is no longer held.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::Arc;

/// An event's id: `<aggregator_epoch>.<seq>@<instance>` (instance in 16 hex digits).
/// Sequence numbers start at 1 in each aggregator process; the epoch grows by one at
/// every restart from a snapshot, and the instance (random per process) tells apart two
/// processes that started without one — so a resume never silently skips across a
/// restart: an id of another epoch or instance gets a [`Gap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId {
    pub epoch: u64,
    pub seq: u64,
    pub instance: u64,
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}@{:016x}", self.epoch, self.seq, self.instance)
    }
}

/// Why an event id could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("event id {got:?}: expected <epoch>.<seq>@<instance> (e.g. 3.1042@00c0ffee00c0ffee), as sent in an event's id")]
pub struct BadEventId {
    pub got: String,
}

impl std::str::FromStr for EventId {
    type Err = BadEventId;

    fn from_str(s: &str) -> Result<Self, BadEventId> {
        let bad = || BadEventId { got: s.chars().take(80).collect() };
        let (head, instance) = s.split_once('@').ok_or_else(bad)?;
        let (epoch, seq) = head.split_once('.').ok_or_else(bad)?;
        let digits = |t: &str| !t.is_empty() && t.len() <= 20 && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(epoch) || !digits(seq) || instance.len() != 16 || !instance.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        Ok(Self {
            epoch: epoch.parse().map_err(|_| bad())?,
            seq: seq.parse().map_err(|_| bad())?,
            instance: u64::from_str_radix(instance, 16).map_err(|_| bad())?,
        })
    }
}

/// Why a subscriber misses events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapReason {
    /// The events after its id were evicted (the log holds the last N).
    Evicted,
    /// Its id belongs to another aggregator process (a restart, or another replica):
    /// nothing it knew carries over; re-list.
    OtherInstance,
}

impl GapReason {
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Evicted => "evicted",
            Self::OtherInstance => "other_instance",
        }
    }
}

/// Events a subscriber will never see: those after `from` up to and including `to`
/// (`to` is the id of the last one missed; the stream goes on after it). `missed` is
/// their number when both ids are of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    pub from: EventId,
    pub to: EventId,
    pub reason: GapReason,
    pub missed: Option<u64>,
}

/// Where a subscriber starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Start {
    /// The first sequence number to read.
    pub next: u64,
    /// What it missed before that, if anything.
    pub gap: Option<Gap>,
}

/// An id a subscriber cannot resume from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("event id {got} is ahead of this stream (its newest is {newest})")]
pub struct AheadOfStream {
    pub got: EventId,
    pub newest: EventId,
}

/// One event with its sequence number.
#[derive(Debug)]
pub struct Logged<T> {
    pub seq: u64,
    pub item: T,
}

/// The last `cap` events of this process, in order.
#[derive(Debug)]
pub struct EventLog<T> {
    epoch: u64,
    instance: u64,
    cap: usize,
    buf: VecDeque<Arc<Logged<T>>>,
    /// The sequence number the next event gets (the first is 1).
    next: u64,
    evicted: u64,
}

impl<T> EventLog<T> {
    /// An empty log holding at most `cap` events (at least 1).
    #[must_use]
    pub fn new(epoch: u64, instance: u64, cap: usize) -> Self {
        let cap = cap.max(1);
        Self { epoch, instance, cap, buf: VecDeque::with_capacity(cap.min(4096)), next: 1, evicted: 0 }
    }

    // --- getters ---

    /// The id of sequence number `seq` in this log.
    #[must_use]
    pub const fn id(&self, seq: u64) -> EventId {
        EventId { epoch: self.epoch, seq, instance: self.instance }
    }

    /// The newest event's id (`seq` 0: none yet).
    #[must_use]
    pub const fn last_id(&self) -> EventId {
        self.id(self.next.saturating_sub(1))
    }

    /// The oldest held event's sequence number (the next one's when empty).
    #[must_use]
    pub fn first_seq(&self) -> u64 {
        self.buf.front().map_or(self.next, |e| e.seq)
    }

    /// Events held, the cap, and events evicted so far.
    #[must_use]
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    #[must_use]
    pub const fn cap(&self) -> usize {
        self.cap
    }

    #[must_use]
    pub const fn evicted(&self) -> u64 {
        self.evicted
    }

    /// The held events, newest first.
    pub fn newest_first(&self) -> impl Iterator<Item = &Arc<Logged<T>>> {
        self.buf.iter().rev()
    }

    // --- mutators ---

    /// Appends an event (the oldest goes past the cap); returns its sequence number.
    pub fn push(&mut self, item: T) -> u64 {
        let seq = self.next;
        self.next = self.next.saturating_add(1);
        if self.buf.len() >= self.cap {
            self.buf.pop_front();
            self.evicted = self.evicted.saturating_add(1);
        }
        self.buf.push_back(Arc::new(Logged { seq, item }));
        seq
    }

    // --- subscribers ---

    /// Where a subscriber that last saw `after` starts (none: from the next event on).
    ///
    /// # Errors
    /// An id of this process newer than its newest event (never sent by it).
    pub fn start(&self, after: Option<EventId>) -> Result<Start, AheadOfStream> {
        let Some(after) = after else { return Ok(Start { next: self.next, gap: None }) };
        let first = self.first_seq();
        if after.epoch != self.epoch || after.instance != self.instance {
            let gap = Gap {
                from: after,
                to: self.id(first.saturating_sub(1)),
                reason: GapReason::OtherInstance,
                missed: None,
            };
            return Ok(Start { next: first, gap: Some(gap) });
        }
        if after.seq >= self.next {
            return Err(AheadOfStream { got: after, newest: self.last_id() });
        }
        let next = after.seq.saturating_add(1);
        Ok(match self.evicted_gap(next) {
            Some(gap) => Start { next: first, gap: Some(gap) },
            None => Start { next, gap: None },
        })
    }

    /// Up to `max` events from sequence number `next` on, appended to `out`.
    ///
    /// # Errors
    /// The events from `next` were evicted: the gap up to the oldest held one (read on
    /// from `gap.to.seq + 1`).
    pub fn read(&self, next: u64, max: usize, out: &mut Vec<Arc<Logged<T>>>) -> Result<(), Gap> {
        if let Some(gap) = self.evicted_gap(next) {
            return Err(gap);
        }
        let skip = usize::try_from(next.saturating_sub(self.first_seq())).unwrap_or(usize::MAX);
        out.extend(self.buf.iter().skip(skip).take(max).cloned());
        Ok(())
    }

    fn evicted_gap(&self, next: u64) -> Option<Gap> {
        let first = self.first_seq();
        (next < first).then(|| Gap {
            from: self.id(next.saturating_sub(1)),
            to: self.id(first - 1),
            reason: GapReason::Evicted,
            missed: Some(first - next),
        })
    }
}

/// A node's loss-rate band (`loss_rate` events are sent when it changes, not for every
/// loss interval): the share of its non-P0 frames lost over a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LossBand {
    /// Nothing lost.
    None,
    /// Below 0.1 %.
    Trace,
    /// Below 1 %.
    Low,
    /// Below 10 %.
    High,
    /// 10 % or more.
    Severe,
}

impl LossBand {
    /// The band of `lost` out of `frames` (received + lost).
    #[must_use]
    pub fn of(lost: u64, frames: u64) -> Self {
        if lost == 0 || frames == 0 {
            return Self::None;
        }
        let (lost, frames) = (u128::from(lost), u128::from(frames));
        if lost * 1000 < frames {
            Self::Trace
        } else if lost * 100 < frames {
            Self::Low
        } else if lost * 10 < frames {
            Self::High
        } else {
            Self::Severe
        }
    }

    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Trace => "below_0.1%",
            Self::Low => "below_1%",
            Self::High => "below_10%",
            Self::Severe => "10%_or_more",
        }
    }
}

/// One node's state as the `events` task polls it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeView {
    pub name: String,
    pub health: &'static str,
    pub liveness: &'static str,
    pub connected: bool,
    /// Per GPU (uuid hex): health.
    pub gpus: BTreeMap<String, &'static str>,
    /// P0 frames lost and attempted, running totals.
    pub p0_lost: u64,
    pub p0_attempted: u64,
    /// Non-P0 frames lost and seen (received + lost), running totals.
    pub bulk_lost: u64,
    pub bulk_frames: u64,
}

/// A change the `events` task reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeChange {
    Health { node: String, gpu: Option<String>, health: &'static str, previous: Option<&'static str> },
    Liveness { node: String, liveness: &'static str, connected: bool, previous: Option<(&'static str, bool)> },
    P0Loss { node: String, lost: u64, lost_total: u64, attempted_total: u64 },
    LossRate { node: String, band: LossBand, previous: LossBand, lost: u64, frames: u64, window_ns: u64 },
}

/// Per node, the loss-rate window in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    started_ns: u64,
    lost: u64,
    frames: u64,
    band: LossBand,
}

/// The diff between polls: what changed since the last [`NodeDiff::poll`]. A node seen
/// for the first time reports its health and liveness (previous `None`); a node that
/// disappears from the view (forgotten by the core) reports nothing more.
#[derive(Debug, Clone, Default)]
pub struct NodeDiff {
    last: BTreeMap<u64, NodeView>,
    windows: BTreeMap<u64, Window>,
    window_ns: u64,
}

impl NodeDiff {
    /// Loss rates are judged over windows of `window_ns` (aggregator time).
    #[must_use]
    pub fn new(window_ns: u64) -> Self {
        Self { window_ns: window_ns.max(1), ..Self::default() }
    }

    /// The changes from the last poll to `now`'s `views` (keyed by node id), each with
    /// its node's id.
    pub fn poll(&mut self, now: u64, views: BTreeMap<u64, NodeView>, out: &mut Vec<(u64, NodeChange)>) {
        for (id, v) in &views {
            let prev = self.last.get(id);
            if prev.is_none_or(|p| p.health != v.health) {
                out.push((
                    *id,
                    NodeChange::Health {
                        node: v.name.clone(),
                        gpu: None,
                        health: v.health,
                        previous: prev.map(|p| p.health),
                    },
                ));
            }
            for (uuid, h) in &v.gpus {
                let was = prev.and_then(|p| p.gpus.get(uuid).copied());
                if was != Some(*h) {
                    out.push((
                        *id,
                        NodeChange::Health { node: v.name.clone(), gpu: Some(uuid.clone()), health: h, previous: was },
                    ));
                }
            }
            if prev.is_none_or(|p| (p.liveness, p.connected) != (v.liveness, v.connected)) {
                out.push((
                    *id,
                    NodeChange::Liveness {
                        node: v.name.clone(),
                        liveness: v.liveness,
                        connected: v.connected,
                        previous: prev.map(|p| (p.liveness, p.connected)),
                    },
                ));
            }
            // First sight (a restart of this process or of the task): the running total is
            // not news; only growth from here on is.
            let lost_before = prev.map_or(v.p0_lost, |p| p.p0_lost);
            if v.p0_lost > lost_before {
                out.push((
                    *id,
                    NodeChange::P0Loss {
                        node: v.name.clone(),
                        lost: v.p0_lost - lost_before,
                        lost_total: v.p0_lost,
                        attempted_total: v.p0_attempted,
                    },
                ));
            }
            let w = self.windows.entry(*id).or_insert(Window {
                started_ns: now,
                lost: v.bulk_lost,
                frames: v.bulk_frames,
                band: LossBand::None,
            });
            if now.saturating_sub(w.started_ns) >= self.window_ns {
                let (lost, frames) = (v.bulk_lost.saturating_sub(w.lost), v.bulk_frames.saturating_sub(w.frames));
                // A window without frames says nothing about the rate: the band stands.
                let band = if frames == 0 { w.band } else { LossBand::of(lost, frames) };
                if band != w.band {
                    out.push((
                        *id,
                        NodeChange::LossRate {
                            node: v.name.clone(),
                            band,
                            previous: w.band,
                            lost,
                            frames,
                            window_ns: now.saturating_sub(w.started_ns),
                        },
                    ));
                }
                *w = Window { started_ns: now, lost: v.bulk_lost, frames: v.bulk_frames, band };
            }
        }
        self.windows.retain(|id, _| views.contains_key(id));
        self.last = views;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(cap: usize) -> EventLog<u32> {
        EventLog::new(3, 0xabc, cap)
    }

    fn read_all(l: &EventLog<u32>, next: u64) -> Result<Vec<(u64, u32)>, Gap> {
        let mut out = Vec::new();
        l.read(next, 1000, &mut out)?;
        Ok(out.iter().map(|e| (e.seq, e.item)).collect())
    }

    #[test]
    fn ids_round_trip_and_bad_ones_are_refused_with_the_expected_shape() {
        let id = EventId { epoch: 3, seq: 1042, instance: 0x00c0_ffee };
        assert_eq!(id.to_string(), "3.1042@0000000000c0ffee");
        assert_eq!(id.to_string().parse::<EventId>(), Ok(id));
        for bad in [
            "",
            "3",
            "3.1",
            "3.1@",
            "3.1@xyz",
            "a.1@0000000000c0ffee",
            "3.-1@0000000000c0ffee",
            "3.1@00c0ffee",
            "3..1@0000000000c0ffee",
            "99999999999999999999999.1@0000000000000000",
        ] {
            let e = bad.parse::<EventId>().expect_err(bad);
            assert!(e.to_string().contains("<epoch>.<seq>@<instance>"), "{e}");
        }
    }

    #[test]
    fn a_subscriber_without_an_id_starts_at_the_next_event() {
        let mut l = log(4);
        l.push(1);
        let s = l.start(None).unwrap();
        assert_eq!(s, Start { next: 2, gap: None });
        assert_eq!(read_all(&l, s.next), Ok(vec![]));
        l.push(2);
        assert_eq!(read_all(&l, s.next), Ok(vec![(2, 2)]));
    }

    #[test]
    fn resume_continues_after_the_id_while_it_is_held() {
        let mut l = log(4);
        for i in 10..13 {
            l.push(i);
        }
        assert_eq!(l.last_id(), EventId { epoch: 3, seq: 3, instance: 0xabc });
        let s = l.start(Some(l.id(1))).unwrap();
        assert_eq!(s, Start { next: 2, gap: None });
        assert_eq!(read_all(&l, 2), Ok(vec![(2, 11), (3, 12)]));
        // The newest id: nothing missed, nothing to read yet.
        assert_eq!(l.start(Some(l.id(3))).unwrap(), Start { next: 4, gap: None });
        // Seq 0 of this process (a list taken before any event): everything held.
        assert_eq!(l.start(Some(l.id(0))).unwrap(), Start { next: 1, gap: None });
    }

    #[test]
    fn an_evicted_id_gets_a_gap_counting_what_was_missed() {
        let mut l = log(3);
        for i in 0..10 {
            l.push(i);
        }
        assert_eq!((l.len(), l.evicted(), l.first_seq()), (3, 7, 8));
        let s = l.start(Some(l.id(2))).unwrap();
        let gap = s.gap.expect("a gap");
        assert_eq!((gap.from, gap.to, gap.reason, gap.missed), (l.id(2), l.id(7), GapReason::Evicted, Some(5)));
        assert_eq!(s.next, 8);
        // A subscriber that fell behind while reading gets the same.
        let g = read_all(&l, 5).expect_err("evicted");
        assert_eq!((g.from, g.to, g.missed), (l.id(4), l.id(7), Some(3)));
        assert_eq!(read_all(&l, g.to.seq + 1), Ok(vec![(8, 7), (9, 8), (10, 9)]));
    }

    #[test]
    fn an_id_of_another_epoch_or_instance_gets_a_gap_whatever_its_seq() {
        let mut l = log(8);
        for i in 0..3 {
            l.push(i);
        }
        for other in [EventId { epoch: 2, seq: 1, instance: 0xabc }, EventId { epoch: 3, seq: 1, instance: 0xdef }] {
            let s = l.start(Some(other)).unwrap();
            let gap = s.gap.expect("gap");
            assert_eq!((gap.from, gap.to, gap.reason, gap.missed), (other, l.id(0), GapReason::OtherInstance, None));
            assert_eq!(s.next, 1, "everything this process holds follows the gap");
        }
    }

    #[test]
    fn an_id_ahead_of_the_stream_is_refused() {
        let mut l = log(8);
        l.push(1);
        let e = l.start(Some(l.id(5))).unwrap_err();
        assert_eq!(e.newest, l.id(1));
    }

    #[test]
    fn reads_are_bounded() {
        let mut l = log(100);
        for i in 0..50 {
            l.push(i);
        }
        let mut out = Vec::new();
        l.read(1, 16, &mut out).unwrap();
        assert_eq!(out.len(), 16);
        assert_eq!(out.last().map(|e| e.seq), Some(16));
    }

    #[test]
    fn loss_bands() {
        assert_eq!(LossBand::of(0, 100), LossBand::None);
        assert_eq!(LossBand::of(5, 0), LossBand::None);
        assert_eq!(LossBand::of(1, 10_000), LossBand::Trace);
        assert_eq!(LossBand::of(1, 1_000), LossBand::Low);
        assert_eq!(LossBand::of(5, 100), LossBand::High);
        assert_eq!(LossBand::of(10, 100), LossBand::Severe);
        assert_eq!(LossBand::of(u64::MAX, u64::MAX), LossBand::Severe);
    }

    fn view(health: &'static str, liveness: &'static str, p0_lost: u64, bulk: (u64, u64)) -> NodeView {
        NodeView {
            name: "node-00".into(),
            health,
            liveness,
            connected: true,
            gpus: BTreeMap::from([("aa".to_owned(), health)]),
            p0_lost,
            p0_attempted: 1000,
            bulk_lost: bulk.0,
            bulk_frames: bulk.1,
        }
    }

    #[test]
    fn the_diff_reports_changes_only() {
        let mut d = NodeDiff::new(1_000);
        let mut out: Vec<(u64, NodeChange)> = Vec::new();
        d.poll(0, BTreeMap::from([(1, view("healthy", "fresh", 0, (0, 0)))]), &mut out);
        assert_eq!(out.len(), 3, "first sight: node health, GPU health, liveness: {out:?}");
        assert!(out.iter().all(|(id, _)| *id == 1));
        out.clear();
        d.poll(500, BTreeMap::from([(1, view("healthy", "fresh", 0, (0, 100)))]), &mut out);
        assert_eq!(out, vec![], "nothing changed");
        d.poll(600, BTreeMap::from([(1, view("healthy_lossy", "fresh", 7, (0, 100)))]), &mut out);
        let got: Vec<NodeChange> = out.drain(..).map(|(_, c)| c).collect();
        let out = got;
        assert!(matches!(
            &out[0],
            NodeChange::Health { gpu: None, health: "healthy_lossy", previous: Some("healthy"), .. }
        ));
        assert!(matches!(&out[1], NodeChange::Health { gpu: Some(_), health: "healthy_lossy", .. }));
        assert!(matches!(&out[2], NodeChange::P0Loss { lost: 7, lost_total: 7, attempted_total: 1000, .. }), "{out:?}");
        assert_eq!(out.len(), 3);
        let mut more = Vec::new();
        d.poll(700, BTreeMap::from([(1, view("healthy_lossy", "silent", 7, (0, 100)))]), &mut more);
        assert!(matches!(
            &more[..],
            [(1, NodeChange::Liveness { liveness: "silent", previous: Some(("fresh", true)), .. })]
        ));
    }

    #[test]
    fn a_p0_loss_total_seen_first_is_not_news() {
        let mut d = NodeDiff::new(1_000);
        let mut out = Vec::new();
        d.poll(0, BTreeMap::from([(1, view("healthy_lossy", "fresh", 40, (0, 0)))]), &mut out);
        assert!(!out.iter().any(|(_, c)| matches!(c, NodeChange::P0Loss { .. })), "{out:?}");
        out.clear();
        d.poll(1, BTreeMap::from([(1, view("healthy_lossy", "fresh", 45, (0, 0)))]), &mut out);
        assert!(matches!(&out[..], [(1, NodeChange::P0Loss { lost: 5, lost_total: 45, .. })]), "{out:?}");
    }

    #[test]
    fn loss_rate_events_come_when_the_band_changes_not_every_window() {
        let mut d = NodeDiff::new(1_000);
        let mut out = Vec::new();
        let at = |d: &mut NodeDiff, t: u64, lost: u64, frames: u64, out: &mut Vec<NodeChange>| {
            let mut raw = Vec::new();
            d.poll(t, BTreeMap::from([(1, view("healthy", "fresh", 0, (lost, frames)))]), &mut raw);
            out.extend(raw.into_iter().map(|(_, c)| c));
        };
        at(&mut d, 0, 0, 0, &mut out);
        out.clear();
        // 5 % over the first window; the same over the second: one event.
        at(&mut d, 1_000, 50, 1_000, &mut out);
        at(&mut d, 2_000, 100, 2_000, &mut out);
        assert!(
            matches!(
                &out[..],
                [NodeChange::LossRate {
                    band: LossBand::High,
                    previous: LossBand::None,
                    lost: 50,
                    frames: 1000,
                    window_ns: 1000,
                    ..
                }]
            ),
            "{out:?}"
        );
        out.clear();
        // An idle window keeps the band; a clean one ends it.
        at(&mut d, 3_000, 100, 2_000, &mut out);
        assert_eq!(out, vec![]);
        at(&mut d, 4_000, 100, 3_000, &mut out);
        assert!(
            matches!(&out[..], [NodeChange::LossRate { band: LossBand::None, previous: LossBand::High, .. }]),
            "{out:?}"
        );
    }
}
