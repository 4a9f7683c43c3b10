//! The aggregator's live page (`GET /`) in a real headless Chromium, driven through
//! chromedriver (WebDriver, fantoccini over plain HTTP): an aggregator fed by the demo
//! scenario, the page read as an operator would — node 3's GPUs "telemetry loss —
//! healthy" and its P0 loss on its timeline, node 5 GPU 2 degraded with its `stuck` evidence, node 7 silent — then the
//! aggregator restarted on the same address and the page reconnecting, with a `gap`
//! notice; the same with the bearer token on (`/healthz` says the API wants one: the
//! page asks for it in its form, without a request answered 401).
//! No console errors. And a 64 × 8 fixture rendered (render time and DOM size printed).
//! Screenshots go to `<target>/tmp/page/`.
//!
//! Named `browser_*`: one at a time. Without `chromium` and `chromedriver` (Debian
//! packages `chromium`, `chromium-driver`, installed by `.ci/run`) they skip with the
//! reason; `CI=true` makes them mandatory.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aggregator::api::dto::NodesDto;
use aggregator::{Aggregator, AggregatorConfig, certs};
use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use loadgen_sim::{SimOptions, builtin};
use ringwatch_tests::{STATE_LIMIT, TempDir, cert_set, stop, truth, wait_nodes};
use serde_json::{Value, json};

/// The browser tools, or the reason they are missing (a failure under `CI=true`).
fn tools() -> bool {
    for (tool, package) in [("chromium", "chromium"), ("chromedriver", "chromium-driver")] {
        if !Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success()) {
            let why = format!("{tool} is not installed (Debian package {package})");
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {why}");
            println!("skipped: {why}");
            return false;
        }
    }
    true
}

/// chromedriver on a free loopback port (one a bind just found free: if another process
/// took it meanwhile, the session's connect fails with the reason), its process group
/// killed on drop.
struct Driver {
    child: Child,
    port: u16,
}

impl Driver {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
        let child = Command::new("chromedriver")
            .args([format!("--port={port}"), "--allowed-ips=127.0.0.1".into()])
            // Its own process group: the browsers it starts end with it (drop).
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver");
        Self { child, port }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The group: chromedriver and the Chromium processes it started (a test that
        // panicked did not close its session). Its pgid is its pid (process_group(0)).
        // `--`: without it procps' kill reads the negative pid as an option and signals
        // every process (kill(-1)).
        let pgid = self.child.id();
        if pgid > 1 {
            let _ = Command::new("kill").args(["-s", "KILL", "--", &format!("-{pgid}")]).status();
        }
        let _ = self.child.wait();
    }
}

/// A headless Chromium session with a fresh profile (in `profile`), its console kept.
async fn browser(driver: &Driver, profile: &std::path::Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1600,1100",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    caps.insert("goog:loggingPrefs".into(), json!({ "browser": "ALL" }));
    let until = Instant::now() + STATE_LIMIT;
    loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
        {
            Ok(c) => return c,
            // chromedriver may not be listening yet.
            Err(e) if Instant::now() < until => {
                println!("waiting for chromedriver: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("a browser session: {e}"),
        }
    }
}

/// chromedriver's `se/log`: the browser console since the last call.
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(&self, base: &url::Url, session: Option<&str>) -> Result<url::Url, url::ParseError> {
        base.join(&format!("session/{}/se/log", session.unwrap_or_default()))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        (http::Method::POST, Some(r#"{"type":"browser"}"#.into()))
    }
}

/// Console entries at SEVERE level, those of failed requests (`source` `network`: the
/// aggregator down during its restart) apart when `network_ok`.
async fn console_errors(c: &Client, network_ok: bool) -> Vec<Value> {
    let log = c.issue_cmd(BrowserLog).await.expect("the browser log");
    log.as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["level"] == "SEVERE" && !(network_ok && e["source"] == "network"))
        .collect()
}

/// The page's own view (`window.ringwatch.state()`).
async fn page_state(c: &Client) -> Value {
    c.execute("return window.ringwatch ? window.ringwatch.state() : null", vec![]).await.expect("state")
}

/// Polls `script` (returning JSON) until `ok` holds; panics with the last value.
async fn wait_page(c: &Client, what: &str, script: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let v = c.execute(script, vec![]).await.unwrap_or(Value::Null);
        if ok(&v) {
            println!("page: {what} after {:?}", started.elapsed());
            return v;
        }
        assert!(started.elapsed() < STATE_LIMIT, "page: {what} not reached; last {v}; state {}", page_state(c).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Clicks the element `css` names, finding it again if the live page re-rendered it between
/// the find and the click (a stale element reference), until [`STATE_LIMIT`].
async fn click(c: &Client, css: &str) {
    let started = Instant::now();
    loop {
        let e = c.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("{css}: {e}"));
        match e.click().await {
            Ok(()) => return,
            Err(err) if err.is_stale_element_reference() && started.elapsed() < STATE_LIMIT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("click {css}: {err:?}"),
        }
    }
}

/// The grid as the page shows it: per node, its cells' `data-health`, labels and titles.
const GRID: &str = "return [...document.querySelectorAll('#grid tr[data-node]')].map(r => ({
    node: r.dataset.node,
    cells: [...r.querySelectorAll('.cell')].map(c => ({ uuid: c.dataset.uuid, health: c.dataset.health, label: c.getAttribute('aria-label'), title: c.title })),
}))";

/// A node's GPU cells (those with a uuid: ranks no frame tied to a GPU share a `?` cell).
fn cells<'a>(grid: &'a Value, node: &str) -> Vec<&'a Value> {
    grid.as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["node"] == node)
        .flat_map(|r| r["cells"].as_array().into_iter().flatten())
        .filter(|c| c["uuid"].as_str().is_some_and(|u| u.bytes().any(|b| b != b'0')))
        .collect()
}

fn shots() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("page");
    std::fs::create_dir_all(&d).expect("screenshot dir");
    d
}

async fn screenshot(c: &Client, name: &str) {
    let png = c.screenshot().await.expect("screenshot");
    let path = shots().join(name);
    std::fs::write(&path, png).expect("write the screenshot");
    println!("screenshot: {}", path.display());
}

/// The demo, the page, a restart.
async fn demo(token: Option<&str>) {
    if !tools() {
        return;
    }
    let dir = TempDir::new(if token.is_some() { "page-token" } else { "page" });
    let s = builtin::builtin("demo").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let truth = truth(&s, options);
    let set = cert_set(dir.path(), s.cluster.nodes);
    let mut cfg: AggregatorConfig = loadgen::cluster::aggregator_config(&set, &s, 1.0);
    cfg.snapshot_path = Some(dir.path().join("core.snap"));
    cfg.events.heartbeat_ms = 1000;
    if let Some(t) = token {
        let f = dir.path().join("token");
        std::fs::write(&f, t).expect("token file");
        cfg.api_token_file = Some(f);
    }
    let agg = Aggregator::start(cfg.clone()).await.expect("aggregator starts");
    let http = agg.http_addr;
    // The page's files need no token (they hold no data); anything else under /ui/ is 404.
    for (path, code, has) in [
        ("/", 200, "<title>ringwatch</title>"),
        ("/ui/app.js", 200, "window.ringwatch"),
        ("/ui/app.css", 200, ".cell"),
        ("/ui/favicon.svg", 200, "<svg"),
    ] {
        let (got, body) = aggregator::api::client::get_with(http, path, &[]).await.expect("answer");
        assert_eq!((got, body.contains(has)), (code, true), "{path}: {body}");
    }
    let auth = token.map(|t| format!("Bearer {t}"));
    let with: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let (got, body) = aggregator::api::client::get_with(http, "/ui/other.js", &with).await.expect("answer");
    assert_eq!(got, 404, "{body}");
    // The restart binds the same address: the page reconnects to where it was loaded from.
    cfg.http = http;
    cfg.listen = agg.quic_addr;

    let driver = Driver::start();
    let c = browser(&driver, &dir.path().join("profile")).await;
    let url = format!("http://{http}/");
    c.goto(&url).await.expect("the page loads");
    if let Some(t) = token {
        // /healthz says the API wants a token: the page asks for it.
        wait_page(&c, "asking for the token", "return window.ringwatch.state()", |v| v["conn"] == "unauthorized").await;
        let input = c.find(Locator::Css("#token")).await.expect("the token field");
        input.send_keys(t).await.expect("type the token");
        c.find(Locator::Css("#auth button")).await.expect("the button").click().await.expect("submit");
    }
    wait_page(&c, "live", "return window.ringwatch.state()", |v| v["conn"] == "live").await;

    let api = |token: Option<&str>| token.map(|t| format!("Bearer {t}"));
    let bearer = api(token);
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, Instant::now(), |_, _, _| {});
    let n5g2 = truth.gpus.iter().find(|g| g.node == 5 && g.gpu == 2).expect("node 5 GPU 2").gpu_uuid.clone();
    let (n3, n5, n7) = (certs::node_name(3), certs::node_name(5), certs::node_name(7));
    // The API's answer first (the page can only show what the aggregator says).
    let settled = |n: &NodesDto| {
        let node = |name: &str| n.nodes.iter().find(|x| x.name == name);
        node(&n3).is_some_and(|x| x.health == "healthy_lossy")
            && node(&n5).is_some_and(|x| x.gpus.iter().any(|g| g.gpu_uuid == n5g2 && g.health == "degraded"))
            && node(&n7).is_some_and(|x| x.liveness == "silent" || x.liveness == "unreachable")
    };
    match &bearer {
        None => {
            wait_nodes(http, "the demo's faults judged", settled).await;
        }
        Some(b) => {
            let started = Instant::now();
            loop {
                let (code, body) =
                    aggregator::api::client::get_with(http, "/v1/nodes", &[("Authorization", b)]).await.expect("nodes");
                assert_eq!(code, 200, "{body}");
                if settled(&serde_json::from_str(&body).expect("nodes")) {
                    break;
                }
                assert!(started.elapsed() < STATE_LIMIT, "the demo's faults judged: {body}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    // The page: node 3 telemetry loss, node 5 GPU 2 degraded, node 7 silent.
    let grid = wait_page(&c, "the demo's faults shown", GRID, |g| {
        let c3 = cells(g, &n3);
        let c7 = cells(g, &n7);
        c3.len() == 4
            && c3.iter().all(|x| x["health"] == "healthy_lossy")
            && cells(g, &n5).iter().any(|x| x["uuid"] == n5g2.as_str() && x["health"] == "degraded")
            && c7.len() == 4
            && c7.iter().all(|x| x["health"] == "silent" || x["health"] == "unreachable")
    })
    .await;
    // Node 3's P0 loss reached the page as an event (on its timeline while it is in the
    // 60 s window).
    wait_page(&c, "node 3's P0 loss event", "return window.ringwatch.state().p0_events", |v| {
        v[n3.as_str()].as_u64() > Some(0)
    })
    .await;
    for x in cells(&grid, &n3) {
        assert_eq!(x["label"], "telemetry loss — healthy", "{x}");
        assert!(x["title"].as_str().is_some_and(|t| t.contains("telemetry loss — healthy")), "{x}");
    }
    for x in cells(&grid, &n7) {
        assert!(x["title"].as_str().is_some_and(|t| t.contains("nobody is blamed")), "{x}");
    }
    let healthy = grid
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["node"] != n3.as_str() && r["node"] != n5.as_str() && r["node"] != n7.as_str())
        .flat_map(|r| r["cells"].as_array().into_iter().flatten())
        .filter(|x| x["health"] != "healthy")
        .count();
    assert_eq!(healthy, 0, "the other nodes' GPUs healthy (their peers' waits blame nobody): {grid}");

    // Node 5 GPU 2: the reason and evidence on click.
    click(&c, &format!(".cell[data-uuid='{n5g2}']")).await;
    let detail = wait_page(
        &c,
        "node 5 GPU 2's evidence",
        "return document.getElementById('detail').hidden ? '' : document.getElementById('detail').innerText",
        |v| v.as_str().is_some_and(|t| t.contains("degraded") && t.contains("stuck")),
    )
    .await;
    let text = detail.as_str().unwrap_or_default();
    println!("detail: {}", text.lines().find(|l| l.contains("stuck")).unwrap_or_default());
    // The latest collectives (those of the latest verdict events), with per-rank outcomes.
    wait_page(&c, "the latest collectives", "return window.ringwatch.state().collectives", |v| {
        v.as_u64().is_some_and(|n| n > 0)
    })
    .await;
    let ranks = c
        .execute("return document.querySelectorAll('#colls tbody tr .o').length", vec![])
        .await
        .expect("outcome chips");
    assert!(ranks.as_u64() > Some(0), "per-rank outcomes shown");
    screenshot(&c, if token.is_some() { "demo-token.png" } else { "demo.png" }).await;
    let errors = console_errors(&c, false).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");
    let st = page_state(&c).await;
    assert_eq!(st["errors"], json!([]), "{st}");

    // The aggregator restarts on the same addresses (the shippers reconnect): the page
    // reconnects, says that what happened in between is not in its stream (a gap), and
    // shows the restored state.
    assert!(agg.shutdown_with_snapshot().await, "final snapshot");
    drop(agg);
    let before = page_state(&c).await;
    wait_page(&c, "noticing the aggregator gone", "return window.ringwatch.state()", |v| v["conn"] == "reconnecting")
        .await;
    let agg = Aggregator::start(cfg).await.expect("the aggregator restarts on the same address");
    assert_eq!(agg.http_addr, http);
    let after = wait_page(&c, "reconnected after the restart", "return window.ringwatch.state()", |v| {
        v["conn"] == "live" && v["gaps"].as_u64() > before["gaps"].as_u64()
    })
    .await;
    println!("before the restart {before}; after {after}");
    let notice = c.find(Locator::Css("#notices .notice")).await.expect("a notice").text().await.expect("text");
    assert!(notice.contains("restarted"), "{notice}");
    wait_page(&c, "the restored state, the shippers back", GRID, |g| {
        let c3 = cells(g, &n3);
        c3.len() == 4 && c3.iter().all(|x| x["health"] == "healthy_lossy")
    })
    .await;
    let _ = stop(shippers).await;
    let errors = console_errors(&c, true).await;
    assert!(errors.is_empty(), "console errors (failed requests while the aggregator was down apart): {errors:?}");
    assert_eq!(page_state(&c).await["errors"], json!([]));
    c.close().await.expect("close the browser");
    agg.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_the_demo_reads_right_and_the_page_reconnects_after_a_restart() {
    demo(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_with_the_bearer_token_on_the_page_asks_for_it_and_works_the_same() {
    demo(Some("page-test-token")).await;
}

/// 64 nodes × 8 GPUs of every health, with streams, P0 loss intervals and pressure.
fn fixture(now_ms: u64) -> Value {
    let healths = ["healthy", "healthy", "healthy", "healthy_lossy", "suspect", "degraded"];
    let nodes: Vec<Value> = (0..64u32)
        .map(|n| {
            let liveness = if n % 16 == 15 { "silent" } else { "fresh" };
            let gpus: Vec<Value> = (0..8u32)
                .map(|g| {
                    json!({ "gpu_uuid": format!("{:016x}{:016x}", n, g), "health": healths[((n * 8 + g) % 6) as usize], "owners": [] })
                })
                .collect();
            json!({
                "name": certs::node_name(n), "node_id": format!("{n:016x}"), "connected": liveness == "fresh",
                "live_connections": 1, "liveness": liveness, "health": "healthy", "connections": 1,
                "watermark_bulk_node_ns": 0, "knowledge_gaps": [{ "from_ms": now_ms - 20_000 - u64::from(n) * 100, "to_ms": now_ms - 19_000 }],
                "gpus": gpus, "awaiting_first_batch": false, "prior_instance": 0,
                "shipper": { "pressure": if n % 8 == 0 { "some" } else { "nominal" }, "shed_tier": if n % 8 == 0 { 2 } else { 0 }, "sampling_level": 0, "spool_bytes": 1 << 20, "spool_cap_bytes": 64 << 20, "age_ms": 100 },
                "bulk": { "events_per_second": 1.0e6, "window_s": 5.0, "attempted": 1000, "sampled_out": 0, "received": 990, "lost": 10, "coverage": 0.99, "lost_share": 0.01, "sampled_share": 0.0, "interfaces": [], "interfaces_turned_away": 0 },
                "streams": (0..4).map(|c| json!({ "class": format!("p{c}"), "received": 1000, "lost_total": c, "lost": {} })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "api_version": "v1", "as_of": { "aggregator_epoch": 1, "aggregator_ms": now_ms, "nodes_with_watermark": 64, "event_id": "" }, "nodes": nodes })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_a_64_by_8_fixture_renders() {
    if !tools() {
        return;
    }
    let dir = TempDir::new("page-fixture");
    let set = cert_set(dir.path(), 1);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator starts");
    let driver = Driver::start();
    let c = browser(&driver, &dir.path().join("profile")).await;
    c.goto(&format!("http://{}/", agg.http_addr)).await.expect("the page loads");
    wait_page(&c, "live", "return window.ringwatch.state()", |v| v["conn"] == "live").await;
    let mut renders = Vec::new();
    for _ in 0..5 {
        let r =
            c.execute("return window.ringwatch.fixture(arguments[0])", vec![fixture(600_000)]).await.expect("render");
        renders.push(r);
    }
    let ms: Vec<f64> = renders.iter().filter_map(|r| r["ms"].as_f64()).collect();
    let last = renders.last().expect("renders");
    println!(
        "64 × 8 fixture: render {:.1} ms first, {:.1} ms median of 5; {} DOM nodes, {} GPU cells",
        ms[0],
        {
            let mut m = ms.clone();
            m.sort_by(f64::total_cmp);
            m[m.len() / 2]
        },
        last["dom_nodes"],
        last["cells"]
    );
    assert_eq!(last["cells"], 512, "{last}");
    let rows = c.execute("return document.querySelectorAll('#grid tr[data-node]').length", vec![]).await.expect("rows");
    assert_eq!(rows, 64);
    let silent = c
        .execute("return document.querySelectorAll('#grid .cell[data-health=silent]').length", vec![])
        .await
        .expect("q");
    assert_eq!(silent, 4 * 8, "the silent nodes' GPUs read silent");
    screenshot(&c, "fixture-64x8.png").await;
    let errors = console_errors(&c, false).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");
    assert_eq!(page_state(&c).await["errors"], json!([]));
    c.close().await.expect("close");
    agg.shutdown();
}
