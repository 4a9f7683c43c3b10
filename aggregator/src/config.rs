//! The aggregator's configuration: flags, environment (`RINGWATCH_AGGREGATOR_<FIELD>`)
//! and a TOML file (`--config`), layered as the shipper's (`ringwatch_transport::config`:
//! flag > env > file > default, every problem at once with its layer, unknown keys
//! refused), parsed into [`AggregatorConfig`].
//!
//! Pure, but for [`check_files`], which reads what the configuration names.

use std::path::{Path, PathBuf};

pub use ringwatch_transport::config::{ConfigError, ConfigErrors, Layer};
use ringwatch_transport::config::{Field, Kind, Schema, Values};

use crate::AggregatorConfig;
use crate::certs::CertSet;

const ENV_PREFIX: &str = "RINGWATCH_AGGREGATOR_";

/// Every field (TOML key; flag `--name-with-dashes`; env upper case), kind, default, help.
const FIELDS: &[Field] = &[
    ("listen", Kind::Addr, Some("0.0.0.0:4433"), "QUIC listen address"),
    ("http", Kind::Addr, Some("127.0.0.1:8080"), "HTTP listen address (the API)"),
    (
        "certs",
        Kind::OptText,
        Some(""),
        "a directory written by `certs init` (ca.pem, aggregator.pem, aggregator.key); ca, cert and key override its files",
    ),
    ("ca", Kind::OptText, Some(""), "CA certificate (PEM) that signs node certificates"),
    ("cert", Kind::OptText, Some(""), "the server certificate (PEM)"),
    ("key", Kind::OptText, Some(""), "the server's private key (PEM)"),
    (
        "tls_reload_interval_ms",
        Kind::Int { min: 0, max: 3_600_000 },
        Some("10000"),
        "how often the TLS files (QUIC and HTTP) are looked at; a rotated certificate is used for new connections without a restart (0: never)",
    ),
    (
        "snapshot",
        Kind::OptText,
        Some(""),
        "snapshot the core to this file periodically and restore from it at start (empty: no snapshots); P0/P1 batches are then acked durable once a snapshot holds them",
    ),
    ("snapshot_interval_ms", Kind::Int { min: 10, max: 3_600_000 }, Some("10000"), "snapshot period"),
    (
        "dedup_window",
        Kind::Int { min: 1, max: 1_048_576 },
        Some("8192"),
        "per shipper session, holes (unsettled batch ranges) remembered before batches are refused",
    ),
    (
        "expect_nodes",
        Kind::Int { min: 0, max: 1_000_000 },
        Some("0"),
        "the cluster's node count (0: unknown): a rank that never reports is then final as indeterminate(uninstrumented) once every node's data is in",
    ),
    (
        "verdict_retention_s",
        Kind::Int { min: 1, max: 30 * 86_400 },
        Some("3600"),
        "an op's verdicts are forgotten this long after their last update",
    ),
    (
        "verdict_store_mb",
        Kind::Int { min: 1, max: 1_048_576 },
        Some("256"),
        "the verdict store's size cap (estimated); the least recently updated ops go first past it",
    ),
    (
        "final_memory_s",
        Kind::Int { min: 1, max: 86_400 },
        Some("600"),
        "how long a final op is remembered, so a late frame for it is counted and ignored",
    ),
    (
        "dead_after_s",
        Kind::Int { min: 0, max: 86_400 },
        Some("300"),
        "how long an unreachable node still gates finality before it is presumed dead",
    ),
    (
        "http_header_timeout_ms",
        Kind::Int { min: 100, max: 600_000 },
        Some("10000"),
        "an HTTP connection that has not sent a request head this long after it opened (or after its last answer) is closed",
    ),
    (
        "http_max_connections",
        Kind::Int { min: 1, max: 1_000_000 },
        Some("1024"),
        "HTTP connections served at once; more are answered 503 and closed",
    ),
    (
        "events_capacity",
        Kind::Int { min: 16, max: 1_000_000 },
        Some("10000"),
        "events GET /v1/events keeps for resuming subscribers (the oldest go first; a resume from one gets a gap event)",
    ),
    (
        "events_heartbeat_ms",
        Kind::Int { min: 100, max: 600_000 },
        Some("15000"),
        "a quiet event stream gets a heartbeat comment this often (proxies keep the connection)",
    ),
    (
        "events_max_subscribers",
        Kind::Int { min: 1, max: 100_000 },
        Some("256"),
        "event streams served at once; more are answered 503",
    ),
    (
        "correlated_share_pct",
        Kind::Int { min: 1, max: 100 },
        Some("25"),
        "/v1/summary says correlated_degradation when more than this share of the nodes turned degraded or healthy_lossy within correlated_window_s",
    ),
    ("correlated_window_s", Kind::Int { min: 1, max: 86_400 }, Some("60"), "the window of correlated_share_pct"),
    (
        "http_tls_cert",
        Kind::OptText,
        Some(""),
        "serve the HTTP API over TLS with this certificate (PEM; with http_tls_key); empty: plain HTTP",
    ),
    ("http_tls_key", Kind::OptText, Some(""), "the HTTP API's TLS private key (PEM)"),
    (
        "http_client_ca",
        Kind::OptText,
        Some(""),
        "with TLS: clients must present a certificate this CA signs (mTLS for scheduler clients); empty: none asked",
    ),
    (
        "api_token_file",
        Kind::OptText,
        Some(""),
        "a file holding the API's bearer token (re-read when it changes): requests without it get 401; /healthz and /readyz are exempt (empty: no token)",
    ),
    (
        "otlp_export",
        Kind::Text,
        Some("off"),
        "on: every event of GET /v1/events also leaves as an OTLP log record (OTLP/HTTP protobuf, to OTEL_EXPORTER_OTLP_LOGS_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; the standard OTEL_* variables configure it); off: nothing is exported",
    ),
    ("log_format", Kind::Text, Some("text"), "logs on stderr: text or json"),
    (
        "role",
        Kind::Text,
        Some("all"),
        "all: one process (no NATS); ingest, matcher or api: one shard role of a scaled-out aggregator over NATS JetStream (needs nats_url)",
    ),
    (
        "nats_url",
        Kind::OptText,
        Some(""),
        "the shard roles' NATS servers, comma-separated (nats://host:port,...); any of the JetStream cluster's",
    ),
    (
        "shard",
        Kind::Int { min: 0, max: 1023 },
        Some("0"),
        "this ingest or matcher shard's index (shippers list the ingest shards; matcher shard i owns the i-th hash range of communicators)",
    ),
    (
        "matcher_shards",
        Kind::Int { min: 1, max: 1024 },
        Some("1"),
        "how many matcher shards there are (every ingest and matcher shard must say the same)",
    ),
    ("nats_replicas", Kind::Int { min: 1, max: 5 }, Some("3"), "JetStream replicas of each stream the roles create"),
    (
        "nats_stream_mb",
        Kind::Int { min: 1, max: 1_048_576 },
        Some("1024"),
        "each records stream's and the verdict stream's size cap (the oldest messages go first; a matcher that far behind counts what it missed)",
    ),
    (
        "time_origin_unix_ms",
        Kind::Int { min: 0, max: 4_102_444_800_000 },
        Some("1767225600000"),
        "the shard roles' aggregator time zero (Unix ms; every role of one cluster must say the same): their clocks are the wall clock since it",
    ),
];

/// The field names with their help (for the binary's flags and the docs).
pub fn fields() -> impl Iterator<Item = (&'static str, &'static str)> {
    ringwatch_transport::config::all_fields::<Aggregator>().map(|&(name, _, _, help)| (name, help))
}

/// The aggregator's schema for [`Inputs`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Aggregator;

/// The raw inputs of the aggregator's configuration.
pub type Inputs = ringwatch_transport::config::Inputs<Aggregator>;

/// The validated configuration: what the service starts with, and the log format.
#[derive(Debug, Clone)]
pub struct Validated {
    pub service: AggregatorConfig,
    pub log_json: bool,
}

impl Schema for Aggregator {
    type Output = Validated;
    const ENV_PREFIX: &'static str = ENV_PREFIX;
    const FIELDS: &'static [Field] = FIELDS;
    const SHARED_FIELDS: &'static [Field] = ringwatch_transport::psi::CONFIG_FIELDS;

    fn build(v: &mut Values) -> Option<Validated> {
        let set = v.opt_text("certs").map(|d| CertSet::at(Path::new(d)));
        let pick = |v: &Values, field: &str, from_set: Option<&PathBuf>| {
            v.opt_text(field).map(PathBuf::from).or_else(|| from_set.cloned())
        };
        let ca = pick(v, "ca", set.as_ref().map(|s| &s.ca));
        let cert = pick(v, "cert", set.as_ref().map(|s| &s.server_cert));
        let key = pick(v, "key", set.as_ref().map(|s| &s.server_key));
        for (field, got) in [("ca", &ca), ("cert", &cert), ("key", &key)] {
            if got.is_none() {
                v.problem(field, "required: give certs = DIR, or ca, cert and key");
            }
        }
        if let Some(f) = v.text("log_format").map(str::to_owned)
            && f != "text"
            && f != "json"
        {
            v.problem("log_format", format!("{f:?} is neither text nor json"));
        }
        if let (Some(l), Some(h)) = (v.addr("listen"), v.addr("http"))
            && l.port() != 0
            && l == h
        {
            v.problem("http", format!("{h} is also the QUIC listen address"));
        }
        let psi = ringwatch_transport::psi::config_from(v);
        match (v.opt_text("http_tls_cert").is_some(), v.opt_text("http_tls_key").is_some()) {
            (true, false) => v.problem("http_tls_key", "required with http_tls_cert"),
            (false, true) => v.problem("http_tls_cert", "required with http_tls_key"),
            _ => {}
        }
        if v.opt_text("http_client_ca").is_some() && v.opt_text("http_tls_cert").is_none() {
            v.problem("http_client_ca", "client certificates need TLS: give http_tls_cert and http_tls_key");
        }
        let otlp = match v.text("otlp_export") {
            Some("off") => None,
            Some("on") => match crate::otlp::OtlpConfig::from_env(|k| std::env::var(k).ok()) {
                Ok(c) => Some(c),
                Err(e) => {
                    v.problem("otlp_export", e.to_string());
                    None
                }
            },
            other => {
                v.problem("otlp_export", format!("{other:?} is neither on nor off"));
                None
            }
        };
        let cluster = cluster_from(v);
        if v.has_problems() {
            return None;
        }
        let int = |n: &str| v.int(n).unwrap_or(0);
        let s_to_ns = |n: &str| int(n).saturating_mul(1_000_000_000);
        let (ca, cert, key) = (ca?, cert?, key?);
        let mut c = AggregatorConfig { ca, cert, key, ..AggregatorConfig::local(&CertSet::at(Path::new("."))) };
        c.listen = v.addr("listen")?;
        c.http = v.addr("http")?;
        c.snapshot_path = v.opt_text("snapshot").map(PathBuf::from);
        c.snapshot_interval_ms = int("snapshot_interval_ms");
        c.tls_reload_interval_ms = int("tls_reload_interval_ms");
        c.psi = psi;
        c.otlp = otlp;
        c.ingest.dedup.window = u32::try_from(int("dedup_window")).unwrap_or(u32::MAX);
        c.matcher.expected_nodes = u32::try_from(int("expect_nodes")).unwrap_or(u32::MAX);
        c.store.retention_ns = s_to_ns("verdict_retention_s");
        c.store.max_bytes = int("verdict_store_mb").saturating_mul(1 << 20);
        c.matcher.final_memory_ns = s_to_ns("final_memory_s");
        c.matcher.dead_after_ns = s_to_ns("dead_after_s");
        c.http_limits = ringwatch_transport::http::HttpLimits {
            header_read_timeout: std::time::Duration::from_millis(int("http_header_timeout_ms")),
            max_connections: usize::try_from(int("http_max_connections")).unwrap_or(usize::MAX),
        };
        c.events = crate::api::events::EventsConfig {
            capacity: usize::try_from(int("events_capacity")).unwrap_or(usize::MAX),
            heartbeat_ms: int("events_heartbeat_ms"),
            max_subscribers: int("events_max_subscribers"),
            ..c.events
        };
        c.api_token_file = v.opt_text("api_token_file").map(PathBuf::from);
        c.http_tls = match (v.opt_text("http_tls_cert"), v.opt_text("http_tls_key")) {
            (Some(cert), Some(key)) => Some(crate::HttpTls {
                cert: PathBuf::from(cert),
                key: PathBuf::from(key),
                client_ca: v.opt_text("http_client_ca").map(PathBuf::from),
            }),
            _ => None,
        };
        c.summary = crate::state::SummaryConfig {
            correlated_share_pct: int("correlated_share_pct"),
            correlated_window_ns: s_to_ns("correlated_window_s"),
        };
        c.cluster = cluster;
        if let Some(cl) = &mut c.cluster {
            cl.verdict_max_age = std::time::Duration::from_nanos(c.store.retention_ns);
        }
        Some(Validated { service: c, log_json: v.text("log_format") == Some("json") })
    }

    fn check_files(c: &Validated) -> Vec<ConfigError> {
        check_files(&c.service)
    }
}

/// The shard role, if any (problems reported on `v`).
fn cluster_from(v: &mut Values) -> Option<crate::cluster::ClusterConfig> {
    use crate::cluster::{ClusterConfig, ShardRole};
    let int = |v: &Values, n: &str| v.int(n).unwrap_or(0);
    let shard = u32::try_from(int(v, "shard")).unwrap_or(0);
    let shards = u32::try_from(int(v, "matcher_shards")).unwrap_or(1);
    let role = match v.text("role") {
        Some("all") => None,
        Some("ingest") => Some(ShardRole::Ingest { shard }),
        Some("matcher") => Some(ShardRole::Matcher { shard }),
        Some("api") => Some(ShardRole::Api),
        other => {
            v.problem("role", format!("{other:?} is none of all, ingest, matcher, api"));
            return None;
        }
    };
    let urls: Vec<String> = v
        .opt_text("nats_url")
        .map(|t| t.split(',').map(|u| u.trim().to_owned()).filter(|u| !u.is_empty()).collect())
        .unwrap_or_default();
    let Some(role) = role else {
        if !urls.is_empty() {
            v.problem("nats_url", "only the shard roles use NATS: give role = ingest, matcher or api");
        }
        return None;
    };
    if urls.is_empty() {
        v.problem("nats_url", "required by the shard roles");
    }
    for u in &urls {
        if u.parse::<async_nats::ServerAddr>().is_err() {
            v.problem("nats_url", format!("{u:?} is not a NATS server address (nats://host:port)"));
        }
    }
    if matches!(role, ShardRole::Ingest { .. }) && v.opt_text("snapshot").is_some() {
        v.problem(
            "snapshot",
            "an ingest shard's durability is the bus (a batch is acked durable once its records are in JetStream); a snapshot restored after a crash would miss batches acked since",
        );
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    if int(v, "time_origin_unix_ms") > now_ms {
        v.problem("time_origin_unix_ms", "in the future: the roles' clocks would all read 0 until then");
    }
    if matches!(role, ShardRole::Api) && v.opt_text("snapshot").is_some() {
        v.problem("snapshot", "the API role rebuilds its state from the streams at every start: no snapshot");
    }
    if matches!(role, ShardRole::Matcher { .. }) && shard >= shards {
        v.problem("shard", format!("matcher shard {shard} of {shards}: the index must be below matcher_shards"));
    }
    Some(ClusterConfig {
        role,
        nats: urls,
        matcher_shards: shards,
        replicas: usize::try_from(int(v, "nats_replicas")).unwrap_or(1),
        stream_max_bytes: i64::try_from(int(v, "nats_stream_mb").saturating_mul(1 << 20)).unwrap_or(i64::MAX),
        verdict_max_age: std::time::Duration::from_secs(3600),
        time_origin_unix_ms: int(v, "time_origin_unix_ms"),
    })
}

/// Checks the files the configuration names, every problem at once: the CA (PEM, CA
/// certificates, valid now), the server certificate and key (PEM, valid now, the key
/// matching), and the snapshot's directory (exists, writable: a snapshot that can never
/// be written must stop the start, not fail every 10 s while `/healthz` says ok).
#[must_use]
pub fn check_files(c: &AggregatorConfig) -> Vec<ConfigError> {
    use ringwatch_transport::check;
    let mut problems = check::ca("ca", &c.ca);
    problems.extend(check::identity("cert", &c.cert, "key", &c.key, None));
    if let Some(problem) = c.psi.as_ref().and_then(ringwatch_transport::psi::check_config) {
        problems.push(problem);
    }
    if let Some(t) = &c.http_tls {
        problems.extend(check::identity("http_tls_cert", &t.cert, "http_tls_key", &t.key, None));
        if let Some(ca) = &t.client_ca {
            problems.extend(check::ca("http_client_ca", ca));
        }
    }
    if let Some(token) = &c.api_token_file
        && let Err(e) = crate::api::auth::read_token(token)
    {
        problems.push(("api_token_file", e));
    }
    if let Some(snap) = &c.snapshot_path {
        let dir = snap.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let probe = dir.join(format!(".ringwatch-write-check-{}", std::process::id()));
        match std::fs::write(&probe, b"") {
            Ok(()) => {
                let _ = std::fs::remove_file(&probe);
            }
            Err(e) => problems.push(("snapshot", format!("directory {} is not writable: {e}", dir.display()))),
        }
        if snap.is_dir() {
            problems.push(("snapshot", format!("{} is a directory, not a file", snap.display())));
        }
    }
    problems
        .into_iter()
        .map(|(field, message)| ConfigError { field: field.to_owned(), layer: Layer::Check, message })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_cores_and_layers_apply() {
        let mut i = Inputs::default();
        i.file("certs = \"/etc/rw\"\nverdict_retention_s = 60\n");
        i.env([("RINGWATCH_AGGREGATOR_VERDICT_RETENTION_S", "120"), ("HOME", "/root")]);
        i.flag("http", "127.0.0.1:9000");
        let v = i.validate().unwrap();
        let c = v.service;
        assert_eq!(c.ca, PathBuf::from("/etc/rw/ca.pem"));
        assert_eq!(c.store.retention_ns, 120_000_000_000, "env beats file");
        assert_eq!(c.http.port(), 9000);
        let d = AggregatorConfig::local(&CertSet::at(Path::new(".")));
        assert_eq!(c.ingest.dedup.window, d.ingest.dedup.window);
        assert_eq!(c.store.max_bytes, d.store.max_bytes);
        assert_eq!(c.matcher.final_memory_ns, d.matcher.final_memory_ns);
        assert_eq!(c.matcher.dead_after_ns, d.matcher.dead_after_ns);
        assert_eq!(c.matcher.expected_nodes, d.matcher.expected_nodes);
        assert_eq!(c.snapshot_interval_ms, d.snapshot_interval_ms);
        assert_eq!(c.http_limits, d.http_limits);
        assert_eq!(c.events, d.events);
        assert_eq!(c.api_token_file, None);
        assert_eq!(c.http_tls, None);
        assert_eq!(c.summary, d.summary);
        assert!(!v.log_json);
    }

    #[test]
    fn the_documented_example_validates_and_names_every_field() {
        let text = include_str!("../../deploy/aggregator.example.toml");
        let mut i = Inputs::default();
        i.file(text);
        i.validate().unwrap();
        for (name, _) in fields() {
            assert!(text.contains(&format!("\n{name} = ")), "{name} missing from the example");
        }
    }

    #[test]
    fn shard_roles_need_nats_and_agree_on_what_they_are() {
        let base = "certs = \"/etc/rw\"\n";
        let ok = |extra: &str| {
            let mut i = Inputs::default();
            i.file(&format!("{base}{extra}"));
            i.validate()
        };
        let c = ok("role = \"matcher\"\nshard = 1\nmatcher_shards = 2\nnats_url = \"nats://a:4222, nats://b:4222\"\n")
            .unwrap()
            .service
            .cluster
            .unwrap();
        assert_eq!(c.role, crate::cluster::ShardRole::Matcher { shard: 1 });
        assert_eq!(c.nats, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(c.matcher_shards, 2);
        assert!(ok("").unwrap().service.cluster.is_none(), "all: one process");
        let problem = |extra: &str, field: &str, says: &str| {
            let e = ok(extra).unwrap_err();
            assert!(e.0.iter().any(|x| x.field == field && x.message.contains(says)), "{extra}: {e}");
        };
        problem("role = \"ingest\"\n", "nats_url", "required");
        problem("nats_url = \"nats://a:4222\"\n", "nats_url", "only the shard roles");
        problem("role = \"shard\"\n", "role", "none of");
        problem("role = \"matcher\"\nshard = 2\nmatcher_shards = 2\nnats_url = \"nats://a:1\"\n", "shard", "below");
        problem("role = \"ingest\"\nnats_url = \"nats://a:1\"\nsnapshot = \"/tmp/x.snap\"\n", "snapshot", "bus");
        problem("role = \"api\"\nnats_url = \"nats://a:1\"\nsnapshot = \"/tmp/x.snap\"\n", "snapshot", "rebuilds");
        problem(
            "role = \"api\"\nnats_url = \"nats://a:1\"\ntime_origin_unix_ms = 4000000000000\n",
            "time_origin_unix_ms",
            "future",
        );
    }

    #[test]
    fn every_problem_is_reported_with_its_layer() {
        let mut i = Inputs::default();
        i.file("listen = \"nowhere\"\nsnapshot_intervall_ms = 5\n");
        i.env([("RINGWATCH_AGGREGATOR_DEAD_AFTER_S", "soon"), ("RINGWATCH_AGGREGATOR_BOGUS", "1")]);
        i.flag("log_format", "yaml");
        let e = i.validate().unwrap_err();
        let got: Vec<(String, Layer)> = e.0.iter().map(|e| (e.field.clone(), e.layer)).collect();
        for want in [
            ("listen", Layer::File),
            ("snapshot_intervall_ms", Layer::File),
            ("dead_after_s", Layer::Env),
            ("RINGWATCH_AGGREGATOR_BOGUS", Layer::Env),
            ("log_format", Layer::Flag),
            ("ca", Layer::Default),
            ("cert", Layer::Default),
            ("key", Layer::Default),
        ] {
            assert!(got.contains(&(want.0.to_string(), want.1)), "missing {want:?} in {e}");
        }
        assert_eq!(got.len(), 8, "{e}");
    }

    #[test]
    fn otlp_export_is_on_or_off() {
        let mut i = Inputs::default();
        i.file("ca = \"a\"\ncert = \"b\"\nkey = \"c\"\notlp_export = \"maybe\"\n");
        let e = i.validate().unwrap_err();
        assert!(e.0.iter().any(|p| p.field == "otlp_export" && p.to_string().contains("neither on nor off")), "{e}");
    }
}
