//! What the I/O tasks share: the core behind one lock, the verdict store behind another,
//! the node registry, and counters.
//!
//! The core is one state machine (`ringwatch_core::Core`); connection tasks and the timer
//! task lock it for one batch or one timeout at a time and never across an `.await`.
//! Its events go to the `VerdictStore` (latest per (op, rank), bounded by age and bytes)
//! while the core's lock is still held, so they land in the order the core produced
//! them; locks are always taken core first, store second. A query locks only the store,
//! for one bounded page.
//! The registry is read by every HTTP request and written on connect/disconnect: a
//! `DashMap` (read-mostly, never on the per-frame path).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use dashmap::DashMap;
use ringwatch_core::{Core, NodeId, VerdictStore};

use crate::events::EventLog;

/// Counters of the I/O shell (the core counts its own).
#[derive(Debug, Default)]
pub struct Counters {
    pub connections: AtomicU64,
    pub handshake_failures: AtomicU64,
    /// Peers whose certificate had no usable DNS name.
    pub identity_refused: AtomicU64,
    /// Batches whose `node_id` disagreed with the certificate's name.
    pub node_mismatch: AtomicU64,
    pub batches_applied: AtomicU64,
    pub batches_duplicate: AtomicU64,
    /// Batches rejected (nacked), by `NackReason` code (0..16).
    pub rejected_by_reason: [AtomicU64; 16],
    /// Batch streams that failed before their end (reset, connection lost).
    pub stream_errors: AtomicU64,
    pub protocol_errors: AtomicU64,
    /// Acks held back by the test hook.
    pub acks_held: AtomicU64,
    /// Connections closed for too many rejected batches.
    pub connections_closed_abuse: AtomicU64,
    pub snapshots_written: AtomicU64,
    pub snapshot_failures: AtomicU64,
    /// Snapshot attempts that failed since the last one that succeeded.
    pub snapshot_failures_in_a_row: AtomicU64,
    pub last_snapshot_bytes: AtomicU64,
    /// How long the last snapshot held the core's lock (µs), and when it was taken.
    pub last_snapshot_hold_us: AtomicU64,
    pub last_snapshot_at_ms: AtomicU64,
    /// P0/P1 batches acked `durable` (a snapshot on disk holds them).
    pub batches_durable: AtomicU64,
    /// P0/P1 batches a connection could not remember for a durable ack (its list of
    /// 65,536 was full): their shipper keeps them until the next connection, or until
    /// its spool needs the room.
    pub durable_untracked: AtomicU64,
    /// Connections that spoke control protocol 2 (a shipper one version behind: its acks
    /// all mean applied).
    pub connections_protocol_2: AtomicU64,
    /// Connections refused for a control protocol this aggregator does not speak.
    pub protocol_refused: AtomicU64,
}

impl Counters {
    /// Adds one.
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Rejections, by reason code.
    #[must_use]
    pub fn rejected(&self) -> BTreeMap<u16, u64> {
        self.rejected_by_reason
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let n = c.load(Ordering::Relaxed);
                (n > 0).then(|| (u16::try_from(i).unwrap_or(0), n))
            })
            .collect()
    }
}

/// One long-lived task's health, for `/healthz` (issue 18).
#[derive(Debug)]
pub struct TaskHealth {
    pub name: &'static str,
    /// Whether the task is running (false once it ended or died).
    pub alive: AtomicBool,
    /// Panics caught (an I/O task restarts in place after one; the core's tasks do not).
    pub panics: AtomicU64,
    pub restarts: AtomicU64,
    /// Real ms since the aggregator started at the task's last progress (the timer's
    /// tick, a connection accepted, a request served, a snapshot written); 0 = none yet.
    pub last_progress_real_ms: AtomicU64,
}

impl TaskHealth {
    const fn new(name: &'static str) -> Self {
        Self {
            name,
            alive: AtomicBool::new(false),
            panics: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            last_progress_real_ms: AtomicU64::new(0),
        }
    }
}

/// The aggregator's long-lived tasks, and panics caught in short-lived ones.
#[derive(Debug)]
pub struct Tasks {
    /// The core's timers (a panic there ends the process).
    pub timers: TaskHealth,
    /// The QUIC accept loop.
    pub ingest: TaskHealth,
    /// The HTTP server.
    pub http: TaskHealth,
    /// The snapshot schedule (alive only when snapshots are configured).
    pub snapshots: TaskHealth,
    /// The memory-pressure watcher's follower (alive only when `psi` is on and PSI is
    /// available here).
    pub pressure: TaskHealth,
    /// The event stream's node-state poll (health, liveness, P0 loss, loss rates).
    pub events: TaskHealth,
    /// The OTLP exporter (alive only when `otlp_export` is on).
    pub otlp: TaskHealth,
    /// The certificate reload (alive unless `tls_reload_interval_ms` is 0).
    pub tls: TaskHealth,
    /// A shard role's bus work (alive only in the shard roles): an ingest shard's record
    /// publisher, a matcher shard's record consumer, the API role's verdict consumer.
    pub cluster: TaskHealth,
    /// A shard role's state traffic: an ingest shard's node summaries, a matcher shard's
    /// event publisher, the API role's state consumer.
    pub cluster_state: TaskHealth,
    /// Panics caught in a connection's or a batch stream's task (that connection is
    /// closed; its shipper reconnects and resends what was not acked).
    pub connection_panics: AtomicU64,
    /// Panics caught in an HTTP handler (answered 500).
    pub handler_panics: AtomicU64,
}

impl Default for Tasks {
    fn default() -> Self {
        Self {
            timers: TaskHealth::new("timers"),
            ingest: TaskHealth::new("ingest"),
            http: TaskHealth::new("http"),
            snapshots: TaskHealth::new("snapshots"),
            pressure: TaskHealth::new("pressure"),
            events: TaskHealth::new("events"),
            otlp: TaskHealth::new("otlp"),
            tls: TaskHealth::new("tls"),
            cluster: TaskHealth::new("cluster"),
            cluster_state: TaskHealth::new("cluster_state"),
            connection_panics: AtomicU64::new(0),
            handler_panics: AtomicU64::new(0),
        }
    }
}

impl Tasks {
    /// Every long-lived task.
    #[must_use]
    pub fn all(&self) -> [&TaskHealth; 10] {
        [
            &self.timers,
            &self.ingest,
            &self.http,
            &self.snapshots,
            &self.pressure,
            &self.events,
            &self.otlp,
            &self.tls,
            &self.cluster,
            &self.cluster_state,
        ]
    }
}

/// The core cannot be used: a panic happened while it was being updated (its state may
/// be half-mutated), or a task that drives it died. The process is ending (non-zero, so
/// a supervisor restarts it from its last snapshot); nothing may be acked or
/// snapshotted from here on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the core failed; the aggregator is exiting to restart from its snapshot")]
pub struct CoreFailed;

/// Real ns in aggregator time at `time_scale` (1, or ≤ 0: unchanged).
#[must_use]
pub fn scale_ns(ns: u64, time_scale: f64) -> u64 {
    if time_scale <= 0.0 || (time_scale - 1.0).abs() < f64::EPSILON {
        return ns;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "ns of a run"
    )]
    let scaled = (ns as f64 * time_scale) as u64;
    scaled
}

/// How often a throttled log line may repeat.
pub const LOG_SUMMARY_MS: u64 = 10_000;

/// A log line that repeats at most once per period; what it held back is counted and
/// said in the next one.
#[derive(Debug, Default)]
pub struct LogThrottle {
    /// Real ms of the last line (none yet).
    last_ms: std::sync::Mutex<Option<u64>>,
    suppressed: AtomicU64,
}

impl LogThrottle {
    /// Whether to log now (`now_ms`, real time); `Some(n)`: yes, and `n` lines were held
    /// back since the last one.
    pub fn allow(&self, now_ms: u64, period_ms: u64) -> Option<u64> {
        let mut last = self.last_ms.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_some_and(|l| now_ms.saturating_sub(l) < period_ms) {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now_ms);
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

/// One node as the registry knows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeEntry {
    pub name: String,
    /// Its connections open now (a reconnecting shipper's old connection may close after
    /// its new one opened): connected while any is.
    pub live: u32,
    /// Connections ever accepted from it.
    pub connections: u64,
    pub last_shipper_session: u64,
}

impl NodeEntry {
    /// Whether any of its connections is open.
    #[must_use]
    pub fn connected(&self) -> bool {
        self.live > 0
    }
}

/// The aggregator's own memory pressure: the watcher's state, why there is none, and
/// what its P3 shedding did.
#[derive(Debug, Default)]
pub struct PressureShared {
    pub state: Mutex<Option<tokio::sync::watch::Receiver<ringwatch_transport::psi::PressureState>>>,
    pub unavailable: Mutex<Option<String>>,
    /// The watcher was armed: its follower's end is then a fault (`/healthz`).
    pub armed: AtomicBool,
    pub sheds: AtomicU64,
    pub rss_returned_bytes: AtomicU64,
}

/// `/v1/summary`'s `correlated_degradation`: more than `correlated_share_pct` % of the
/// nodes turned `degraded` or `healthy_lossy` within `correlated_window_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryConfig {
    pub correlated_share_pct: u64,
    pub correlated_window_ns: u64,
}

impl Default for SummaryConfig {
    fn default() -> Self {
        Self { correlated_share_pct: 25, correlated_window_ns: 60_000_000_000 }
    }
}

/// The event stream (`GET /v1/events`): the bounded log, the subscribers' wake-up, and
/// counters.
#[derive(Debug)]
pub struct EventsShared {
    pub config: crate::api::events::EventsConfig,
    log: Mutex<EventLog<crate::api::events::Event>>,
    /// The newest event's sequence number, as pushed …
    pub newest: AtomicU64,
    /// … and as announced to subscribers (they wait on it) by the `events` task, every
    /// few ms: waking every subscriber is O(subscribers), never done under the core's
    /// lock.
    pub wake: tokio::sync::watch::Sender<u64>,
    pub subscribers: AtomicU64,
    pub refused: AtomicU64,
    pub gaps_sent: AtomicU64,
    /// The aggregator is stopping: streams end.
    pub closing: AtomicBool,
}

impl EventsShared {
    fn new(epoch: u64, instance: u64, config: crate::api::events::EventsConfig) -> Self {
        Self {
            config,
            log: Mutex::new(EventLog::new(epoch, instance, config.capacity)),
            newest: AtomicU64::new(0),
            wake: tokio::sync::watch::Sender::new(0),
            subscribers: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            gaps_sent: AtomicU64::new(0),
            closing: AtomicBool::new(false),
        }
    }
}

/// Everything shared.
#[derive(Debug)]
pub struct Shared {
    pub started: Instant,
    /// Aggregator time at `started` (0, or the restored snapshot's time plus downtime).
    pub base_ns: u64,
    /// Aggregator time runs this many times faster than real time (1 in production;
    /// `loadgen` compresses simulated runs with it, the simulator's clocks alike).
    pub time_scale: f64,
    /// Whether the state was restored from a snapshot.
    pub restored: bool,
    /// A snapshot found at start that this build cannot read (another format version):
    /// the aggregator started fresh in its place, with every node's knowledge gap from
    /// its time; the file was moved aside to this path.
    pub snapshot_skipped: Option<(u32, String)>,
    /// This process's memory pressure and its P3 shedding.
    pub pressure: PressureShared,
    /// What an ack promises (`hello`): `snapshot` when snapshots are configured.
    pub durability: proto_flat::codes::Durability,
    /// The newest control protocol this aggregator speaks (tests set 2 to stand in for
    /// the previous release).
    pub max_control_version: u16,
    /// Snapshots captured so far: a batch applied while it was `g` is in every snapshot
    /// captured after, so durable once one numbered above `g` is on disk. Written under
    /// the core's lock.
    pub capture_gen: AtomicU64,
    /// The capture number of the newest snapshot written to disk.
    pub durable_gen: tokio::sync::watch::Sender<u64>,
    core: Mutex<Core>,
    store: Mutex<VerdictStore>,
    pub nodes: DashMap<NodeId, NodeEntry>,
    /// The event stream's log and subscribers.
    pub events: EventsShared,
    /// The API's bearer token (none: the API asks for none).
    pub api_token: Option<crate::api::auth::TokenFile>,
    /// Requests answered 401 (no token, or the wrong one).
    pub http_unauthorized: AtomicU64,
    /// The HTTP listener's connection cap (for `/v1/summary`'s saturation).
    pub http_max_connections: u64,
    /// `/v1/summary`'s correlated-degradation rule.
    pub summary: SummaryConfig,
    pub counters: Counters,
    pub instance: u64,
    pub epoch: u64,
    /// Test hook: withhold acks from this aggregator time on (the shippers' spools then
    /// hold every batch applied since).
    pub hold_acks_from_ns: Option<u64>,
    /// Test hook (feature `test-hooks`, `GET /test/arm-timer-panic`): the timer task
    /// panics, holding the core's lock, at its next turn.
    pub test_panic_timer: AtomicBool,
    pub tasks: Tasks,
    /// The HTTP listener's counters (connections, the cap, header timeouts).
    pub http: Arc<ringwatch_transport::http::HttpCounters>,
    /// Handshake failures and refused identities are logged one line per
    /// [`LOG_SUMMARY_MS`] at most (a storm of garbage Initials must not flood the log).
    pub handshake_log: LogThrottle,
    /// The snapshot task's buffers, kept from one snapshot to the next.
    pub snapshot_buffers: std::sync::Mutex<crate::snapshots::Buffers>,
    /// Time to capture and write each snapshot (served by `/metrics`).
    pub snapshot_seconds: prometheus::Histogram,
    /// What the OTLP exporter did (all zero while it is off).
    pub otlp: crate::otlp::OtlpCounters,
    /// Certificate reloads of the QUIC listener and (with `http_tls_cert`) the HTTP one.
    pub tls_quic: Arc<ringwatch_transport::reload::ReloadCounters>,
    pub tls_http: Option<Arc<ringwatch_transport::reload::ReloadCounters>>,
    /// The certificate reload runs (`tls_reload_interval_ms` > 0).
    pub tls_reload_on: AtomicBool,
    /// Why the core failed (see [`CoreFailed`]); `None` while it serves.
    failure: tokio::sync::watch::Sender<Option<String>>,
    /// The shard role this process runs (none: `all`).
    pub cluster_role: Option<crate::cluster::ShardRole>,
    /// What the shard roles did.
    pub cluster: crate::cluster::ClusterCounters,
    /// Woken when a shard role's publisher has put something on the bus (a waiting batch
    /// stream or record consumer looks again).
    pub publish_drained: tokio::sync::Notify,
    /// A matcher shard keeps every event drained for the bus (in its core).
    events_for_bus: AtomicBool,
    /// An ingest shard stopping in order: batches read from now on are not applied (their
    /// shippers keep them and send them to the next instance).
    pub draining: AtomicBool,
    /// P0/P1 batches acked `applied` whose `ack durable` is not yet written, over every
    /// connection (an orderly stop waits for them).
    pub awaiting_durable: AtomicU64,
}

impl Shared {
    /// Shared state around a fresh core.
    #[must_use]
    pub fn new(core: Core, store: VerdictStore, instance: u64, epoch: u64, hold_acks_from_ns: Option<u64>) -> Self {
        Self {
            started: Instant::now(),
            base_ns: 0,
            time_scale: 1.0,
            restored: false,
            snapshot_skipped: None,
            pressure: PressureShared::default(),
            durability: proto_flat::codes::Durability::None,
            max_control_version: proto_flat::control::CONTROL_VERSION,
            capture_gen: AtomicU64::new(0),
            durable_gen: tokio::sync::watch::Sender::new(0),
            core: Mutex::new(core),
            store: Mutex::new(store),
            nodes: DashMap::new(),
            events: EventsShared::new(epoch, instance, crate::api::events::EventsConfig::default()),
            api_token: None,
            http_unauthorized: AtomicU64::new(0),
            http_max_connections: 0,
            summary: SummaryConfig::default(),
            counters: Counters::default(),
            instance,
            epoch,
            hold_acks_from_ns,
            test_panic_timer: AtomicBool::new(false),
            tasks: Tasks::default(),
            http: Arc::default(),
            handshake_log: LogThrottle::default(),
            snapshot_buffers: std::sync::Mutex::new(crate::snapshots::Buffers::default()),
            snapshot_seconds: crate::metrics::snapshot_histogram(),
            otlp: crate::otlp::OtlpCounters::default(),
            tls_quic: Arc::default(),
            tls_http: None,
            tls_reload_on: AtomicBool::new(false),
            failure: tokio::sync::watch::Sender::new(None),
            cluster_role: None,
            cluster: crate::cluster::ClusterCounters::default(),
            publish_drained: tokio::sync::Notify::new(),
            events_for_bus: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            awaiting_durable: AtomicU64::new(0),
        }
    }

    /// Real ms since start (task progress is measured in real time).
    #[must_use]
    pub fn real_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Notes progress of a long-lived task.
    pub fn progress(&self, task: &TaskHealth) {
        task.last_progress_real_ms.store(self.real_ms().max(1), Ordering::Relaxed);
    }

    /// The core failed: logged once; everything waiting on [`Self::failed`] wakes (the
    /// binary exits non-zero).
    pub fn fail(&self, why: impl Into<String>) {
        let why = why.into();
        let first = self.failure.send_if_modified(|f| {
            if f.is_some() {
                return false;
            }
            *f = Some(why.clone());
            true
        });
        if first {
            tracing::error!(reason = %why, "core failed: exiting so the aggregator restarts from its snapshot");
        }
    }

    /// Why the core failed, if it did.
    #[must_use]
    pub fn failure(&self) -> Option<String> {
        self.failure.borrow().clone()
    }

    /// Resolves when the core fails, with why.
    pub async fn failed(&self) -> String {
        let mut rx = self.failure.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone().unwrap_or_default(),
            // The sender lives in `self`: never dropped while this borrow lives.
            Err(_) => String::new(),
        }
    }

    /// Whether a panic happened while the core's lock was held (checked after a task
    /// panicked: was it mid-update?).
    #[must_use]
    pub fn core_poisoned(&self) -> bool {
        self.core.is_poisoned() || self.store.is_poisoned()
    }

    /// Aggregator time (the core's `now`): ns since the first start, continued across
    /// restarts from the snapshot.
    #[must_use]
    pub fn now(&self) -> u64 {
        self.base_ns.saturating_add(self.aggregator_ns(self.started.elapsed()))
    }

    /// A real duration (time since start, a connection's RTT) in aggregator time, which
    /// runs `time_scale` times faster in compressed test runs.
    #[must_use]
    pub fn aggregator_ns(&self, real: std::time::Duration) -> u64 {
        scale_ns(u64::try_from(real.as_nanos()).unwrap_or(u64::MAX), self.time_scale)
    }

    /// The core, locked.
    ///
    /// # Errors
    /// [`CoreFailed`] once the core failed — a panic while its lock was held (the lock is
    /// poisoned: the state may be half-updated, so it is never used again, acked from or
    /// snapshotted; the process exits and restarts from its last snapshot), or a task
    /// that drives it died.
    pub fn core(&self) -> Result<MutexGuard<'_, Core>, CoreFailed> {
        match self.core.lock() {
            Ok(guard) if self.failure.borrow().is_none() => Ok(guard),
            Ok(_) => Err(CoreFailed),
            Err(_) => {
                self.fail("a panic while the core's lock was held: its state may be half-updated");
                Err(CoreFailed)
            }
        }
    }

    /// The verdict store, locked. It is written under the core's lock; a panic while it
    /// was held fails the core the same way (reads still get the store).
    pub fn store(&self) -> MutexGuard<'_, VerdictStore> {
        self.store.lock().unwrap_or_else(|poisoned| {
            self.fail("a panic while the verdict store's lock was held");
            poisoned.into_inner()
        })
    }

    /// The event stream's configuration (at start, before any event).
    pub fn configure_events(&mut self, config: crate::api::events::EventsConfig) {
        self.events = EventsShared::new(self.epoch, self.instance, config);
    }

    /// The event log, locked (after the core's and the store's locks when those are
    /// held; for a bounded copy or a push).
    pub fn events_log(&self) -> MutexGuard<'_, EventLog<crate::api::events::Event>> {
        self.events.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends events to the log (the caller holds the core's lock, so they are in the
    /// core's order); the `events` task wakes the subscribers ([`Self::wake_subscribers`]).
    pub fn push_events(&self, now: u64, events: impl IntoIterator<Item = crate::api::events::Event>) {
        let mut log = self.events_log();
        for mut e in events {
            e.at_ns = now;
            log.push(e);
        }
        self.events.newest.store(log.last_id().seq, Ordering::Release);
    }

    /// Wakes the subscribers if events came since the last call.
    pub fn wake_subscribers(&self) {
        let newest = self.events.newest.load(Ordering::Acquire);
        self.events.wake.send_if_modified(|n| {
            let newer = newest > *n;
            *n = newest;
            newer
        });
    }

    /// Ends every event stream (the aggregator is stopping).
    pub fn close_events(&self) {
        self.events.closing.store(true, Ordering::Relaxed);
        self.events.wake.send_modify(|_| {});
    }

    /// Whether the ack-holding test hook is in force now.
    #[must_use]
    pub fn holding_acks(&self) -> bool {
        self.hold_acks_from_ns.is_some_and(|t| self.now() >= t)
    }

    /// Moves the core's pending events into the verdict store (the caller holds the
    /// core's lock: events land in the order the core produced them).
    pub fn drain_events(&self, core: &mut Core) {
        let mut events = Vec::new();
        while let Some(e) = core.poll_event() {
            events.push(e);
        }
        if events.is_empty() {
            return;
        }
        let now = self.now();
        if self.events_for_bus.load(Ordering::Relaxed) {
            core.keep_for_bus(events.iter().cloned());
        }
        self.push_events(now, events.iter().map(crate::api::events::Event::of_matcher));
        self.store().apply(now, events);
    }

    /// Matcher role: keep every event drained for the bus (`Core::for_bus`).
    pub fn keep_events_for_the_bus(&self) {
        self.events_for_bus.store(true, Ordering::Relaxed);
    }

    /// Matcher role: events not yet on the bus (0 when the core failed).
    pub fn unpublished_events(&self) -> usize {
        self.core().map_or(0, |c| c.for_bus().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttled_line_repeats_once_per_period_and_says_what_it_held_back() {
        let t = LogThrottle::default();
        assert_eq!(t.allow(1_000, LOG_SUMMARY_MS), Some(0), "the first line goes out");
        for ms in [1_001, 5_000, 10_999] {
            assert_eq!(t.allow(ms, LOG_SUMMARY_MS), None);
        }
        assert_eq!(t.allow(11_000, LOG_SUMMARY_MS), Some(3), "the next says three were held back");
        assert_eq!(t.allow(11_001, LOG_SUMMARY_MS), None);
    }
}
