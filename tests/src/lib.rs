//! Cross-crate end-to-end tests live in `tests/tests/`; this library holds their shared
//! helpers (test-only crate, never published): temporary directories, an aggregator with
//! a fresh certificate set, shipper configurations, a tiny HTTP/1.1 GET, [`pair`]: the
//! real shipper and aggregator state machines wired together in simulated time, and
//! [`scaleout`]: a NATS cluster and shard roles as processes. The binary `ringwatch-role`
//! runs one shard role (the fault tests SIGKILL it).

pub use ringwatch_faultproxy::cgroup;
pub mod pair;
pub mod scaleout;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use aggregator::certs::{self, CertSet};
use node_shipper::config::{ShipperConfig, Source};

/// The repository root (the workspace directory), for tests that read the project's
/// own files.
#[must_use]
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A directory removed when dropped — kept (and named on stderr) when the test
/// panicked and `RINGWATCH_KEEP_FAILED` is set, for its logs.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh, unique directory under the system temp dir.
    #[must_use]
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p =
            std::env::temp_dir().join(format!("rw-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() && std::env::var_os("RINGWATCH_KEEP_FAILED").is_some() {
            eprintln!("kept for its logs: {}", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A dev certificate set for `nodes` simulator nodes (`node-00`, …).
#[must_use]
pub fn cert_set(dir: &Path, nodes: u32) -> CertSet {
    let names: Vec<String> = (0..nodes).map(certs::node_name).collect();
    certs::init(dir, &names).expect("certificates")
}

/// A shipper configuration for node `node` of the set, shipping `source` to `aggregator`
/// (loadgen's, in real time).
#[must_use]
pub fn shipper_config(set: &CertSet, aggregator: SocketAddr, node: u32, source: Source) -> ShipperConfig {
    let mut cfg = loadgen::cluster::shipper_config(set, aggregator, "", 1000, node, 1.0);
    cfg.source = source;
    cfg
}

/// `GET path` over HTTP/1.1; returns the status and the body.
///
/// # Panics
/// When the server cannot be reached or answers something that is not HTTP.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    aggregator::api::client::get(addr, path).await.expect("an HTTP answer")
}

/// `GET path` parsed as JSON into `T`.
///
/// # Panics
/// A non-200 answer or a body that is not a `T`.
pub async fn get_json<T: serde::de::DeserializeOwned>(addr: SocketAddr, path: &str) -> T {
    aggregator::api::client::get_json(addr, path).await.unwrap_or_else(|e| panic!("{e}"))
}

pub use loadgen::Discard;

/// The generator's own account of a run.
///
/// # Panics
/// An invalid scenario.
#[must_use]
pub fn truth(s: &loadgen_sim::Scenario, options: loadgen_sim::SimOptions) -> loadgen_sim::GroundTruth {
    loadgen::truth(s, options).expect("scenario")
}

/// A shipper running in process, and how to stop it.
pub type Running = (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<node_shipper::driver::Report>);

/// One in-process shipper per node of `s`, each on its simulated source (all started at
/// `start`), shipping to `aggregator`; `tweak` adjusts a node's configuration and run
/// options before it starts.
///
/// # Panics
/// A source that cannot be built from the scenario.
pub fn spawn_sim_shippers(
    s: &loadgen_sim::Scenario,
    options: loadgen_sim::SimOptions,
    set: &CertSet,
    aggregator: SocketAddr,
    start: std::time::Instant,
    mut tweak: impl FnMut(u32, &mut ShipperConfig, &mut node_shipper::driver::RunOptions),
) -> Vec<Running> {
    (0..s.cluster.nodes)
        .map(|node| {
            let source = node_shipper::source::SimSource::new(s, options, node, start).expect("sim source");
            let placeholder = Source::Sim { scenario: s.name.clone(), node, bulk_scale_ppm: 0, seed: None };
            let mut cfg = shipper_config(set, aggregator, node, placeholder);
            let mut opts = node_shipper::driver::RunOptions::default();
            tweak(node, &mut cfg, &mut opts);
            spawn_shipper(cfg, Box::new(source), opts)
        })
        .collect()
}

/// Runs a shipper in process until [`stop`].
#[must_use]
pub fn spawn_shipper(
    cfg: ShipperConfig,
    source: Box<dyn node_shipper::source::Source>,
    opts: node_shipper::driver::RunOptions,
) -> Running {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        node_shipper::driver::run(&cfg, opts, source, async {
            let _ = rx.await;
        })
        .await
        .expect("shipper runs")
    });
    (tx, task)
}

/// SIGTERM-equivalent for in-process shippers: each flushes and reports.
///
/// # Panics
/// A shipper task that panicked.
pub async fn stop(shippers: Vec<Running>) -> Vec<node_shipper::driver::Report> {
    let mut out = Vec::new();
    for (tx, task) in shippers {
        let _ = tx.send(());
        out.push(task.await.expect("shipper task"));
    }
    out
}

/// How long a test waits for the state it checks before it fails, printing what it saw.
/// Generous on purpose: CI machines are shared, and late is fine where wrong is not.
pub const STATE_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Polls `/v1/nodes` until `done` holds (at most [`STATE_LIMIT`]; the wait is printed).
///
/// # Panics
/// When the state is not reached in time (with the last answer), or the API fails.
pub async fn wait_nodes(
    http: SocketAddr,
    what: &str,
    done: impl Fn(&aggregator::api::dto::NodesDto) -> bool,
) -> aggregator::api::dto::NodesDto {
    wait_json(http, "/v1/nodes", what, done).await
}

/// Polls `/v1/ingest` until `done` holds (at most [`STATE_LIMIT`]; the wait is printed).
///
/// # Panics
/// When the state is not reached in time (with the last answer), or the API fails.
pub async fn wait_ingest(
    http: SocketAddr,
    what: &str,
    done: impl Fn(&aggregator::api::dto::IngestDto) -> bool,
) -> aggregator::api::dto::IngestDto {
    wait_json(http, "/v1/ingest", what, done).await
}

/// Polls `GET path` until `done` holds (at most [`STATE_LIMIT`]; the wait is printed).
///
/// # Panics
/// When the state is not reached in time (with the last answer), or the API fails.
pub async fn wait_json<T: serde::de::DeserializeOwned + std::fmt::Debug>(
    http: SocketAddr,
    path: &str,
    what: &str,
    done: impl Fn(&T) -> bool,
) -> T {
    let started = std::time::Instant::now();
    loop {
        let got: T = get_json(http, path).await;
        if done(&got) {
            println!("state reached, {what}: after {:?}", started.elapsed());
            return got;
        }
        assert!(started.elapsed() < STATE_LIMIT, "{what}: not reached within {STATE_LIMIT:?}; last {path}: {got:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Waits until every decidable rank verdict of `truth` is final at the aggregator (the
/// scorer's table with the default 500 ms reorder slack; ops from seq 1); returns how
/// many that is.
///
/// # Panics
/// As [`wait_json`].
pub async fn wait_decidable_final(http: SocketAddr, truth: &loadgen_sim::GroundTruth) -> u64 {
    let table = loadgen_sim::expect::Table::new(truth, 500.0);
    let decidable = table.ranks().filter(|(c, _, e)| c.comm_op_seq > 0 && e.decidable).count() as u64;
    wait_json(
        http,
        "/v1/verdicts?final=true&limit=1",
        "every decidable verdict final",
        |v: &aggregator::api::dto::VerdictsDto| v.total.unwrap_or(0) >= decidable,
    )
    .await;
    decidable
}

/// Whether every stream of `truth` on the nodes `include` accepts is settled at the
/// aggregator: its heartbeats reported everything the generator made (attempted +
/// sampled out = generated), and nothing is pending or in transit.
#[must_use]
pub fn streams_settled(
    nodes: &aggregator::api::dto::NodesDto,
    truth: &loadgen_sim::GroundTruth,
    include: impl Fn(u32) -> bool,
) -> bool {
    truth.streams.iter().filter(|t| include(t.node)).all(|t| {
        let name = certs::node_name(t.node);
        nodes.nodes.iter().filter(|n| n.name == name).flat_map(|n| &n.streams).any(|x| {
            x.epoch == t.epoch
                && x.stream_id == t.stream_id
                && x.attempted + x.sampled_out == t.generated
                && x.pending == 0
                && x.in_transit == 0
        })
    })
}
