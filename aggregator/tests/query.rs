//! `aggregator query …` against a running `aggregator run` (real processes, a bearer
//! token, in-process shippers on the seed-case simulator): tables, `--json`, the event
//! log, `--follow`, and the documented exit codes.
//!
//! Named `net_*`: real timers, run alone.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use aggregator::api::dto::{CollectivesDto, SummaryDto};
use loadgen_sim::{SimOptions, builtin};
use ringwatch_tests::{TempDir, cert_set, stop, streams_settled, truth};

/// Kills and reaps the process (by its pid) when dropped.
struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn query(http: &str, token: Option<&std::path::Path>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_aggregator"));
    cmd.args(["query", "--http", http]);
    if let Some(t) = token {
        cmd.arg("--token-file").arg(t);
    }
    let out = cmd.args(args).output().expect("aggregator query runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_query_cli_tables_json_events_and_exit_codes() {
    let dir = TempDir::new("query-cli");
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let truth = truth(&s, options);
    let set = cert_set(dir.path(), s.cluster.nodes);
    let token = dir.path().join("token");
    std::fs::write(&token, "cli-token\n").expect("token");
    let mut child = Command::new(env!("CARGO_BIN_EXE_aggregator"))
        .args(["run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--expect-nodes", "8"])
        .arg("--certs")
        .arg(dir.path())
        .arg("--api-token-file")
        .arg(&token)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aggregator starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let quic: std::net::SocketAddr =
        lines.next().expect("quic").expect("utf-8").trim_start_matches("quic ").parse().expect("addr");
    let http = lines.next().expect("http").expect("utf-8").trim_start_matches("http http://").to_owned();
    let _proc = Proc(child);
    let addr: std::net::SocketAddr = http.parse().expect("addr");
    let t = Some(token.as_path());

    // Follow the stream from the start, in the background, as a person would.
    let mut follow = Command::new(env!("CARGO_BIN_EXE_aggregator"))
        .args(["query", "--http", &http, "--token-file"])
        .arg(&token)
        .args(["events", "--follow", "--json", "-q", "kind=health"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("follower");
    let follow_out = follow.stdout.take().expect("stdout");
    let follow = Proc(follow);

    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, quic, Instant::now(), |_, _, _| {});
    // Wait on state through the API (with the token).
    let started = Instant::now();
    loop {
        let (code, out, err) = query(&http, t, &["nodes", "--json"]);
        assert_eq!(code, 0, "{err}");
        let nodes: aggregator::api::dto::NodesDto = serde_json::from_str(&out).expect("json");
        if streams_settled(&nodes, &truth, |_| true) {
            break;
        }
        assert!(started.elapsed() < ringwatch_tests::STATE_LIMIT, "not settled: {nodes:?}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let (code, out, err) = query(&http, t, &["summary"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("nodes                    8 ("), "{out}");
    assert!(out.contains("healthy_lossy 1"), "{out}");
    let (_, json, _) = query(&http, t, &["summary", "--json"]);
    let sum: SummaryDto = serde_json::from_str(&json).expect("summary json");
    assert_eq!(sum.nodes, 8);

    let (code, out, _) = query(&http, t, &["nodes"]);
    assert_eq!(code, 0);
    assert_eq!(out.lines().filter(|l| l.starts_with("node-")).count(), 8, "{out}");
    assert!(out.lines().next().is_some_and(|h| h.starts_with("NODE") && h.contains("HEALTH")), "{out}");

    let (code, out, _) = query(&http, t, &["node", "node-03"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("node-03 (") && out.contains("healthy_lossy") && out.contains("kernel_ring_full"), "{out}");

    let (code, json, _) = query(&http, t, &["collectives", "--all", "--json", "-q", "limit=50"]);
    assert_eq!(code, 0);
    let all: CollectivesDto = serde_json::from_str(&json).expect("collectives json");
    assert!(all.collectives.len() > 50 && all.next_cursor.is_none(), "{} collectives", all.collectives.len());
    let id = &all.collectives[0].id;
    let (code, out, _) = query(&http, t, &["collective", id]);
    assert_eq!(code, 0);
    assert!(out.starts_with(id.as_str()) && out.contains("RANK") && out.contains("completed"), "{out}");

    let (code, out, _) = query(&http, t, &["loss", "-q", "class=p0"]);
    assert_eq!(code, 0);
    assert!(out.contains("p0") && out.contains("node-03"), "{out}");

    // The log, printed whole: one line per event, ids in order.
    let (_, body) = aggregator::api::client::get_with(addr, "/v1/ingest", &[("Authorization", "Bearer cli-token")])
        .await
        .expect("ingest");
    let ingest: aggregator::api::dto::IngestDto = serde_json::from_str(&body).expect("ingest json");
    let (code, out, err) = query(&http, t, &["events"]);
    assert_eq!(code, 0, "{err}");
    let newest: aggregator::events::EventId = ingest.events.last_id.parse().expect("id");
    let seqs: Vec<u64> = out
        .lines()
        .map(|l| l.split(' ').next().and_then(|id| id.parse::<aggregator::events::EventId>().ok()).expect("id").seq)
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "in order");
    assert!(seqs.last().is_some_and(|&l| l >= newest.seq), "up to the newest: {newest}");

    // The follower saw node 3 turn healthy_lossy, as JSON lines.
    let mut seen = false;
    for line in BufReader::new(follow_out).lines() {
        let v: serde_json::Value = serde_json::from_str(&line.expect("line")).expect("json line");
        assert_eq!(v["event"], "health", "{v}");
        if v["data"]["node"] == "node-03" && v["data"]["health"] == "healthy_lossy" {
            seen = true;
            break;
        }
    }
    assert!(seen);
    drop(follow);

    let _ = stop(shippers).await;

    // Exit codes.
    assert_eq!(query(&http, t, &["node", "nope"]).0, 3, "404");
    let (code, _, err) = query(&http, t, &["collectives", "-q", "state=done"]);
    assert_eq!(code, 2, "400");
    assert!(err.contains("state="), "{err}");
    let (code, _, err) = query(&http, None, &["summary"]);
    assert_eq!(code, 4, "401: {err}");
    assert_eq!(query("127.0.0.1:1", t, &["summary"]).0, 1, "unreachable");
    assert_eq!(query(&http, t, &["collectives", "-q", "oops"]).0, 2, "usage");
}

/// `aggregator query` against an aggregator serving its API over TLS with client
/// certificates (`http_tls_cert`, `http_client_ca`): `--tls-ca` with `--tls-cert` /
/// `--tls-key` answers; without the client certificate, or in plain HTTP, the query
/// fails with exit 1 (unreachable); TLS options without `--tls-ca` are a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_query_over_tls_with_a_client_certificate() {
    let dir = TempDir::new("query-tls");
    let set = cert_set(dir.path(), 1);
    let mut child = Command::new(env!("CARGO_BIN_EXE_aggregator"))
        .args(["run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--certs"])
        .arg(dir.path())
        .arg("--http-tls-cert")
        .arg(&set.server_cert)
        .arg("--http-tls-key")
        .arg(&set.server_key)
        .arg("--http-client-ca")
        .arg(&set.ca)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aggregator starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let _quic = lines.next().expect("quic").expect("utf-8");
    let line = lines.next().expect("http").expect("utf-8");
    let http = line.rsplit_once("://").map(|(_, a)| a.to_owned()).expect("address");
    let _proc = Proc(child);
    let node = aggregator::certs::node_name(0);
    let (cert, key) = (dir.path().join(format!("{node}.pem")), dir.path().join(format!("{node}.key")));
    let ca = set.ca.to_str().expect("utf-8").to_owned();
    let (cert, key) = (cert.to_str().expect("utf-8").to_owned(), key.to_str().expect("utf-8").to_owned());

    let (code, out, err) =
        query(&http, None, &["--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key, "summary", "--json"]);
    assert_eq!(code, 0, "{err}");
    let summary: SummaryDto = serde_json::from_str(&out).expect("summary JSON");
    println!("over mTLS: summary as of {}", summary.as_of.event_id);
    let (code, out, err) = query(&http, None, &["--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key, "nodes"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("NODE") && out.contains("as of aggregator"), "{out}");
    let (code, _, err) = query(&http, None, &["--tls-ca", &ca, "summary"]);
    assert_eq!(code, 1, "no client certificate: refused: {err}");
    let (code, _, err) = query(&http, None, &["summary"]);
    assert_eq!(code, 1, "plain HTTP on the TLS port: {err}");
    let (code, _, err) = query(&http, None, &["--tls-cert", &cert, "--tls-key", &key, "summary"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tls-ca"), "{err}");
}
