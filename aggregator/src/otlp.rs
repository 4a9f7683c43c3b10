//! OTLP export of the event stream (off by default; `otlp_export = "on"`): every event of
//! `GET /v1/events` — verdicts and revisions, recoveries, node and GPU health, liveness,
//! P0 loss, loss-rate bands — leaves as one OTLP log record (body: the event's JSON, as
//! the stream sends it; attributes: its kind, id, node and finality), posted as
//! OTLP/HTTP protobuf (`opentelemetry-proto`'s messages, hyper's HTTP/1.1 client).
//!
//! Configured by the standard variables: `OTEL_EXPORTER_OTLP_LOGS_ENDPOINT` (the whole
//! URL) or `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/logs` appended), `…_HEADERS`
//! (`k=v,k=v`, values percent-decoded), `…_TIMEOUT` (ms, default 10,000),
//! `…_PROTOCOL` (only `http/protobuf`), `OTEL_SERVICE_NAME` and
//! `OTEL_RESOURCE_ATTRIBUTES`. Plain `http://` only: an `https://` endpoint is refused
//! at start (send through a local collector).
//!
//! Bounded: the exporter reads the event log (bounded by `events_capacity`) like a
//! subscriber, at most [`MAX_BATCH`] records a request. While the collector is down or
//! slow it retries the same batch (backoff to 30 s) and the log keeps only its newest
//! events: what it evicts before export is counted dropped (`evicted`), as is a batch
//! the collector refuses for good (a 4xx other than 408/429: `rejected`). So every event
//! logged since start is exported, dropped with a reason, or pending.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::logs::v1::{LogRecord, ResourceLogs, ScopeLogs, SeverityNumber};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost::Message as _;

use crate::api::events::{Event, Kind};
use crate::events::Logged;
use crate::state::Shared;

/// Records per export request at most.
pub const MAX_BATCH: usize = 512;

/// Node names the exporter keeps (past it the cache starts afresh).
const MAX_NAMES: usize = 65_536;

/// Where and how to export (from the environment, [`OtlpConfig::from_env`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpConfig {
    /// `host:port` and the request path of the logs endpoint.
    pub authority: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
    pub service_name: String,
    pub resource: Vec<(String, String)>,
}

/// A variable that makes no sense, named with why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}: {why}")]
pub struct OtlpEnvError {
    pub var: &'static str,
    pub why: String,
}

fn err(var: &'static str, why: impl Into<String>) -> OtlpEnvError {
    OtlpEnvError { var, why: why.into() }
}

/// `k=v,k=v` (the W3C baggage form the OTLP variables use; values percent-decoded).
fn pairs(var: &'static str, text: &str) -> Result<Vec<(String, String)>, OtlpEnvError> {
    text.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').ok_or_else(|| err(var, format!("{p:?} is not key=value")))?;
            let v = percent_decode(v.trim()).ok_or_else(|| err(var, format!("{p:?}: bad percent-encoding")))?;
            Ok((k.trim().to_owned(), v))
        })
        .collect()
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl OtlpConfig {
    /// Reads the standard variables through `get` (`std::env::var` in the binary).
    ///
    /// # Errors
    /// No endpoint, an `https` or malformed one, another protocol, bad headers or
    /// timeout: each names its variable.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, OtlpEnvError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if let Some(p) = get("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL").or_else(|| get("OTEL_EXPORTER_OTLP_PROTOCOL"))
            && p.trim() != "http/protobuf"
        {
            return Err(err("OTEL_EXPORTER_OTLP_PROTOCOL", format!("{p:?}: only http/protobuf is exported")));
        }
        let (var, url) = match (get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"), get("OTEL_EXPORTER_OTLP_ENDPOINT")) {
            (Some(u), _) => ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", u),
            (None, Some(base)) => ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("{}/v1/logs", base.trim_end_matches('/'))),
            (None, None) => {
                return Err(err(
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "not set (nor OTEL_EXPORTER_OTLP_LOGS_ENDPOINT): otlp_export = \"on\" needs a collector",
                ));
            }
        };
        let uri: axum::http::Uri = url.trim().parse().map_err(|e| err(var, format!("{url:?}: {e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(err(
                    var,
                    format!("{url:?}: https is not supported; export to a local collector over http"),
                ));
            }
            _ => return Err(err(var, format!("{url:?}: expected http://host:port/path"))),
        }
        let host = uri.host().ok_or_else(|| err(var, format!("{url:?}: no host")))?;
        let authority = format!("{host}:{}", uri.port_u16().unwrap_or(80));
        let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
        let headers = match get("OTEL_EXPORTER_OTLP_LOGS_HEADERS").or_else(|| get("OTEL_EXPORTER_OTLP_HEADERS")) {
            Some(h) => pairs("OTEL_EXPORTER_OTLP_HEADERS", &h)?,
            None => Vec::new(),
        };
        let timeout =
            match get("OTEL_EXPORTER_OTLP_LOGS_TIMEOUT").or_else(|| get("OTEL_EXPORTER_OTLP_TIMEOUT")) {
                Some(t) => {
                    Duration::from_millis(t.trim().parse::<u64>().ok().filter(|&ms| ms > 0).ok_or_else(|| {
                        err("OTEL_EXPORTER_OTLP_TIMEOUT", format!("{t:?}: expected milliseconds > 0"))
                    })?)
                }
                None => Duration::from_secs(10),
            };
        let mut resource = match get("OTEL_RESOURCE_ATTRIBUTES") {
            Some(r) => pairs("OTEL_RESOURCE_ATTRIBUTES", &r)?,
            None => Vec::new(),
        };
        let service_name = get("OTEL_SERVICE_NAME")
            .or_else(|| resource.iter().find(|(k, _)| k == "service.name").map(|(_, v)| v.clone()))
            .unwrap_or_else(|| "ringwatch-aggregator".to_owned());
        resource.retain(|(k, _)| k != "service.name");
        Ok(Self { authority, path, headers, timeout, service_name, resource })
    }
}

/// What the exporter did (`/metrics`: `ringwatch_otlp_*`).
#[derive(Debug, Default)]
pub struct OtlpCounters {
    /// `otlp_export` is on (the task is expected to run).
    pub enabled: std::sync::atomic::AtomicBool,
    pub exported: AtomicU64,
    pub dropped_evicted: AtomicU64,
    pub dropped_rejected: AtomicU64,
    /// Requests that failed (sent again unless rejected), and those accepted.
    pub request_failures: AtomicU64,
    pub requests_ok: AtomicU64,
    /// The next event's sequence number to export (kept here so a restarted task goes
    /// on where the last one stopped).
    pub next: AtomicU64,
}

fn kv(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value) }), ..Default::default() }
}

fn text(key: &str, v: impl Into<String>) -> KeyValue {
    kv(key, any_value::Value::StringValue(v.into()))
}

/// Whether an event is a warning: a stuck rank (real degradation), a degraded node or
/// GPU, an unreachable node. Telemetry loss (`healthy_lossy`, P0 loss) is not.
fn warning(kind: Kind, outcome: Option<&ringwatch_core::verdict::Outcome>, json: &str) -> bool {
    match kind {
        Kind::Verdict | Kind::Revision => outcome == Some(&ringwatch_core::verdict::Outcome::Stuck),
        Kind::Health => json.contains("\"health\":\"degraded\""),
        Kind::Liveness => json.contains("\"liveness\":\"unreachable\""),
        Kind::Recovery | Kind::P0Loss | Kind::LossRate => false,
    }
}

/// One event as a log record (`now_unix_ns`: when it was read for export).
fn record(e: &Logged<Event>, id: &str, json: &str, node: Option<String>, now_unix_ns: u64) -> LogRecord {
    let kind = e.item.kind.name();
    let mut attributes = vec![text("ringwatch.event.kind", kind), text("ringwatch.event.id", id)];
    if let Some(n) = node {
        attributes.push(text("ringwatch.node", n));
    }
    if let Some(f) = e.item.is_final {
        attributes.push(kv("ringwatch.verdict.final", any_value::Value::BoolValue(f)));
    }
    let warn = warning(e.item.kind, e.item.verdict().map(|v| &v.outcome), json);
    let (severity, severity_text) = if warn { (SeverityNumber::Warn, "WARN") } else { (SeverityNumber::Info, "INFO") };
    LogRecord {
        time_unix_nano: now_unix_ns,
        observed_time_unix_nano: now_unix_ns,
        severity_number: severity as i32,
        severity_text: severity_text.to_owned(),
        body: Some(AnyValue { value: Some(any_value::Value::StringValue(json.to_owned())) }),
        attributes,
        event_name: format!("ringwatch.{kind}"),
        ..Default::default()
    }
}

fn request(cfg: &OtlpConfig, instance: u64, records: Vec<LogRecord>) -> ExportLogsServiceRequest {
    let mut attributes = vec![
        text("service.name", cfg.service_name.clone()),
        text("service.instance.id", format!("{instance:016x}")),
        text("service.version", env!("CARGO_PKG_VERSION")),
    ];
    attributes.extend(cfg.resource.iter().map(|(k, v)| text(k, v.clone())));
    ExportLogsServiceRequest {
        resource_logs: vec![ResourceLogs {
            resource: Some(Resource { attributes, ..Default::default() }),
            scope_logs: vec![ScopeLogs {
                scope: Some(InstrumentationScope {
                    name: "ringwatch".to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    ..Default::default()
                }),
                log_records: records,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// How a request ended.
enum Sent {
    /// Accepted; the collector refused this many of its records (OTLP partial success).
    Ok(u64),
    /// Worth sending again (connection refused, timeout, 408, 429, 5xx).
    Retry(String),
    /// Refused for good.
    Rejected(String),
}

async fn post(cfg: &OtlpConfig, body: Vec<u8>) -> Sent {
    use http_body_util::BodyExt as _;
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(&cfg.authority).await.map_err(|e| e.to_string())?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
        // Ends the connection's task however this attempt ends (a timeout included).
        struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let _driver = AbortOnDrop(tokio::spawn(conn));
        let mut req = axum::http::Request::post(&cfg.path)
            .header("host", &cfg.authority)
            .header("content-type", "application/x-protobuf");
        for (k, v) in &cfg.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req.body(http_body_util::Full::new(axum::body::Bytes::from(body))).map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        // The collector's answer (a partial-success message or an error), at most 64 KiB.
        let answer = http_body_util::Limited::new(resp.into_body(), 64 << 10)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok::<_, String>((status, answer))
    };
    let text = |a: &[u8]| String::from_utf8_lossy(a).into_owned();
    match tokio::time::timeout(cfg.timeout, attempt).await {
        Err(_) => Sent::Retry(format!("no answer within {:?}", cfg.timeout)),
        Ok(Err(e)) => Sent::Retry(e),
        Ok(Ok((200..=299, a))) => {
            // An empty body is a full success; a partial one names what was refused.
            let refused = ExportLogsServiceResponse::decode(a)
                .ok()
                .and_then(|r| r.partial_success)
                .map_or(0, |p| u64::try_from(p.rejected_log_records).unwrap_or(0));
            Sent::Ok(refused)
        }
        Ok(Ok((s @ (408 | 429 | 500..=599), a))) => Sent::Retry(format!("status {s}: {}", text(&a))),
        Ok(Ok((s, a))) => Sent::Rejected(format!("status {s}: {}", text(&a))),
    }
}

fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The exporter task: from the next event logged on, every event exported, dropped
/// with a reason, or pending. Returns only when the aggregator stops.
pub async fn run(s: Arc<Shared>, cfg: OtlpConfig) {
    let mut wake = s.events.wake.subscribe();
    // From the log's first event (1) on, or where a previous run of this task (restarted
    // after a panic) stopped: nothing logged is skipped uncounted.
    let mut next = s.otlp.next.load(Relaxed).max(1);
    let mut names: std::collections::BTreeMap<u64, String> = std::collections::BTreeMap::new();
    let mut backoff = Duration::from_millis(250);
    loop {
        if s.events.closing.load(Relaxed) {
            return;
        }
        let mut got = Vec::new();
        let read = s.events_log().read(next, MAX_BATCH, &mut got);
        if let Err(gap) = read {
            s.otlp.dropped_evicted.fetch_add(gap.missed.unwrap_or(0), Relaxed);
            next = gap.to.seq.saturating_add(1);
            s.otlp.next.store(next, Relaxed);
            continue;
        }
        if got.is_empty() {
            s.progress(&s.tasks.otlp);
            let _ = tokio::time::timeout(Duration::from_secs(1), wake.changed()).await;
            continue;
        }
        let now = unix_ns();
        let this = s.events_log().last_id();
        if names.len() > MAX_NAMES {
            // Names of nodes long gone: looked up again when needed.
            names.clear();
        }
        let records: Vec<LogRecord> = got
            .iter()
            .map(|e| {
                let node = e.item.node.and_then(|n| {
                    if !names.contains_key(&n.0)
                        && let Some(entry) = s.nodes.get(&n)
                    {
                        names.insert(n.0, entry.name.clone());
                    }
                    names.get(&n.0).cloned()
                });
                let id = crate::events::EventId { seq: e.seq, ..this }.to_string();
                let json = e.item.json(&|id| names.get(&id).cloned());
                record(e, &id, &json, node, now)
            })
            .collect();
        let n = records.len() as u64;
        let last = got.last().map_or(next, |e| e.seq);
        let body = request(&cfg, s.instance, records).encode_to_vec();
        loop {
            match post(&cfg, body.clone()).await {
                Sent::Ok(refused) => {
                    let refused = refused.min(n);
                    s.otlp.requests_ok.fetch_add(1, Relaxed);
                    s.otlp.exported.fetch_add(n - refused, Relaxed);
                    s.otlp.dropped_rejected.fetch_add(refused, Relaxed);
                    if refused > 0 {
                        tracing::warn!(records = n, refused, "the OTLP collector refused part of a batch: dropped");
                    }
                    backoff = Duration::from_millis(250);
                    break;
                }
                Sent::Rejected(why) => {
                    s.otlp.request_failures.fetch_add(1, Relaxed);
                    s.otlp.dropped_rejected.fetch_add(n, Relaxed);
                    tracing::warn!(records = n, %why, "the OTLP collector refused a batch of events: dropped");
                    break;
                }
                Sent::Retry(why) => {
                    s.otlp.request_failures.fetch_add(1, Relaxed);
                    tracing::warn!(records = n, %why, retry_in = ?backoff, "OTLP export failed; sending again");
                    s.progress(&s.tasks.otlp);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    if s.events.closing.load(Relaxed) {
                        return;
                    }
                }
            }
        }
        next = last.saturating_add(1);
        s.otlp.next.store(next, Relaxed);
        s.progress(&s.tasks.otlp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::BTreeMap<String, String> =
            vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn real_degradation_and_unreachable_nodes_are_warnings_telemetry_loss_is_not() {
        use ringwatch_core::verdict::Outcome;
        assert!(warning(Kind::Verdict, Some(&Outcome::Stuck), ""));
        assert!(warning(Kind::Revision, Some(&Outcome::Stuck), ""));
        assert!(!warning(Kind::Verdict, Some(&Outcome::Completed), ""));
        assert!(!warning(Kind::Verdict, Some(&Outcome::UnknownSilent), ""));
        assert!(warning(Kind::Health, None, r#"{"node":"n","health":"degraded","previous":"healthy"}"#));
        assert!(!warning(Kind::Health, None, r#"{"node":"n","health":"healthy_lossy","previous":"degraded"}"#));
        assert!(warning(Kind::Liveness, None, r#"{"node":"n","liveness":"unreachable","connected":false}"#));
        assert!(!warning(Kind::P0Loss, None, r#"{"node":"n","frames_lost":3}"#));
    }

    #[test]
    fn the_standard_variables_configure_the_exporter_and_bad_ones_are_named() {
        let c = OtlpConfig::from_env(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20x, x-team=ml"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_RESOURCE_ATTRIBUTES", "service.name=rw,deployment.environment=prod"),
        ]))
        .unwrap();
        assert_eq!((c.authority.as_str(), c.path.as_str()), ("collector:4318", "/v1/logs"));
        assert_eq!(c.headers, vec![("authorization".into(), "Bearer x".into()), ("x-team".into(), "ml".into())]);
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.service_name, "rw");
        assert_eq!(c.resource, vec![("deployment.environment".into(), "prod".into())]);
        let logs = OtlpConfig::from_env(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:1"),
            ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://127.0.0.1:9999/custom/logs"),
            ("OTEL_SERVICE_NAME", "agg"),
        ]))
        .unwrap();
        assert_eq!(
            (logs.authority.as_str(), logs.path.as_str(), logs.service_name.as_str()),
            ("127.0.0.1:9999", "/custom/logs", "agg")
        );
        for (vars, var) in [
            (&[][..], "OTEL_EXPORTER_OTLP_ENDPOINT"),
            (&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318")][..], "OTEL_EXPORTER_OTLP_ENDPOINT"),
            (&[("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4318")][..], "OTEL_EXPORTER_OTLP_ENDPOINT"),
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")][..],
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ),
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), ("OTEL_EXPORTER_OTLP_HEADERS", "novalue")][..],
                "OTEL_EXPORTER_OTLP_HEADERS",
            ),
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")][..],
                "OTEL_EXPORTER_OTLP_TIMEOUT",
            ),
        ] {
            let e = OtlpConfig::from_env(env(vars)).expect_err("refused");
            assert_eq!(e.var, var, "{e}");
        }
    }
}
