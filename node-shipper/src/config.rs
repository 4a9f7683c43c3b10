//! The shipper's configuration: flags, environment and a TOML file, validated into one
//! type, with every problem reported at once (the layering is
//! `ringwatch_transport::config`'s: flag > `RINGWATCH_SHIPPER_<FIELD>` > TOML > default).
//!
//! Pure: callers hand in the file's text and the environment; nothing here reads either.
//! The files the configuration names are checked apart ([`check_files`]).

use std::net::SocketAddr;
use std::path::PathBuf;

pub use ringwatch_transport::config::{ConfigError, ConfigErrors, Layer};
use ringwatch_transport::config::{Field, Kind, Schema, Values};

use crate::core::batcher::BatcherConfig;
use crate::core::spool::SpoolConfig;

/// Every field: name (TOML key; flag `--name-with-dashes`; env upper case), kind, default,
/// help.
const FIELDS: &[Field] = &[
    (
        "aggregator",
        Kind::HostPort,
        None,
        "aggregator address: ip:port, or dns-name:port resolved at every connection attempt; a comma-separated list of ingest shards: the one rendezvous hashing of node_name picks, then the next in that order while it cannot be reached",
    ),
    ("server_name", Kind::Text, Some("aggregator"), "name in the aggregator's certificate"),
    ("node_name", Kind::Text, None, "this node's name; must equal its client certificate's DNS SAN"),
    ("ca", Kind::Text, None, "CA certificate (PEM) that signed the aggregator's certificate"),
    ("cert", Kind::Text, None, "this node's client certificate (PEM)"),
    ("key", Kind::Text, None, "this node's private key (PEM)"),
    (
        "tls_reload_interval_ms",
        Kind::Int { min: 0, max: 3_600_000 },
        Some("10000"),
        "how often the TLS files are looked at; a rotated certificate is used for the next connection without a restart (0: never)",
    ),
    ("source", Kind::Text, None, "frame source: bpf (the eBPF rings), capture:PATH or sim:SCENARIO"),
    ("source_node", Kind::Int { min: 0, max: 1 << 20 }, Some("0"), "which node of the capture or scenario to ship"),
    (
        "sim_bulk_scale_ppm",
        Kind::Int { min: 1, max: 1_000_000 },
        Some("1000"),
        "sim source: bulk rate, ppm of link rate",
    ),
    ("sim_seed", Kind::Int { min: 0, max: u64::MAX }, Some("0"), "sim source: seed (0 = the scenario's own)"),
    (
        "replay_speed_pct",
        Kind::Int { min: 0, max: 100_000 },
        Some("100"),
        "capture source: pace, % of real time (0 = unpaced)",
    ),
    ("max_batch_bytes", Kind::Int { min: 4096, max: 1 << 20 }, Some("65536"), "payload bytes per P0/P1 batch"),
    (
        "bulk_batch_bytes",
        Kind::Int { min: 4096, max: 1 << 20 },
        Some("262144"),
        "payload bytes per bulk (P2/P3) batch (at least max_batch_bytes)",
    ),
    ("flush_interval_ms", Kind::Int { min: 1, max: 10_000 }, Some("5"), "longest a batch stays open"),
    (
        "spool_bytes",
        Kind::Int { min: 1 << 20, max: 1 << 40 },
        Some("268435456"),
        "spool cap (with memory_budget = cgroup, a ceiling on the cap derived from the cgroup's limit)",
    ),
    (
        "memory_budget",
        Kind::Text,
        Some("cgroup"),
        "cgroup (the spool and reader-queue caps derived from this process's cgroup memory limit at start and on each pressure event) or static (spool_bytes as is)",
    ),
    (
        "memory_headroom_bytes",
        Kind::Int { min: 0, max: 1 << 40 },
        Some("25165824"),
        "memory_budget = cgroup: what the process itself needs (code, runtime, TLS, allocator slack) besides the spool, the reader queue, the rings, QUIC's send window and the buffer pools",
    ),
    ("p0_reserve_bytes", Kind::Int { min: 0, max: 1 << 40 }, Some("8388608"), "spool room only P0 may use"),
    ("p1_reserve_bytes", Kind::Int { min: 0, max: 1 << 40 }, Some("8388608"), "spool room only P1 may use"),
    ("heartbeat_interval_ms", Kind::Int { min: 10, max: 60_000 }, Some("1000"), "heartbeat period"),
    ("shutdown_deadline_ms", Kind::Int { min: 0, max: 600_000 }, Some("5000"), "SIGTERM flush deadline"),
    ("log_format", Kind::Text, Some("text"), "logs on stderr: text or json"),
    (
        "bpf_pin_dir",
        Kind::Text,
        Some("/sys/fs/bpf/ringwatch"),
        "bpf source: bpffs directory of the pinned rings, counters and programs (one per shipper)",
    ),
    (
        "p0_ring_bytes",
        Kind::Int { min: 4096, max: 1 << 30 },
        Some("1048576"),
        "bpf source: P0 ring size, a power of two (a pinned ring keeps its size)",
    ),
    (
        "bulk_ring_bytes",
        Kind::Int { min: 4096, max: 1 << 31 },
        Some("16777216"),
        "bpf source: bulk ring size, a power of two: peak bytes/s × p99.9 drain gap × 3",
    ),
    (
        "bpf_object",
        Kind::OptText,
        Some(""),
        "bpf source: a compiled ringwatch.bpf.o to load instead of the embedded one",
    ),
    ("kernel_btf", Kind::Text, Some("/sys/kernel/btf/vmlinux"), "bpf source: the kernel's BTF, checked before loading"),
    (
        "ring_drain_interval_us",
        Kind::Int { min: 50, max: 1_000_000 },
        Some("1000"),
        "bpf source: drain period (producers submit without wakeups)",
    ),
    ("reader_cpus", Kind::OptText, Some(""), "CPUs to pin the ring reader thread to, e.g. 2,3 (empty: not pinned)"),
    (
        "xdp_interfaces",
        Kind::OptText,
        Some(""),
        "bpf source: interfaces to attach the bulk XDP program to, comma-separated (links pinned)",
    ),
    (
        "nccl_profiler_shim",
        Kind::OptText,
        Some(""),
        "bpf source: libnccl-profiler-ringwatch.so to put uprobes on (the path NCCL_PROFILER_PLUGIN names)",
    ),
    ("bulk_sampling_level", Kind::Int { min: 0, max: 15 }, Some("0"), "bulk keeps 1 in 2^level events (the floor)"),
    (
        "bulk_sampling_max_level",
        Kind::Int { min: 0, max: 15 },
        Some("8"),
        "spool pressure may raise bulk sampling up to this level (at least bulk_sampling_level)",
    ),
    (
        "http_listen",
        Kind::OptText,
        Some(""),
        "address (ip:port) of the shipper's HTTP listener for /healthz, /readyz and /metrics (empty: none; give one under hostNetwork only deliberately)",
    ),
    (
        "psi_bulk_share_pct",
        Kind::Int { min: 0, max: 100 },
        Some("25"),
        "under `some` pressure bulk may hold this % of its spool share (under `full`: none); the rest is shed as psi_shed",
    ),
    (
        "throttle_p3",
        Kind::OptText,
        Some(""),
        "background cgroup v2 directories (absolute, comma-separated) frozen or memory.high-lowered from `some` pressure on (needs psi = on)",
    ),
    (
        "throttle_p2",
        Kind::OptText,
        Some(""),
        "background cgroup v2 directories (absolute, comma-separated) frozen or memory.high-lowered under `full` pressure (needs psi = on)",
    ),
];

/// The field names, in documentation order, with their help (for `--help` and docs).
pub fn fields() -> impl Iterator<Item = (&'static str, &'static str)> {
    ringwatch_transport::config::all_fields::<Shipper>().map(|&(name, _, _, help)| (name, help))
}

/// The environment variable of a field.
#[must_use]
pub fn env_name(field: &str) -> String {
    ringwatch_transport::config::env_name(ENV_PREFIX, field)
}

const ENV_PREFIX: &str = "RINGWATCH_SHIPPER_";

/// Where the frames come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A capture file, paced at `speed_pct` % of real time (0: unpaced).
    Capture { path: PathBuf, node: u32, speed_pct: u64 },
    /// A built-in scenario name or a scenario file, one node of it (feature `sim-source`).
    Sim { scenario: String, node: u32, bulk_scale_ppm: u64, seed: Option<u64> },
    /// The eBPF rings.
    Bpf(crate::bpf::BpfConfig),
}

/// Where the aggregator is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AggregatorAddr {
    /// An address.
    Ip(SocketAddr),
    /// A DNS name (a Kubernetes Service, say), resolved at every connection attempt so
    /// an aggregator that moved is found again.
    Name { host: String, port: u16 },
}

impl From<SocketAddr> for AggregatorAddr {
    fn from(a: SocketAddr) -> Self {
        Self::Ip(a)
    }
}

impl std::fmt::Display for AggregatorAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ip(a) => a.fmt(f),
            Self::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl AggregatorAddr {
    /// From text [`ringwatch_transport::config::host_port`] accepted.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        if let Ok(a) = text.parse() {
            return Some(Self::Ip(a));
        }
        let (host, port) = text.rsplit_once(':')?;
        Some(Self::Name { host: host.to_owned(), port: port.parse().ok()? })
    }

    /// From a [`ringwatch_transport::config::host_ports`] list: the ingest shard
    /// `node_name` goes to (rendezvous hashing; a list of one is that one).
    #[must_use]
    pub fn pick(list: &str, node_name: &str) -> Option<Self> {
        Self::ordered(list, node_name)?.into_iter().next()
    }

    /// Every shard of a [`ringwatch_transport::config::host_ports`] list in `node_name`'s
    /// rendezvous order: the first is [`Self::pick`]'s, the rest are where the shipper
    /// fails over to, in turn, when the one before cannot be reached. `None` if any item
    /// does not parse.
    #[must_use]
    pub fn ordered(list: &str, node_name: &str) -> Option<Vec<Self>> {
        let items: Vec<&str> = list.split(',').map(str::trim).collect();
        ringwatch_transport::shard::rendezvous_order(node_name, &items).into_iter().map(|s| Self::parse(s)).collect()
    }

    /// The address to connect to now: a name is looked up (the first IPv4 answer
    /// preferred when `v4`, else the first IPv6 one; the socket is bound to one family).
    ///
    /// # Errors
    /// The lookup failed or gave no address of the socket's family.
    pub async fn resolve(&self, v4: bool) -> Result<SocketAddr, String> {
        match self {
            Self::Ip(a) => Ok(*a),
            Self::Name { host, port } => {
                let all = tokio::net::lookup_host((host.as_str(), *port))
                    .await
                    .map_err(|e| format!("resolving {self}: {e}"))?;
                all.into_iter()
                    .find(|a| a.is_ipv4() == v4)
                    .ok_or_else(|| format!("{self} has no IPv{} address", if v4 { 4 } else { 6 }))
            }
        }
    }

    /// Whether the socket should be IPv6: an IPv6 address, or a name given as such
    /// (names bind IPv4 unless they resolve only to IPv6 at start).
    #[must_use]
    pub fn is_ipv6(&self) -> bool {
        matches!(self, Self::Ip(a) if a.is_ipv6())
    }
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShipperConfig {
    pub aggregator: AggregatorAddr,
    /// The other ingest shards of the `aggregator` list, in this node's rendezvous order:
    /// where the shipper fails over to when the one it uses cannot be reached (empty: one
    /// aggregator).
    pub fallbacks: Vec<AggregatorAddr>,
    pub server_name: String,
    pub node_name: String,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// How often the TLS files are looked at for a rotation (0: never).
    pub tls_reload_interval_ms: u64,
    pub source: Source,
    pub batcher: BatcherConfig,
    pub spool: SpoolConfig,
    pub heartbeat_interval_ms: u64,
    pub shutdown_deadline_ms: u64,
    /// JSON log lines (production) instead of text.
    pub log_json: bool,
    /// CPUs the ring reader thread is pinned to (empty: not pinned).
    pub reader_cpus: Vec<usize>,
    /// Bulk sampling: the floor and how far spool pressure may raise it.
    pub sampling: crate::core::SamplingConfig,
    /// The HTTP listener for `/healthz`, `/readyz` and `/metrics` (none: not served).
    pub http_listen: Option<SocketAddr>,
    /// The memory-pressure watcher (none: `psi = "off"`).
    pub psi: Option<ringwatch_transport::psi::PsiConfig>,
    /// Under `some` pressure, the % of bulk's spool share bulk may hold.
    pub psi_bulk_share_pct: u8,
    /// Background cgroups to throttle under pressure, by tier (checked by
    /// [`check_files`]; empty: none).
    pub throttle: Vec<(crate::core::throttle::Tier, PathBuf)>,
    /// Caps derived from the cgroup's memory limit, with this headroom (bytes) for the
    /// process itself (none: `memory_budget = "static"`, `spool_bytes` as configured).
    pub memory_budget: Option<u64>,
}

/// The shipper's schema for [`Inputs`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Shipper;

/// The raw inputs of the shipper's configuration.
pub type Inputs = ringwatch_transport::config::Inputs<Shipper>;

impl Schema for Shipper {
    type Output = ShipperConfig;
    const ENV_PREFIX: &'static str = ENV_PREFIX;
    const FIELDS: &'static [Field] = FIELDS;
    const SHARED_FIELDS: &'static [Field] = ringwatch_transport::psi::CONFIG_FIELDS;

    fn build(v: &mut Values) -> Option<ShipperConfig> {
        build(v)
    }

    fn check_files(c: &ShipperConfig) -> Vec<ConfigError> {
        check_files(c)
    }
}

#[allow(clippy::too_many_lines, reason = "one field after another")]
fn build(v: &mut Values) -> Option<ShipperConfig> {
    let int = |v: &Values, n: &str| v.int(n).unwrap_or(0);
    let node = u32::try_from(int(v, "source_node")).unwrap_or(u32::MAX);
    let source = v.text("source").map(str::to_owned).and_then(|s| {
        let parsed = match s.split_once(':') {
            Some(("capture", p)) if !p.is_empty() => Some(Source::Capture {
                path: PathBuf::from(p),
                node,
                speed_pct: v.int("replay_speed_pct").unwrap_or(100),
            }),
            Some(("sim", n)) if !n.is_empty() => Some(Source::Sim {
                scenario: n.to_string(),
                node,
                bulk_scale_ppm: v.int("sim_bulk_scale_ppm").unwrap_or(1000),
                seed: v.int("sim_seed").filter(|&s| s != 0),
            }),
            None if s == "bpf" => Some(Source::Bpf(crate::bpf::BpfConfig {
                pin_dir: PathBuf::from(v.text("bpf_pin_dir").unwrap_or_default()),
                p0_ring_bytes: u32::try_from(int(v, "p0_ring_bytes")).unwrap_or(0),
                bulk_ring_bytes: u32::try_from(int(v, "bulk_ring_bytes")).unwrap_or(0),
                object: v.opt_text("bpf_object").map(PathBuf::from),
                kernel_btf: PathBuf::from(v.text("kernel_btf").unwrap_or_default()),
                drain_interval_us: v.int("ring_drain_interval_us").unwrap_or(1000),
                counters_interval_ms: v.int("heartbeat_interval_ms").unwrap_or(1000),
                xdp_interfaces: v
                    .text("xdp_interfaces")
                    .map(|t| t.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect())
                    .unwrap_or_default(),
                nccl_shim: v.opt_text("nccl_profiler_shim").map(PathBuf::from),
            })),
            _ => None,
        };
        if parsed.is_none() {
            v.problem("source", format!("{s:?} is none of bpf, capture:PATH, sim:SCENARIO"));
        }
        parsed
    });
    if let Some(f) = v.text("log_format").map(str::to_owned)
        && f != "text"
        && f != "json"
    {
        v.problem("log_format", format!("{f:?} is neither text nor json"));
    }
    for ring in ["p0_ring_bytes", "bulk_ring_bytes"] {
        if let Some(x) = v.int(ring)
            && let Err(e) = crate::bpf::check_ring_size(ring, u32::try_from(x).unwrap_or(u32::MAX))
        {
            v.problem(ring, e.to_string());
        }
    }
    let mut reader_cpus = Vec::new();
    if let Some(list) = v.text("reader_cpus").map(str::to_owned) {
        for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.parse::<usize>() {
                Ok(c) if c < 1024 => reader_cpus.push(c),
                _ => v.problem("reader_cpus", format!("{part:?} is not a CPU number (0..1023)")),
            }
        }
    }
    if let (Some(spool), Some(max_batch)) = (v.int("spool_bytes"), v.int("max_batch_bytes")) {
        let reserves = int(v, "p0_reserve_bytes") + int(v, "p1_reserve_bytes");
        let batch = max_batch.max(int(v, "bulk_batch_bytes"));
        // Bulk needs room for at least one whole batch beyond both reserves.
        if reserves + 2 * batch > spool {
            v.problem(
                "spool_bytes",
                format!(
                    "{spool} cannot hold both reserves ({reserves}) plus two batches of max_batch_bytes / bulk_batch_bytes"
                ),
            );
        }
    }
    // Contradictions: a value that would be silently adjusted is refused instead.
    if let (Some(floor), Some(ceiling)) = (v.int("bulk_sampling_level"), v.int("bulk_sampling_max_level"))
        && floor > ceiling
    {
        v.problem(
            "bulk_sampling_max_level",
            format!("{ceiling} is below bulk_sampling_level ({floor}): the ceiling must be at least the floor"),
        );
    }
    if let (Some(batch), Some(bulk)) = (v.int("max_batch_bytes"), v.int("bulk_batch_bytes"))
        && bulk < batch
    {
        v.problem("bulk_batch_bytes", format!("{bulk} is below max_batch_bytes ({batch})"));
    }
    let psi = ringwatch_transport::psi::config_from(v);
    let psi_on = psi.is_some();
    let memory_budget = match v.text("memory_budget") {
        Some("cgroup") | None => true,
        Some("static") => false,
        Some(other) => {
            let other = other.to_owned();
            v.problem("memory_budget", format!("{other:?} is neither cgroup nor static"));
            false
        }
    };
    let mut throttle = Vec::new();
    for (field, tier) in
        [("throttle_p3", crate::core::throttle::Tier::P3), ("throttle_p2", crate::core::throttle::Tier::P2)]
    {
        let list = v.opt_text(field).map(str::to_owned).unwrap_or_default();
        for p in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if p.starts_with('/') {
                throttle.push((tier, PathBuf::from(p)));
            } else {
                v.problem(field, format!("{p:?} is not an absolute cgroup directory"));
            }
        }
    }
    if !throttle.is_empty() && !psi_on {
        v.problem("throttle_p3", "throttling background cgroups follows memory pressure: it needs psi = on".to_owned());
    }
    let http_listen = match v.opt_text("http_listen").map(str::to_owned) {
        None => None,
        Some(a) => match a.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                v.problem("http_listen", format!("{a:?} is not ip:port"));
                None
            }
        },
    };
    if v.has_problems() {
        return None;
    }
    let path = |n: &str| PathBuf::from(v.text(n).unwrap_or_default());
    let string = |n: &str| v.text(n).unwrap_or_default().to_owned();
    let as_usize = |n: &str| usize::try_from(int(v, n)).unwrap_or(usize::MAX);
    let mut order = AggregatorAddr::ordered(v.text("aggregator")?, v.text("node_name").unwrap_or_default())?;
    if order.is_empty() {
        return None;
    }
    let aggregator = order.remove(0);
    Some(ShipperConfig {
        aggregator,
        fallbacks: order,
        server_name: string("server_name"),
        node_name: string("node_name"),
        ca: path("ca"),
        cert: path("cert"),
        key: path("key"),
        tls_reload_interval_ms: int(v, "tls_reload_interval_ms"),
        source: source?,
        batcher: BatcherConfig {
            max_batch_bytes: as_usize("max_batch_bytes"),
            bulk_batch_bytes: as_usize("bulk_batch_bytes"),
            flush_interval_ns: int(v, "flush_interval_ms") * 1_000_000,
            ..BatcherConfig::default()
        },
        spool: SpoolConfig {
            cap_bytes: as_usize("spool_bytes"),
            p0_reserve_bytes: as_usize("p0_reserve_bytes"),
            p1_reserve_bytes: as_usize("p1_reserve_bytes"),
        },
        heartbeat_interval_ms: int(v, "heartbeat_interval_ms"),
        shutdown_deadline_ms: int(v, "shutdown_deadline_ms"),
        log_json: string("log_format") == "json",
        reader_cpus,
        sampling: crate::core::SamplingConfig {
            floor: u8::try_from(int(v, "bulk_sampling_level")).unwrap_or(0),
            ceiling: u8::try_from(int(v, "bulk_sampling_max_level")).unwrap_or(0),
            ..crate::core::SamplingConfig::default()
        },
        http_listen,
        psi,
        psi_bulk_share_pct: u8::try_from(int(v, "psi_bulk_share_pct")).unwrap_or(25),
        memory_budget: memory_budget.then(|| int(v, "memory_headroom_bytes")),
        throttle,
    })
}

/// Checks the files the configuration names, every problem at once: the CA, the node's
/// certificate and key (PEM, valid now, the key matching, the DNS SAN equal to
/// `node_name`), the source's capture file, scenario file or NCCL shim, and the PSI
/// triggers against this process's capabilities. Reads the filesystem (the rest of this
/// module does not).
#[must_use]
pub fn check_files(cfg: &ShipperConfig) -> Vec<ConfigError> {
    use ringwatch_transport::check;
    let mut problems = check::ca("ca", &cfg.ca);
    problems.extend(check::identity("cert", &cfg.cert, "key", &cfg.key, Some(&cfg.node_name)));
    let exists = |field: &'static str, p: &std::path::Path, problems: &mut Vec<(&'static str, String)>| {
        if let Err(e) = std::fs::metadata(p) {
            problems.push((field, format!("{}: {e}", p.display())));
        }
    };
    match &cfg.source {
        Source::Capture { path, .. } => exists("source", path, &mut problems),
        Source::Sim { scenario, .. } => {
            if loadgen_sim::builtin::builtin(scenario).is_none() {
                exists("source", std::path::Path::new(scenario), &mut problems);
            }
        }
        Source::Bpf(b) => {
            if let Some(shim) = &b.nccl_shim {
                exists("nccl_profiler_shim", shim, &mut problems);
            }
            if let Some(obj) = &b.object {
                exists("bpf_object", obj, &mut problems);
            }
        }
    }
    if let Some(problem) = cfg.psi.as_ref().and_then(ringwatch_transport::psi::check_config) {
        problems.push(problem);
    }
    let own = crate::throttle::own_cgroup_dir();
    for (tier, path) in &cfg.throttle {
        if let Err(e) = crate::throttle::check(*tier, path, own.as_deref()) {
            problems.push((if *tier == crate::core::throttle::Tier::P3 { "throttle_p3" } else { "throttle_p2" }, e));
        }
    }
    problems
        .into_iter()
        .map(|(field, message)| ConfigError { field: field.to_owned(), layer: Layer::Check, message })
        .collect()
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn a_dns_name_is_resolved_when_connecting_and_an_address_is_taken_as_is() {
        // A list of ingest shards: each node picks one, always the same, and the nodes spread.
        let list = "10.0.0.1:4433,10.0.0.2:4433,10.0.0.3:4433";
        let picks: std::collections::BTreeSet<String> =
            (0..64).map(|n| super::AggregatorAddr::pick(list, &format!("node-{n:02}")).unwrap().to_string()).collect();
        assert_eq!(picks.len(), 3, "every shard gets nodes: {picks:?}");
        assert_eq!(super::AggregatorAddr::pick(list, "node-07"), super::AggregatorAddr::pick(list, "node-07"));
        assert_eq!(super::AggregatorAddr::pick("localhost:4433", "node-07").unwrap().to_string(), "localhost:4433");
        let a = super::AggregatorAddr::parse("localhost:4433").unwrap();
        assert_eq!(a.to_string(), "localhost:4433");
        assert_eq!(a.resolve(true).await.unwrap(), "127.0.0.1:4433".parse().unwrap());
        let ip = super::AggregatorAddr::parse("[::1]:9").unwrap();
        assert!(ip.is_ipv6());
        assert_eq!(ip.resolve(true).await.unwrap(), "[::1]:9".parse().unwrap());
        let nowhere = super::AggregatorAddr::parse("no-such-host.invalid:4433").unwrap();
        assert!(nowhere.resolve(true).await.is_err());
    }

    use super::*;

    const GOOD: &str = r#"
aggregator = "127.0.0.1:4433"
node_name = "node-0"
ca = "ca.pem"
cert = "node-0.pem"
key = "node-0.key"
source = "sim:demo"
flush_interval_ms = 2
"#;

    #[test]
    fn a_good_file_validates_with_defaults_filled_in() {
        let mut i = Inputs::default();
        i.file(GOOD);
        let c = i.validate().unwrap();
        assert_eq!(c.aggregator, AggregatorAddr::Ip("127.0.0.1:4433".parse().unwrap()));
        assert_eq!(c.source, Source::Sim { scenario: "demo".into(), node: 0, bulk_scale_ppm: 1000, seed: None });
        assert_eq!(c.batcher.flush_interval_ns, 2_000_000);
        assert_eq!(c.batcher.max_batch_bytes, 65_536);
        assert_eq!(c.server_name, "aggregator");
    }

    #[test]
    fn the_documented_example_validates_and_names_every_field() {
        let text = include_str!("../../deploy/node-shipper.example.toml");
        let mut i = Inputs::default();
        i.file(text);
        i.validate().unwrap();
        for (name, _) in fields() {
            assert!(text.contains(&format!("\n{name} = ")), "{name} missing from the example");
        }
    }

    #[test]
    fn flags_beat_env_beat_file() {
        let mut i = Inputs::default();
        i.flag("flush_interval_ms", "7");
        i.file(GOOD);
        i.env([
            ("RINGWATCH_SHIPPER_FLUSH_INTERVAL_MS", "3"),
            ("RINGWATCH_SHIPPER_NODE_NAME", "node-9"),
            ("PATH", "/x"),
        ]);
        let c = i.validate().unwrap();
        assert_eq!(c.batcher.flush_interval_ns, 7_000_000, "flag wins, whatever the call order");
        assert_eq!(c.node_name, "node-9", "env beats file");
    }

    #[test]
    fn every_problem_is_reported_at_once_with_its_layer() {
        let mut i = Inputs::default();
        i.file(
            "aggregator = \"nowhere\"\nmax_batch_bytes = 12\nflush_intervall_ms = 5\nca = [1]\nsource = \"kafka:x\"\n",
        );
        i.env([("RINGWATCH_SHIPPER_HEARTBEAT_INTERVAL_MS", "soon"), ("RINGWATCH_SHIPPER_BOGUS", "1")]);
        i.flag("cert", "");
        let e = i.validate().unwrap_err();
        let got: Vec<(String, Layer)> = e.0.iter().map(|e| (e.field.clone(), e.layer)).collect();
        for want in [
            ("aggregator", Layer::File),
            ("max_batch_bytes", Layer::File),
            ("flush_intervall_ms", Layer::File),
            ("ca", Layer::File),
            ("source", Layer::File),
            ("heartbeat_interval_ms", Layer::Env),
            ("RINGWATCH_SHIPPER_BOGUS", Layer::Env),
            ("cert", Layer::Flag),
            ("node_name", Layer::Default),
            ("key", Layer::Default),
        ] {
            assert!(got.contains(&(want.0.to_string(), want.1)), "missing {want:?} in {e}");
        }
        assert_eq!(got.len(), 10, "{e}");
        assert!(e.to_string().starts_with("10 configuration problem(s):"));
    }

    #[test]
    fn the_bpf_source_validates_its_rings_cpus_and_shim() {
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("source", "bpf");
        i.flag("bulk_ring_bytes", "33554432");
        i.flag("reader_cpus", "2, 3");
        i.flag("xdp_interfaces", "eth0,eth1");
        i.flag("nccl_profiler_shim", "/opt/rw/libnccl-profiler-ringwatch.so");
        i.flag("heartbeat_interval_ms", "250");
        let c = i.validate().unwrap();
        let Source::Bpf(b) = &c.source else { panic!("{:?}", c.source) };
        assert_eq!((b.bulk_ring_bytes, b.p0_ring_bytes, b.counters_interval_ms), (32 << 20, 1 << 20, 250));
        assert_eq!(b.xdp_interfaces, vec!["eth0".to_owned(), "eth1".to_owned()]);
        assert_eq!(b.nccl_shim.as_deref(), Some(std::path::Path::new("/opt/rw/libnccl-profiler-ringwatch.so")));
        assert_eq!(b.object, None, "empty means the embedded object");
        assert_eq!(c.reader_cpus, vec![2, 3]);

        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("source", "bpf");
        i.flag("bulk_ring_bytes", "3000000");
        i.flag("reader_cpus", "2,x");
        i.flag("bulk_sampling_level", "16");
        let e = i.validate().unwrap_err();
        let fields: Vec<&str> = e.0.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["bulk_sampling_level", "bulk_ring_bytes", "reader_cpus"], "{e}");
        assert!(e.to_string().contains("power of two"), "{e}");
    }

    #[test]
    fn throttled_cgroups_need_absolute_paths_and_the_watcher() {
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("throttle_p3", "/sys/fs/cgroup/unified/cache, /sys/fs/cgroup/unified/prefetch");
        i.flag("throttle_p2", "/sys/fs/cgroup/unified/batch");
        i.flag("memory_budget", "static");
        let c = i.validate().unwrap();
        let tiers: Vec<_> = c.throttle.iter().map(|(t, p)| (t.name(), p.display().to_string())).collect();
        assert_eq!(
            tiers,
            [
                ("p3", "/sys/fs/cgroup/unified/cache".to_owned()),
                ("p3", "/sys/fs/cgroup/unified/prefetch".to_owned()),
                ("p2", "/sys/fs/cgroup/unified/batch".to_owned())
            ]
        );
        assert_eq!(c.memory_budget, None);
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("throttle_p2", "batch");
        i.flag("psi", "off");
        i.flag("memory_budget", "lots");
        let e = i.validate().unwrap_err();
        let fields: Vec<&str> = e.0.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["memory_budget", "throttle_p2"], "{e}");
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("throttle_p3", "/sys/fs/cgroup/unified/cache");
        i.flag("psi", "off");
        assert!(i.validate().unwrap_err().to_string().contains("needs psi = on"));
    }

    #[test]
    fn a_spool_too_small_for_its_reserves_is_refused_and_broken_toml_is_one_error() {
        let mut i = Inputs::default();
        i.file(GOOD);
        i.flag("spool_bytes", "1048576");
        i.flag("p0_reserve_bytes", "1048576");
        let e = i.validate().unwrap_err();
        assert_eq!(e.0.len(), 1, "{e}");
        assert_eq!(e.0[0].field, "spool_bytes");
        let mut i = Inputs::default();
        i.file("aggregator = ");
        assert_eq!(i.validate().unwrap_err().0[0].field, "(file)");
    }
}
