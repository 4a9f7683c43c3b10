//! `/metrics` (issue 25) against the real tools: Debian's `promtool` lints both
//! binaries' output and unit-tests the alert rules; a real Prometheus scrapes an
//! aggregator and a shipper fed by the simulator, loads the rules, and answers PromQL
//! with the numbers `/v1/nodes` gives.
//!
//! Named `ext_*`: an external server, one at a time. Without `prometheus`/`promtool`
//! (Debian package `prometheus`, installed by `.ci/run`) they skip with the reason;
//! with `CI=true` they fail instead.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aggregator::Aggregator;
use aggregator::api::dto::NodesDto;
use loadgen_sim::{SimOptions, builtin};
use node_shipper::driver::RunOptions;
use ringwatch_tests::{
    STATE_LIMIT, TempDir, cert_set, get_json, http_get, repo_root, stop, streams_settled, truth, wait_nodes,
};
use ringwatch_transport::http::HttpLimits;

/// The tool, or the reason it is missing (a failure under `CI=true`).
fn tool(name: &str) -> Option<()> {
    if Command::new(name).arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some(());
    }
    let why = format!("{name} is not installed (Debian package prometheus)");
    assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {why}");
    println!("skipped: {why}");
    None
}

/// `promtool check metrics` on `text`: its exit status and what it said.
fn promtool_check_metrics(text: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write");
    let out = child.wait_with_output().expect("promtool ends");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn ext_the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    if tool("promtool").is_none() {
        return;
    }
    let dir = repo_root().join("deploy/prometheus");
    for args in [&["check", "rules", "ringwatch.rules.yml"][..], &["test", "rules", "ringwatch.rules.test.yml"][..]] {
        let out = Command::new("promtool").args(args).current_dir(&dir).output().expect("promtool runs");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        println!("promtool {}:\n{text}", args.join(" "));
        assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
        assert!(text.contains("SUCCESS"), "{text}");
    }
}

/// A free loopback port (bound, then released for Prometheus to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A PromQL instant query: each series' labels and value.
async fn query(prom: SocketAddr, q: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let (code, body) = http_get(prom, &format!("/api/v1/query?query={}", encode(q))).await;
    assert_eq!(code, 200, "{q}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    v["data"]["result"]
        .as_array()
        .expect("a vector")
        .iter()
        .map(|r| {
            let labels = r["metric"]
                .as_object()
                .expect("labels")
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            let value = r["value"][1].as_str().and_then(|s| s.parse().ok()).expect("a value");
            (labels, value)
        })
        .collect()
}

/// Polls `q` until `done` holds on its answer (at most [`STATE_LIMIT`]).
async fn wait_query(
    prom: SocketAddr,
    q: &str,
    done: impl Fn(&[(BTreeMap<String, String>, f64)]) -> bool,
) -> Vec<(BTreeMap<String, String>, f64)> {
    let started = Instant::now();
    loop {
        let got = query(prom, q).await;
        if done(&got) {
            println!("state reached, {q}: after {:?}", started.elapsed());
            return got;
        }
        assert!(started.elapsed() < STATE_LIMIT, "{q}: not reached within {STATE_LIMIT:?}; last answer {got:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Kills the Prometheus it holds (started by this test) when dropped.
struct Prometheus(std::process::Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_prometheus_scrapes_both_binaries_and_its_loss_by_cause_is_the_apis() {
    if tool("prometheus").is_none() || tool("promtool").is_none() {
        return;
    }
    let dir = TempDir::new("prometheus");
    // The seed case: node 3's P0 ring overflows (kernel_ring_full), nodes 5 and 7 misbehave.
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let truth = truth(&s, options);
    let set = cert_set(dir.path(), s.cluster.nodes);
    let agg = Aggregator::start(loadgen::cluster::aggregator_config(&set, &s, 1.0)).await.expect("aggregator starts");
    let http = agg.http_addr;
    // Node 3's shipper serves /metrics.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.set_nonblocking(true).expect("nonblocking");
    let shipper_http = l.local_addr().expect("addr");
    let listener = Arc::new(l);
    let shippers =
        ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, Instant::now(), |node, _, opts| {
            if node == 3 {
                *opts =
                    RunOptions { http: Some((Arc::clone(&listener), HttpLimits::default())), ..RunOptions::default() };
            }
        });
    let nodes: NodesDto = wait_nodes(http, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;

    // promtool lints both endpoints.
    for (what, addr) in [("aggregator", http), ("shipper", shipper_http)] {
        let (code, text) = http_get(addr, "/metrics").await;
        assert_eq!(code, 200, "{what}: {text}");
        let (ok, said) = promtool_check_metrics(&text);
        println!(
            "promtool check metrics, {what}: {} lines, {}",
            text.lines().count(),
            if said.is_empty() { "clean" } else { &said }
        );
        assert!(ok && said.trim().is_empty(), "{what}: promtool check metrics:\n{said}");
    }

    // A real Prometheus scrapes both every second and loads the alert rules.
    let port = free_port();
    let prom: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let rules = repo_root().join("deploy/prometheus/ringwatch.rules.yml");
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: ['{}']\n\
         scrape_configs:\n\
         \x20 - job_name: aggregator\n\
         \x20   static_configs: [{{targets: ['{http}']}}]\n\
         \x20 - job_name: shipper\n\
         \x20   static_configs: [{{targets: ['{shipper_http}']}}]\n",
        rules.display()
    );
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).expect("config");
    let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
    let mut prometheus = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .arg(format!("--web.listen-address={prom}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus starts"),
    );

    // Ready (it opens its port once its storage and rules are loaded).
    let started = Instant::now();
    loop {
        if let Ok((200, _)) = aggregator::api::client::get(prom, "/-/ready").await {
            break;
        }
        let exited = prometheus.0.try_wait().expect("wait");
        let log = std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
        assert!(exited.is_none(), "prometheus exited {exited:?}:\n{log}");
        assert!(started.elapsed() < STATE_LIMIT, "prometheus not ready:\n{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Both targets up.
    wait_query(prom, "up", |r| r.len() == 2 && r.iter().all(|(_, v)| *v == 1.0)).await;

    // Loss by node and cause: Prometheus' answer is /v1/nodes' (settled, so it holds).
    let mut want: BTreeMap<(String, String), f64> = BTreeMap::new();
    for n in &nodes.nodes {
        for st in &n.streams {
            for (cause, v) in &st.lost {
                *want.entry((n.name.clone(), cause.clone())).or_default() += *v as f64;
            }
        }
    }
    assert!(want.values().any(|v| *v > 0.0), "the seed case loses frames: {want:?}");
    let got = wait_query(prom, "sum by (node, cause) (ringwatch_node_frames_lost_total)", |r| {
        let got: BTreeMap<(String, String), f64> =
            r.iter().map(|(l, v)| ((l["node"].clone(), l["cause"].clone()), *v)).filter(|(_, v)| *v > 0.0).collect();
        let want: BTreeMap<(String, String), f64> =
            want.iter().filter(|(_, v)| **v > 0.0).map(|(k, v)| (k.clone(), *v)).collect();
        got == want
    })
    .await;
    println!("loss by node and cause (PromQL = /v1/nodes): {got:?}");

    // Received per node equals /v1/nodes too (the settled classes: P1 grows with every
    // heartbeat); node health as a state set.
    let received: BTreeMap<String, f64> = nodes
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.streams.iter().filter(|s| s.class != "p1").map(|s| s.received as f64).sum()))
        .collect();
    wait_query(prom, "sum by (node) (ringwatch_node_frames_received_total{class!=\"p1\"})", |r| {
        r.iter().map(|(l, v)| (l["node"].clone(), *v)).collect::<BTreeMap<_, _>>() == received
    })
    .await;
    let health = query(prom, "ringwatch_node_health == 1").await;
    let by_node: BTreeMap<String, String> =
        health.iter().map(|(l, _)| (l["node"].clone(), l["health"].clone())).collect();
    let now: NodesDto = get_json(http, "/v1/nodes").await;
    for n in &now.nodes {
        assert_eq!(by_node.get(&n.name), Some(&n.health), "{}: health", n.name);
    }

    // The shipper's own account: frames read, and its kernel counters per ring.
    let read = query(prom, "ringwatch_shipper_frames_read_total").await;
    assert!(read.first().is_some_and(|(_, v)| *v > 0.0), "{read:?}");
    let attempted = query(prom, "sum(ringwatch_kernel_events_attempted_total)").await;
    assert!(attempted.first().is_some_and(|(_, v)| *v > 0.0), "{attempted:?}");
    // Every stage of a delivered batch was timed (the simulated source stamps frames on
    // the node's clock, so `read` too), and the aggregator timed kernel → applied.
    let stages = wait_query(prom, "ringwatch_shipper_stage_seconds_count > 0", |r| r.len() == 4).await;
    let named: BTreeSet<&str> = stages.iter().filter_map(|(l, _)| l.get("stage").map(String::as_str)).collect();
    assert_eq!(named, BTreeSet::from(["read", "batch", "send", "ack"]), "{stages:?}");
    let p99 = wait_query(
        prom,
        "histogram_quantile(0.99, sum by (le) (ringwatch_end_to_end_latency_seconds_bucket{class=\"p0\"}))",
        |r| r.first().is_some_and(|(_, v)| v.is_finite() && *v > 0.0),
    )
    .await;
    println!("end-to-end p99 of P0 (kernel timestamp → applied): {:.4} s", p99[0].1);

    // Loss-aware figures: the timing coverage of final all-reduces (node 3's lost
    // completions leave some without complete timing), their durations, time to final;
    // each node's bulk coverage as /v1/nodes says it, and a bulk rate per node.
    let coverage = wait_query(prom, "ringwatch_collective_timing_coverage_ratio", |r| {
        r.iter().any(|(l, v)| l["op"] == "all_reduce" && *v > 0.0 && *v < 1.0)
    })
    .await;
    println!("timing coverage by op: {coverage:?}");
    wait_query(prom, "ringwatch_collective_duration_seconds_count{op=\"all_reduce\"} > 0", |r| r.len() == 1).await;
    // (Also `op="unknown"`: a tp all-gather all of whose ranks live on node 3 lost every
    // frame; decided from PROGRESS, its kind unknown.)
    wait_query(prom, "ringwatch_verdict_time_to_final_seconds_count > 0", |r| {
        let ops: BTreeSet<&str> = r.iter().filter_map(|(l, _)| l.get("op").map(String::as_str)).collect();
        ops.contains("all_reduce") && ops.contains("all_gather")
    })
    .await;
    let bulk: BTreeMap<String, f64> = nodes
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.bulk.as_ref().and_then(|b| b.coverage).unwrap_or(-1.0)))
        .collect();
    wait_query(prom, "ringwatch_node_bulk_coverage_ratio", |r| {
        r.iter().map(|(l, v)| (l["node"].clone(), *v)).collect::<BTreeMap<_, _>>() == bulk
    })
    .await;
    // Per interface, from the kernel's per-interface counters: every bulk event here is
    // a packet on one of eight interfaces, so in one scrape their packet rates add up to
    // the node's bulk event rate (both from the same heartbeats), whatever the node lost.
    let per_node = |r: &[(BTreeMap<String, String>, f64)]| -> BTreeMap<String, f64> {
        r.iter().map(|(l, v)| (l["node"].clone(), *v)).collect()
    };
    // (Waited for: until a node's interfaces have seen a full window, the bulk rate's
    // window may start one heartbeat earlier, at the epoch's first.)
    let sums = wait_query(
        prom,
        "sum by (node) (ringwatch_interface_packets_per_second) - on (node) ringwatch_node_bulk_events_per_second",
        |r| r.len() == nodes.nodes.len() && r.iter().all(|(_, d)| d.abs() < 1e-6),
    )
    .await;
    println!("interface packets/s minus bulk events/s per node: {:?}", per_node(&sums));
    let ifs = query(prom, "count by (node) (ringwatch_interface_bytes_per_second)").await;
    assert!(per_node(&ifs).values().all(|&n| n == 8.0) && ifs.len() == nodes.nodes.len(), "eight interfaces: {ifs:?}");
    let rates = query(prom, "sum by (node) (ringwatch_interface_packets_per_second)").await;
    println!("interface packets/s per node: {:?}", per_node(&rates));

    // The rules loaded and evaluate without errors against these series.
    let rules_text = std::fs::read_to_string(repo_root().join("deploy/prometheus/ringwatch.rules.yml")).expect("rules");
    let in_file = rules_text.lines().filter(|l| l.trim_start().starts_with("- alert:")).count();
    let started = Instant::now();
    loop {
        let (code, body) = http_get(prom, "/api/v1/rules").await;
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let rules: Vec<&serde_json::Value> = v["data"]["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .flat_map(|g| g["rules"].as_array().expect("rules"))
            .collect();
        let evaluated = rules.iter().all(|r| r["lastEvaluation"].as_str().is_some_and(|t| !t.starts_with("0001")));
        if rules.len() == in_file && evaluated {
            for r in &rules {
                assert_eq!(r["health"], "ok", "{r}");
            }
            println!("{in_file} rules loaded and evaluated, all healthy");
            break;
        }
        assert!(started.elapsed() < STATE_LIMIT, "rules not evaluated: {body}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let _ = stop(shippers).await;
    agg.shutdown();
}
