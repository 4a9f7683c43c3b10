//! Scale-out helpers (issues 28, 29): a 3-server NATS JetStream cluster on loopback, the
//! demo scenario's configuration for each shard role, and a shard role run as a process
//! of its own (`ringwatch-role`, this crate's binary) so that a fault test can SIGKILL
//! it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aggregator::certs::CertSet;
use aggregator::cluster::{ClusterConfig, ShardRole};

/// The demo runs 4× slower than real time through the shards (2 cores carry eight
/// shippers, three NATS servers and five roles).
pub const TIME_SCALE: f64 = 4.0;

/// Matcher shards in these tests.
pub const MATCHER_SHARDS: u32 = 2;

/// Loopback addresses for `shards` ingest shards, each the first choice (the shippers'
/// rendezvous order over the address list) of at least `min_each` of `names`. The
/// split depends on the ports, and with free ports chosen by the kernel one shard
/// could get no node (1 in 128 for 8 nodes over 2) or too few for a test's faults to
/// mean anything; these ports are held while the split is checked, then let go for the
/// ingest shards to bind.
///
/// # Panics
/// When no such ports turn up in 1,000 tries, or loopback UDP cannot be bound.
#[must_use]
pub fn ingest_listen_addrs(names: &[String], shards: usize, min_each: usize) -> Vec<SocketAddr> {
    for _ in 0..1_000 {
        let socks: Vec<std::net::UdpSocket> =
            (0..shards).map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("loopback UDP")).collect();
        let addrs: Vec<SocketAddr> = socks.iter().map(|s| s.local_addr().expect("bound")).collect();
        if first_choice_counts(names, &addrs).iter().all(|&c| c >= min_each) {
            return addrs;
        }
    }
    panic!("no {shards} loopback ports split {} nodes at least {min_each} each", names.len());
}

/// How many of `names` have each of `addrs` first in their rendezvous order (the shard
/// a shipper given that list connects to first).
#[must_use]
pub fn first_choice_counts(names: &[String], addrs: &[SocketAddr]) -> Vec<usize> {
    let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    let mut first = vec![0usize; addrs.len()];
    for n in names {
        if let Some(pick) = ringwatch_transport::shard::rendezvous_order(n, &list).first()
            && let Some(i) = list.iter().position(|x| x == *pick)
        {
            first[i] += 1;
        }
    }
    first
}

/// `nats-server`, or the reason it is missing (a failure under `CI=true`).
#[must_use]
pub fn nats_server() -> Option<()> {
    if Command::new("nats-server").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some(());
    }
    let why = "nats-server is not installed (Debian package nats-server)";
    assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {why}");
    println!("skipped: {why}");
    None
}

/// A free TCP port on loopback (free when asked).
///
/// # Panics
/// When no port can be bound.
#[must_use]
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// Three JetStream servers routed to each other; killed (by pid) and their stores
/// removed when dropped.
#[derive(Debug)]
pub struct NatsCluster {
    children: Vec<Option<Child>>,
    pub urls: Vec<String>,
    dir: crate::TempDir,
}

impl NatsCluster {
    /// # Panics
    /// When a server cannot be started.
    #[must_use]
    pub fn start() -> Self {
        let dir = crate::TempDir::new("nats");
        let client: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let routes: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut children = Vec::new();
        for i in 0..3 {
            let store = dir.0.join(format!("n{i}"));
            let others: Vec<String> =
                (0..3).filter(|&j| j != i).map(|j| format!("\"nats-route://127.0.0.1:{}\"", routes[j])).collect();
            let conf = format!(
                "server_name: n{i}\nlisten: 127.0.0.1:{}\njetstream {{ store_dir: \"{}\" }}\ncluster {{ name: rw, listen: 127.0.0.1:{}, routes: [{}] }}\n",
                client[i],
                store.display(),
                routes[i],
                others.join(", ")
            );
            let path = dir.0.join(format!("n{i}.conf"));
            std::fs::write(&path, conf).expect("write config");
            let log = std::fs::File::create(dir.0.join(format!("n{i}.log"))).expect("log file");
            children.push(Some(
                Command::new("nats-server")
                    .arg("-c")
                    .arg(&path)
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("nats-server starts"),
            ));
        }
        let urls = client.iter().map(|p| format!("nats://127.0.0.1:{p}")).collect();
        Self { children, urls, dir }
    }

    /// SIGKILLs server `i` (its store stays on disk; it is not started again).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children.get_mut(i).and_then(Option::take) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The last lines of every server's log.
    #[must_use]
    pub fn logs(&self) -> String {
        (0..3)
            .map(|i| std::fs::read_to_string(self.dir.0.join(format!("n{i}.log"))).unwrap_or_default())
            .map(|l| l.lines().rev().take(15).collect::<Vec<_>>().join("\n"))
            .collect::<Vec<_>>()
            .join("\n---\n")
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut().filter_map(Option::as_mut) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The demo's aggregator configuration (its short timers) for one shard role.
///
/// # Panics
/// When the built-in demo scenario does not load.
#[must_use]
pub fn role_config(set: &CertSet, nats: &[String], role: ShardRole, origin_ms: u64) -> aggregator::AggregatorConfig {
    let s = loadgen_sim::builtin::builtin("demo").expect("built in").expect("valid");
    let mut cfg = loadgen::cluster::aggregator_config(set, &s, TIME_SCALE);
    // A node failing over between ingest shards is unreachable meanwhile, for real time.
    cfg.matcher.dead_after_ns = loadgen::cluster::scaled_out_dead_after_ns(cfg.matcher.dead_after_ns, TIME_SCALE);
    cfg.cluster = Some(ClusterConfig {
        role,
        nats: nats.to_vec(),
        matcher_shards: MATCHER_SHARDS,
        replicas: 3,
        stream_max_bytes: 256 << 20,
        verdict_max_age: Duration::from_secs(3600),
        time_origin_unix_ms: origin_ms,
    });
    cfg
}

/// The demo run (seed 2026) the scale-out tests drive, through `external` (none: one
/// in-process aggregator).
///
/// # Panics
/// When the built-in demo scenario does not load.
#[must_use]
pub fn demo_spec(external: Option<loadgen::cluster::External>) -> loadgen::cluster::RunSpec {
    loadgen::cluster::RunSpec {
        scenario: loadgen_sim::builtin::builtin("demo").expect("built in").expect("valid"),
        seed: Some(2026),
        scale: 1e-4,
        time_scale: TIME_SCALE,
        progress: false,
        net_faults: None,
        external,
        demo_rows: false,
    }
}

/// Scores a scaled-out run against its truth, prints the table, and asserts every final
/// verdict right, none falsely degraded and every stream exact. Returns the score.
///
/// # Panics
/// When one of those does not hold.
pub fn assert_scored_right(r: &loadgen::cluster::RunResult) -> loadgen::score::Score {
    let sc = loadgen::score::score(
        &r.truth,
        &r.nodes,
        &r.verdicts,
        r.ended_at_ms,
        loadgen::cluster::reorder_sim_ms(TIME_SCALE),
    );
    println!("{}", sc.table());
    assert_eq!(sc.final_right, sc.final_verdicts, "wrong final verdicts: {:?}", sc.wrong_examples);
    assert_eq!(sc.false_degraded, 0);
    for c in &sc.conservation {
        assert_eq!(c.exact, c.streams, "{} not exact: {c:?}", c.node);
    }
    sc
}

/// Unix ms now (every role's time origin in a test).
///
/// # Panics
/// Before 1970.
#[must_use]
pub fn unix_ms() -> u64 {
    u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis())
        .expect("ms")
}

/// What a role process is told (its command line: `key=value` words).
#[derive(Debug, Clone)]
pub struct RoleArgs {
    pub role: ShardRole,
    pub nats: Vec<String>,
    pub certs: PathBuf,
    pub origin_ms: u64,
    pub listen: Option<SocketAddr>,
    pub snapshot: Option<PathBuf>,
    /// Where the process writes `quic_addr http_addr` once it serves.
    pub addr_file: PathBuf,
}

impl RoleArgs {
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        let role = match self.role {
            ShardRole::Ingest { shard } => format!("ingest:{shard}"),
            ShardRole::Matcher { shard } => format!("matcher:{shard}"),
            ShardRole::Api => "api".to_owned(),
        };
        let mut v = vec![
            format!("role={role}"),
            format!("nats={}", self.nats.join(",")),
            format!("certs={}", self.certs.display()),
            format!("origin_ms={}", self.origin_ms),
            format!("addr_file={}", self.addr_file.display()),
        ];
        if let Some(l) = self.listen {
            v.push(format!("listen={l}"));
        }
        if let Some(s) = &self.snapshot {
            v.push(format!("snapshot={}", s.display()));
        }
        v
    }

    /// # Errors
    /// A word that is not `key=value`, an unknown key, a value that does not parse, or a
    /// missing key.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let (mut role, mut nats, mut certs, mut origin_ms, mut listen, mut snapshot, mut addr_file) =
            (None, None, None, None, None, None, None);
        for a in args {
            let (k, v) = a.split_once('=').ok_or_else(|| format!("not key=value: {a}"))?;
            match k {
                "role" => {
                    role = Some(match v.split_once(':') {
                        Some(("ingest", n)) => {
                            ShardRole::Ingest { shard: n.parse().map_err(|_| format!("shard: {v}"))? }
                        }
                        Some(("matcher", n)) => {
                            ShardRole::Matcher { shard: n.parse().map_err(|_| format!("shard: {v}"))? }
                        }
                        None if v == "api" => ShardRole::Api,
                        _ => return Err(format!("role: {v}")),
                    });
                }
                "nats" => nats = Some(v.split(',').map(str::to_owned).collect()),
                "certs" => certs = Some(PathBuf::from(v)),
                "origin_ms" => origin_ms = Some(v.parse().map_err(|_| format!("origin_ms: {v}"))?),
                "listen" => listen = Some(v.parse().map_err(|_| format!("listen: {v}"))?),
                "snapshot" => snapshot = Some(PathBuf::from(v)),
                "addr_file" => addr_file = Some(PathBuf::from(v)),
                _ => return Err(format!("unknown key {k}")),
            }
        }
        Ok(Self {
            role: role.ok_or("role= missing")?,
            nats: nats.ok_or("nats= missing")?,
            certs: certs.ok_or("certs= missing")?,
            origin_ms: origin_ms.ok_or("origin_ms= missing")?,
            listen,
            snapshot,
            addr_file: addr_file.ok_or("addr_file= missing")?,
        })
    }
}

/// A shard role in a process of its own; SIGKILLed when dropped.
#[derive(Debug)]
pub struct RoleProcess {
    child: Option<Child>,
    pub pid: u32,
    pub quic: SocketAddr,
    pub http: SocketAddr,
}

impl RoleProcess {
    /// Starts `ringwatch-role` (`exe`) and waits until it serves (it retries while the
    /// JetStream cluster forms), at most [`crate::STATE_LIMIT`].
    ///
    /// # Panics
    /// When it cannot be started, exits, or does not serve in time.
    pub async fn start(exe: &Path, args: &RoleArgs, log: &Path) -> Self {
        let _ = std::fs::remove_file(&args.addr_file);
        let log = std::fs::File::create(log).expect("role log");
        let mut child = Command::new(exe)
            .args(args.to_args())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("ringwatch-role starts");
        let started = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&args.addr_file)
                && let Some((q, h)) = text.trim().split_once(' ')
                && let (Ok(quic), Ok(http)) = (q.parse(), h.parse())
            {
                return Self { pid: child.id(), child: Some(child), quic, http };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("role {:?} exited before serving: {status}", args.role);
            }
            assert!(started.elapsed() < crate::STATE_LIMIT, "role {:?} did not serve in time", args.role);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL (no drain, no snapshot, no goodbye), and reaped.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Its `/v1/ingest` `cluster` section (`None` while it does not answer).
    pub async fn cluster(&self) -> Option<aggregator::api::dto::ClusterDto> {
        let ing: aggregator::api::dto::IngestDto =
            aggregator::api::client::get_json(self.http, "/v1/ingest").await.ok()?;
        ing.cluster
    }
}

impl Drop for RoleProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
