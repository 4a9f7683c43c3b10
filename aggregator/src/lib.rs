//! `aggregator`: the central service.
//!
//! What it is: the I/O shell around `ringwatch-core` — QUIC ingest with mutual TLS
//! ([`ingest`]), the core's timers, the HTTP API ([`api`], axum; DTOs in `api/dto.rs`),
//! and `aggregator certs init` ([`certs`]). All decisions are the core's
//! (`aggregator/core`, package `ringwatch-core`), which this crate drives: connection
//! tasks hand it validated batches, a timer task hands it time.
//!
//! Snapshots are written on a schedule and restored at start ([`snapshots`]); every task
//! is supervised ([`supervise`]: a panic in the core ends the process non-zero, to restart
//! from the snapshot; an I/O task restarts in place, counted).
//!
//! What it is not (yet): `/metrics` and OTLP export (later issues).

pub mod api;
pub mod certs;
pub mod cluster;
pub mod config;
pub mod events;
pub mod ingest;
pub mod metrics;
pub mod otlp;
pub mod query;
pub mod snapshots;
pub mod state;
pub mod supervise;

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ringwatch_core::{Core, IngestConfig, MatcherConfig, StoreConfig, VerdictStore};
use ringwatch_transport::reload::TlsWatch;
use ringwatch_transport::{TlsFiles, Tuning};
use tokio::task::JoinHandle;

pub use ringwatch_core as core;
pub use state::Shared;

/// Everything an aggregator needs to start.
#[derive(Debug, Clone)]
pub struct AggregatorConfig {
    /// QUIC (UDP) listen address.
    pub listen: SocketAddr,
    /// HTTP listen address.
    pub http: SocketAddr,
    /// The CA that signs node certificates.
    pub ca: PathBuf,
    /// The server certificate and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    pub tuning: Tuning,
    pub ingest: IngestConfig,
    pub matcher: MatcherConfig,
    /// The verdict store's limits (retention and bytes).
    pub store: StoreConfig,
    /// Test hook: never send acks (shippers' spools then hold every batch) …
    pub hold_acks: bool,
    /// … or only from this long after start.
    pub hold_acks_after_ms: Option<u64>,
    /// Where the core is snapshotted, and restored from at start (none: no snapshots).
    /// With a path, `hello` declares durability `snapshot` and P0/P1 batches are acked
    /// `durable` once a snapshot on disk holds them; without, `none`.
    pub snapshot_path: Option<PathBuf>,
    /// The newest control protocol to speak (the default: this build's; 2 stands in for
    /// the previous release in tests).
    pub max_control_version: u16,
    pub snapshot_interval_ms: u64,
    /// The HTTP listener's header-read timeout and connection cap.
    pub http_limits: ringwatch_transport::http::HttpLimits,
    /// Aggregator time per real time (1 in production; `loadgen --time-scale` compresses
    /// simulated runs, whose node clocks run as fast).
    pub time_scale: f64,
    /// The memory-pressure watcher on this process's cgroup (none: off). Under pressure
    /// the aggregator sheds its P3: the verdict store keeps a quarter of its retention
    /// and bytes, logs drop to WARN, freed heap goes back to the kernel.
    pub psi: Option<ringwatch_transport::psi::PsiConfig>,
    /// OTLP export of the event stream (`otlp_export`; `None`: off).
    pub otlp: Option<otlp::OtlpConfig>,
    /// The event stream (`GET /v1/events`): log size, heartbeat, subscriber cap.
    pub events: api::events::EventsConfig,
    /// The API's bearer token file (none: no token asked).
    pub api_token_file: Option<PathBuf>,
    /// `/v1/summary`'s correlated-degradation rule.
    pub summary: state::SummaryConfig,
    /// TLS on the HTTP listener (none: plain HTTP).
    pub http_tls: Option<HttpTls>,
    /// How often the TLS files are looked at for a rotation (0: never; a rotated
    /// certificate is used for new connections, see `ringwatch_transport::reload`).
    pub tls_reload_interval_ms: u64,
    /// A shard role over NATS JetStream (none: `all`, one process; see [`cluster`]).
    pub cluster: Option<cluster::ClusterConfig>,
}

/// The HTTP API's TLS: its certificate and key, and the CA client certificates must be
/// signed by (mTLS; none: no client certificate asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl AggregatorConfig {
    /// Defaults around a certificate set, listening on ephemeral loopback ports.
    #[must_use]
    pub fn local(certs: &certs::CertSet) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            ca: certs.ca.clone(),
            cert: certs.server_cert.clone(),
            key: certs.server_key.clone(),
            tuning: Tuning::default(),
            ingest: IngestConfig::default(),
            matcher: MatcherConfig::default(),
            store: StoreConfig::default(),
            hold_acks: false,
            hold_acks_after_ms: None,
            snapshot_path: None,
            max_control_version: proto_flat::control::CONTROL_VERSION,
            snapshot_interval_ms: 10_000,
            http_limits: ringwatch_transport::http::HttpLimits::default(),
            time_scale: 1.0,
            // In-process aggregators (tests, loadgen) share their process's cgroup with
            // everything else in it: off unless asked for.
            psi: None,
            otlp: None,
            events: api::events::EventsConfig::default(),
            api_token_file: None,
            summary: state::SummaryConfig::default(),
            http_tls: None,
            tls_reload_interval_ms: ringwatch_transport::reload::DEFAULT_INTERVAL_MS,
            cluster: None,
        }
    }
}

/// The shard role's tasks, each supervised (see [`cluster`]).
fn spawn_cluster_tasks(
    shared: &Arc<Shared>,
    c: &cluster::ClusterConfig,
    js: &async_nats::jetstream::Context,
) -> Vec<JoinHandle<()>> {
    type Task = fn(
        Arc<Shared>,
        cluster::ClusterConfig,
        async_nats::jetstream::Context,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
    let (bus, state): (Task, Task) = match c.role {
        cluster::ShardRole::Ingest { .. } => (
            |s, c, js| Box::pin(cluster::publish_records(s, c, js)),
            |s, c, js| Box::pin(cluster::publish_nodes(s, c, js)),
        ),
        cluster::ShardRole::Matcher { .. } => (
            |s, c, js| Box::pin(cluster::consume_records(s, c, js)),
            |s, c, js| Box::pin(cluster::publish_verdicts(s, c, js)),
        ),
        cluster::ShardRole::Api => {
            (|s, _, js| Box::pin(cluster::consume_verdicts(s, js)), |s, _, js| Box::pin(cluster::consume_state(s, js)))
        }
    };
    let mut out = Vec::new();
    for (task, pick) in [(bus, (|s| &s.tasks.cluster) as supervise::Pick), (state, |s| &s.tasks.cluster_state)] {
        let (sh, c, js) = (Arc::clone(shared), c.clone(), js.clone());
        out.push(supervise::spawn_io_task(Arc::clone(shared), pick, move || {
            task(Arc::clone(&sh), c.clone(), js.clone())
        }));
    }
    if matches!(c.role, cluster::ShardRole::Matcher { .. }) {
        let (sh, c, js) = (Arc::clone(shared), c.clone(), js.clone());
        out.push(supervise::spawn_io_task(
            Arc::clone(shared),
            |s| &s.tasks.cluster_state,
            move || cluster::publish_health(Arc::clone(&sh), c.clone(), js.clone()),
        ));
    }
    out
}

/// Errors starting the service.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("transport: {0}")]
    Transport(#[from] ringwatch_transport::TransportError),
    #[error("HTTP listener {addr}: {source}")]
    Http { addr: SocketAddr, source: std::io::Error },
    #[error("snapshot: {0}")]
    Snapshot(#[from] snapshots::SnapshotFileError),
    #[error("HTTP TLS: {0}")]
    HttpTls(ringwatch_transport::TransportError),
    #[error("NATS: {0}")]
    Nats(String),
}

/// A running aggregator.
#[derive(Debug)]
pub struct Aggregator {
    /// Where shippers connect (the bound address).
    pub quic_addr: SocketAddr,
    /// Where the API answers.
    pub http_addr: SocketAddr,
    pub shared: Arc<Shared>,
    endpoint: quinn::Endpoint,
    tasks: Vec<JoinHandle<()>>,
    snapshot_path: Option<PathBuf>,
    /// A shard role's bus (see [`cluster`]).
    nats: Option<Box<(cluster::ClusterConfig, async_nats::jetstream::Context)>>,
}

impl Aggregator {
    /// Binds both listeners and starts serving.
    ///
    /// # Errors
    /// Certificates that do not load, or addresses that cannot be bound.
    pub async fn start(cfg: AggregatorConfig) -> Result<Self, StartError> {
        let files = TlsFiles { ca: &cfg.ca, cert: &cfg.cert, key: &cfg.key };
        let server = ringwatch_transport::server_config(files, &cfg.tuning)?;
        let endpoint = cfg.tuning.endpoint(cfg.listen, Some(server))?;
        let quic_addr = endpoint.local_addr().map_err(|source| {
            StartError::Transport(ringwatch_transport::TransportError::Socket { addr: cfg.listen, source })
        })?;
        let instance = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let mut skipped = None;
        let restored = match &cfg.snapshot_path {
            Some(p) => match snapshots::load(p) {
                Ok(r) => r,
                // Another build's format (an upgrade, or a downgrade): never a crash loop.
                // Start fresh in its place — epoch and aggregator time continued, every
                // node's knowledge gap from the snapshot's time — and keep the file.
                Err(snapshots::SnapshotFileError::Version { found, snapshot_ns, now_ns, epoch, .. }) => {
                    let aside = snapshots::set_aside(p, found).map_err(StartError::Snapshot)?;
                    tracing::warn!(
                        found,
                        expected = ringwatch_core::snapshot::SNAPSHOT_VERSION,
                        kept_at = %aside.display(),
                        "snapshot of another format version: starting fresh with a knowledge gap"
                    );
                    skipped = Some((found, aside.display().to_string(), snapshot_ns, now_ns, epoch));
                    None
                }
                Err(e) => return Err(e.into()),
            },
            None => None,
        };
        let hold = if cfg.hold_acks { Some(0) } else { cfg.hold_acks_after_ms.map(|ms| ms * 1_000_000) };
        let mut shared = match restored {
            Some(mut r) => {
                tracing::info!(epoch = r.epoch, snapshot_ns = r.snapshot_ns, "restored from snapshot");
                // The downtime in aggregator time (runs `time_scale` times faster in a
                // compressed loadgen run).
                r.now_ns = scaled_downtime(r.snapshot_ns, r.now_ns, cfg.time_scale);
                let hold = hold.map(|h| h.saturating_add(r.now_ns));
                let mut store = r.store;
                // Limits are configuration, not state: this run's apply.
                store.set_config(cfg.store);
                let mut s = Shared::new(r.core, store, instance, r.epoch, hold);
                s.base_ns = r.now_ns;
                s.restored = true;
                s
            }
            None => match skipped {
                Some((found, aside, snapshot_ns, now_ns, epoch)) => {
                    let now_ns = scaled_downtime(snapshot_ns, now_ns, cfg.time_scale);
                    let mut core = Core::new(cfg.ingest, cfg.matcher, now_ns);
                    core.forget_since(snapshot_ns);
                    let hold = hold.map(|h| h.saturating_add(now_ns));
                    let mut s = Shared::new(core, VerdictStore::new(cfg.store), instance, epoch, hold);
                    s.base_ns = now_ns;
                    s.snapshot_skipped = Some((found, aside));
                    s
                }
                None => {
                    Shared::new(Core::new(cfg.ingest, cfg.matcher, 0), VerdictStore::new(cfg.store), instance, 1, hold)
                }
            },
        };
        shared.durability = if matches!(cfg.cluster.as_ref().map(|c| c.role), Some(cluster::ShardRole::Ingest { .. })) {
            // Nothing published is needed from this process again: a batch is durable
            // once its records are on the bus.
            shared.durable_gen.send_replace(1);
            proto_flat::codes::Durability::Jetstream
        } else if cfg.snapshot_path.is_some() {
            proto_flat::codes::Durability::Snapshot
        } else {
            proto_flat::codes::Durability::None
        };
        shared.max_control_version = cfg
            .max_control_version
            .clamp(proto_flat::control::MIN_CONTROL_VERSION, proto_flat::control::CONTROL_VERSION);
        // Timers and caps are configuration, not state: a restored core takes this run's.
        if let Ok(mut core) = shared.core() {
            core.reconfigure(cfg.ingest, cfg.matcher);
            if let Some(c) = &cfg.cluster {
                core.set_role(c.core_role());
            }
        }
        let nats = match &cfg.cluster {
            Some(c) => {
                // Every role's clock: the wall clock since the shared origin.
                shared.base_ns = cluster::now_ns(c, cfg.time_scale);
                shared.cluster_role = Some(c.role);
                if matches!(c.role, cluster::ShardRole::Matcher { .. }) {
                    shared.keep_events_for_the_bus();
                }
                if !matches!(c.role, cluster::ShardRole::Ingest { .. }) {
                    // Only ingest shards take shippers: a shipper sent here is refused.
                    endpoint.set_server_config(None);
                }
                let name = format!("ringwatch-{}", c.role_name());
                Some((c.clone(), cluster::connect(c, &name).await.map_err(StartError::Nats)?))
            }
            None => None,
        };
        shared.time_scale = if cfg.time_scale > 0.0 { cfg.time_scale } else { 1.0 };
        shared.configure_events(cfg.events);
        shared.api_token = cfg.api_token_file.clone().map(api::auth::TokenFile::new);
        shared.summary = cfg.summary;
        shared.http_max_connections = u64::try_from(cfg.http_limits.max_connections).unwrap_or(u64::MAX);
        let http_tls = match &cfg.http_tls {
            Some(t) => Some(Arc::new(std::sync::RwLock::new(
                ringwatch_transport::http_tls_config(&t.cert, &t.key, t.client_ca.as_deref())
                    .map_err(StartError::HttpTls)?,
            ))),
            None => None,
        };
        // Rotated certificates: the QUIC listener's files, and the HTTP listener's.
        let mut reload = TlsReload::new(&cfg, endpoint.clone());
        shared.tls_quic = Arc::clone(&reload.quic.counters);
        if let (Some(t), Some(tls)) = (&cfg.http_tls, &http_tls) {
            let ca = t.client_ca.as_deref().unwrap_or(&t.cert);
            let w = TlsWatch::new(ca, &t.cert, &t.key, &[]);
            shared.tls_http = Some(Arc::clone(&w.counters));
            reload.http = Some((w, t.clone(), Arc::clone(tls)));
        }
        let shared = Arc::new(shared);
        // A std listener, so the HTTP task can restart in place on a clone of it.
        let listener = std::net::TcpListener::bind(cfg.http)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| StartError::Http { addr: cfg.http, source })?;
        let http_addr = listener.local_addr().map_err(|source| StartError::Http { addr: cfg.http, source })?;
        let router = api::router(Arc::clone(&shared));
        let (limits, http_counters) = (cfg.http_limits, Arc::clone(&shared.http));
        let ep = endpoint.clone();
        let sh = Arc::clone(&shared);
        let takes_shippers = !matches!(
            cfg.cluster.as_ref().map(|c| c.role),
            Some(cluster::ShardRole::Matcher { .. } | cluster::ShardRole::Api)
        );
        let mut tasks = vec![
            supervise::spawn_io_task(
                Arc::clone(&shared),
                |s| &s.tasks.ingest,
                move || {
                    let (ep, sh) = (ep.clone(), Arc::clone(&sh));
                    async move {
                        if takes_shippers {
                            ingest::serve(ep, sh).await;
                        } else {
                            std::future::pending::<()>().await;
                        }
                    }
                },
            ),
            supervise::spawn_core_task(Arc::clone(&shared), |s| &s.tasks.timers, timers(Arc::clone(&shared))),
            supervise::spawn_io_task(
                Arc::clone(&shared),
                |s| &s.tasks.http,
                move || {
                    serve_http(
                        listener.try_clone(),
                        router.clone(),
                        limits,
                        Arc::clone(&http_counters),
                        http_tls.clone(),
                    )
                },
            ),
        ];
        let sh = Arc::clone(&shared);
        tasks.push(supervise::spawn_io_task(
            Arc::clone(&shared),
            |s| &s.tasks.events,
            move || watch_nodes(Arc::clone(&sh)),
        ));
        if let Some((c, js)) = &nats {
            tasks.extend(spawn_cluster_tasks(&shared, c, js));
        }
        if let Some(psi) = cfg.psi.clone() {
            let sh = Arc::clone(&shared);
            tasks.push(supervise::spawn_io_task(
                Arc::clone(&shared),
                |s| &s.tasks.pressure,
                move || follow_pressure(Arc::clone(&sh), psi.clone()),
            ));
        }
        if let Some(o) = cfg.otlp.clone() {
            shared.otlp.enabled.store(true, std::sync::atomic::Ordering::Relaxed);
            let sh = Arc::clone(&shared);
            tasks.push(supervise::spawn_io_task(
                Arc::clone(&shared),
                |s| &s.tasks.otlp,
                move || otlp::run(Arc::clone(&sh), o.clone()),
            ));
        }
        if cfg.tls_reload_interval_ms > 0 {
            shared.tls_reload_on.store(true, std::sync::atomic::Ordering::Relaxed);
            let (interval, reload) = (cfg.tls_reload_interval_ms, Arc::new(tokio::sync::Mutex::new(reload)));
            let sh = Arc::clone(&shared);
            tasks.push(supervise::spawn_io_task(
                Arc::clone(&shared),
                |s| &s.tasks.tls,
                move || reload_tls(Arc::clone(&sh), Arc::clone(&reload), interval),
            ));
        }
        if let Some(path) = cfg.snapshot_path.clone() {
            let (sh, interval) = (Arc::clone(&shared), cfg.snapshot_interval_ms);
            tasks.push(supervise::spawn_io_task(
                Arc::clone(&shared),
                |s| &s.tasks.snapshots,
                move || snapshot_loop(Arc::clone(&sh), path.clone(), interval),
            ));
        }
        Ok(Self {
            quic_addr,
            http_addr,
            shared,
            endpoint,
            tasks,
            snapshot_path: cfg.snapshot_path,
            nats: nats.map(Box::new),
        })
    }

    /// Resolves when the core fails (a panic while it was being updated, or its timer
    /// task died), with why. The binary then exits non-zero without a snapshot, so it
    /// restarts from the last good one.
    pub async fn failed(&self) -> String {
        self.shared.failed().await
    }

    /// Stops accepting and closes every connection.
    pub fn shutdown(&self) {
        self.shared.close_events();
        self.endpoint.close(ringwatch_transport::close::SHUTDOWN.into(), b"aggregator shutting down");
        for t in &self.tasks {
            t.abort();
        }
    }

    /// An orderly stop (SIGTERM): closes every connection first, so no ack leaves after
    /// it, then writes a final snapshot if snapshots are configured — a restart from it
    /// forgets nothing that was acked. Returns whether a snapshot was written (never
    /// after the core failed).
    pub async fn shutdown_with_snapshot(&self) -> bool {
        // An ingest shard first stops applying (new connections refused, batches left to
        // their shippers), puts what it holds on the bus, and tells its shippers which
        // batches that made durable — so the next instance is not sent them again.
        if let Some((c, js)) = self.nats.as_deref()
            && matches!(c.role, cluster::ShardRole::Ingest { .. })
        {
            self.shared.draining.store(true, std::sync::atomic::Ordering::Relaxed);
            self.endpoint.set_server_config(None);
            let left = cluster::flush_records(&self.shared, c, js, Duration::from_secs(5)).await;
            if left > 0 {
                tracing::warn!(left, "records not on the bus at shutdown (JetStream unreachable)");
            }
            let started = std::time::Instant::now();
            while self.shared.awaiting_durable.load(std::sync::atomic::Ordering::Relaxed) > 0
                && started.elapsed() < Duration::from_secs(2)
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The last acks are written; give them a moment on the wire before the close
            // (which abandons what streams have not sent).
            tokio::time::sleep(Duration::from_millis(200)).await;
            tracing::info!(left, "ingest shard drained");
        }
        self.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        // An aborted task stops at its next await: one mid-apply on another worker thread
        // (a matcher applying a bus message) finishes that apply first. The snapshot waits
        // for it (bounded), so it holds everything the core applied and its bus position.
        let started = std::time::Instant::now();
        while !self.tasks.iter().all(JoinHandle::is_finished) && started.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // What the closes and the last timer turns produced (nodes disconnected) too.
        if let Some((c, js)) = self.nats.as_deref()
            && matches!(c.role, cluster::ShardRole::Ingest { .. })
        {
            let left = cluster::flush_records(&self.shared, c, js, Duration::from_secs(2)).await;
            if left > 0 {
                tracing::warn!(left, "records not on the bus at shutdown (JetStream unreachable)");
            }
        }
        let Some(path) = self.snapshot_path.clone() else { return false };
        let shared = Arc::clone(&self.shared);
        let sh = Arc::clone(&shared);
        let written = match tokio::task::spawn_blocking(move || snapshot_now(&sh, &path)).await {
            Ok(w) => w,
            Err(e) => {
                let why = if e.is_panic() { supervise::panic_message(e.into_panic().as_ref()) } else { e.to_string() };
                shared.fail(format!("the final snapshot failed: {why}"));
                false
            }
        };
        tracing::info!(written, "final snapshot");
        written
    }
}

/// Aggregator time after a restart: the snapshot's, plus the downtime (`now_ns −
/// snapshot_ns`, wall clock) at `time_scale`.
fn scaled_downtime(snapshot_ns: u64, now_ns: u64, time_scale: f64) -> u64 {
    snapshot_ns.saturating_add(state::scale_ns(now_ns.saturating_sub(snapshot_ns), time_scale))
}

/// What the certificate reload looks at: the QUIC listener's files, and the HTTP
/// listener's with TLS on.
struct TlsReload {
    quic: TlsWatch,
    files: (PathBuf, PathBuf, PathBuf),
    tuning: Tuning,
    endpoint: quinn::Endpoint,
    http: Option<(TlsWatch, HttpTls, ringwatch_transport::reload::SharedServerTls)>,
}

impl TlsReload {
    fn new(cfg: &AggregatorConfig, endpoint: quinn::Endpoint) -> Self {
        Self {
            quic: TlsWatch::new(&cfg.ca, &cfg.cert, &cfg.key, &[]),
            files: (cfg.ca.clone(), cfg.cert.clone(), cfg.key.clone()),
            tuning: cfg.tuning,
            endpoint,
            http: None,
        }
    }

    /// One look at the files: what changed and loads is put in force for new
    /// connections.
    fn poll(&mut self) {
        let (ca, cert, key) = (&self.files.0, &self.files.1, &self.files.2);
        let tuning = &self.tuning;
        if let Some(server) =
            self.quic.poll("quic", || ringwatch_transport::server_config(TlsFiles { ca, cert, key }, tuning))
        {
            self.endpoint.set_server_config(Some(server));
        }
        if let Some((watch, t, tls)) = &mut self.http
            && let Some(config) =
                watch.poll("http", || ringwatch_transport::http_tls_config(&t.cert, &t.key, t.client_ca.as_deref()))
        {
            ringwatch_transport::reload::replace(tls, config);
        }
    }
}

/// Looks at the TLS files every `interval_ms` (the task `tls`).
async fn reload_tls(shared: Arc<Shared>, reload: Arc<tokio::sync::Mutex<TlsReload>>, interval_ms: u64) {
    let mut tick = tokio::time::interval(Duration::from_millis(interval_ms.max(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        shared.progress(&shared.tasks.tls);
        reload.lock().await.poll();
    }
}

/// Serves the API on (a clone of) the listener, with its limits.
async fn serve_http(
    listener: std::io::Result<std::net::TcpListener>,
    router: axum::Router,
    limits: ringwatch_transport::http::HttpLimits,
    counters: Arc<ringwatch_transport::http::HttpCounters>,
    tls: Option<ringwatch_transport::reload::SharedServerTls>,
) {
    let listener = match listener.and_then(tokio::net::TcpListener::from_std) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "HTTP listener unusable");
            return;
        }
    };
    ringwatch_transport::http::serve(listener, router, limits, counters, tls).await;
}

/// Writes a snapshot every `interval_ms`.
async fn snapshot_loop(shared: Arc<Shared>, path: PathBuf, interval_ms: u64) {
    let mut tick = tokio::time::interval(Duration::from_millis(interval_ms.max(10)));
    tick.tick().await;
    loop {
        tick.tick().await;
        let (shared2, path2) = (Arc::clone(&shared), path.clone());
        match tokio::task::spawn_blocking(move || snapshot_now(&shared2, &path2)).await {
            Ok(true) => shared.progress(&shared.tasks.snapshots),
            Ok(false) => {}
            Err(e) => {
                state::Counters::inc(&shared.counters.snapshot_failures);
                state::Counters::inc(&shared.counters.snapshot_failures_in_a_row);
                if e.is_panic() {
                    // As a panic of this task: counted and restarted by its supervisor,
                    // or the core fails if the panic held its lock.
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
    }
}

/// Takes one consistent snapshot and writes it: under the core's lock, pending verdict
/// events are drained into the store, then the core and the store are serialized into
/// the snapshot buffers (one cut: no verdict can be in neither); the file is written
/// after every lock is released. The lock hold time and the size go to the shell's
/// counters. Once the file is on disk, every batch applied before the cut is durable:
/// connections send `ack durable` for their P0/P1 batches (`capture_gen`,
/// `durable_gen`).
pub fn snapshot_now(shared: &Shared, path: &std::path::Path) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    // One snapshot at a time (the periodic task and the final one share the buffers).
    let mut buffers = shared.snapshot_buffers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let started = std::time::Instant::now();
    let now;
    let captured = {
        // A failed core is never written: the last good snapshot is what a restart uses.
        let Ok(mut core) = shared.core() else { return false };
        shared.drain_events(&mut core);
        let store = shared.store();
        now = shared.now();
        // Under the core's lock: every batch applied before this line saw a lower number.
        let generation = shared.capture_gen.fetch_add(1, Relaxed).saturating_add(1);
        buffers.capture(path, &core, &store, now, shared.epoch).map(|()| generation)
    };
    let hold_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    match captured.and_then(|g| snapshots::write_captured(path, &buffers).map(|b| (g, b))) {
        Ok((generation, bytes)) => {
            shared.durable_gen.send_if_modified(|d| {
                let newer = generation > *d;
                *d = (*d).max(generation);
                newer
            });
            state::Counters::inc(&shared.counters.snapshots_written);
            shared.counters.snapshot_failures_in_a_row.store(0, Relaxed);
            shared.counters.last_snapshot_bytes.store(bytes as u64, Relaxed);
            shared.counters.last_snapshot_hold_us.store(hold_us, Relaxed);
            shared.snapshot_seconds.observe(started.elapsed().as_secs_f64());
            shared.counters.last_snapshot_at_ms.store(now / 1_000_000, Relaxed);
            true
        }
        Err(e) => {
            state::Counters::inc(&shared.counters.snapshot_failures);
            let in_a_row = shared.counters.snapshot_failures_in_a_row.fetch_add(1, Relaxed).saturating_add(1);
            tracing::warn!(error = %e, in_a_row, "snapshot failed");
            false
        }
    }
}

/// Follows the memory-pressure watcher (started here; a restart after a panic arms it
/// again) and sheds the aggregator's P3 while pressure lasts: the verdict store keeps a
/// quarter of its limits, logs drop to WARN, and the freed heap goes back to the kernel.
/// Returns when PSI is unavailable (said once; the task is then not "armed" and its end
/// is no fault) or when the watcher stopped (logged; `/healthz` says so).
async fn follow_pressure(shared: Arc<Shared>, cfg: ringwatch_transport::psi::PsiConfig) {
    use ringwatch_transport::pressure::Level;
    let w = match ringwatch_transport::psi::start(&cfg) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "memory pressure watcher unavailable: running without it");
            *shared.pressure.unavailable.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(e.to_string());
            return;
        }
    };
    tracing::info!(file = %w.state.borrow().file.display(), "memory pressure watcher armed");
    // This task aborted (shutdown) or restarted after a panic: its watcher goes with it.
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _watcher = AbortOnDrop(w.task.abort_handle());
    shared.pressure.armed.store(true, std::sync::atomic::Ordering::Relaxed);
    *shared.pressure.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(w.state.clone());
    let mut state = w.state;
    let mut last = Level::Nominal;
    loop {
        let level = state.borrow_and_update().level;
        if level != last {
            let pressured = level != Level::Nominal;
            if pressured != (last != Level::Nominal) {
                let now = shared.now();
                let (ops_before, ops_after) = {
                    let mut store = shared.store();
                    let before = store.pressure().ops;
                    store.set_pressure(pressured, now);
                    (before, store.pressure().ops)
                };
                if pressured {
                    let quiet = ringwatch_transport::shell::pressure_log_floor(true);
                    let trimmed = ringwatch_transport::memcg::trim();
                    shared.pressure.sheds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    shared
                        .pressure
                        .rss_returned_bytes
                        .fetch_add(trimmed.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(
                        level = level.name(),
                        store_ops_shed = ops_after - ops_before,
                        rss_returned = ?trimmed,
                        logs_at_warn = quiet,
                        "memory pressure: P3 shed (verdict store to a quarter of its limits, info logs)"
                    );
                } else {
                    ringwatch_transport::shell::pressure_log_floor(false);
                    tracing::info!("memory pressure over: verdict store limits and logs back to normal");
                }
            }
            last = level;
        }
        shared.progress(&shared.tasks.pressure);
        if state.changed().await.is_err() {
            let why = match w.task.await {
                Ok(Ok(())) => "ended".to_owned(),
                Ok(Err(e)) => format!("failed: {e}"),
                Err(e) => format!("ended: {e}"),
            };
            tracing::error!(why = %why, "memory pressure watcher stopped: pressure is no longer followed");
            // Shedding is not left on with nothing to end it.
            let now = shared.now();
            shared.store().set_pressure(false, now);
            ringwatch_transport::shell::pressure_log_floor(false);
            return;
        }
    }
}

/// How often the `events` task wakes the event stream's subscribers when events came.
const WAKE_MS: u64 = 20;

/// The `events` task: every [`WAKE_MS`] it wakes the subscribers if events came; every
/// `poll_ms` (real time) it reads each node's health, GPU health, liveness, connection
/// and loss counts under the core's lock and pushes what changed (`events::NodeDiff`)
/// to the event log, still under the lock — so a list's `as_of.event_id` never names an
/// event its content does not reflect.
async fn watch_nodes(shared: Arc<Shared>) {
    use ringwatch_core::NodeId;
    let cfg = shared.events.config;
    let mut diff = events::NodeDiff::new(cfg.loss_window_ms.saturating_mul(1_000_000));
    let mut tick = tokio::time::interval(Duration::from_millis(WAKE_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changes = Vec::new();
    let mut last_poll: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        shared.wake_subscribers();
        if last_poll.is_some_and(|t| t.elapsed() < Duration::from_millis(cfg.poll_ms)) {
            continue;
        }
        last_poll = Some(tokio::time::Instant::now());
        let names: std::collections::BTreeMap<ringwatch_core::NodeId, (String, bool)> =
            shared.nodes.iter().map(|e| (*e.key(), (e.name.clone(), e.connected()))).collect();
        {
            let Ok(core) = shared.core() else { return };
            let now = shared.now();
            let health = core.node_health(now);
            let gpu_health = core.gpu_health(now);
            let mut views = std::collections::BTreeMap::new();
            for id in core.node_ids() {
                let Some(st) = core.node_state(id) else { continue };
                let (name, connected) = names.get(&id).cloned().unwrap_or_else(|| (format!("{:016x}", id.0), false));
                let (p0_lost, p0_attempted) = core.p0_loss(id);
                let (mut bulk_lost, mut bulk_frames) = (0u64, 0u64);
                for t in core.trackers(id) {
                    if proto_flat::header::StreamId(t.key.stream_id).class() == proto_flat::codes::Class::P0 {
                        continue;
                    }
                    let c = t.counts();
                    bulk_lost = bulk_lost.saturating_add(c.lost_total());
                    bulk_frames = bulk_frames.saturating_add(c.received.saturating_add(c.lost_total()));
                }
                let gpus = gpu_health
                    .range((id, [0u8; 16])..=(id, [0xff; 16]))
                    .map(|((_, uuid), h)| {
                        (uuid.iter().map(|b| format!("{b:02x}")).collect(), api::dto::health_name(*h))
                    })
                    .collect();
                views.insert(
                    id.0,
                    events::NodeView {
                        name,
                        health: api::dto::health_name(
                            health.get(&id).copied().unwrap_or(ringwatch_core::Health::Healthy),
                        ),
                        liveness: api::dto::liveness_name(st.liveness),
                        connected,
                        gpus,
                        p0_lost,
                        p0_attempted,
                        bulk_lost,
                        bulk_frames,
                    },
                );
            }
            diff.poll(now, views, &mut changes);
            if !changes.is_empty() {
                shared.push_events(now, changes.drain(..).map(|(id, c)| api::events::Event::of_change(NodeId(id), &c)));
            }
        }
        shared.wake_subscribers();
        shared.progress(&shared.tasks.events);
    }
}

/// Drives the core's timers: at each due time, and at least every 100 ms. Each turn is
/// the task's progress (`/healthz`). Returns only when the core failed.
async fn timers(shared: Arc<Shared>) {
    loop {
        let now = shared.now();
        let due = {
            let Ok(mut core) = shared.core() else { return };
            #[cfg(feature = "test-hooks")]
            if shared.test_panic_timer.load(std::sync::atomic::Ordering::Relaxed) {
                // Mid-update, as a real bug would be: the lock is held and poisoned.
                core.handle_timeout(now);
                panic!("test hook: the timer task panics with the core's lock held");
            }
            core.handle_timeout(now);
            shared.drain_events(&mut core);
            // The store's retention runs on the timer too (not only when verdicts come).
            shared.store().expire(now);
            core.poll_timeout()
        };
        shared.progress(&shared.tasks.timers);
        let wait = due.map_or(100_000_000, |d| d.saturating_sub(now)).clamp(1_000_000, 100_000_000);
        // Real time to wait: aggregator time runs `time_scale` times faster.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "≤ 100 ms"
        )]
        let real = (wait as f64 / shared.time_scale) as u64;
        tokio::time::sleep(Duration::from_nanos(real.max(500_000))).await;
    }
}
