//! Careless operators and misbehaving clients (issue 22): a refused shipper backs off to
//! the cap instead of reconnecting in a loop, a node stays connected while any of its
//! connections is live, half-open HTTP clients cannot stop `/healthz`, the shipper's own
//! `/healthz` and `/readyz`, and snapshots failing in a row make the aggregator not ready.
//!
//! Named `net_*`: real timers, run alone.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use aggregator::api::dto::{IngestDto, NodesDto};
use aggregator::certs;
use aggregator::{Aggregator, AggregatorConfig};
use node_shipper::config::Source;
use node_shipper::driver::RunOptions;
use node_shipper::source::SyntheticSource;
use proto_flat::control::encode_resume;
use ringwatch_tests::{TempDir, cert_set, get_json, http_get, shipper_config, spawn_shipper, stop, wait_json};
use ringwatch_transport::http::HttpLimits;
use ringwatch_transport::{CONTROL_PREFACE, TlsFiles, Tuning};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A bound loopback listener for a shipper's `/healthz` and `/readyz`.
fn shipper_http() -> (SocketAddr, RunOptions) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.set_nonblocking(true).expect("nonblocking");
    let addr = l.local_addr().expect("addr");
    (addr, RunOptions { http: Some((Arc::new(l), HttpLimits::default())), ..RunOptions::default() })
}

/// A synthetic bulk source: enough batches per second to reach the aggregator's abuse
/// threshold within a few seconds when every one is refused.
fn synthetic() -> (Box<dyn node_shipper::source::Source>, Arc<AtomicBool>) {
    let halt = Arc::new(AtomicBool::new(false));
    (Box::new(SyntheticSource::new(50_000.0, 2, 100_000_000, Arc::clone(&halt))), halt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_refused_shippers_back_off_to_the_cap_instead_of_reconnecting_in_a_loop() {
    let dir = TempDir::new("refused");
    let set = cert_set(dir.path(), 2);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let placeholder = Source::Sim { scenario: "synthetic".into(), node: 0, bulk_scale_ppm: 0, seed: None };

    // 1. A certificate of another CA: with TLS 1.3 the shipper's side of the handshake
    //    completes before the aggregator refuses its certificate.
    let foreign = dir.path().join("foreign");
    certs::init_foreign(&foreign, &[certs::node_name(0)]).expect("foreign certs");
    let mut cfg = shipper_config(&set, agg.quic_addr, 0, placeholder.clone());
    (cfg.cert, cfg.key) = certs::CertSet::at(&foreign).node(&certs::node_name(0));
    let (http, opts) = shipper_http();
    let (source, halt_a) = synthetic();
    let foreign_shipper = spawn_shipper(cfg, source, opts);

    // 2. node-01's certificate shipping as node-00 (a node name that is not its SAN, which
    //    the binary refuses at start; in process nothing checks): every batch is nacked
    //    `node_mismatch`, and the aggregator closes the connection as abuse.
    let mut cfg = shipper_config(&set, agg.quic_addr, 1, placeholder);
    cfg.node_name = certs::node_name(0);
    cfg.batcher.bulk_batch_bytes = 16 << 10;
    cfg.batcher.max_batch_bytes = 16 << 10;
    cfg.batcher.flush_interval_ns = 1_000_000;
    let (source, halt_b) = synthetic();
    let mismatched = spawn_shipper(cfg, source, RunOptions::default());

    // The refused shipper's own listener says why it is not ready.
    let (code, body) = wait_json_status(http, "/readyz", 503, |b| b.contains("last refusal")).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("TLS"), "{body}");
    let (code, body) = http_get(http, "/healthz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"connections_refused\":"), "{body}");
    let (code, body) = http_get(http, "/healthz?verbose=1").await;
    assert_eq!(code, 400, "{body}");
    let (code, body) = http_get(http, "/metrics-not-yet").await;
    assert_eq!((code, body.contains("\"error\"")), (404, true), "{body}");

    // 30 s of refusals: the attempts are bounded by the backoff schedule (a refusal jumps
    // to the 5 s cap: one attempt per 2.5–5 s, at most 13 in 30 s; the bound 15).
    let window = Duration::from_secs(30);
    let started = Instant::now();
    tokio::time::sleep(window.saturating_sub(started.elapsed())).await;
    halt_a.store(true, std::sync::atomic::Ordering::Relaxed);
    halt_b.store(true, std::sync::atomic::Ordering::Relaxed);
    let reports = stop(vec![foreign_shipper, mismatched]).await;
    let ingest: IngestDto = get_json(agg.http_addr, "/v1/ingest").await;
    let nodes: NodesDto = get_json(agg.http_addr, "/v1/nodes").await;
    let node01 = nodes.nodes.iter().find(|n| n.name == certs::node_name(1)).map_or(0, |n| n.connections);
    println!(
        "foreign CA: {} attempts, {} refused ({:?}); aggregator handshake failures {}",
        reports[0].connect_attempts, reports[0].connections_refused, reports[0].last_refusal, ingest.handshake_failures
    );
    println!(
        "node_mismatch: {} attempts, {} refused ({:?}); aggregator: {} connections of node-01, {} abuse closes",
        reports[1].connect_attempts,
        reports[1].connections_refused,
        reports[1].last_refusal,
        node01,
        ingest.connections_closed_abuse
    );
    for r in &reports {
        assert!((2..=15).contains(&r.connect_attempts), "attempts in 30 s: {}", r.connect_attempts);
        assert!(r.connections_refused >= 1, "{r:?}");
    }
    assert!((2..=16).contains(&ingest.handshake_failures), "{}", ingest.handshake_failures);
    assert!(reports[0].last_refusal.as_deref().is_some_and(|w| w.contains("TLS")), "{:?}", reports[0].last_refusal);
    assert!(
        reports[1].last_refusal.as_deref().is_some_and(|w| w.contains("closed by the aggregator")),
        "{:?}",
        reports[1].last_refusal
    );
    assert!(ingest.connections_closed_abuse >= 1 && node01 <= 16, "{ingest:?}");
    agg.shutdown();
}

/// Polls `GET path` until its status is `code` and `done(body)` holds.
async fn wait_json_status(addr: SocketAddr, path: &str, code: u16, done: impl Fn(&str) -> bool) -> (u16, String) {
    let started = Instant::now();
    loop {
        let (c, body) = http_get(addr, path).await;
        if c == code && done(&body) {
            return (c, body);
        }
        assert!(started.elapsed() < ringwatch_tests::STATE_LIMIT, "{path}: last {c} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A raw connection of `node` holding its control stream open (preface and a `resume`).
async fn raw_connection(
    agg: SocketAddr,
    set: &certs::CertSet,
    node: &str,
    session: u64,
) -> (quinn::Endpoint, quinn::Connection, quinn::SendStream) {
    let (cert, key) = set.node(node);
    let tuning = Tuning::default();
    let client =
        ringwatch_transport::client_config(TlsFiles { ca: &set.ca, cert: &cert, key: &key }, &tuning).expect("client");
    let mut ep = tuning.endpoint(SocketAddr::from(([127, 0, 0, 1], 0)), None).expect("endpoint");
    ep.set_default_client_config(client);
    let conn = ep.connect(agg, "localhost").expect("connect").await.expect("handshake");
    let (mut send, _recv) = conn.open_bi().await.expect("control stream");
    let mut opening = CONTROL_PREFACE.to_vec();
    encode_resume(&mut opening, session, 1, 0, 0, &[], &[]).expect("resume");
    send.write_all(&opening).await.expect("preface");
    (ep, conn, send)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_a_node_is_connected_while_any_of_its_connections_is_live() {
    let dir = TempDir::new("live");
    let set = cert_set(dir.path(), 1);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let name = certs::node_name(0);
    let live = |n: &NodesDto| n.nodes.iter().find(|x| x.name == name).map(|x| (x.connected, x.live_connections));
    let (ep_a, a, _ctl_a) = raw_connection(agg.quic_addr, &set, &name, 11).await;
    let (ep_b, b, _ctl_b) = raw_connection(agg.quic_addr, &set, &name, 12).await;
    wait_json(agg.http_addr, "/v1/nodes", "two live connections", |n: &NodesDto| live(n) == Some((true, 2))).await;
    // The older connection closes (a shipper's old connection timing out after its new
    // one opened): the node stays connected.
    a.close(0u32.into(), b"old connection");
    let n =
        wait_json(agg.http_addr, "/v1/nodes", "one live connection", |n: &NodesDto| live(n).map(|l| l.1) == Some(1))
            .await;
    assert_eq!(live(&n), Some((true, 1)), "{n:?}");
    let h: aggregator::api::dto::HealthzDto = get_json(agg.http_addr, "/healthz").await;
    assert_eq!(h.nodes_connected, 1);
    b.close(0u32.into(), b"last connection");
    wait_json(agg.http_addr, "/v1/nodes", "no live connection", |n: &NodesDto| live(n) == Some((false, 0))).await;
    ep_a.close(0u32.into(), b"");
    ep_b.close(0u32.into(), b"");
    agg.shutdown();
}

/// Opens `n` connections that send part of a request head and nothing more.
async fn half_open(addr: SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ").await.expect("partial head");
        out.push(s);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_half_open_http_requests_neither_exhaust_files_nor_stop_healthz() {
    let dir = TempDir::new("loris");
    let set = cert_set(dir.path(), 1);
    let mut cfg = AggregatorConfig::local(&set);
    cfg.http_limits = HttpLimits { header_read_timeout: Duration::from_secs(3), max_connections: 1024 };
    let agg = Aggregator::start(cfg).await.expect("aggregator");

    // A shipper with its own listener: ready once its session is established.
    let placeholder = Source::Sim { scenario: "synthetic".into(), node: 0, bulk_scale_ppm: 0, seed: None };
    let (shipper_addr, opts) = shipper_http();
    let (source, halt) = synthetic();
    let shipper = spawn_shipper(shipper_config(&set, agg.quic_addr, 0, placeholder), source, opts);
    let (code, body) = wait_json_status(shipper_addr, "/readyz", 200, |b| b.contains("\"ready\":true")).await;
    assert_eq!(code, 200, "{body}");

    // 1,000 half-open requests: /healthz still answers while they are open.
    let slow = half_open(agg.http_addr, 1_000).await;
    let (code, body) = http_get(agg.http_addr, "/healthz").await;
    assert_eq!(code, 200, "/healthz with 1,000 half-open requests open: {body}");
    // Each is closed once the header-read timeout passes.
    let ingest = wait_json(agg.http_addr, "/v1/ingest", "the half-open requests timed out", |i: &IngestDto| {
        i.http.header_timeouts >= 1_000
    })
    .await;
    println!("after 1,000 half-open requests: {:?}", ingest.http);
    let mut closed = 0;
    for mut s in slow {
        let mut buf = [0u8; 256];
        // Closed by the server: EOF (or a reset) rather than a wait.
        if let Ok(Ok(_) | Err(_)) = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 1_000, "every half-open request was closed by the server");
    halt.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = stop(vec![shipper]).await;
    agg.shutdown();

    // The cap: past it a connection is answered 503 and closed at once, counted; once
    // the idle ones time out the API answers again.
    let mut cfg = AggregatorConfig::local(&set);
    cfg.http_limits = HttpLimits { header_read_timeout: Duration::from_secs(2), max_connections: 8 };
    let agg = Aggregator::start(cfg).await.expect("aggregator");
    let idle = half_open(agg.http_addr, 8).await;
    let mut extra = tokio::net::TcpStream::connect(agg.http_addr).await.expect("connect");
    let mut answer = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), extra.read_to_string(&mut answer)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "past the cap: {answer:?}");
    assert!(answer.contains("too many HTTP connections"), "{answer}");
    drop(idle);
    let (_, body) = wait_json_status(agg.http_addr, "/v1/ingest", 200, |_| true).await;
    let ingest: IngestDto = serde_json::from_str(&body).expect("/v1/ingest");
    assert!(ingest.http.refused_at_cap >= 1, "{:?}", ingest.http);
    agg.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_failing_snapshots_make_the_aggregator_not_ready_until_one_succeeds() {
    let dir = TempDir::new("snapfail");
    let set = cert_set(dir.path(), 1);
    let snaps = dir.path().join("snapshots");
    std::fs::create_dir(&snaps).expect("snapshot dir");
    let mut cfg = AggregatorConfig::local(&set);
    cfg.snapshot_path = Some(snaps.join("core.snap"));
    cfg.snapshot_interval_ms = 50;
    let agg = Aggregator::start(cfg).await.expect("aggregator");
    let written = |i: &IngestDto| i.snapshots_written >= 1;
    wait_json(agg.http_addr, "/v1/ingest", "a snapshot written", written).await;
    let (code, _) = http_get(agg.http_addr, "/readyz").await;
    assert_eq!(code, 200);

    // The directory goes away under the running aggregator (a volume unmounted, a
    // careless cleanup): snapshots fail, and after three in a row it says so.
    // Moved away in one step: removing it file by file races the writer (every 50 ms it
    // creates `core.snap.tmp` again, and the removal then finds the directory not empty).
    std::fs::rename(&snaps, dir.path().join("snapshots.gone")).expect("move the snapshot dir away");
    let (_, body) = wait_json_status(agg.http_addr, "/healthz", 503, |b| b.contains("snapshots failed")).await;
    let h: aggregator::api::dto::HealthzDto = serde_json::from_str(&body).expect("healthz json");
    assert_eq!(h.status, "degraded", "{body}");
    assert!(h.reasons.iter().any(|r| r.contains("not acked durable")), "{body}");
    let (code, body) = http_get(agg.http_addr, "/readyz").await;
    assert!(code == 503 && body.contains("snapshots failed"), "{code} {body}");

    // Back: the next snapshot succeeds and the aggregator is ready again.
    std::fs::create_dir(&snaps).expect("snapshot dir again");
    let (_, body) = wait_json_status(agg.http_addr, "/healthz", 200, |b| b.contains("\"status\":\"ok\"")).await;
    let i: IngestDto = get_json(agg.http_addr, "/v1/ingest").await;
    assert!(i.snapshot_failures >= 3, "{i:?} {body}");
    agg.shutdown();
}
