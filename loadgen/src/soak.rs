//! `loadgen soak`: the system for a long while, with restarts of either side, and one line
//! per minute of what memory and accounting do.
//!
//! What runs: the aggregator — a separate process when its binary is given or found
//! beside this one (`aggregator run` with snapshots, so durability `snapshot`), else
//! embedded — and one in-process shipper per node of the `soak` scenario
//! (`loadgen/scenarios/soak.toml`, its duration set to the soak's), fed by the simulator
//! in real time over real QUIC with mutual TLS, optionally through the fault proxy.
//!
//! Restarts, one every `restart_every` (±25 %, seeded), the two sides in turn: the
//! aggregator SIGKILLed or SIGTERMed (drawn; then started again on the same addresses
//! from its snapshot), then a drawn node's shipper stopped as on SIGTERM and a new
//! session started (the simulator lives in this process, so shipper restarts are
//! SIGTERMs; see [`crate::cluster`]).
//!
//! Each minute: RSS of the aggregator and of this process (the shippers, the simulator
//! and the scorer; read after `malloc_trim`, see [`trim_heap`]), the snapshot's size, frames generated (as the heartbeats announced them),
//! received, lost by cause, sampled out, another instance's, still pending or in
//! transit, **unaccounted** (announced and in none of those: must be 0), and the final
//! verdicts the aggregator holds (retention 5 min) with those the scorer finds wrong
//! against the generator's truth (must be 0). At the end, after the shippers stopped and
//! the streams settled: every stream against the generator's own counts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aggregator::api::client;
use aggregator::api::dto::{IngestDto, NodesDto, VerdictsDto};
use aggregator::certs;
use aggregator::{Aggregator, AggregatorConfig};
use loadgen_sim::{Scenario, SimOptions};
use node_shipper::driver::{Report, RunOptions};
use node_shipper::source::SimSource;

use crate::cluster::{NodeCmd, TempDir, shipper_config, spawn_node};

/// The soak's workload.
pub const SCENARIO: &str = include_str!("../scenarios/soak.toml");

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakSpec {
    pub duration: Duration,
    /// About how often something restarts (0: never).
    pub restart_every: Duration,
    /// The `aggregator` binary to run as a process; `None`: embedded.
    pub aggregator_bin: Option<PathBuf>,
    /// Bulk event rate as a fraction of the scenario's line rate.
    pub scale: f64,
    pub seed: u64,
    /// Faults on the network between shippers and the aggregator.
    pub net_faults: Option<ringwatch_faultproxy::Faults>,
    /// Print each minute's line as it comes.
    pub print: bool,
}

/// One minute's line.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Minute {
    pub minute: u64,
    pub aggregator_rss_kb: u64,
    pub loadgen_rss_kb: u64,
    /// This process's live heap (see [`live_heap_kb`]).
    pub loadgen_heap_kb: u64,
    pub snapshot_bytes: u64,
    pub generated: u64,
    pub received: u64,
    pub lost: BTreeMap<String, u64>,
    pub sampled_out: u64,
    pub prior_instance: u64,
    pub pending_or_in_transit: u64,
    pub unaccounted: u64,
    pub final_verdicts: u64,
    pub wrong_verdicts: u64,
    pub restarts_so_far: usize,
}

/// What a soak produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SoakResult {
    pub minutes: Vec<Minute>,
    /// The restarts, in order: `(real s from the start, what)`.
    pub restarts: Vec<(u64, String)>,
    /// After the end: streams exact against the generator, of all; frames the generator
    /// made that are in no state at the aggregator.
    pub streams_exact: u64,
    pub streams: u64,
    pub unaccounted_vs_generator: u64,
    /// The final score's verdicts: final, and wrong.
    pub final_verdicts: u64,
    pub wrong_verdicts: u64,
    pub wrong_examples: Vec<(String, u32, String, String)>,
    /// Least-squares RSS slope from minute 5 on, MB per 10 minutes (None: too short).
    pub aggregator_rss_slope_mb_per_10min: Option<f64>,
    pub loadgen_rss_slope_mb_per_10min: Option<f64>,
    /// The same for loadgen's live heap (what it holds, whatever the allocator keeps).
    pub loadgen_heap_slope_mb_per_10min: Option<f64>,
    /// Shipper sessions' reports: P0/P1 kept until durable, durable lag, and so on.
    pub reports: Vec<Report>,
}

impl SoakResult {
    /// Nothing unaccounted, no wrong final verdict, every stream exact, and (for runs of
    /// 15 minutes or more) both RSS slopes under 1 MB per 10 minutes.
    #[must_use]
    pub fn passed(&self) -> bool {
        let slopes_ok = [self.aggregator_rss_slope_mb_per_10min, self.loadgen_rss_slope_mb_per_10min]
            .iter()
            .all(|s| self.minutes.len() < 15 || s.is_some_and(|v| v < 1.0));
        self.minutes.iter().all(|m| m.unaccounted == 0)
            && self.wrong_verdicts == 0
            && self.minutes.iter().all(|m| m.wrong_verdicts == 0)
            && self.streams_exact == self.streams
            && self.unaccounted_vs_generator == 0
            && slopes_ok
    }

    /// The table: a line per minute and the summary.
    #[must_use]
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:>4} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9} {:>8} {:>8} {:>7} {:>8} {:>5} {:>4}  lost by cause",
            "min",
            "agg MB",
            "lg MB",
            "lg heap",
            "snap KB",
            "generated",
            "received",
            "lost",
            "sampled",
            "prior",
            "pending",
            "unacct",
            "final",
            "wrong",
            "rst"
        );
        for m in &self.minutes {
            let lost: u64 = m.lost.values().sum();
            #[allow(clippy::cast_precision_loss, reason = "display")]
            let _ = writeln!(
                t,
                "{:>4} {:>9.1} {:>9.1} {:>9.1} {:>9} {:>11} {:>11} {:>9} {:>9} {:>8} {:>8} {:>7} {:>8} {:>5} {:>4}  {:?}",
                m.minute,
                m.aggregator_rss_kb as f64 / 1024.0,
                m.loadgen_rss_kb as f64 / 1024.0,
                m.loadgen_heap_kb as f64 / 1024.0,
                m.snapshot_bytes / 1024,
                m.generated,
                m.received,
                lost,
                m.sampled_out,
                m.prior_instance,
                m.pending_or_in_transit,
                m.unaccounted,
                m.final_verdicts,
                m.wrong_verdicts,
                m.restarts_so_far,
                m.lost
            );
        }
        let slope =
            |s: Option<f64>| s.map_or_else(|| "n/a (under 7 minutes)".to_owned(), |v| format!("{v:+.2} MB/10 min"));
        let _ = writeln!(
            t,
            "RSS slope from minute 5: aggregator {}, loadgen {} (live heap {})",
            slope(self.aggregator_rss_slope_mb_per_10min),
            slope(self.loadgen_rss_slope_mb_per_10min),
            slope(self.loadgen_heap_slope_mb_per_10min)
        );
        let _ = writeln!(
            t,
            "after the end: streams exact {}/{}, unaccounted against the generator {}; final verdicts {}, wrong {} {:?}",
            self.streams_exact,
            self.streams,
            self.unaccounted_vs_generator,
            self.final_verdicts,
            self.wrong_verdicts,
            self.wrong_examples
        );
        let (kept, durable, released): (u64, u64, u64) = self.reports.iter().fold((0, 0, 0), |a, r| {
            (a.0 + r.batches_kept_for_durable, a.1 + r.batches_durable, a.2 + r.released_undurable)
        });
        let lag = self.reports.iter().map(|r| r.durable_lag.p99_us).max().unwrap_or(0);
        let _ = writeln!(
            t,
            "shipper sessions {}: P0/P1 batches kept until durable {kept}, acked durable {durable}, released before {released}; durable lag p99 (worst session) {} ms",
            self.reports.len(),
            lag / 1000
        );
        let _ = writeln!(t, "restarts ({}): {:?}", self.restarts.len(), self.restarts);
        t
    }
}

/// Errors.
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error("{0}")]
    Setup(String),
    #[error("API: {0}")]
    Api(#[from] client::ClientError),
}

/// The aggregator being soaked.
enum Agg {
    Process { child: Child, bin: PathBuf, args: Vec<String> },
    Embedded { agg: Option<Aggregator>, cfg: Box<AggregatorConfig> },
}

impl Agg {
    fn rss_kb(&self) -> u64 {
        match self {
            Self::Process { child, .. } => rss_kb(&format!("/proc/{}/status", child.id())),
            Self::Embedded { .. } => 0,
        }
    }

    async fn restart(&mut self, kill: bool, down: Duration) -> Result<(), String> {
        match self {
            Self::Process { child, bin, args } => {
                let sig = if kill { "-KILL" } else { "-TERM" };
                let _ = Command::new("kill").args([sig, &child.id().to_string()]).status();
                let _ = tokio::task::block_in_place(|| child.wait());
                tokio::time::sleep(down).await;
                let by = Instant::now() + Duration::from_secs(10);
                loop {
                    let (c, _, _) = spawn_process(bin, args)?;
                    *child = c;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    match child.try_wait() {
                        Ok(None) => return Ok(()),
                        // The port is still held by the old socket: try again.
                        _ if Instant::now() < by => tokio::time::sleep(Duration::from_millis(100)).await,
                        _ => return Err("the aggregator does not start again".into()),
                    }
                }
            }
            Self::Embedded { agg, cfg } => {
                if let Some(a) = agg.take() {
                    if kill {
                        a.shutdown();
                    } else {
                        a.shutdown_with_snapshot().await;
                    }
                }
                tokio::time::sleep(down).await;
                let by = Instant::now() + Duration::from_secs(10);
                loop {
                    match Aggregator::start((**cfg).clone()).await {
                        Ok(a) => {
                            *agg = Some(a);
                            return Ok(());
                        }
                        Err(_) if Instant::now() < by => tokio::time::sleep(Duration::from_millis(50)).await,
                        Err(e) => return Err(e.to_string()),
                    }
                }
            }
        }
    }

    async fn stop(self) {
        match self {
            Self::Process { mut child, .. } => {
                let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
                let _ = tokio::task::spawn_blocking(move || child.wait()).await;
            }
            Self::Embedded { agg, .. } => {
                if let Some(a) = agg {
                    a.shutdown_with_snapshot().await;
                }
            }
        }
    }
}

/// This process restarts shipper sessions in place (a real shipper restart is a new
/// process), and each session's freed buffers stayed with glibc: the RSS rose about
/// 12 MB per restart while the live heap stayed at 91–101 MB (heaptrack: 11 restarts in
/// 3 minutes, 27 KB unfreed at exit). So the soak fixes malloc's mmap threshold at
/// 128 KiB (a fixed value also stops glibc from raising it after each large free, which
/// moved the sessions' multi-MB buffers into the arenas) and two arenas, and returns free
/// pages (`malloc_trim`) before it reads its own RSS; it also reports the live heap
/// (`mallinfo2`), which no allocator policy changes.
#[allow(unsafe_code, reason = "libc calls with no safe std equivalent")]
fn tune_allocator() {
    // SAFETY: `mallopt` takes two integers and only changes malloc's parameters; called
    // once, before the shippers start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// See [`tune_allocator`].
#[allow(unsafe_code, reason = "one libc call with no safe std equivalent")]
fn trim_heap() {
    // SAFETY: `malloc_trim` takes no pointers; it only returns free pages of the
    // allocator's own arenas to the kernel and is safe to call from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes malloc has handed out and not had back (arenas and mmapped chunks), KiB.
#[allow(unsafe_code, reason = "one libc call with no safe std equivalent")]
fn live_heap_kb() -> u64 {
    // SAFETY: `mallinfo2` takes no arguments and returns a plain struct by value.
    let mi = unsafe { libc::mallinfo2() };
    u64::try_from(mi.uordblks.saturating_add(mi.hblkhd) / 1024).unwrap_or(u64::MAX)
}

fn rss_kb(status: &str) -> u64 {
    std::fs::read_to_string(status)
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Starts `bin run ARGS` and reads its two address lines.
fn spawn_process(bin: &Path, args: &[String]) -> Result<(Child, SocketAddr, SocketAddr), String> {
    use std::io::BufRead as _;
    let mut child = Command::new(bin)
        .arg("run")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut lines = std::io::BufReader::new(out).lines();
    let mut next = || lines.next().and_then(Result::ok).unwrap_or_default();
    let quic = next().trim_start_matches("quic ").parse().map_err(|e| format!("quic address: {e}"));
    let http = next().trim_start_matches("http http://").parse().map_err(|e| format!("http address: {e}"));
    match (quic, http) {
        (Ok(q), Ok(h)) => Ok((child, q, h)),
        (Err(e), _) | (_, Err(e)) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("the aggregator did not start: {e}"))
        }
    }
}

/// The `aggregator` binary beside this executable (a cargo target directory), if built.
#[must_use]
pub fn sibling_aggregator() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    // A test binary lives in `deps/`, one level further down.
    [dir.join("aggregator"), dir.parent()?.join("aggregator")].into_iter().find(|p| p.is_file())
}

/// xorshift: the restart schedule's draws.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn slope_mb_per_10min(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    #[allow(clippy::cast_precision_loss, reason = "a handful of points")]
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
    let (mx, my) = (sx / n, sy / n);
    let (num, den) =
        points.iter().fold((0.0, 0.0), |a, p| (a.0 + (p.0 - mx) * (p.1 - my), a.1 + (p.0 - mx) * (p.0 - mx)));
    // KB per minute → MB per 10 minutes.
    (den > 0.0).then(|| num / den * 10.0 / 1024.0)
}

/// Runs the soak.
///
/// # Errors
/// Set-up failures (certificates, the aggregator not starting) and an API that stops
/// answering for good.
#[allow(clippy::too_many_lines, reason = "one run, in order")]
pub async fn run(spec: SoakSpec) -> Result<SoakResult, SoakError> {
    tune_allocator();
    let mut scenario = Scenario::parse(SCENARIO).map_err(|e| SoakError::Setup(e.to_string()))?;
    scenario.duration_ms = u64::try_from(spec.duration.as_millis()).unwrap_or(u64::MAX).max(10_000);
    scenario.seed = spec.seed;
    let options = SimOptions { bulk_scale: spec.scale, seed: Some(spec.seed) };
    let truth = crate::truth(&scenario, options).map_err(|e| SoakError::Setup(e.to_string()))?;
    let dir = TempDir::new("soak").map_err(|e| SoakError::Setup(e.to_string()))?;
    let names: Vec<String> = (0..scenario.cluster.nodes).map(certs::node_name).collect();
    let set = certs::init(&dir.path, &names).map_err(|e| SoakError::Setup(e.to_string()))?;
    let snap = dir.path.join("aggregator.snap");
    // Verdicts kept 5 minutes and final ops remembered 2: the store and the matcher reach
    // their steady size early in the run, so an RSS slope after minute 5 is a leak.
    let common = |listen: SocketAddr, http: SocketAddr| -> Vec<String> {
        [
            "--listen",
            &listen.to_string(),
            "--http",
            &http.to_string(),
            "--certs",
            &dir.path.display().to_string(),
            "--snapshot",
            &snap.display().to_string(),
            "--snapshot-interval-ms",
            "1000",
            "--expect-nodes",
            &scenario.cluster.nodes.to_string(),
            "--verdict-retention-s",
            "300",
            "--final-memory-s",
            "120",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let (mut agg, quic, http) = match &spec.aggregator_bin {
        Some(bin) => {
            let (child, q, h) = spawn_process(bin, &common(any, any)).map_err(SoakError::Setup)?;
            (Agg::Process { child, bin: bin.clone(), args: common(q, h) }, q, h)
        }
        None => {
            let mut cfg = AggregatorConfig::local(&set);
            cfg.snapshot_path = Some(snap.clone());
            cfg.snapshot_interval_ms = 1000;
            cfg.matcher.expected_nodes = scenario.cluster.nodes;
            cfg.store.retention_ns = 300_000_000_000;
            cfg.matcher.final_memory_ns = 120_000_000_000;
            let a = Aggregator::start(cfg.clone()).await.map_err(|e| SoakError::Setup(e.to_string()))?;
            let (q, h) = (a.quic_addr, a.http_addr);
            (cfg.listen, cfg.http) = (q, h);
            (Agg::Embedded { agg: Some(a), cfg: Box::new(cfg) }, q, h)
        }
    };
    let proxy = match spec.net_faults {
        Some(f) => {
            let p = ringwatch_faultproxy::FaultProxy::start(any, quic, spec.seed)
                .await
                .map_err(|e| SoakError::Setup(e.to_string()))?;
            p.set(ringwatch_faultproxy::Direction::Both, f);
            Some(p)
        }
        None => None,
    };
    let ship_to = proxy.as_ref().map_or(quic, |p| p.addr);

    let start = Instant::now();
    let mut shippers = Vec::new();
    for node in 0..scenario.cluster.nodes {
        let source = SimSource::new(&scenario, options, node, start).map_err(|e| SoakError::Setup(e.to_string()))?;
        let cfg = shipper_config(&set, ship_to, &scenario.name, scenario.timers.heartbeat_ms, node, 1.0);
        let (tx, rx) = tokio::sync::mpsc::channel::<NodeCmd>(4);
        shippers.push((tx, spawn_node(cfg, RunOptions::default(), Box::new(source), rx)));
    }

    let mut rng = spec.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let draw = |rng: &mut u64, lo: u64, hi: u64| lo + next(rng) % (hi - lo).max(1);
    let every_ms = u64::try_from(spec.restart_every.as_millis()).unwrap_or(u64::MAX);
    let mut next_restart = (every_ms > 0).then(|| draw(&mut rng, every_ms * 3 / 4, every_ms * 5 / 4));
    let mut restarts: Vec<(u64, String)> = Vec::new();
    let mut minutes = Vec::new();
    let mut next_minute = 60_000u64;
    let end_ms = scenario.duration_ms;
    loop {
        let now_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        if now_ms >= end_ms {
            break;
        }
        if let Some(at) = next_restart.filter(|&at| now_ms >= at && at + 5_000 < end_ms) {
            let down = Duration::from_millis(draw(&mut rng, 300, 3000));
            // Sides alternate, aggregator first; which shipper, SIGKILL or SIGTERM, the
            // downtime and the interval are drawn.
            let what = match if restarts.len().is_multiple_of(2) { 2 + next(&mut rng) % 2 } else { 0 } {
                0 => {
                    let node = u32::try_from(next(&mut rng) % u64::from(scenario.cluster.nodes)).unwrap_or(0);
                    let _ = shippers[node as usize].0.send(NodeCmd::Restart(down)).await;
                    format!("shipper node-{node:02} SIGTERM, down {} ms", down.as_millis())
                }
                k => {
                    let kill = k == 3;
                    match agg.restart(kill, down).await {
                        Ok(()) => format!(
                            "aggregator {}, down {} ms",
                            if kill { "SIGKILL" } else { "SIGTERM" },
                            down.as_millis()
                        ),
                        Err(e) => return Err(SoakError::Setup(e)),
                    }
                }
            };
            restarts.push((at / 1000, what));
            next_restart = Some(at + draw(&mut rng, every_ms * 3 / 4, every_ms * 5 / 4));
        }
        if now_ms >= next_minute {
            let m = minute(next_minute / 60_000, &agg, http, &snap, &truth, restarts.len()).await?;
            if spec.print {
                println!("{}", serde_json::to_string(&m).unwrap_or_default());
            }
            minutes.push(m);
            next_minute += 60_000;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The end: every stream settled against the generator, then the shippers stop.
    let settle_by = Instant::now() + crate::cluster::SETTLE_LIMIT;
    let nodes = loop {
        let nodes: Option<NodesDto> = client::get_json(http, "/v1/nodes").await.ok();
        if let Some(n) = nodes {
            let cons = crate::score::conservation(&truth, &n);
            if cons.iter().all(|c| c.exact == c.streams) || Instant::now() >= settle_by {
                break n;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let last = minute(minutes.len() as u64 + 1, &agg, http, &snap, &truth, restarts.len()).await?;
    let verdicts = client::get_all_verdicts(http, "").await?;
    let ended_at_ms = client::get_json::<aggregator::api::dto::HealthzDto>(http, "/healthz").await?.uptime_ms;
    let mut reports = Vec::new();
    for (tx, task) in shippers {
        let _ = tx.send(NodeCmd::Stop).await;
        if let Ok(Ok(sessions)) = task.await {
            reports.extend(sessions);
        }
    }
    agg.stop().await;
    let cons = crate::score::conservation(&truth, &nodes);
    let sc = crate::score::score(&truth, &nodes, &verdicts, ended_at_ms, 500.0);
    let points = |f: fn(&Minute) -> u64| -> Vec<(f64, f64)> {
        #[allow(clippy::cast_precision_loss, reason = "minutes and KB")]
        minutes.iter().filter(|m| m.minute >= 5).map(|m| (m.minute as f64, f(m) as f64)).collect()
    };
    let agg_slope =
        if spec.aggregator_bin.is_some() { slope_mb_per_10min(&points(|m| m.aggregator_rss_kb)) } else { None };
    let lg_slope = slope_mb_per_10min(&points(|m| m.loadgen_rss_kb));
    let heap_slope = slope_mb_per_10min(&points(|m| m.loadgen_heap_kb));
    minutes.push(last);
    Ok(SoakResult {
        minutes,
        restarts,
        streams_exact: cons.iter().map(|c| c.exact).sum(),
        streams: cons.iter().map(|c| c.streams).sum(),
        unaccounted_vs_generator: unaccounted_vs(&truth, &nodes),
        final_verdicts: sc.final_verdicts,
        wrong_verdicts: sc.final_verdicts - sc.final_right,
        wrong_examples: sc.wrong_examples,
        aggregator_rss_slope_mb_per_10min: agg_slope,
        loadgen_rss_slope_mb_per_10min: lg_slope,
        loadgen_heap_slope_mb_per_10min: heap_slope,
        reports,
    })
}

/// Frames the generator made that are in no state at the aggregator (or counted twice),
/// over every stream: `|generated − (received + lost + prior_instance + sampled out)|`.
fn unaccounted_vs(truth: &loadgen_sim::GroundTruth, nodes: &NodesDto) -> u64 {
    truth
        .streams
        .iter()
        .map(|t| {
            let name = certs::node_name(t.node);
            let got = nodes
                .nodes
                .iter()
                .find(|n| n.name == name)
                .and_then(|n| n.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id));
            got.map_or(t.generated, |g| {
                t.generated.abs_diff(g.received + g.lost_total + g.prior_instance + g.sampled_out)
            })
        })
        .sum()
}

/// One minute's line (waits for an aggregator that is restarting).
async fn minute(
    n: u64,
    agg: &Agg,
    http: SocketAddr,
    snap: &Path,
    truth: &loadgen_sim::GroundTruth,
    restarts: usize,
) -> Result<Minute, SoakError> {
    let by = Instant::now() + Duration::from_secs(60);
    let (nodes, verdicts) = loop {
        let got: Result<(NodesDto, VerdictsDto, IngestDto), client::ClientError> = async {
            Ok((
                client::get_json(http, "/v1/nodes").await?,
                client::get_all_verdicts(http, "final=true").await?,
                client::get_json(http, "/v1/ingest").await?,
            ))
        }
        .await;
        // Right after an aggregator restart the shippers are still reconnecting: a line
        // is taken once every node is back with its streams (or after 60 s, as it is).
        let nodes_back = |n: &NodesDto| {
            (0..truth.nodes.len()).all(|i| {
                let name = certs::node_name(u32::try_from(i).unwrap_or(0));
                n.nodes.iter().any(|x| x.name == name && x.connected && !x.streams.is_empty())
            })
        };
        match got {
            Ok((n, v, _)) if nodes_back(&n) || Instant::now() >= by => break (n, v),
            Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) if Instant::now() >= by => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let mut m = Minute {
        minute: n,
        aggregator_rss_kb: agg.rss_kb(),
        loadgen_rss_kb: {
            trim_heap();
            rss_kb("/proc/self/status")
        },
        loadgen_heap_kb: live_heap_kb(),
        snapshot_bytes: std::fs::metadata(snap).map_or(0, |md| md.len()),
        restarts_so_far: restarts,
        ..Minute::default()
    };
    for node in &nodes.nodes {
        m.prior_instance += node.prior_instance;
        for s in &node.streams {
            m.generated += s.attempted + s.sampled_out;
            m.received += s.received;
            m.sampled_out += s.sampled_out;
            m.pending_or_in_transit += s.pending + s.in_transit;
            for (cause, k) in &s.lost {
                *m.lost.entry(cause.clone()).or_default() += k;
            }
            // Seqs the heartbeats announced (below `attempted`) that are in no state:
            // received, lost, another instance's, pending or in transit. (Frames received
            // above the last announcement are ahead of it, not extra.)
            let known = s.received + s.lost_total + s.prior_instance + s.pending + s.in_transit;
            m.unaccounted += s.attempted.saturating_sub(known);
        }
    }
    let sc = crate::score::score(truth, &nodes, &verdicts, 0, 500.0);
    m.final_verdicts = sc.final_verdicts;
    m.wrong_verdicts = sc.final_verdicts - sc.final_right;
    Ok(m)
}
