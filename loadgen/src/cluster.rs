//! Running a simulated cluster for real: an embedded aggregator, one in-process shipper
//! per node (the simulator as its source), real QUIC with mutual TLS on loopback (a dev
//! certificate set in a temporary directory), verdicts read back through the HTTP DTOs.
//!
//! Restarts: the scenario's `shipper_restart` and `aggregator_restart` faults are applied
//! by one restart driver ([`run`]): a shipper session stops as on SIGTERM (it flushes, or
//! reports what it cannot) and a new one takes the node's simulated kernel side over
//! after `down_ms` (same epoch, a new session: the simulator lives in this process, so a
//! SIGKILL would take it along — the eBPF kernel tests cover a shipper SIGKILL); the
//! embedded aggregator stops with its final snapshot, or (`kill = true`) without one, and
//! starts again on the same addresses from its snapshot file.
//!
//! Time: the simulator runs in real time, or `time_scale` times faster with the
//! aggregator's clock and the shippers' timers scaled alike (everything the evidence
//! rules see stays consistent). Network and processing delays look `time_scale` times
//! longer to the aggregator, so the one timer that guards them — the reorder timeout —
//! stays 500 ms of real time.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aggregator::api::client::{self, ClientError};
use aggregator::api::dto::{NodesDto, VerdictsDto};
use aggregator::certs::{self, CertSet};
use aggregator::{Aggregator, AggregatorConfig};
use loadgen_sim::{GroundTruth, Scenario, SimOptions};
use node_shipper::config::{ShipperConfig, Source};
use node_shipper::core::batcher::BatcherConfig;
use node_shipper::core::spool::SpoolConfig;
use node_shipper::driver::{self, Report, RunOptions};
use node_shipper::source::SimSource;
use ringwatch_core::{IngestConfig, MatcherConfig};

/// What to run.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub scenario: Scenario,
    /// Replaces the scenario's seed.
    pub seed: Option<u64>,
    /// Bulk event rate as a fraction of the scenario's line rate.
    pub scale: f64,
    /// Simulated (and aggregator) time per real time.
    pub time_scale: f64,
    /// Show progress bars on stderr.
    pub progress: bool,
    /// Faults on the network between every shipper and the aggregator (through the UDP
    /// fault proxy), if any.
    pub net_faults: Option<ringwatch_faultproxy::Faults>,
    /// An aggregator already running elsewhere instead of the embedded one.
    pub external: Option<External>,
    /// Also read the demo table through the per-node and per-GPU resources while the
    /// shippers are still connected ([`RunResult::demo_rows`]).
    pub demo_rows: bool,
}

/// A running aggregator to drive: where its QUIC and HTTP listen, and a certificate
/// directory written by `aggregator certs init --nodes N` for it (its CA signed the node
/// certificates the shippers present). Its matcher timers should be the scenario's.
#[derive(Debug, Clone)]
pub struct External {
    pub quic: SocketAddr,
    /// A scaled-out aggregator's ingest shards (the aggregator's `--role ingest`): each
    /// shipper is given the whole list and picks its shard by rendezvous hashing of its
    /// node name, as a deployed shipper does. Empty: `quic` alone.
    pub ingest_shards: Vec<SocketAddr>,
    pub http: SocketAddr,
    pub certs: PathBuf,
    /// The external aggregator's `time_scale` (1 unless it was started compressed, as a
    /// test's in-process shard roles are): the run's must equal it.
    pub time_scale: f64,
    /// Also wait for this before the run counts as settled (a scaled-out aggregator's
    /// roles have drained their streams); none: the API's state alone.
    pub settled: Option<SettledHook>,
}

/// A condition the settle phase also waits for.
#[derive(Clone)]
pub struct SettledHook(pub Arc<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for SettledHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SettledHook")
    }
}

/// Errors running a cluster.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("scenario: {0}")]
    Scenario(String),
    #[error("certificates: {0}")]
    Certs(#[from] certs::CertError),
    #[error("aggregator: {0}")]
    Aggregator(#[from] aggregator::StartError),
    #[error("API: {0}")]
    Api(#[from] ClientError),
    #[error("temporary directory: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Usage(String),
}

/// A directory removed when dropped (unless kept).
#[derive(Debug)]
pub struct TempDir {
    pub path: PathBuf,
    pub keep: bool,
}

impl TempDir {
    /// A fresh directory under the system temp dir.
    ///
    /// # Errors
    /// It cannot be created.
    pub fn new(tag: &str) -> std::io::Result<Self> {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "ringwatch-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path)?;
        Ok(Self { path, keep: false })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// What a run produced.
#[derive(Debug)]
pub struct RunResult {
    pub truth: GroundTruth,
    pub nodes: NodesDto,
    pub verdicts: VerdictsDto,
    pub reports: Vec<Report>,
    /// Real time from the first shipper's start to the end of the settle phase.
    pub wall: Duration,
    /// How long the run waited after the simulated end for the state it scores.
    pub settled_in: Duration,
    /// Bulk + P0 frames/s the scenario asks of the whole cluster, and what the shippers
    /// read, per real second, while the simulation ran.
    pub target_frames_per_s: f64,
    pub achieved_frames_per_s: f64,
    /// Aggregator time (ms) when the verdicts were read.
    pub ended_at_ms: u64,
    /// What the fault proxy did, when there was one.
    pub proxy: Option<ringwatch_faultproxy::ProxyStats>,
    pub spec: RunSpec,
    /// The embedded aggregator, still serving (dropped: stopped); none with an external one.
    pub aggregator: Option<Aggregator>,
    /// Reports of shipper sessions that a `shipper_restart` ended (`reports` holds each
    /// node's last session).
    pub earlier_sessions: Vec<Report>,
    /// The restarts the driver applied, in order.
    pub restarts: Vec<AppliedRestart>,
    /// Where the verdicts were read.
    pub http_addr: SocketAddr,
    pub certs: TempDir,
    /// The demo table read through `/v1/nodes/{node}`, `/v1/gpus/{uuid}` and
    /// `/v1/verdicts?gpu=` at the same point as `nodes` and `verdicts` (with
    /// [`RunSpec::demo_rows`]).
    pub demo_rows: Option<Vec<crate::demo::Row>>,
}

/// A restart the driver applied.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AppliedRestart {
    /// `shipper_restart` or `aggregator_restart`.
    pub kind: &'static str,
    pub node: Option<u32>,
    /// Real ms from the run's start when it was applied, and the downtime (real ms).
    pub at_real_ms: u64,
    pub down_real_ms: u64,
    /// An aggregator stopped without its final snapshot (SIGKILL-like).
    pub kill: bool,
    /// Why it could not be applied, if it could not.
    pub error: Option<String>,
}

/// What a node's runner is told.
#[derive(Debug)]
pub(crate) enum NodeCmd {
    /// Stop this session (SIGTERM) and start the next one after this long.
    Restart(Duration),
    /// Stop for good.
    Stop,
}

/// Runs node shippers session after session until told to stop (or the node dies):
/// every session's report, oldest first.
pub(crate) fn spawn_node(
    cfg: ShipperConfig,
    opts: RunOptions,
    source: Box<dyn node_shipper::source::Source>,
    mut cmds: tokio::sync::mpsc::Receiver<NodeCmd>,
) -> tokio::task::JoinHandle<Result<Vec<Report>, driver::ShipperError>> {
    tokio::spawn(async move {
        let mut reports = Vec::new();
        let mut source = Some(source);
        while let Some(src) = source.take() {
            let next = std::sync::Mutex::new(None);
            let stop = async {
                let cmd = cmds.recv().await.unwrap_or(NodeCmd::Stop);
                *next.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(cmd);
            };
            let (report, back) = driver::run_and_return_source(&cfg, opts.clone(), src, stop).await?;
            let ended = report.ended;
            reports.push(report);
            let cmd = next.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
            match (cmd, back) {
                (Some(NodeCmd::Restart(down)), Some(mut src)) if ended == driver::Ended::Shutdown => {
                    if !src.next_session() {
                        break;
                    }
                    tokio::select! {
                        () = tokio::time::sleep(down) => {}
                        cmd = cmds.recv() => {
                            if !matches!(cmd, Some(NodeCmd::Restart(_))) {
                                break;
                            }
                        }
                    }
                    source = Some(src);
                }
                // Told to stop, or the node died: this was the last session.
                _ => break,
            }
        }
        Ok(reports)
    })
}

/// Stops the embedded aggregator (with its final snapshot, or without: `kill`) and starts
/// it again after `down` on the same addresses (`cfg.listen`, `cfg.http`), from its
/// snapshot file; the old sockets close once their last connection is gone, so binding is
/// retried for up to 10 s.
async fn restart_aggregator(
    slot: &tokio::sync::Mutex<Option<Aggregator>>,
    cfg: &AggregatorConfig,
    down: Duration,
    kill: bool,
) -> Result<(), String> {
    let old = slot.lock().await.take();
    if let Some(a) = old {
        if kill {
            a.shutdown();
        } else {
            a.shutdown_with_snapshot().await;
        }
        drop(a);
    }
    tokio::time::sleep(down).await;
    let by = Instant::now() + Duration::from_secs(10);
    loop {
        match Aggregator::start(cfg.clone()).await {
            Ok(a) => {
                *slot.lock().await = Some(a);
                return Ok(());
            }
            Err(aggregator::StartError::Transport(_) | aggregator::StartError::Http { .. }) if Instant::now() < by => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The matcher and ingest configured with the scenario's timers (the simulator judges
/// `decidable` with the same ones).
#[must_use]
pub fn aggregator_config(set: &CertSet, s: &Scenario, time_scale: f64) -> AggregatorConfig {
    let mut cfg = AggregatorConfig::local(set);
    // The reorder timeout guards real network and processing delays, so it stays 500 ms
    // of *real* time when the run is compressed (in aggregator time: 500 ms × scale).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "ns")]
    let reorder_ns = (reorder_real_ms(time_scale) as f64 * 1e6 * time_scale.max(1.0)) as u64;
    cfg.matcher = MatcherConfig {
        stuck_min_ns: s.timers.stuck_deadline_ms.saturating_mul(1_000_000),
        join_deadline_ns: s.timers.join_deadline_ms.saturating_mul(1_000_000),
        reorder_timeout_ns: reorder_ns,
        straggler_threshold_ns: straggler_threshold_ns(s),
        expected_nodes: s.cluster.nodes,
        // loadgen's network faults (loss, delay and reordering through the proxy) never
        // cut a live node off for long: a node unreachable here is one of the scenario's
        // dead nodes (or a connection that closed for a moment and comes back in
        // seconds), presumed dead after the stuck deadline instead of the default 300 s,
        // which would hold every dead-node scenario's finality for 300 s of its time.
        // (Ingest shards a node can fail over between need longer: `scaled_out_dead_after_ns`.)
        dead_after_ns: s.timers.stuck_deadline_ms.saturating_mul(1_000_000),
        ..MatcherConfig::default()
    };
    cfg.ingest = IngestConfig {
        silent_ns: s.timers.silent_ms.saturating_mul(1_000_000),
        reorder_timeout_ns: reorder_ns,
        ..IngestConfig::default()
    };
    cfg.time_scale = time_scale;
    // The truth states node health as of the run's end; the run is read after its settle
    // phase, which takes as long as this machine needs today (up to SETTLE_LIMIT real).
    // A GPU degraded near the end must not clear meanwhile (under a CPU hog a long
    // settle let `gpu-straggler-skew`'s straggler clear: a "missed" culprit).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "ns")]
    let settle_ns = (SETTLE_LIMIT.as_nanos() as f64 * time_scale.max(1.0)) as u64;
    // A scenario that says when degraded clears (a GPU pause that ends) gets exactly that.
    cfg.matcher.degraded_clear_ns = match s.timers.degraded_clear_ms {
        Some(c) => c.saturating_mul(1_000_000),
        None => {
            cfg.matcher.degraded_clear_ns.max(s.duration_ms.saturating_mul(1_000_000).saturating_add(2 * settle_ns))
        }
    };
    cfg
}

/// The scenario's straggler threshold, for the aggregator (the truth judges with it too).
#[must_use]
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "ms to ns, non-negative")]
pub fn straggler_threshold_ns(s: &Scenario) -> u64 {
    (s.timers.straggler_threshold_ms.max(0.0) * 1e6) as u64
}

/// The shipper of node `node` with a simulator source, heartbeating every
/// `heartbeat_ms` of simulated time, its timers scaled with the run.
#[must_use]
pub fn shipper_config(
    set: &CertSet,
    aggregator: SocketAddr,
    scenario: &str,
    heartbeat_ms: u64,
    node: u32,
    time_scale: f64,
) -> ShipperConfig {
    let name = certs::node_name(node);
    let (cert, key) = set.node(&name);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "ms timers"
    )]
    let scaled = |ms: f64| (ms / time_scale).max(1.0) as u64;
    ShipperConfig {
        aggregator: aggregator.into(),
        fallbacks: Vec::new(),
        server_name: "localhost".into(),
        node_name: name,
        ca: set.ca.clone(),
        cert,
        key,
        tls_reload_interval_ms: ringwatch_transport::reload::DEFAULT_INTERVAL_MS,
        source: Source::Sim { scenario: scenario.to_owned(), node, bulk_scale_ppm: 0, seed: None },
        batcher: BatcherConfig {
            max_batch_bytes: 64 * 1024,
            bulk_batch_bytes: 256 * 1024,
            flush_interval_ns: scaled(5.0) * 1_000_000,
            pool_size: 64,
            ..BatcherConfig::default()
        },
        spool: SpoolConfig { cap_bytes: 64 << 20, p0_reserve_bytes: 4 << 20, p1_reserve_bytes: 4 << 20 },
        #[allow(clippy::cast_precision_loss, reason = "ms")]
        heartbeat_interval_ms: scaled(heartbeat_ms as f64).max(10),
        shutdown_deadline_ms: 3000,
        log_json: false,
        reader_cpus: Vec::new(),
        sampling: node_shipper::core::SamplingConfig::default(),
        http_listen: None,
        // Eight shippers in one process would watch one cgroup: the demo runs without.
        psi: None,
        psi_bulk_share_pct: 25,
        // Likewise one cgroup limit for them all: static caps.
        memory_budget: None,
        throttle: Vec::new(),
    }
}

/// The reorder timeout of docs/design.md ("Timers"), kept in real time for compressed runs.
pub const REORDER_REAL_MS: u64 = 500;

/// The reorder timeout in real ms for a run at `time_scale`: 500 ms (docs/design.md) at real
/// time; 1.5 s when compressed, because a compressed run pushes several times the frame
/// rate through the same 2 cores, and on a loaded CI machine P0 frames then arrived later
/// than 500 ms real (a completion judged `completed_inferred` where it did complete:
/// `net_sweep_demo`, seed 3, at 4×). Only finality waits longer; no verdict changes.
#[must_use]
pub fn reorder_real_ms(time_scale: f64) -> u64 {
    if time_scale > 1.0 { 3 * REORDER_REAL_MS } else { REORDER_REAL_MS }
}

/// How long, in real time, a shipper takes at most to fail over from an ingest shard
/// that died without a word (SIGKILL) on a loaded machine: the QUIC idle timeout (10 s)
/// before it gives the connection up, then a handshake and its resume on the next shard.
/// Until then its node is unreachable, and must not be presumed dead: a scaled-out run's
/// `dead_after_ns` is at least this. (In a run compressed 4× the stuck deadline — 60 s
/// of aggregator time — is 15 s real, and a failover that took 18 s real had its ranks'
/// `unknown_silent` made final before their completions came.)
pub const FAILOVER_REAL_MS: u64 = 30_000;

/// A scaled-out run's `dead_after_ns`: `dead_after_ns` (what [`aggregator_config`] set),
/// but no less than [`FAILOVER_REAL_MS`] in aggregator ns at this time scale.
#[must_use]
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "ns")]
pub fn scaled_out_dead_after_ns(dead_after_ns: u64, time_scale: f64) -> u64 {
    dead_after_ns.max((FAILOVER_REAL_MS as f64 * 1e6 * time_scale.max(1.0)) as u64)
}

/// The aggregator's reorder timeout in simulated ms at this time scale (what the
/// scorer's table allows for).
#[must_use]
#[allow(clippy::cast_precision_loss, reason = "ms")]
pub fn reorder_sim_ms(time_scale: f64) -> f64 {
    reorder_real_ms(time_scale) as f64 * time_scale.max(1.0)
}

/// How long a run waits, after the simulated end, for every stream to be exact and every
/// live node's watermark to pass its last data by the reorder timeout and three
/// heartbeats, before it is scored as it is (printed when reached). On an idle 2-core
/// machine runs settle within a few seconds.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(90);

/// Runs `spec` to its end and reads the verdicts.
///
/// # Errors
/// A scenario that does not validate, certificates or sockets that cannot be set up, or
/// an API that does not answer.
pub async fn run(spec: RunSpec) -> Result<RunResult, RunError> {
    let mut scenario = spec.scenario.clone();
    if let Some(seed) = spec.seed {
        scenario.seed = seed;
    }
    let options = SimOptions { bulk_scale: spec.scale, seed: spec.seed };
    let truth = crate::truth(&scenario, options).map_err(|e| RunError::Scenario(e.to_string()))?;
    let mut dir = TempDir::new("loadgen")?;
    let restarts_aggregator = scenario.faults.iter().any(|f| matches!(f, loadgen_sim::Fault::AggregatorRestart { .. }));
    if restarts_aggregator && spec.external.is_some() {
        return Err(RunError::Usage("aggregator_restart needs the embedded aggregator (loadgen restarts it)".into()));
    }
    let mut agg_cfg: Option<AggregatorConfig> = None;
    let (set, agg, quic, http) = match &spec.external {
        Some(x) => {
            if (spec.time_scale - x.time_scale).abs() > f64::EPSILON {
                return Err(RunError::Usage(
                    "--time-scale needs the embedded aggregator (its clock is scaled too)".into(),
                ));
            }
            let set = CertSet::at(&x.certs);
            if !set.ca.exists() || !set.node(&certs::node_name(scenario.cluster.nodes - 1)).0.exists() {
                return Err(RunError::Usage(format!(
                    "{} lacks ca.pem or node certificates for {} nodes (write them with `aggregator certs init --dir {} --nodes {}`)",
                    x.certs.display(),
                    scenario.cluster.nodes,
                    x.certs.display(),
                    scenario.cluster.nodes
                )));
            }
            dir.keep = true;
            (set, None, x.quic, x.http)
        }
        None => {
            let names: Vec<String> = (0..scenario.cluster.nodes).map(certs::node_name).collect();
            let set = certs::init(&dir.path, &names)?;
            let mut cfg = aggregator_config(&set, &scenario, spec.time_scale);
            if restarts_aggregator {
                // Restarts restore from here; a snapshot every second of real time.
                cfg.snapshot_path = Some(dir.path.join("aggregator.snap"));
                cfg.snapshot_interval_ms = 1000;
            }
            let agg = Aggregator::start(cfg.clone()).await?;
            let (q, h) = (agg.quic_addr, agg.http_addr);
            (cfg.listen, cfg.http) = (q, h);
            agg_cfg = Some(cfg);
            (set, Some(agg), q, h)
        }
    };
    let agg = Arc::new(tokio::sync::Mutex::new(agg));
    let proxy = match spec.net_faults {
        Some(f) => {
            let p = ringwatch_faultproxy::FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], 0)), quic, scenario.seed)
                .await?;
            p.set(ringwatch_faultproxy::Direction::Both, f);
            Some(p)
        }
        None => None,
    };
    let ship_to = proxy.as_ref().map_or(quic, |p| p.addr);

    let start = Instant::now();
    let live: Vec<Arc<AtomicU64>> = (0..scenario.cluster.nodes).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let mut shippers = Vec::new();
    for node in 0..scenario.cluster.nodes {
        let source = SimSource::new(&scenario, options, node, start)
            .map_err(|e| RunError::Scenario(e.to_string()))?
            .with_speed(spec.time_scale);
        let mut cfg =
            shipper_config(&set, ship_to, &scenario.name, scenario.timers.heartbeat_ms, node, spec.time_scale);
        if let Some(x) = spec.external.as_ref().filter(|x| !x.ingest_shards.is_empty() && proxy.is_none()) {
            let list: Vec<String> = x.ingest_shards.iter().map(ToString::to_string).collect();
            if let Some(mut order) = node_shipper::config::AggregatorAddr::ordered(&list.join(","), &cfg.node_name)
                && !order.is_empty()
            {
                cfg.aggregator = order.remove(0);
                cfg.fallbacks = order;
            }
        }
        let opts = RunOptions { frames_in: Some(Arc::clone(&live[node as usize])), ..RunOptions::default() };
        let (tx, rx) = tokio::sync::mpsc::channel::<NodeCmd>(4);
        shippers.push((tx, spawn_node(cfg, opts, Box::new(source), rx)));
    }
    // The restart driver: each restart fault at its (scaled) time, in order.
    let driver_task = {
        let mut faults: Vec<loadgen_sim::Fault> = scenario.faults.iter().filter(|f| f.is_restart()).cloned().collect();
        faults.sort_by_key(|f| match *f {
            loadgen_sim::Fault::ShipperRestart { at_ms, .. } | loadgen_sim::Fault::AggregatorRestart { at_ms, .. } => {
                at_ms
            }
            _ => u64::MAX,
        });
        let senders: Vec<tokio::sync::mpsc::Sender<NodeCmd>> = shippers.iter().map(|(tx, _)| tx.clone()).collect();
        let (agg, agg_cfg, scale) = (Arc::clone(&agg), agg_cfg.clone(), spec.time_scale);
        tokio::spawn(async move {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss,
                reason = "ms"
            )]
            let real = |ms: u64| Duration::from_millis((ms as f64 / scale) as u64);
            let mut applied = Vec::new();
            for f in faults {
                let (at, down, node, kill) = match f {
                    loadgen_sim::Fault::ShipperRestart { node, at_ms, down_ms } => (at_ms, down_ms, Some(node), false),
                    loadgen_sim::Fault::AggregatorRestart { at_ms, down_ms, kill } => (at_ms, down_ms, None, kill),
                    _ => continue,
                };
                tokio::time::sleep(real(at).saturating_sub(start.elapsed())).await;
                let at_real_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
                let error = match (node, &agg_cfg) {
                    (Some(n), _) => match senders.get(n as usize) {
                        Some(tx) => tx
                            .send(NodeCmd::Restart(real(down)))
                            .await
                            .err()
                            .map(|_| "the node's shipper had ended".to_owned()),
                        None => Some(format!("no node {n}")),
                    },
                    (None, Some(cfg)) => restart_aggregator(&agg, cfg, real(down), kill).await.err(),
                    (None, None) => Some("no embedded aggregator".to_owned()),
                };
                if let Some(e) = &error {
                    eprintln!("loadgen: {} at {at} ms not applied: {e}", f.kind());
                }
                applied.push(AppliedRestart {
                    kind: f.kind(),
                    node,
                    at_real_ms,
                    down_real_ms: u64::try_from(real(down).as_millis()).unwrap_or(u64::MAX),
                    kill,
                    error,
                });
            }
            applied
        })
    };

    // The run, with a progress bar of simulated time and live rates.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "ms")]
    let run_real = Duration::from_millis((scenario.duration_ms as f64 / spec.time_scale) as u64);
    let target = crate::progress::target_frames_per_s(&truth, spec.time_scale);
    let bar = crate::progress::bar(spec.progress, &scenario, spec.scale, spec.time_scale, target);
    let frames_at_end;
    loop {
        let elapsed = start.elapsed();
        let frames: u64 = live.iter().map(|l| l.load(Ordering::Relaxed)).sum();
        crate::progress::tick(&bar, elapsed, spec.time_scale, frames);
        if elapsed >= run_real {
            frames_at_end = frames;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200).min(run_real - elapsed)).await;
    }
    // Every restart is applied (one due after the simulated end comes late, not never).
    let restarts = driver_task.await.unwrap_or_default();
    // The run ends on state, not on the clock: first every stream exact (everything the
    // generator made is received or accounted for; a dead node's announced seqs in an
    // explicit state) and every dead node unreachable, then every live node's P0 watermark past where it stood then by the
    // reorder timeout and three heartbeats (node time) — the aggregator has confirmed, by
    // heartbeats it processed, that nothing more can arrive for what it judged, so every
    // verdict that finality allows is final. However long this machine takes today, up
    // to a generous limit, after which the run is scored as it is (and says so).
    let settle_started = Instant::now();
    let agg_config = aggregator_config(&set, &scenario, spec.time_scale);
    let reorder_ns = agg_config.ingest.reorder_timeout_ns;
    let mut beyond_ns = reorder_ns.saturating_add(scenario.timers.heartbeat_ms.saturating_mul(3_000_000));
    // An unreachable dead node gates finality until it is presumed dead.
    if truth.nodes.iter().any(|t| t.dead_at_ms.is_some()) {
        let mut dead_after = agg_config.matcher.dead_after_ns;
        if spec.external.as_ref().is_some_and(|x| x.ingest_shards.len() > 1) {
            dead_after = scaled_out_dead_after_ns(dead_after, spec.time_scale);
        }
        beyond_ns = beyond_ns.saturating_add(dead_after);
    }
    let mut targets: Option<Vec<(String, u64)>> = None;
    loop {
        let nodes: NodesDto = client::get_json(http, "/v1/nodes").await?;
        let cons = crate::score::conservation(&truth, &nodes);
        let exact = cons.iter().all(|c| c.exact == c.streams);
        // A dead node gates its peers' verdicts until it is unreachable (docs/design.md,
        // "Liveness and the silent-node rule"): wait for that too (a node never heard of
        // reads unreachable).
        let dead_unreachable = truth
            .nodes
            .iter()
            .filter(|t| t.dead_at_ms.is_some())
            .all(|t| nodes.nodes.iter().find(|n| n.name == t.name).is_none_or(|n| n.liveness == "unreachable"));
        if exact && dead_unreachable && targets.is_none() {
            targets = Some(
                nodes
                    .nodes
                    .iter()
                    .filter(|n| truth.nodes.iter().any(|t| t.name == n.name && t.dead_at_ms.is_none()))
                    .filter(|n| n.watermark_p0_node_ns > 0)
                    .map(|n| (n.name.clone(), n.watermark_p0_node_ns.saturating_add(beyond_ns)))
                    .collect(),
            );
        }
        let passed = targets.as_ref().is_some_and(|t| {
            t.iter().all(|(name, at)| nodes.nodes.iter().any(|n| &n.name == name && n.watermark_p0_node_ns >= *at))
        }) && spec.external.as_ref().and_then(|x| x.settled.as_ref()).is_none_or(|h| (h.0)());
        if passed {
            break;
        }
        if settle_started.elapsed() >= SETTLE_LIMIT {
            eprintln!(
                "loadgen: {} seed {}: not settled {SETTLE_LIMIT:?} after the simulated end (streams exact {}/{}, watermarks {}); scoring as it is",
                scenario.name,
                scenario.seed,
                cons.iter().map(|c| c.exact).sum::<u64>(),
                cons.iter().map(|c| c.streams).sum::<u64>(),
                if targets.is_some() { "not yet past the last data" } else { "not measured" },
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let nodes: NodesDto = client::get_json(http, "/v1/nodes").await?;
    let verdicts: VerdictsDto = client::get_all_verdicts(http, "").await?;
    let demo_rows = if spec.demo_rows { Some(crate::demo::rows_from_api(http, &truth).await?) } else { None };
    let agg = agg.lock().await.take();
    let ended_at_ms = match &agg {
        Some(a) => a.shared.now() / 1_000_000,
        None => client::get_json::<aggregator::api::dto::HealthzDto>(http, "/healthz").await?.uptime_ms,
    };
    let settled_in = settle_started.elapsed();
    crate::progress::finish(&bar);
    let wall = start.elapsed();
    let proxy_stats = proxy.as_ref().map(ringwatch_faultproxy::FaultProxy::stats);
    let mut reports = Vec::new();
    let mut earlier_sessions = Vec::new();
    for (tx, task) in shippers {
        let _ = tx.send(NodeCmd::Stop).await;
        if let Ok(Ok(mut sessions)) = task.await
            && let Some(last) = sessions.pop()
        {
            earlier_sessions.extend(sessions);
            reports.push(last);
        }
    }
    #[allow(clippy::cast_precision_loss, reason = "rates")]
    let achieved = frames_at_end as f64 / run_real.as_secs_f64().max(1e-9);
    Ok(RunResult {
        truth,
        nodes,
        verdicts,
        reports,
        wall,
        settled_in,
        target_frames_per_s: target,
        achieved_frames_per_s: achieved,
        ended_at_ms,
        proxy: proxy_stats,
        spec,
        aggregator: agg,
        earlier_sessions,
        restarts,
        http_addr: http,
        certs: dir,
        demo_rows,
    })
}
