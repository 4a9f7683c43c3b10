//! The I/O shell: a reader thread that never waits on the network, and a QUIC task that
//! ships what the core spooled.
//!
//! - The **reader** (its own OS thread) polls the source and copies frames into its own
//!   batches ([`Stager`]: the per-frame work, no lock taken); cut batches, counters and
//!   epochs go to the core through a lock-free queue ([`std::sync::mpsc`]) whose staged
//!   bytes are capped ([`READER_QUEUE_BYTES`]); emptied batch buffers come back through
//!   another. When the queue is full the reader keeps draining the ring and sheds bulk
//!   batches as `shipper_spool_full` loss ranges (P0 is never shed there) — also when
//!   the spool's bulk share is full, so the core never seals a batch only to evict it —
//!   and, while it sheds, drains one budget per millisecond instead of spinning (a ring
//!   that overflows meanwhile is counted by the kernel, `kernel_ring_full`). It never
//!   waits on the core, the network or the aggregator.
//! - The **pump** (a task beside the network) applies the reader's messages to the core
//!   (seal, spool, heartbeat with the counters), and drives the core's timers, so
//!   heartbeats continue while the network is down.
//! - The **network task** connects with mutual TLS, opens the control stream, sends
//!   each spooled batch on its own stream (priority by lane), applies acks and nacks,
//!   and reconnects with capped exponential backoff and jitter; after a reconnect every
//!   unacked batch is sent again (the aggregator dedups).
//! - **Shutdown** (the future passed to [`run`] resolves, e.g. SIGTERM): reading stops,
//!   a last heartbeat and every open batch are spooled, the network task keeps sending
//!   until the spool is empty or `shutdown_deadline_ms` passed; what is left is
//!   reported ([`Report::unflushed`]).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use proto_flat::control::{CONTROL_VERSION, MIN_CONTROL_VERSION, control_preface};
use proto_flat::control::{ControlMessage, parse_control};
use ringwatch_transport::pressure::Level;
use ringwatch_transport::psi::PressureState;
use ringwatch_transport::{TlsFiles, Tuning, close, lane_priority};
use tokio::sync::{Notify, Semaphore, watch};

use crate::config::{AggregatorAddr, ShipperConfig};
use crate::core::backoff::Backoff;
use crate::core::batcher::{SessionMeta, Staged, Stager};
use crate::core::budget::{Budget, BudgetInput};
use crate::core::loss::LostRange;
use crate::core::owner::OwnerCache;
use crate::core::shipper::{BatchEvent, LatencySummary, Pressure};
use crate::core::spool::SpoolCounters;
use crate::core::throttle::{Plan, Step};
use crate::core::{CoreConfig, ShipperCore, ShipperStats, Unflushed};
use crate::core::{EpochStart, SourceCounters};
use crate::source::{Source, SourceEvent, SourceState};
use crate::throttle::{Mechanism, Target};
use proto_flat::batch::BatchWriter;
use proto_flat::codes::{Class, LossCause, WireEnum};
use proto_flat::sections::OwnerEntry;

/// Why [`run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ended {
    /// The shutdown future resolved (SIGTERM).
    Shutdown,
    /// The (simulated) node died: nothing flushed.
    NodeDead,
    /// The core's pump task failed (a panic): nothing more is shipped; what was held is
    /// reported (`main` exits 70, for a supervisor to restart the shipper, whose next
    /// session's `session_start` accounts for the tail).
    Failed,
}

/// What a run did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub ended: Ended,
    pub node_name: String,
    pub shipper_session: u64,
    pub connections: u64,
    /// Connection attempts, and those the aggregator refused (a certificate it does not
    /// accept, or an abuse close), with the last refusal's reason.
    pub connect_attempts: u64,
    pub connections_refused: u64,
    pub last_refusal: Option<String>,
    /// Times the shipper moved on to the next ingest shard of its list (rendezvous
    /// order) because the one it used could not be reached.
    pub failovers: u64,
    /// Ring frames read from the source.
    pub frames_in: u64,
    /// Frames acked, all lanes, and per lane (P1 holds the shipper's own frames).
    pub frames_acked: u64,
    pub frames_acked_by_lane: [u64; 4],
    pub own_frames_lost: u64,
    pub frames_lost_spool_full: u64,
    pub frames_lost_rejected: u64,
    /// Bulk frames shed under memory pressure (named in `psi_shed` loss records), and
    /// the spool's bulk batches shed for it.
    pub frames_lost_psi_shed: u64,
    pub batches_shed_pressure: u64,
    /// Of the spool-full and `psi_shed` frames, those shed after their batch was sent:
    /// they may still have been applied (the aggregator then counts them received, so
    /// its loss count for the cause is at least the total less these, at most the total).
    pub frames_lost_spool_full_after_send: u64,
    pub frames_lost_psi_shed_after_send: u64,
    /// The memory-pressure watcher: its state at the end (`None`: off or unavailable,
    /// see `pressure_unavailable`).
    pub pressure: Option<PressureDto>,
    pub pressure_unavailable: Option<String>,
    /// The memory budget in force at the end (`None`: `memory_budget = "static"`).
    pub memory_budget: Option<BudgetDto>,
    /// The background-cgroup throttle (`None`: no cgroups listed).
    pub throttle: Option<ThrottleDto>,
    /// What P3 shedding did under memory pressure.
    pub p3: P3Dto,
    /// The recycled batch buffers at the end.
    pub pools: PoolsDto,
    /// Ring frames given up at shutdown (named in `shipper_shutdown` loss records, or
    /// unflushed when even those could not be delivered).
    pub frames_lost_shutdown: u64,
    /// Per lane (P0, P1, P2, P3): frames put into batches, and frames of batches that
    /// left unacked. `frames_in_by_lane = frames_acked_by_lane + frames_lost_by_lane`
    /// once the run is over (unflushed batches count as lost there too).
    pub frames_in_by_lane: [u64; 4],
    pub frames_lost_by_lane: [u64; 4],
    pub loss_records: u64,
    pub heartbeats: u64,
    /// Heartbeats sent under `full` memory pressure, each for two intervals.
    pub heartbeats_coalesced: u64,
    pub batches_acked: u64,
    pub batches_nacked: u64,
    pub spool_evicted: u64,
    pub spool_resent: u64,
    /// Lanes sent again because their acks stalled, and batches sent again because
    /// their stream failed or the aggregator stopped it.
    pub lane_resends: u64,
    pub send_failures: u64,
    /// Unacked when the shutdown deadline passed (given up, reported here).
    pub unflushed_batches: u64,
    pub unflushed_frames: u64,
    pub unflushed_batches_by_lane: [u64; 4],
    pub unflushed_frames_by_lane: [u64; 4],
    /// Whether the spool emptied before the deadline.
    pub flushed: bool,
    /// Batch latency, first frame in → ack, per lane.
    pub latency_p0: LatencySummary,
    pub latency_p1: LatencySummary,
    pub latency_p2: LatencySummary,
    /// The last aggregator's control protocol and durability (`none`, `snapshot`).
    pub control_version: u16,
    pub durability: String,
    /// With durability `snapshot`: P0/P1 batches kept after their applied ack until a
    /// durable ack, how many such acks came, the durable lag (first frame in → durable
    /// ack), batches released before one (room was needed, or an aggregator without
    /// durability answered), and batches still awaiting one at exit (applied: only an
    /// aggregator crash before its next snapshot loses them).
    pub batches_kept_for_durable: u64,
    pub batches_durable: u64,
    pub durable_lag: LatencySummary,
    pub released_undurable: u64,
    pub awaiting_durable_at_exit: u64,
    /// Every batch's fate, when [`RunOptions::batch_log`] was set.
    #[serde(skip)]
    pub batch_log: Vec<BatchEvent>,
    #[serde(skip)]
    pub stats: ShipperStats,
    #[serde(skip)]
    pub spool: SpoolCounters,
    /// The rings' drain and fill figures (eBPF source only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rings: Option<crate::bpf::RingStats>,
}

/// Errors before shipping starts.
#[derive(Debug, thiserror::Error)]
pub enum ShipperError {
    #[error("transport: {0}")]
    Transport(#[from] ringwatch_transport::TransportError),
    #[error("server name {0:?} is not a valid DNS name")]
    ServerName(String),
    /// The cgroup's memory limit cannot hold the spool's floor (a configuration error:
    /// `main` exits 2).
    #[error("memory budget: {0}")]
    Budget(#[from] crate::core::budget::TooSmall),
    /// A background cgroup to throttle that cannot be (a configuration error).
    #[error("throttle: {0}")]
    Throttle(String),
}

/// How to run: transport tuning, live counters, and test hooks.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Ring frames read so far, updated live (progress displays).
    pub frames_in: Option<Arc<AtomicU64>>,
    pub tuning: Tuning,
    /// Test hook: corrupt the stream summary of the first bulk batch with
    /// `batch_seq ≥ n` as it is sent (the aggregator must nack it `summary_mismatch`).
    #[doc(hidden)]
    pub poison_bulk_batch_from: Option<u64>,
    /// Keep every batch's fate ([`Report::batch_log`]); tests.
    pub batch_log: bool,
    /// The newest control protocol to offer (default: this build's). Tests set 2 to
    /// stand in for a shipper one release behind.
    #[doc(hidden)]
    pub max_control_version: Option<u16>,
    /// The cap on staged bytes between the reader and the core (default
    /// [`READER_QUEUE_BYTES`]); tests set it small to make the reader shed.
    pub reader_queue_bytes: Option<usize>,
    /// Test hook: the core's pump panics once it applied this many of the reader's
    /// messages (the run must end `Ended::Failed`, not shed into a dead queue).
    #[doc(hidden)]
    pub test_panic_pump_after: Option<u64>,
    /// A bound listener to serve `/healthz`, `/readyz` and `/metrics` on while the shipper runs
    /// (the binary binds `http_listen`), with its limits.
    pub http: Option<(Arc<std::net::TcpListener>, ringwatch_transport::http::HttpLimits)>,
}

/// What the reader thread is set up with.
#[derive(Debug, Clone)]
struct ReaderSetup {
    cpus: Vec<usize>,
    sampling: crate::core::SamplingConfig,
    batcher: crate::core::batcher::BatcherConfig,
    meta: SessionMeta,
    heartbeat_interval_ns: u64,
    spool_cap: usize,
}

/// Process-wide counters the network side keeps.
#[derive(Debug, Default)]
struct NetCounters {
    /// Connection attempts, connections made (handshake done on this side), and
    /// attempts the aggregator refused ([`refusal`]).
    attempts: AtomicU64,
    connections: AtomicU64,
    refused: AtomicU64,
    /// Times the shipper moved on to the next ingest shard in its rendezvous order.
    failovers: AtomicU64,
    protocol_errors: AtomicU64,
    /// The current connection got its `hello` (the session is established).
    established: AtomicBool,
    last_refusal: Mutex<Option<String>>,
    /// The aggregator (ingest shard) the network loop tries or uses now.
    target: Mutex<String>,
}

/// What the staged bytes between the reader and the core may reach before the reader
/// sheds bulk (a few hundred milliseconds of one node's bulk at 8.3 M frames/s).
pub const READER_QUEUE_BYTES: usize = 64 << 20;

/// Reader → core, in order: batches are sealed in the order they were cut, and counters
/// reach the core after every batch holding frames they count (so a heartbeat's
/// `held_from_seq` is exact). Only staged bytes count against the queue's cap; the other
/// messages are small and come at most one per counters read, epoch, session start,
/// sampling change or shedding episode.
enum ToCore {
    Staged(Staged),
    Shed(Class, Vec<LostRange>),
    Epoch(EpochStart),
    Counters(Box<SourceCounters>, u64),
    SessionStart(Vec<proto_flat::sections::SessionStreamEntry>, u64),
    Sampling(u8),
    StreamIndex(u16),
    Malformed(u64),
}

/// The reader's end of the queue.
struct ToCoreTx {
    tx: std::sync::mpsc::Sender<ToCore>,
    shared: Arc<Shared>,
    /// Shed ranges not yet sent (sent before anything else that follows them).
    shed: Vec<LostRange>,
    shed_lane: Class,
    sent: bool,
    /// A bulk batch was shed since the reader last looked.
    shed_now: bool,
    /// In a shedding episode (see [`Self::staged`]).
    shedding: bool,
}

impl ToCoreTx {
    fn send(&mut self, msg: ToCore) {
        self.flush_shed();
        self.raw(msg);
    }

    fn raw(&mut self, msg: ToCore) {
        // The pump is gone only when the run ends (or failed): nothing more to do.
        let _ = self.tx.send(msg);
        self.sent = true;
    }

    /// A cut batch: queued, or — bulk, with the queue at its cap — shed into loss ranges
    /// and its writer reused at once. Consecutive shed batches extend the same ranges
    /// (one loss record per stream per shedding episode, not per batch: under a long
    /// overload the records must not become a flood of their own on a link that is
    /// already too slow); the ranges go to the core when a bulk batch is queued again,
    /// before any counters or epoch, when [`MAX_SHED_RANGES`] are pending, and at exit.
    fn staged(&mut self, s: Staged, stager_back: &mut Vec<BatchWriter>) {
        let len = s.payload_len();
        let bulk = matches!(s.lane, Class::P2 | Class::P3);
        let queued = self.shared.queue_bytes.load(Ordering::Acquire).saturating_add(len);
        let spooled = self.shared.spool_used.load(Ordering::Acquire).saturating_add(queued);
        // Shed here when the queue is at its cap, or when the spool's bulk share is full
        // already (the core would only seal the batch to evict one: under a sustained
        // overload that work is wasted, and it is CPU the network needs) — and then go on
        // shedding until the queue is half empty and the spool three quarters, as the
        // eBPF producer does with its ring: one hole per overload episode, not one per
        // batch the network frees room for (every hole is a gap and a loss record at the
        // aggregator).
        if self.shedding {
            self.shedding = queued > self.shared.queue_cap / 2 || spooled > self.shared.bulk_share / 4 * 3;
        } else {
            self.shedding = queued > self.shared.queue_cap || spooled > self.shared.bulk_share;
        }
        if bulk && self.shedding {
            if !self.shed.is_empty() && self.shed_lane != s.lane {
                self.flush_shed();
            }
            self.shed_lane = s.lane;
            self.shed_now = true;
            let session = self.shared.session;
            for r in s.lost_ranges(LossCause::ShipperSpoolFull, session) {
                LostRange::merge_into(&mut self.shed, r);
            }
            stager_back.push(s.writer);
            if self.shed.len() >= MAX_SHED_RANGES {
                self.flush_shed();
            }
            return;
        }
        self.shared.queue_bytes.fetch_add(len, Ordering::AcqRel);
        if bulk {
            self.send(ToCore::Staged(s));
        } else {
            // P0 and P1 pass without ending a shedding episode of bulk.
            self.raw(ToCore::Staged(s));
        }
    }

    fn flush_shed(&mut self) {
        if !self.shed.is_empty() {
            let ranges = std::mem::take(&mut self.shed);
            self.raw(ToCore::Shed(self.shed_lane, ranges));
        }
    }
}

/// Shed ranges the reader holds before it hands them on (one per stream per episode in
/// the usual case; a ring of more streams than this sends them in parts).
const MAX_SHED_RANGES: usize = 1024;

struct Shared {
    core: Mutex<ShipperCore>,
    /// The TLS client configuration for the next connection (replaced when the
    /// certificate files rotate), what the reloads did, and a wake for a network task
    /// waiting out a backoff.
    client: Mutex<quinn::ClientConfig>,
    tls: Arc<ringwatch_transport::reload::ReloadCounters>,
    tls_rotated: Notify,
    /// Why the certificate reload task stopped (it should not).
    tls_ended: Mutex<Option<String>>,
    /// Staged bytes in the reader's queue, and their cap (see [`ToCore`] for what is uncapped).
    queue_bytes: AtomicUsize,
    queue_cap: usize,
    /// The spool's bytes as of the pump's last turn (the reader's sampling decision and
    /// shedding), and what bulk may use of it (the cap less both reserves).
    spool_used: AtomicUsize,
    bulk_share: usize,
    /// The node's monotonic clock as last read by the reader, and the shipper's clock
    /// then (the pump's timers extrapolate from it).
    mono_at: Mutex<(u64, u64)>,
    /// The reader queued something.
    wake: Notify,
    /// Per lane, how often it was sent again ([`ShipperStats::lane_resends_by_lane`]):
    /// a batch stream of a lane resent since it opened is reset.
    resends: watch::Sender<[u64; 4]>,
    session: u64,
    /// Batches are ready, or the window opened.
    ready: Notify,
    start: Instant,
    net: NetCounters,
    /// The poison hook, cleared once used.
    poison_from: Mutex<Option<u64>>,
    /// The newest control protocol to offer.
    max_control_version: u16,
    /// The memory-pressure level ([`Level::code`]) the reader acts on: above nominal it
    /// raises bulk sampling as if the spool were full.
    pressure_level: std::sync::atomic::AtomicU8,
    /// The watcher's state (none: off or unavailable).
    pressure: Mutex<Option<watch::Receiver<PressureState>>>,
    /// Why there is no watcher (said once at start).
    pressure_unavailable: Mutex<Option<String>>,
    /// The memory budget: what it is derived from, and the caps in force (`None`:
    /// static caps).
    budget: Mutex<Option<(BudgetInput, Budget, Option<PathBuf>)>>,
    spool_cap_at_start: u64,
    reserves: u64,
    budget_rederived: AtomicU64,
    /// Why the watcher stopped, if it did.
    pressure_ended: Mutex<Option<String>>,
    /// What P3 shedding did.
    p3: P3Counters,
    /// The reader's spare writers: capacity held, writers their cap turned away.
    reader_spare_bytes: AtomicUsize,
    reader_spare_turned_away: AtomicU64,
    /// The reader's ring histograms, copied every [`RING_METRICS_EVERY_NS`] (`None`:
    /// the source reads no rings).
    ring_metrics: Mutex<Option<crate::core::ringstats::RingMetrics>>,
    /// Each pool's byte cap.
    pool_cap_bytes: usize,
    /// The reader's owner lookups.
    owners: Arc<OwnerCounters>,
    /// The background cgroups to throttle under pressure.
    throttle: Mutex<Throttling>,
}

/// Owner lookups for the reader: the processes PROGRESS names, resolved from
/// `/proc/<pid>/cgroup` (sources whose pids are this host's only) on a helper thread of
/// their own — a procfs read can wait on the kernel's cgroup lock, and the ring reader
/// must never wait. The reader hands over each counters read's processes (dropped when
/// the helper is still busy: the next read hands them again) and takes the latest
/// answer.
struct Owned {
    to_helper: Option<std::sync::mpsc::SyncSender<Vec<(u32, u64)>>>,
    latest: Arc<Mutex<Vec<OwnerEntry>>>,
}

impl Owned {
    fn new(local: bool, counters: &Arc<OwnerCounters>) -> Self {
        let latest = Arc::new(Mutex::new(Vec::new()));
        if !local {
            return Self { to_helper: None, latest };
        }
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(u32, u64)>>(1);
        let (out, c) = (Arc::clone(&latest), Arc::clone(counters));
        let spawned = std::thread::Builder::new().name("rw-owners".into()).spawn(move || {
            // Marks the helper stopped however it ends (a panic included).
            struct Stopped(Arc<OwnerCounters>);
            impl Drop for Stopped {
                fn drop(&mut self) {
                    self.0.stopped.store(true, Ordering::Relaxed);
                }
            }
            let _stopped = Stopped(Arc::clone(&c));
            let mut cache = OwnerCache::default();
            for keys in rx {
                if let Some(v) = cache.refresh(keys, |pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok().map(|t| crate::core::owner::parse(&t))
                }) {
                    c.processes.store(v.len() as u64, Ordering::Relaxed);
                    *out.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = v;
                }
                c.lookups.store(cache.lookups, Ordering::Relaxed);
                c.failed.store(cache.failed, Ordering::Relaxed);
                c.deferred.store(cache.deferred, Ordering::Relaxed);
                c.turned_away.store(cache.turned_away, Ordering::Relaxed);
            }
        });
        match spawned {
            Ok(_) => Self { to_helper: Some(tx), latest },
            Err(e) => {
                tracing::warn!(error = %e, "could not start the owner lookup thread: rank owners stay unknown");
                counters.stopped.store(true, Ordering::Relaxed);
                Self { to_helper: None, latest }
            }
        }
    }

    /// `c` with the owners of its processes, as far as they are known now.
    fn counters(&self, c: &SourceCounters) -> Box<SourceCounters> {
        let mut c = Box::new(c.clone());
        if let Some(tx) = &self.to_helper {
            let keys = c.progress.iter().map(|p| (p.pid.get(), p.cgroup_id.get())).collect();
            // Full: the helper is still on the last read's processes.
            let _ = tx.try_send(keys);
            c.owners.clone_from(&self.latest.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        }
        c
    }
}

/// Owner lookups, as `/healthz` shows them: processes with a known owner now, lookups
/// made, failed (retried) and put off to the next read, processes past the cap, and
/// whether the helper thread stopped.
#[derive(Debug, Default)]
struct OwnerCounters {
    processes: AtomicU64,
    lookups: AtomicU64,
    failed: AtomicU64,
    deferred: AtomicU64,
    turned_away: AtomicU64,
    stopped: AtomicBool,
}

/// [`OwnerCounters`], as `/healthz` shows them.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct OwnersDto {
    pub processes: u64,
    pub lookups: u64,
    pub failed: u64,
    pub deferred: u64,
    pub turned_away: u64,
    pub stopped: bool,
}

impl OwnerCounters {
    fn dto(&self) -> OwnersDto {
        OwnersDto {
            processes: self.processes.load(Ordering::Relaxed),
            lookups: self.lookups.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            deferred: self.deferred.load(Ordering::Relaxed),
            turned_away: self.turned_away.load(Ordering::Relaxed),
            stopped: self.stopped.load(Ordering::Relaxed),
        }
    }
}

/// P3 shedding (entering pressure): times, buffer bytes freed from the pools, resident
/// bytes the allocator gave back to the kernel (`malloc_trim`).
#[derive(Debug, Default)]
struct P3Counters {
    sheds: AtomicU64,
    pooled_bytes_freed: AtomicU64,
    rss_returned_bytes: AtomicU64,
}

/// P3 shedding, as `/healthz` and the report show it.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct P3Dto {
    pub sheds: u64,
    pub pooled_bytes_freed: u64,
    pub rss_returned_bytes: u64,
}

/// The recycled batch buffers (the core's pool, the reader's spare writers), as
/// `/healthz` and the report show them: each capped at `cap_bytes`; what a cap turned
/// away was freed.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct PoolsDto {
    pub cap_bytes: usize,
    pub core_bytes: usize,
    pub core_turned_away: u64,
    pub reader_bytes: usize,
    pub reader_turned_away: u64,
}

impl Shared {
    /// What `/metrics` serves (takes the core's lock on its own, then the others').
    fn metrics_reading(&self) -> crate::metrics::Reading {
        let mut r = {
            let core = self.core();
            let spool = core.spool();
            crate::metrics::Reading {
                stats: *core.stats(),
                counters: core.counters().clone(),
                sampling_level: core.sampling_level(),
                spool_lane_bytes: spool.lane_bytes(),
                spool_cap_bytes: spool.cap_bytes(),
                spool_evicted: spool.counters().evicted,
                spool_shed_pressure: spool.counters().shed_pressure,
                pools: [core.pool(), (0, 0)],
                latency: Some(core.latency().clone()),
                ..crate::metrics::Reading::default()
            }
        };
        let reader = self.pools_dto_without_core();
        r.pools[1] = (reader.reader_bytes, reader.reader_turned_away);
        r.queue_bytes = self.queue_bytes.load(Ordering::Relaxed);
        r.tls = Some(Arc::clone(&self.tls));
        r.queue_cap_bytes = self.queue_cap;
        r.connected = self.net.established.load(Ordering::Relaxed);
        r.connect_attempts = self.net.attempts.load(Ordering::Relaxed);
        r.connections = self.net.connections.load(Ordering::Relaxed);
        r.connections_refused = self.net.refused.load(Ordering::Relaxed);
        r.failovers = self.net.failovers.load(Ordering::Relaxed);
        r.pressure_level = self.pressure_level.load(Ordering::Relaxed);
        r.p3_sheds = self.p3.dto().sheds;
        r.ring = self.ring_metrics.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        r
    }

    /// Takes the core's lock.
    fn pools_dto(&self) -> PoolsDto {
        let (core_bytes, core_turned_away) = self.core().pool();
        PoolsDto { core_bytes, core_turned_away, ..self.pools_dto_without_core() }
    }

    /// The reader's side and the cap (the core's figures zero): for a caller that holds
    /// the core's lock.
    fn pools_dto_without_core(&self) -> PoolsDto {
        PoolsDto {
            cap_bytes: self.pool_cap_bytes,
            core_bytes: 0,
            core_turned_away: 0,
            reader_bytes: self.reader_spare_bytes.load(Ordering::Relaxed),
            reader_turned_away: self.reader_spare_turned_away.load(Ordering::Relaxed),
        }
    }
}

impl P3Counters {
    fn dto(&self) -> P3Dto {
        P3Dto {
            sheds: self.sheds.load(Ordering::Relaxed),
            pooled_bytes_freed: self.pooled_bytes_freed.load(Ordering::Relaxed),
            rss_returned_bytes: self.rss_returned_bytes.load(Ordering::Relaxed),
        }
    }
}

/// The throttle's plan, its cgroups, and what it did.
#[derive(Debug, Default)]
struct Throttling {
    plan: Plan,
    targets: Vec<Target>,
    holds: u64,
    releases: u64,
    errors: u64,
}

impl Throttling {
    fn apply(&mut self, steps: Vec<Step>, level: Level) {
        for step in steps {
            let (i, holding) = match step {
                Step::Hold(i) => (i, true),
                Step::Release(i) => (i, false),
            };
            let Some(t) = self.targets.get_mut(i) else { continue };
            let done = if holding { crate::throttle::hold(t) } else { crate::throttle::release(t) };
            match done {
                Ok(what) if holding => {
                    self.holds += 1;
                    tracing::warn!(cgroup = %t.path.display(), tier = t.tier.name(), level = level.name(), %what, "memory pressure: background cgroup throttled");
                }
                Ok(what) => {
                    self.releases += 1;
                    tracing::info!(cgroup = %t.path.display(), tier = t.tier.name(), level = level.name(), %what, "background cgroup released");
                }
                Err(e) => {
                    self.errors += 1;
                    self.plan.failed(step);
                    tracing::error!(cgroup = %t.path.display(), holding, error = %e, "throttling a background cgroup failed");
                }
            }
        }
    }

    fn follow(&mut self, level: Level) {
        let steps = self.plan.on_level(level);
        self.apply(steps, level);
    }

    fn release_all(&mut self) {
        let steps = self.plan.release_all();
        self.apply(steps, Level::Nominal);
    }

    fn dto(&self) -> Option<ThrottleDto> {
        (!self.targets.is_empty()).then(|| ThrottleDto {
            cgroups: self
                .targets
                .iter()
                .enumerate()
                .map(|(i, t)| ThrottledDto {
                    path: t.path.display().to_string(),
                    tier: t.tier.name(),
                    mechanism: match t.mechanism {
                        Mechanism::Freeze => "freeze",
                        Mechanism::MemoryHigh { .. } => "memory.high",
                    },
                    held: self.plan.is_held(i),
                })
                .collect(),
            holds: self.holds,
            releases: self.releases,
            errors: self.errors,
        })
    }
}

/// The throttle, as `/healthz` and the report show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ThrottleDto {
    pub cgroups: Vec<ThrottledDto>,
    /// Holds and releases done, and cgroup writes that failed.
    pub holds: u64,
    pub releases: u64,
    pub errors: u64,
}

/// One listed background cgroup.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ThrottledDto {
    pub path: String,
    pub tier: &'static str,
    pub mechanism: &'static str,
    pub held: bool,
}

/// The memory budget, as `/healthz` and the report show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BudgetDto {
    /// The limit and the file it came from (`None`: no limit found).
    pub limit_bytes: Option<u64>,
    pub limit_file: Option<String>,
    pub ring_bytes: u64,
    /// QUIC's connection send window and both buffer pools' caps, counted off the limit.
    pub transport_bytes: u64,
    pub pool_bytes: u64,
    pub headroom_bytes: u64,
    pub spool_cap_bytes: u64,
    pub reader_queue_cap_bytes: u64,
    /// Times the limit was read again (on pressure events) and found to change the caps.
    pub rederived: u64,
}

/// The memory-pressure watcher's state, as `/healthz` and the report show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PressureDto {
    pub level: &'static str,
    pub file: String,
    pub some_avg10: f64,
    pub full_avg10: f64,
    pub some_total_us: u64,
    pub full_total_us: u64,
    /// Triggers fired (`some`, `full`) and level changes.
    pub fired: [u64; 2],
    pub transitions: u64,
}

impl Shared {
    /// The core: only the pump and the network side take it (never the reader).
    fn core(&self) -> MutexGuard<'_, ShipperCore> {
        self.core.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The node's monotonic clock now, extrapolated from the reader's last read.
    fn node_mono(&self, now: u64) -> u64 {
        let (mono, at) = *self.mono_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if mono == 0 { 0 } else { mono.saturating_add(now.saturating_sub(at)) }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn throttling(&self) -> MutexGuard<'_, Throttling> {
        self.throttle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn budget_dto(&self) -> Option<BudgetDto> {
        let b = self.budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (input, budget, file) = b.as_ref()?;
        Some(BudgetDto {
            limit_bytes: budget.limit_bytes,
            limit_file: file.as_ref().map(|f| f.display().to_string()),
            ring_bytes: input.ring_bytes,
            transport_bytes: input.transport_bytes,
            pool_bytes: input.pool_bytes,
            headroom_bytes: input.headroom_bytes,
            spool_cap_bytes: budget.spool_cap_bytes,
            reader_queue_cap_bytes: budget.reader_queue_cap_bytes,
            rederived: self.budget_rederived.load(Ordering::Relaxed),
        })
    }

    /// The ceiling the memory budget puts on bulk's share of the spool (`None`: the
    /// start's caps stand). With `reread` (a pressure event) the cgroup's limit is read
    /// again and the caps derived from it first. The spool's own cap was fixed at start,
    /// so a lower budget is applied as this ceiling; a limit that no longer holds the
    /// floor keeps the floor (the shipper is already running: it says so).
    fn budget_ceiling(&self, reread: bool) -> Option<usize> {
        let mut b = self.budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (input, budget, file) = b.as_mut()?;
        let limit = if reread { ringwatch_transport::memcg::own_limit() } else { None };
        let fresh = BudgetInput { limit_bytes: limit.as_ref().map(|l| l.bytes), ..*input };
        if reread && fresh.limit_bytes != input.limit_bytes {
            match crate::core::budget::derive(fresh) {
                Ok(new) => {
                    tracing::warn!(
                        limit = ?fresh.limit_bytes,
                        spool_cap = new.spool_cap_bytes,
                        was = budget.spool_cap_bytes,
                        "memory limit changed: spool budget derived again"
                    );
                    *budget = Budget { spool_cap_bytes: new.spool_cap_bytes.min(self.spool_cap_at_start), ..new };
                }
                Err(e) => {
                    tracing::error!(error = %e, "memory limit changed below the spool's floor: keeping the floor");
                    *budget = Budget {
                        limit_bytes: fresh.limit_bytes,
                        available_bytes: Some(e.available),
                        spool_cap_bytes: e.floor,
                        ..*budget
                    };
                }
            }
            *input = fresh;
            *file = limit.map(|l| l.file);
            self.budget_rederived.fetch_add(1, Ordering::Relaxed);
        }
        (budget.spool_cap_bytes < self.spool_cap_at_start)
            .then(|| usize::try_from(budget.spool_cap_bytes.saturating_sub(self.reserves)).unwrap_or(usize::MAX))
    }

    fn pressure_dto(&self) -> Option<PressureDto> {
        let rx = self.pressure.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let s = rx.as_ref()?.borrow().clone();
        Some(PressureDto {
            level: s.level.name(),
            file: s.file.display().to_string(),
            some_avg10: s.reading.some.avg10,
            full_avg10: s.reading.full.avg10,
            some_total_us: s.reading.some.total_us,
            full_total_us: s.reading.full.total_us,
            fired: s.fired,
            transitions: s.transitions,
        })
    }
}

/// Applies the watcher's state to the core: the pressure for heartbeats, and bulk's
/// limit in the spool (under `some`, `share_pct` % of bulk's share; under `full`, none;
/// never more than a memory budget derived again on the event allows). Runs until the
/// watcher ends; the state then stays as it was last set, and `/healthz` says the
/// watcher ended.
async fn follow_pressure(shared: Arc<Shared>, mut state: watch::Receiver<PressureState>, share_pct: u8) {
    let mut last = None;
    loop {
        let s = state.borrow_and_update().clone();
        // Each pressure event (a level change) reads the cgroup's limit again; between
        // them the last derived ceiling stands.
        let ceiling = shared.budget_ceiling(last != Some(s.level));
        last = Some(s.level);
        let pressure = Pressure {
            level: s.level,
            some_avg10_ppm: s.reading.some.avg10_ppm(),
            full_avg10_ppm: s.reading.full.avg10_ppm(),
        };
        let by_level = match s.level {
            Level::Nominal => None,
            Level::Some => Some(shared.bulk_share / 100 * usize::from(share_pct.min(100))),
            Level::Full => Some(0),
        };
        let limit = match (by_level, ceiling) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let was = shared.pressure_level.swap(s.level.code(), Ordering::Relaxed);
        let p3_freed = {
            let now = shared.now();
            let mut core = shared.core();
            core.set_pressure(pressure, limit, now);
            // P3 on entering pressure: pooled buffers freed, the batch log stopped;
            // (the reader frees its spare writers when it sees the level).
            match (was == Level::Nominal.code(), s.level == Level::Nominal) {
                (true, false) => Some(core.shed_p3()),
                (false, true) => {
                    core.restore_p3();
                    None
                }
                _ => None,
            }
        };
        if let Some(freed) = p3_freed {
            // Logs at WARN only while pressured, and the freed heap back to the kernel.
            let quiet = ringwatch_transport::shell::pressure_log_floor(true);
            let trimmed = ringwatch_transport::memcg::trim();
            tracing::warn!(
                pooled_bytes_freed = freed,
                rss_returned = ?trimmed,
                logs_at_warn = quiet,
                "memory pressure: P3 shed (buffer pools, batch log, info logs)"
            );
            let p3 = &shared.p3;
            p3.sheds.fetch_add(1, Ordering::Relaxed);
            p3.pooled_bytes_freed.fetch_add(freed as u64, Ordering::Relaxed);
            p3.rss_returned_bytes.fetch_add(trimmed.unwrap_or(0), Ordering::Relaxed);
        } else if s.level == Level::Nominal && was != Level::Nominal.code() {
            ringwatch_transport::shell::pressure_log_floor(false);
            tracing::info!("memory pressure over: logs and buffer pooling back to normal");
        }
        shared.ready.notify_one();
        shared.throttling().follow(s.level);
        if state.changed().await.is_err() {
            // The watcher stopped: nothing would release a throttled cgroup later.
            shared.throttling().release_all();
            return;
        }
    }
}

/// The memory budget from this process's cgroup (`None`: `memory_budget = "static"`),
/// what it was derived from, and the limit's file.
fn derive_budget(
    cfg: &ShipperConfig,
    tuning: &Tuning,
    queue_ceiling: usize,
) -> Result<Option<(BudgetInput, Budget, Option<PathBuf>)>, crate::core::budget::TooSmall> {
    let Some(headroom) = cfg.memory_budget else { return Ok(None) };
    let limit = ringwatch_transport::memcg::own_limit();
    let input = BudgetInput {
        limit_bytes: limit.as_ref().map(|l| l.bytes),
        ..budget_input(cfg, tuning, headroom, queue_ceiling)
    };
    let b = crate::core::budget::derive(input)?;
    Ok(Some((input, b, limit.map(|l| l.file))))
}

/// The caps [`run`] will derive from this process's cgroup (`None`: static caps), for a
/// check before the source is opened.
///
/// # Errors
/// The cgroup's limit cannot hold the spool's floor.
pub fn memory_budget(cfg: &ShipperConfig, tuning: &Tuning) -> Result<Option<Budget>, crate::core::budget::TooSmall> {
    derive_budget(cfg, tuning, READER_QUEUE_BYTES).map(|b| b.map(|(_, b, _)| b))
}

/// What the memory budget is derived from, but the limit (read by the caller).
fn budget_input(cfg: &ShipperConfig, tuning: &Tuning, headroom: u64, queue_ceiling: usize) -> BudgetInput {
    let ring_bytes = match &cfg.source {
        crate::config::Source::Bpf(b) => u64::from(b.p0_ring_bytes) + u64::from(b.bulk_ring_bytes),
        _ => 0,
    };
    let batch = cfg.batcher.max_batch_bytes.max(cfg.batcher.bulk_batch_bytes);
    BudgetInput {
        limit_bytes: None,
        ring_bytes,
        transport_bytes: tuning.send_window(),
        // The core's pool and the reader's spare writers, each at its cap.
        pool_bytes: 2 * cfg.batcher.pool_bytes as u64,
        headroom_bytes: headroom,
        spool_ceiling: cfg.spool.cap_bytes as u64,
        queue_ceiling: queue_ceiling as u64,
        spool_floor: (cfg.spool.p0_reserve_bytes + cfg.spool.p1_reserve_bytes + 2 * batch) as u64,
    }
}

/// A new shipper session id: unique per process start (time and pid mixed).
#[must_use]
pub fn new_session_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish().max(1)
}

/// The core's configuration from the shipper's.
#[must_use]
pub fn core_config(cfg: &ShipperConfig, tuning: &Tuning) -> CoreConfig {
    CoreConfig {
        batcher: cfg.batcher,
        spool: cfg.spool,
        heartbeat_interval_ns: cfg.heartbeat_interval_ms * 1_000_000,
        bulk_window_bytes: usize::try_from(tuning.bulk_window_bytes).unwrap_or(usize::MAX),
        batch_log: false,
        ..CoreConfig::default()
    }
}

/// Ships `source` to the configured aggregator until `shutdown` resolves or the source's
/// node dies.
///
/// # Errors
/// TLS material that does not load, or a socket that cannot be bound.
pub async fn run(
    cfg: &ShipperConfig,
    options: RunOptions,
    source: Box<dyn Source>,
    shutdown: impl Future<Output = ()>,
) -> Result<Report, ShipperError> {
    run_and_return_source(cfg, options, source, shutdown).await.map(|(r, _)| r)
}

/// [`run`], and the source back when the session ended (a simulated kernel side that a
/// restarted shipper session takes over: [`Source::next_session`]).
///
/// # Errors
/// As [`run`].
pub async fn run_and_return_source(
    cfg: &ShipperConfig,
    options: RunOptions,
    source: Box<dyn Source>,
    shutdown: impl Future<Output = ()>,
) -> Result<(Report, Option<Box<dyn Source>>), ShipperError> {
    let tuning = options.tuning;
    // The memory budget: the spool's and the reader queue's caps from the cgroup's limit.
    let queue_ceiling = options.reader_queue_bytes.unwrap_or(READER_QUEUE_BYTES);
    let budget = derive_budget(cfg, &tuning, queue_ceiling)?;
    let effective;
    let cfg = match &budget {
        None => cfg,
        Some((_, b, file)) => {
            tracing::info!(
                limit = ?b.limit_bytes,
                file = ?file,
                spool_cap = b.spool_cap_bytes,
                reader_queue_cap = b.reader_queue_cap_bytes,
                "memory budget from the cgroup"
            );
            let mut c = cfg.clone();
            c.spool.cap_bytes = usize::try_from(b.spool_cap_bytes).unwrap_or(usize::MAX);
            effective = c;
            &effective
        }
    };
    let throttling = {
        let own = crate::throttle::own_cgroup_dir();
        let mut targets = Vec::new();
        for (tier, path) in &cfg.throttle {
            targets.push(crate::throttle::check(*tier, path, own.as_deref()).map_err(ShipperError::Throttle)?);
        }
        Throttling { plan: Plan::new(targets.iter().map(|t| t.tier).collect()), targets, ..Throttling::default() }
    };
    let queue_cap = budget
        .as_ref()
        .map_or(queue_ceiling, |(_, b, _)| usize::try_from(b.reader_queue_cap_bytes).unwrap_or(usize::MAX));
    let files = TlsFiles { ca: &cfg.ca, cert: &cfg.cert, key: &cfg.key };
    let client = ringwatch_transport::client_config(files, &tuning)?;
    // A name's family: IPv4 unless it resolves only to IPv6 now (unresolvable at start:
    // IPv4, and the network loop keeps trying).
    let v6 = match &cfg.aggregator {
        AggregatorAddr::Ip(a) => a.is_ipv6(),
        name => name.resolve(true).await.is_err() && name.resolve(false).await.is_ok(),
    };
    let bind: SocketAddr = if v6 { SocketAddr::from(([0u16; 8], 0)) } else { SocketAddr::from(([0u8; 4], 0)) };
    let endpoint = tuning.endpoint(bind, None)?;
    let tls_watch = ringwatch_transport::reload::TlsWatch::new(&cfg.ca, &cfg.cert, &cfg.key, &[]);
    rustls::pki_types::ServerName::try_from(cfg.server_name.clone())
        .map_err(|_| ShipperError::ServerName(cfg.server_name.clone()))?;

    let session = new_session_id();
    let meta = SessionMeta { node_id: proto_flat::node_id_of(&cfg.node_name), epoch: 0, shipper_session: session };
    let shared = Arc::new(Shared {
        queue_bytes: AtomicUsize::new(0),
        queue_cap,
        spool_used: AtomicUsize::new(0),
        bulk_share: cfg
            .spool
            .cap_bytes
            .saturating_sub(cfg.spool.p0_reserve_bytes)
            .saturating_sub(cfg.spool.p1_reserve_bytes),
        mono_at: Mutex::new((0, 0)),
        wake: Notify::new(),
        resends: watch::Sender::new([0; 4]),
        session,
        client: Mutex::new(client),
        tls: Arc::clone(&tls_watch.counters),
        tls_rotated: Notify::new(),
        tls_ended: Mutex::new(None),
        core: Mutex::new(ShipperCore::new(
            CoreConfig { batch_log: options.batch_log, ..core_config(cfg, &tuning) },
            meta,
            0,
        )),
        ready: Notify::new(),
        start: Instant::now(),
        net: NetCounters::default(),
        poison_from: Mutex::new(options.poison_bulk_batch_from),
        max_control_version: options
            .max_control_version
            .unwrap_or(CONTROL_VERSION)
            .clamp(MIN_CONTROL_VERSION, CONTROL_VERSION),
        pressure_level: std::sync::atomic::AtomicU8::new(0),
        pressure: Mutex::new(None),
        pressure_unavailable: Mutex::new(None),
        spool_cap_at_start: cfg.spool.cap_bytes as u64,
        reserves: (cfg.spool.p0_reserve_bytes + cfg.spool.p1_reserve_bytes) as u64,
        budget: Mutex::new(budget),
        budget_rederived: AtomicU64::new(0),
        pressure_ended: Mutex::new(None),
        p3: P3Counters::default(),
        reader_spare_bytes: AtomicUsize::new(0),
        reader_spare_turned_away: AtomicU64::new(0),
        ring_metrics: Mutex::new(None),
        pool_cap_bytes: cfg.batcher.pool_bytes,
        owners: Arc::new(OwnerCounters::default()),
        throttle: Mutex::new(throttling),
    });
    tracing::info!(node = %cfg.node_name, session = format!("{session:016x}"), source = %source.describe(), aggregator = %cfg.aggregator, "shipper starting");

    // Memory pressure: the watcher, and a task applying its state to the core.
    let pressure_task = match &cfg.psi {
        None => None,
        Some(psi_cfg) => match ringwatch_transport::psi::start(psi_cfg) {
            Ok(w) => {
                tracing::info!(file = %w.state.borrow().file.display(), "memory pressure watcher armed");
                *shared.pressure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(w.state.clone());
                let follow = tokio::spawn(follow_pressure(Arc::clone(&shared), w.state, cfg.psi_bulk_share_pct));
                // Supervised: a watcher that ends (its cgroup removed, a read failing)
                // is logged and makes `/healthz` degraded; shedding stays as last set.
                let watcher = w.task.abort_handle();
                let sup = {
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        let why = match w.task.await {
                            Ok(Ok(())) => "ended".to_owned(),
                            Ok(Err(e)) => format!("failed: {e}"),
                            Err(e) if e.is_cancelled() => return,
                            Err(e) => format!("panicked: {e}"),
                        };
                        tracing::error!(why = %why, "memory pressure watcher stopped: pressure is no longer followed");
                        *shared.pressure_ended.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
                    })
                };
                Some((watcher, sup, follow))
            }
            Err(e) => {
                tracing::warn!(error = %e, "memory pressure watcher unavailable: running without it");
                *shared.pressure_unavailable.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Some(e.to_string());
                None
            }
        },
    };

    // Certificate rotation, supervised: a reload task that ends is logged and makes
    // `/healthz` degraded (the configuration in force stays).
    let tls_task = (cfg.tls_reload_interval_ms > 0).then(|| {
        let files = (cfg.ca.clone(), cfg.cert.clone(), cfg.key.clone());
        let task = tokio::spawn(reload_tls(Arc::clone(&shared), tls_watch, files, tuning, cfg.tls_reload_interval_ms));
        let abort = task.abort_handle();
        let shared = Arc::clone(&shared);
        let sup = tokio::spawn(async move {
            let why = match task.await {
                Ok(()) => "ended".to_owned(),
                Err(e) if e.is_cancelled() => return,
                Err(e) => format!("panicked: {e}"),
            };
            tracing::error!(why = %why, "the certificate reload stopped: rotated certificates are not picked up");
            *shared.tls_ended.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
        });
        (abort, sup)
    });

    // Reader thread.
    let stop_reading = Arc::new(AtomicBool::new(false));
    let (reader_done_tx, mut reader_done_rx) = watch::channel(false);
    let live = options.frames_in.clone();
    let setup = ReaderSetup {
        cpus: cfg.reader_cpus.clone(),
        sampling: cfg.sampling,
        batcher: cfg.batcher,
        meta,
        heartbeat_interval_ns: cfg.heartbeat_interval_ms.saturating_mul(1_000_000),
        spool_cap: cfg.spool.cap_bytes,
    };
    let (to_core, from_reader) = std::sync::mpsc::channel::<ToCore>();
    let (writers_back, writers_back_rx) = std::sync::mpsc::channel::<BatchWriter>();
    let reader = {
        let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop_reading));
        std::thread::Builder::new()
            .name("ring-reader".into())
            .spawn(move || {
                let tx = ToCoreTx {
                    tx: to_core,
                    shared: Arc::clone(&shared),
                    shed: Vec::new(),
                    shed_lane: Class::P2,
                    sent: false,
                    shed_now: false,
                    shedding: false,
                };
                let r = reader_loop(source, &shared, tx, &writers_back_rx, &stop, live.as_deref(), &setup);
                let _ = reader_done_tx.send(true);
                r
            })
            .map_err(|e| {
                ShipperError::Transport(ringwatch_transport::TransportError::Socket { addr: bind, source: e })
            })?
    };

    // The pump: the reader's messages into the core, and the core's timers.
    let (stop_pump_tx, stop_pump_rx) = watch::channel(false);
    let mut pump =
        tokio::spawn(pump(Arc::clone(&shared), from_reader, writers_back, stop_pump_rx, options.test_panic_pump_after));

    // Network task.
    let (stop_net_tx, stop_net_rx) = watch::channel(false);
    let net = tokio::spawn(network(
        endpoint.clone(),
        (std::iter::once(cfg.aggregator.clone()).chain(cfg.fallbacks.iter().cloned()).collect(), !v6),
        cfg.server_name.clone(),
        Arc::clone(&shared),
        stop_net_rx,
    ));

    let http = options.http.as_ref().and_then(|(listener, limits)| {
        let listener = listener.try_clone().and_then(tokio::net::TcpListener::from_std);
        match listener {
            Ok(l) => {
                let router = health_router(Arc::clone(&shared), cfg.aggregator.to_string());
                Some(tokio::spawn(ringwatch_transport::http::serve(l, router, *limits, Arc::default(), None)))
            }
            Err(e) => {
                tracing::error!(error = %e, "HTTP listener unusable: /healthz, /readyz and /metrics are not served");
                None
            }
        }
    });

    let mut pumped = None;
    let ended = tokio::select! {
        () = shutdown => Ended::Shutdown,
        _ = reader_done_rx.wait_for(|d| *d) => Ended::NodeDead,
        r = &mut pump => {
            // The pump only returns when told to stop: this is a panic.
            tracing::error!(error = ?r.as_ref().err(), "the core pump failed: the shipper stops");
            pumped = Some(r);
            Ended::Failed
        }
    };
    stop_reading.store(true, Ordering::Relaxed);
    let (source, state) = tokio::task::spawn_blocking(move || reader.join()).await.ok().and_then(Result::ok).unzip();
    // Everything the reader queued (it flushed its open batches as it stopped) reaches
    // the core before the shutdown steps below.
    let _ = stop_pump_tx.send(true);
    let pumped = match pumped {
        Some(r) => r,
        None => pump.await,
    };
    if let Ok((rx, back)) = pumped {
        let now = shared.now();
        let mut core = shared.core();
        while let Ok(msg) = rx.try_recv() {
            apply(&shared, &mut core, msg, &back, now);
        }
    }
    let ended = if state == Some(SourceState::NodeDead) && ended != Ended::Failed { Ended::NodeDead } else { ended };
    let rings = source.as_ref().and_then(|s| s.ring_stats());

    let flushed;
    if ended == Ended::Shutdown {
        // A last heartbeat with the final counters, every open batch spooled, then send
        // until the spool is empty or the deadline passes.
        {
            let now = shared.now();
            let mut core = shared.core();
            if let Some(src) = &source {
                let counters = src.counters().clone();
                core.handle_counters(&counters, src.node_mono_ns(), now);
            }
            core.flush(now);
        }
        shared.ready.notify_one();
        let deadline = Instant::now() + Duration::from_millis(cfg.shutdown_deadline_ms);
        flushed = spool_empties_by(&shared, deadline).await;
        if !flushed {
            {
                let core = shared.core();
                let spool = core.spool();
                tracing::warn!(
                    lane_bytes = ?spool.lane_bytes(),
                    in_flight = ?[0, 1, 2, 3].map(|l| spool.in_flight(l)),
                    connected = shared.net.established.load(Ordering::Relaxed),
                    connections = shared.net.connections.load(Ordering::Relaxed),
                    deadline_ms = cfg.shutdown_deadline_ms,
                    "the SIGTERM flush did not empty the spool by its deadline"
                );
            }
            // What could not be flushed leaves as `shipper_shutdown` loss records (P1,
            // sent first): the aggregator then knows why those frames never come.
            let given_up = shared.core().give_up_data(shared.now());
            shared.ready.notify_one();
            let records_deadline = Instant::now() + FINAL_LOSS_RECORDS_WAIT;
            let delivered = spool_empties_by(&shared, records_deadline).await;
            tracing::info!(
                frames = given_up,
                records_delivered = delivered,
                "unflushed frames given up as shipper_shutdown loss records"
            );
        }
        if shared.core().spool().is_empty() {
            // A last heartbeat once nothing is held (`held_from_seq` = `attempted_seq`),
            // so the aggregator settles whatever gap is left instead of waiting for a
            // frame or loss record that will not come.
            {
                let now = shared.now();
                let mono = source.as_ref().map_or(0, |src| src.node_mono_ns());
                shared.core().heartbeat_now(mono, now);
            }
            shared.ready.notify_one();
            let _ = spool_empties_by(&shared, Instant::now() + FINAL_LOSS_RECORDS_WAIT).await;
        }
        // Durability `snapshot`: P0/P1 batches applied but not yet in a snapshot wait for
        // it until the flush deadline, so an aggregator crash right after this shutdown
        // loses none of them; what still waits then is in the report
        // (`awaiting_durable_at_exit`).
        while shared.core().spool().awaiting_durable() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    } else {
        flushed = false;
    }
    let _ = stop_net_tx.send(true);
    let _ = net.await;
    if let Some(h) = http {
        h.abort();
    }
    if let Some((task, sup)) = tls_task {
        task.abort();
        sup.abort();
    }
    if let Some((watcher, sup, follow)) = pressure_task {
        watcher.abort();
        sup.abort();
        follow.abort();
    }
    // A background cgroup left frozen would stay frozen after the shipper.
    shared.throttling().release_all();
    let code = if ended == Ended::Shutdown { close::SHUTDOWN } else { close::PROTOCOL };
    endpoint.close(code.into(), b"shipper stopping");
    let _ = tokio::time::timeout(Duration::from_millis(500), endpoint.wait_idle()).await;

    let mut core = shared.core();
    let unflushed: Unflushed = if ended == Ended::Shutdown { core.abandon() } else { core.unacked() };
    let stats = *core.stats();
    let spool = *core.spool().counters();
    let (core_pooled, core_turned_away) = core.pool();
    let slot = |c: proto_flat::LossCause| c.drop_slot().and_then(|s| stats.frames_lost.get(s).copied()).unwrap_or(0);
    let after_send = |c: proto_flat::LossCause| {
        c.drop_slot().and_then(|s| stats.frames_lost_after_send.get(s).copied()).unwrap_or(0)
    };
    let report = Report {
        ended,
        node_name: cfg.node_name.clone(),
        shipper_session: session,
        connections: shared.net.connections.load(Ordering::Relaxed),
        connect_attempts: shared.net.attempts.load(Ordering::Relaxed),
        connections_refused: shared.net.refused.load(Ordering::Relaxed),
        last_refusal: shared.net.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
        failovers: shared.net.failovers.load(Ordering::Relaxed),
        frames_in: stats.frames_in,
        frames_acked: stats.frames_acked,
        frames_acked_by_lane: stats.frames_acked_by_lane,
        own_frames_lost: stats.own_frames_lost,
        frames_lost_spool_full: slot(proto_flat::LossCause::ShipperSpoolFull),
        frames_lost_rejected: slot(proto_flat::LossCause::Rejected),
        frames_lost_psi_shed: slot(proto_flat::LossCause::PsiShed),
        batches_shed_pressure: spool.shed_pressure,
        frames_lost_spool_full_after_send: after_send(proto_flat::LossCause::ShipperSpoolFull),
        frames_lost_psi_shed_after_send: after_send(proto_flat::LossCause::PsiShed),
        pressure: shared.pressure_dto(),
        pressure_unavailable: shared
            .pressure_unavailable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone(),
        memory_budget: shared.budget_dto(),
        throttle: shared.throttling().dto(),
        p3: shared.p3.dto(),
        pools: PoolsDto { core_bytes: core_pooled, core_turned_away, ..shared.pools_dto_without_core() },
        frames_lost_shutdown: slot(proto_flat::LossCause::ShipperShutdown),
        frames_in_by_lane: stats.frames_in_by_lane,
        frames_lost_by_lane: stats.frames_lost_by_lane,
        loss_records: stats.loss_records,
        heartbeats: stats.heartbeats,
        heartbeats_coalesced: stats.heartbeats_coalesced,
        batches_acked: stats.batches_acked,
        batches_nacked: stats.batches_nacked,
        spool_evicted: spool.evicted,
        spool_resent: spool.resent,
        lane_resends: stats.lane_resends,
        send_failures: stats.send_failures,
        unflushed_batches: unflushed.batches,
        unflushed_frames: unflushed.frames,
        unflushed_batches_by_lane: unflushed.batches_by_lane,
        unflushed_frames_by_lane: unflushed.frames_by_lane,
        flushed,
        latency_p0: core.latency().summary(proto_flat::Class::P0),
        latency_p1: core.latency().summary(proto_flat::Class::P1),
        latency_p2: core.latency().summary(proto_flat::Class::P2),
        control_version: stats.control_version,
        durability: proto_flat::codes::Durability::from_code_const(stats.durability).to_string(),
        batches_kept_for_durable: spool.kept_for_durable,
        batches_durable: stats.batches_durable,
        durable_lag: core.latency().durable_summary(),
        released_undurable: stats.released_undurable,
        awaiting_durable_at_exit: core.spool().awaiting_durable() as u64,
        batch_log: core.batch_log().0.to_vec(),
        stats,
        spool,
        rings,
    };
    Ok((report, source))
}

/// How long the final `shipper_shutdown` loss records get to reach the aggregator after
/// the flush deadline, and the last heartbeat after them (a few small P1 batches; P1
/// goes before bulk).
pub const FINAL_LOSS_RECORDS_WAIT: Duration = Duration::from_secs(2);

/// How often the reader copies its ring histograms for `/metrics`.
const RING_METRICS_EVERY_NS: u64 = 250_000_000;

/// Waits until the spool is empty (true) or `deadline` passes (false).
async fn spool_empties_by(shared: &Shared, deadline: Instant) -> bool {
    loop {
        {
            let now = shared.now();
            let mut core = shared.core();
            if core.spool().is_empty() {
                return true;
            }
            // The pump has stopped, and with it the timeouts that resend a lane whose
            // batch's stream stalled: without this a P0 batch on a stream the aggregator
            // stopped reading waited unacked until the deadline gave it up (36 P0 frames
            // lost at a 45 s deadline, the 64 MiB memcg test).
            if core.resend_stalled(now) {
                publish_resends(shared, &core);
                drop(core);
                shared.ready.notify_one();
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Tells the senders which lanes were sent again (a sender resets its stream when its
/// lane's count moves).
fn publish_resends(shared: &Shared, core: &ShipperCore) {
    let by_lane = core.stats().lane_resends_by_lane;
    shared.resends.send_if_modified(|g| {
        let changed = *g != by_lane;
        *g = by_lane;
        changed
    });
}

/// Reads until told to stop or the node dies; returns the source (for the final
/// counters) and its last state. Takes no lock the network side holds: frames go into
/// the reader's own batches, cut batches and counters into the queue to the core.
fn reader_loop(
    mut source: Box<dyn Source>,
    shared: &Shared,
    mut q: ToCoreTx,
    writers_back: &std::sync::mpsc::Receiver<BatchWriter>,
    stop: &AtomicBool,
    live: Option<&AtomicU64>,
    reader: &ReaderSetup,
) -> (Box<dyn Source>, SourceState) {
    let mut state = SourceState::Running;
    if let Err(e) = crate::bpf::pin_current_thread(&reader.cpus) {
        tracing::warn!(cpus = ?reader.cpus, error = %e, "could not pin the ring reader thread; it runs unpinned");
    }
    let mut sampling = crate::core::SamplingPolicy::new(reader.sampling);
    let mut stager = Stager::new(reader.batcher, reader.meta);
    let mut spare: Vec<BatchWriter> = Vec::new();
    let mut stager_pooling = true;
    q.send(ToCore::StreamIndex(source.shipper_stream_index()));
    if source.set_sampling_level(sampling.level()) {
        q.send(ToCore::Sampling(sampling.level()));
    }
    let owned = Owned::new(source.pids_are_local(), &shared.owners);
    let stamps_now = source.stamps_frames_now();
    let mut malformed_sent = 0u64;
    let mut next_finished_counters = 0u64;
    let mut next_ring_metrics = 0u64;
    let mut frames_in = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let now = shared.now();
        let mono = source.node_mono_ns();
        *shared.mono_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = (mono, now);
        stager.set_mono_offset(stamps_now.then(|| i128::from(mono) - i128::from(now)));
        while let Ok(w) = writers_back.try_recv() {
            stager.give_back(w);
        }
        for w in spare.drain(..) {
            stager.give_back(w);
        }
        // Memory pressure (P3): spare writers are freed, not kept, while it lasts.
        let pressured = shared.pressure_level.load(Ordering::Relaxed) != 0;
        if pressured == stager_pooling {
            stager_pooling = !pressured;
            stager.set_pooling(stager_pooling);
        }
        shared.reader_spare_bytes.store(stager.spare_bytes(), Ordering::Relaxed);
        shared.reader_spare_turned_away.store(stager.spare_turned_away, Ordering::Relaxed);
        let mut events = 0usize;
        let mut counters_seen = false;
        state = source.poll(2048, &mut |ev| {
            events += 1;
            match ev {
                SourceEvent::Frame(f) => {
                    frames_in += 1;
                    stager.push(f, now, &mut |b| q.staged(b, &mut spare));
                }
                SourceEvent::Epoch(e) => {
                    stager.set_epoch(e.epoch, &mut |b| q.staged(b, &mut spare));
                    q.send(ToCore::Epoch(e));
                }
                SourceEvent::Counters(c) => {
                    counters_seen = true;
                    // Every frame the counters count goes to the core before them.
                    stager.flush(&mut |b| q.staged(b, &mut spare));
                    if stager.frames_malformed > malformed_sent {
                        q.send(ToCore::Malformed(stager.frames_malformed - malformed_sent));
                        malformed_sent = stager.frames_malformed;
                    }
                    q.send(ToCore::Counters(owned.counters(c), mono));
                }
                SourceEvent::SessionStart(st) => q.send(ToCore::SessionStart(st.to_vec(), mono)),
            }
        });
        if counters_seen {
            // Once per counters read: spool pressure (and what waits for the spool)
            // moves the kernel's bulk sampling.
            // Memory pressure counts as a full spool: sampling goes up a step per read.
            let pressured = shared.pressure_level.load(Ordering::Relaxed) != 0;
            let used = if pressured {
                reader.spool_cap
            } else {
                shared.spool_used.load(Ordering::Acquire) + shared.queue_bytes.load(Ordering::Acquire)
            };
            let before = sampling.level();
            let level = sampling.decide(used, reader.spool_cap);
            if level != before {
                if source.set_sampling_level(level) {
                    tracing::info!(from = before, to = level, spool_bytes = used, "bulk sampling level changed");
                }
                q.send(ToCore::Sampling(level));
            }
        }
        if state == SourceState::NodeDead {
            break;
        }
        if state == SourceState::Finished && now >= next_finished_counters {
            // A finished source's counters stay exact: nothing more will be attempted,
            // so they hold as of now (and the watermarks move on).
            next_finished_counters = now.saturating_add(reader.heartbeat_interval_ns);
            stager.flush(&mut |b| q.staged(b, &mut spare));
            let mut c = owned.counters(source.counters());
            c.mono_ns = mono;
            q.send(ToCore::Counters(c, mono));
        }
        stager.poll_cut(now, &mut |b| q.staged(b, &mut spare));
        if now >= next_ring_metrics {
            next_ring_metrics = now.saturating_add(RING_METRICS_EVERY_NS);
            if let Some(m) = source.ring_metrics() {
                *shared.ring_metrics.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(m);
            }
        }
        if let Some(l) = live {
            l.store(frames_in, Ordering::Relaxed);
        }
        if std::mem::take(&mut q.sent) {
            shared.wake.notify_one();
        }
        // Idle, or shedding: a turn's pause. While the spool is full the reader drains a
        // budget per millisecond instead of spinning to copy frames only to shed them
        // (a core the network and the aggregator need on a small node); what a real ring
        // cannot hold meanwhile the kernel drops, counted per stream
        // (`kernel_ring_full`). P0 has its own ring and is never shed.
        if events < 16 || std::mem::take(&mut q.shed_now) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // What was read goes to the core (the shutdown path flushes and ships it).
    stager.flush(&mut |b| q.staged(b, &mut spare));
    if stager.frames_malformed > malformed_sent {
        q.send(ToCore::Malformed(stager.frames_malformed - malformed_sent));
    }
    q.flush_shed();
    shared.wake.notify_one();
    (source, state)
}

/// Applies one message from the reader to the core.
fn apply(shared: &Shared, core: &mut ShipperCore, msg: ToCore, back: &std::sync::mpsc::Sender<BatchWriter>, now: u64) {
    match msg {
        ToCore::Staged(mut st) => {
            shared.queue_bytes.fetch_sub(st.payload_len(), Ordering::AcqRel);
            core.handle_staged(&mut st, now);
            let _ = back.send(st.writer);
        }
        ToCore::Shed(lane, ranges) => core.handle_shed(lane, &ranges, now),
        ToCore::Epoch(e) => core.handle_epoch(&e, now),
        ToCore::Counters(c, mono) => core.handle_counters(&c, mono, now),
        ToCore::SessionStart(st, mono) => core.handle_session_start(&st, mono, now),
        ToCore::Sampling(level) => core.set_sampling_level(level),
        ToCore::StreamIndex(i) => core.set_shipper_stream_index(i),
        ToCore::Malformed(n) => core.note_malformed(n),
    }
}

/// Applies the reader's messages to the core (a bounded number per turn of the lock, so
/// the network side gets it between turns) and drives the core's timers. Returns the
/// queue's ends when told to stop, for the shutdown path to drain.
async fn pump(
    shared: Arc<Shared>,
    rx: std::sync::mpsc::Receiver<ToCore>,
    back: std::sync::mpsc::Sender<BatchWriter>,
    mut stop: watch::Receiver<bool>,
    panic_after: Option<u64>,
) -> (std::sync::mpsc::Receiver<ToCore>, std::sync::mpsc::Sender<BatchWriter>) {
    let mut total = 0u64;
    loop {
        let mut applied = 0usize;
        let next = {
            let now = shared.now();
            let mut core = shared.core();
            while applied < 64 {
                let Ok(msg) = rx.try_recv() else { break };
                apply(&shared, &mut core, msg, &back, now);
                applied += 1;
            }
            if now >= core.poll_timeout() {
                core.handle_timeout(shared.node_mono(now), now);
            }
            shared.spool_used.store(core.spool().used_bytes(), Ordering::Release);
            total = total.saturating_add(u64::try_from(applied).unwrap_or(u64::MAX));
            assert!(panic_after.is_none_or(|n| total < n), "test hook: the pump panics after {total} messages");
            publish_resends(&shared, &core);
            core.poll_timeout()
        };
        shared.ready.notify_one();
        if applied == 64 {
            tokio::task::yield_now().await;
            continue;
        }
        let wait = Duration::from_nanos(next.saturating_sub(shared.now()).clamp(100_000, 50_000_000));
        tokio::select! {
            () = shared.wake.notified() => {}
            () = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return (rx, back),
        }
    }
}

async fn network(
    endpoint: quinn::Endpoint,
    (targets, v4): (Vec<AggregatorAddr>, bool),
    server_name: String,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(BACKOFF_BASE_MS, BACKOFF_CAP_MS);
    let mut rng_state = new_session_id();
    // The control protocol to offer next: the newest, or — after an aggregator closed a
    // connection before its hello for the protocol (one a release older answers so) —
    // the one before, for the next attempt only, so an aggregator upgraded meanwhile gets
    // the newest again.
    let mut offer = shared.max_control_version;
    // Which of `targets` (the ingest shards in this node's rendezvous order) to try: the
    // first; the next after one could not be reached (no connection, or one that timed
    // out: the shard went silent); the first again after a connection the aggregator
    // closed (an orderly restart comes back where it was).
    let mut at = 0usize;
    while !*stop.borrow() {
        shared.net.attempts.fetch_add(1, Ordering::Relaxed);
        let Some(target) = targets.get(at).or(targets.first()) else { return };
        *shared.net.target.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = target.to_string();
        let client = shared.client.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        // A name is looked up at every attempt: a restarted aggregator may have moved.
        let resolved = tokio::select! {
            r = target.resolve(v4) => r,
            _ = stop.changed() => return,
        };
        let addr = match resolved {
            Ok(a) => a,
            Err(_) => SocketAddr::from(([0u8; 4], 0)),
        };
        let attempt = match resolved {
            Ok(_) => endpoint.connect_with(client, addr, &server_name).map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        let conn = match attempt {
            Ok(connecting) => tokio::select! {
                c = connecting => c.map_err(|e| (refusal(&e), e.to_string())),
                _ = stop.changed() => return,
            },
            Err(e) => Err((None, e)),
        };
        let mut unreachable = false;
        let refused = match conn {
            Ok(conn) => {
                shared.net.connections.fetch_add(1, Ordering::Relaxed);
                let (hellos, acked) = {
                    let mut core = shared.core();
                    core.reconnected();
                    (core.stats().hellos, core.stats().batches_acked)
                };
                tracing::debug!(%addr, control_protocol = offer, "connected");
                let why = connection(&conn, &shared, &mut stop, offer).await;
                shared.net.established.store(false, Ordering::Relaxed);
                if *stop.borrow() {
                    return;
                }
                let (answered, acked_any) = {
                    let core = shared.core();
                    (core.stats().hellos > hellos, core.stats().batches_acked > acked)
                };
                // Only a connection the aggregator acked a batch on proves the set-up
                // good: a TLS 1.3 handshake completes on the client before the server
                // checks the client's certificate, so "connected" proves nothing.
                if acked_any {
                    backoff.reset();
                }
                let refused = conn.close_reason().as_ref().and_then(refusal);
                if refused.is_none() {
                    tracing::info!(%addr, reason = %why, "connection ended");
                }
                unreachable = matches!(conn.close_reason(), Some(quinn::ConnectionError::TimedOut));
                let refused_protocol = matches!(
                    conn.close_reason(),
                    Some(quinn::ConnectionError::ApplicationClosed(ref c))
                        if c.error_code == close::PROTOCOL.into() || c.error_code == close::VERSION.into()
                );
                offer = if !answered && refused_protocol && offer > MIN_CONTROL_VERSION {
                    tracing::warn!(%addr, refused = offer, "the aggregator refused this control protocol: offering the one before");
                    backoff.reset();
                    offer - 1
                } else {
                    shared.max_control_version
                };
                refused
            }
            Err((refused, e)) => {
                if refused.is_none() {
                    tracing::warn!(aggregator = %target, error = %e, retry_step_ms = backoff.step_ms(), "connect failed");
                    unreachable = true;
                }
                refused
            }
        };
        let before = at;
        at = if unreachable {
            (at + 1) % targets.len().max(1)
        } else if refused.is_none() {
            0
        } else {
            at
        };
        if unreachable && at != before {
            shared.net.failovers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(from = %target, to = %targets.get(at).map(ToString::to_string).unwrap_or_default(), "ingest shard unreachable: failing over to the next in this node's rendezvous order");
            // A different shard: no reason to wait out the backoff grown on this one.
            backoff.reset();
        }
        if refused.is_some() {
            backoff.to_cap();
        }
        // xorshift for the jitter draw: no shared RNG needed for a reconnect delay.
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        #[allow(clippy::cast_precision_loss, reason = "a uniform draw needs 53 bits")]
        let unit = (rng_state >> 11) as f64 / (1u64 << 53) as f64;
        let delay = Duration::from_millis(backoff.next_ms(unit));
        if let Some(why) = refused {
            // One line per attempt, and attempts after a refusal are at least half the
            // cap apart.
            let n = shared.net.refused.fetch_add(1, Ordering::Relaxed).saturating_add(1);
            tracing::warn!(
                %addr,
                reason = %why,
                refusals = n,
                retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                "the aggregator refused this shipper; retrying at the backoff cap"
            );
            *shared.net.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            // New certificates: try them now (a refusal may have been the old ones').
            () = shared.tls_rotated.notified() => backoff.reset(),
            _ = stop.changed() => return,
        }
    }
}

/// Looks at the TLS files every `interval_ms`; a rotated set that loads is used for the
/// next connection (the one up keeps its keys).
async fn reload_tls(
    shared: Arc<Shared>,
    mut watch: ringwatch_transport::reload::TlsWatch,
    (ca, cert, key): (PathBuf, PathBuf, PathBuf),
    tuning: Tuning,
    interval_ms: u64,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(interval_ms.max(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let files = TlsFiles { ca: &ca, cert: &cert, key: &key };
        if let Some(client) = watch.poll("quic", || ringwatch_transport::client_config(files, &tuning)) {
            *shared.client.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = client;
            shared.tls_rotated.notify_one();
        }
    }
}

/// Reconnect backoff: from 100 ms, doubling to 5 s; a refusal jumps to the cap (so a
/// refused shipper tries at most once per 2.5–5 s).
pub const BACKOFF_BASE_MS: u64 = 100;
pub const BACKOFF_CAP_MS: u64 = 5_000;

/// Why a connection's end means the aggregator refuses this shipper (retrying soon cannot
/// help): its TLS handshake failed on a certificate (a TLS alert, QUIC crypto error
/// 0x100–0x1ff, from either side), or the aggregator closed it `refused` (no usable
/// identity, node cap) or `abuse` (too many rejected batches, e.g. `node_mismatch`).
fn refusal(e: &quinn::ConnectionError) -> Option<String> {
    let crypto = |code: quinn::TransportErrorCode| (0x100..=0x1ff).contains(&u64::from(code));
    match e {
        quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == close::REFUSED.into() || c.error_code == close::ABUSE.into() =>
        {
            Some(format!("closed by the aggregator: {}", String::from_utf8_lossy(&c.reason)))
        }
        quinn::ConnectionError::ConnectionClosed(c) if crypto(c.error_code) => {
            Some(format!("TLS refused by the aggregator: {c}"))
        }
        quinn::ConnectionError::TransportError(t) if crypto(t.code) => Some(format!("TLS: {t}")),
        _ => None,
    }
}

/// Runs one connection until it fails or the shipper stops; returns why it ended.
async fn connection(
    conn: &quinn::Connection,
    shared: &Arc<Shared>,
    stop: &mut watch::Receiver<bool>,
    version: u16,
) -> String {
    let (mut ctl_send, ctl_recv) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    let _ = ctl_send.set_priority(ringwatch_transport::CONTROL_PRIORITY);
    // The preface, then where the session stands (the aggregator applies it before any
    // batch of this connection).
    let mut opening = control_preface(version).to_vec();
    let r = shared.core().resume();
    if let Err(e) = proto_flat::control::encode_resume(
        &mut opening,
        r.shipper_session,
        r.epoch,
        r.next_batch_seq,
        r.sent_ns,
        &r.held,
        &r.floors,
    ) {
        return format!("resume: {e}");
    }
    if let Err(e) = ctl_send.write_all(&opening).await {
        return e.to_string();
    }
    let reader = tokio::spawn(control_reader(ctl_recv, Arc::clone(shared), conn.clone()));
    let streams = Arc::new(Semaphore::new(512));
    let why = loop {
        // Up to 64 batches per turn of the lock: one handoff per batch would let a busy
        // reader starve the sender.
        let next: Vec<(proto_flat::Class, u64, Vec<u8>)> = {
            let now = shared.now();
            let mut core = shared.core();
            std::iter::from_fn(|| core.poll_transmit(now).map(|(lane, seq, bytes)| (lane, seq, bytes.to_vec())))
                .take(64)
                .collect()
        };
        if !next.is_empty() {
            let mut closed = false;
            for (lane, seq, mut bytes) in next {
                poison_hook(shared, lane, seq, &mut bytes);
                // Waiting for a permit ends with the connection or the shipper: a link
                // so slow that every permit's stream is stuck must not hold the stop.
                let permit = tokio::select! {
                    p = Arc::clone(&streams).acquire_owned() => p.ok(),
                    _ = conn.closed() => None,
                    _ = stop.changed() => None,
                };
                let Some(permit) = permit else {
                    // A new connection sends every unacked batch again.
                    closed = true;
                    break;
                };
                let (conn, shared) = (conn.clone(), Arc::clone(shared));
                let l = usize::from(lane.code()).min(3);
                let mut resends = shared.resends.subscribe();
                let generation = resends.borrow()[l];
                tokio::spawn(async move {
                    // The batch stays unacked in the spool until its ack. A stream that
                    // fails, or that the aggregator stops (it gives up reading a stream
                    // that stalls), sends that batch again now on this connection; a
                    // closed connection sends everything unacked again after the
                    // reconnect. A stream whose lane was sent again meanwhile (its acks
                    // stalled) is reset: the resend carries its batch, and two copies
                    // must not share the send window (on a slow link they would fill it,
                    // and P0/P1 would wait behind bulk).
                    // The permit bounds streams being written, not streams awaiting
                    // the peer's transport ack: P0 must not wait behind bulk for it
                    // (the P0-under-saturation test saw a p99 of 1.8 s when it did).
                    let superseded = resends.wait_for(|g| g[l] != generation);
                    tokio::pin!(superseded);
                    let delivered = match conn.open_uni().await {
                        Ok(mut s) => {
                            let _ = s.set_priority(lane_priority(lane));
                            let written = tokio::select! {
                                w = s.write_all(&bytes) => w.is_ok() && s.finish().is_ok(),
                                _ = &mut superseded => {
                                    let _ = s.reset(0u32.into());
                                    return;
                                }
                            };
                            drop(permit);
                            written
                                && tokio::select! {
                                    r = s.stopped() => matches!(r, Ok(None)),
                                    _ = &mut superseded => {
                                        let _ = s.reset(0u32.into());
                                        return;
                                    }
                                }
                        }
                        Err(_) => {
                            drop(permit);
                            false
                        }
                    };
                    if !delivered && conn.close_reason().is_none() {
                        shared.core().handle_send_failed(seq);
                        shared.ready.notify_one();
                    }
                });
            }
            if closed {
                break "closed".to_owned();
            }
            continue;
        }
        tokio::select! {
            () = shared.ready.notified() => {}
            e = conn.closed() => break e.to_string(),
            _ = stop.changed() => break "stopping".to_owned(),
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    };
    reader.abort();
    why
}

/// The test hook: one bulk batch goes out with a stream summary that disagrees with its
/// frames (CRC resealed, so only the summary check can catch it).
fn poison_hook(shared: &Shared, lane: proto_flat::Class, seq: u64, bytes: &mut [u8]) {
    let mut hook = shared.poison_from.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(from) = *hook else { return };
    if lane != proto_flat::Class::P2 || seq < from {
        return;
    }
    let Ok(view) = proto_flat::batch::BatchView::parse(bytes) else { return };
    let entries_at = usize::from(view.header.header_len.get())
        + view.payload.len()
        + size_of::<proto_flat::sections::SectionHeader>();
    // StreamSummaryEntry.frame_count is the u32 at offset 4.
    if let Some(count) = bytes.get_mut(entries_at + 4) {
        *count = count.wrapping_add(1);
        proto_flat::batch::reseal(bytes);
        *hook = None;
        tracing::warn!(batch_seq = seq, "test hook: poisoned this batch's stream summary");
    }
}

/// Applies `hello`, `ack` and `nack` messages from the control stream.
async fn control_reader(mut recv: quinn::RecvStream, shared: Arc<Shared>, conn: quinn::Connection) {
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    loop {
        let chunk = match recv.read_chunk(64 * 1024, true).await {
            Ok(Some(c)) => c,
            Ok(None) | Err(_) => return,
        };
        buf.extend_from_slice(&chunk.bytes);
        let mut used = 0;
        loop {
            let rest = buf.get(used..).unwrap_or(&[]);
            match parse_control(rest) {
                Ok(Some((msg, n))) => {
                    used += n;
                    let now = shared.now();
                    let mut core = shared.core();
                    match msg {
                        ControlMessage::Hello {
                            aggregator_instance,
                            aggregator_epoch,
                            control_version,
                            durability,
                        } => {
                            core.handle_hello(aggregator_instance, aggregator_epoch, control_version, durability);
                            shared.net.established.store(true, Ordering::Relaxed);
                        }
                        ControlMessage::Ack { shipper_session, status, ranges: r } => {
                            if shipper_session == core.batcher().meta().shipper_session {
                                ranges.clear();
                                ranges.extend(r.iter().map(|x| (x.first.get(), x.last.get())));
                                core.handle_ack(&ranges, status, now);
                            }
                        }
                        ControlMessage::Nack { shipper_session, batch_seq, reason } => {
                            if shipper_session == core.batcher().meta().shipper_session {
                                core.handle_nack(batch_seq, reason, now);
                            }
                        }
                        // Shipper → aggregator only; an aggregator has no business sending one.
                        ControlMessage::Resume { .. } | ControlMessage::Unknown { .. } => {}
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    shared.net.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "bad control message; closing the connection");
                    conn.close(close::PROTOCOL.into(), b"bad control message");
                    return;
                }
            }
        }
        buf.drain(..used);
        shared.ready.notify_one();
    }
}

/// The shipper's own HTTP surface: `GET /healthz` (200 while the shipper runs, with what
/// its network side counted) and `GET /readyz` (200 while a connection to the aggregator
/// has its session established, else 503 with why). Errors as JSON, unknown query
/// parameters refused, like the aggregator's API.
fn health_router(shared: Arc<Shared>, aggregator: String) -> axum::Router {
    use axum::extract::State;
    use axum::http::{StatusCode, Uri};
    use axum::response::{IntoResponse, Response};
    use axum::routing::get;
    use ringwatch_transport::http;

    #[derive(serde::Serialize)]
    struct Health {
        status: &'static str,
        /// Why the status is not `ok`.
        reasons: Vec<String>,
        aggregator: String,
        connected: bool,
        uptime_ms: u64,
        connect_attempts: u64,
        connections: u64,
        connections_refused: u64,
        last_refusal: Option<String>,
        /// The ingest shard in use (`aggregator` is the first of the list's order).
        connected_to: String,
        failovers: u64,
        spool_used_bytes: usize,
        frames_in: u64,
        frames_acked: u64,
        pressure: Option<PressureDto>,
        pressure_unavailable: Option<String>,
        frames_lost_psi_shed: u64,
        memory_budget: Option<BudgetDto>,
        throttle: Option<ThrottleDto>,
        p3: P3Dto,
        pools: PoolsDto,
        owners: OwnersDto,
    }
    #[derive(serde::Serialize)]
    struct Ready {
        ready: bool,
        reasons: Vec<String>,
    }
    async fn healthz(State((s, agg)): State<(Arc<Shared>, String)>, uri: Uri) -> Response {
        if let Err(r) = http::params(&uri, &[]) {
            return r.into_response();
        }
        let (frames_in, frames_acked, frames_lost_psi_shed) = {
            let core = s.core();
            let st = core.stats();
            let psi = proto_flat::LossCause::PsiShed.drop_slot().and_then(|i| st.frames_lost.get(i).copied());
            (st.frames_in, st.frames_acked, psi.unwrap_or(0))
        };
        let mut reasons = Vec::new();
        if let Some(why) = s.pressure_ended.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() {
            reasons.push(format!("memory pressure watcher {why}"));
        }
        if let Some(why) = s.tls_ended.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() {
            reasons.push(format!("certificate reload {why}: rotated certificates are not picked up"));
        }
        let owners = s.owners.dto();
        if owners.stopped {
            reasons.push("the owner lookup thread stopped: rank owners are no longer updated".into());
        }
        // The core's lock on its own (the report takes it before the others).
        let pools = s.pools_dto();
        let code = if reasons.is_empty() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        let health = Health {
            status: if reasons.is_empty() { "ok" } else { "degraded" },
            reasons,
            aggregator: agg,
            connected: s.net.established.load(Ordering::Relaxed),
            uptime_ms: s.now() / 1_000_000,
            connect_attempts: s.net.attempts.load(Ordering::Relaxed),
            connections: s.net.connections.load(Ordering::Relaxed),
            connections_refused: s.net.refused.load(Ordering::Relaxed),
            last_refusal: s.net.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
            connected_to: s.net.target.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
            failovers: s.net.failovers.load(Ordering::Relaxed),
            spool_used_bytes: s.spool_used.load(Ordering::Relaxed),
            frames_in,
            frames_acked,
            pressure: s.pressure_dto(),
            pressure_unavailable: s
                .pressure_unavailable
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            frames_lost_psi_shed,
            memory_budget: s.budget_dto(),
            throttle: s.throttling().dto(),
            p3: s.p3.dto(),
            pools,
            owners,
        };
        (code, axum::Json(health)).into_response()
    }
    async fn readyz(State((s, agg)): State<(Arc<Shared>, String)>, uri: Uri) -> Response {
        if let Err(r) = http::params(&uri, &[]) {
            return r.into_response();
        }
        let mut reasons = Vec::new();
        if !s.net.established.load(Ordering::Relaxed) {
            let last = s.net.last_refusal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            reasons.push(match last {
                Some(why) => format!("no session with the aggregator {agg}; its last refusal: {why}"),
                None => format!("no session with the aggregator {agg}"),
            });
        }
        let code = if reasons.is_empty() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        (code, axum::Json(Ready { ready: reasons.is_empty(), reasons })).into_response()
    }
    async fn metrics(State((s, _)): State<(Arc<Shared>, String)>, uri: Uri) -> Response {
        if let Err(r) = http::params(&uri, &[]) {
            return r.into_response();
        }
        let text = crate::metrics::render(&s.metrics_reading());
        ([(axum::http::header::CONTENT_TYPE, ringwatch_transport::metrics::CONTENT_TYPE)], text).into_response()
    }
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .with_state((shared, aggregator))
}
