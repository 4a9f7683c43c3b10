//! The shipper binary in a 64 MiB memory cgroup under real page-cache thrash (issue 23's
//! acceptance): its link to the aggregator policed by the fault proxy (slow, not cut, so
//! P0 still flows), bulk offered faster than the link so the spool fills. With the PSI
//! watcher and the cgroup-derived budget it sheds bulk as `psi_shed`, delivers every P0
//! frame and lives; with the watcher off and the static 256 MiB cap the OOM killer ends
//! it. And a cgroup too small for the spool's floor is refused at start (exit 2).
//!
//! Named `kernel_*`: real cgroups, run alone; `CI=true` makes them mandatory.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use aggregator::api::dto::NodesDto;
use aggregator::{Aggregator, AggregatorConfig, certs};
use ringwatch_faultproxy::cgroup::{PressureCgroup, skip};
use ringwatch_faultproxy::{Direction, FaultProxy, Faults};

const LIMIT: u64 = 64 << 20;
/// The policed link (client → aggregator), bytes per second.
const LINK_BYTES_PER_S: u64 = 1_000_000;
/// Bulk offered: 2,000 ppm of the scenario's 8 × 100 Gbps of 1500 B packets, 133 k
/// frames/s (≈ 6 MB/s of 48 B frames), six times the link.
const BULK_SCALE_PPM: &str = "2000";
const RUN: Duration = Duration::from_secs(60);

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_node-shipper"))
}

/// The built-in pipeline scenario, long enough for the run.
fn scenario(dir: &Path) -> PathBuf {
    let text =
        include_str!("../../loadgen/scenarios/pipeline-p2p.toml").replace("duration_ms = 6000", "duration_ms = 180000");
    let p = dir.join("pipeline-long.toml");
    std::fs::write(&p, text).expect("scenario");
    p
}

fn args(set: &certs::CertSet, to: SocketAddr, scenario: &Path, extra: &[(&str, &str)]) -> Vec<String> {
    let (cert, key) = set.node(&certs::node_name(0));
    let mut v = Vec::new();
    for (k, val) in [
        ("aggregator", to.to_string()),
        ("server-name", "localhost".into()),
        ("node-name", certs::node_name(0)),
        ("ca", set.ca.display().to_string()),
        ("cert", cert.display().to_string()),
        ("key", key.display().to_string()),
        ("source", format!("sim:{}", scenario.display())),
        ("sim-bulk-scale-ppm", BULK_SCALE_PPM.into()),
        ("heartbeat-interval-ms", "250".into()),
        ("http-listen", "127.0.0.1:0".into()),
        // The SIGTERM flush ends when the spool is empty; the deadline only bounds a
        // flush that cannot finish, and a loaded machine must not turn it into loss.
        ("shutdown-deadline-ms", "45000".into()),
    ] {
        v.push(format!("--{k}"));
        v.push(val);
    }
    for (k, val) in extra {
        v.push(format!("--{k}"));
        v.push((*val).to_owned());
    }
    v
}

/// The shipper's stdout: the `http http://…` line first, the report (JSON) last.
struct Shipper {
    child: Child,
    http: SocketAddr,
    lines: std::sync::mpsc::Receiver<String>,
}

fn start(cg: &PressureCgroup, args: &[String]) -> Shipper {
    let mut child =
        cg.command(&binary(), args).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("node-shipper");
    let out = child.stdout.take().expect("stdout");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let first = lines.recv_timeout(Duration::from_secs(60)).expect("the shipper's first line");
    let http = first.strip_prefix("http http://").and_then(|a| a.parse().ok()).unwrap_or_else(|| panic!("{first:?}"));
    Shipper { child, http, lines }
}

async fn healthz(addr: SocketAddr) -> Option<serde_json::Value> {
    let (_, body) = aggregator::api::client::get(addr, "/healthz").await.ok()?;
    serde_json::from_str(&body).ok()
}

/// A process's resident memory of one kind (`RssAnon`, `RssFile`), bytes; 0 once it is
/// gone.
fn rss(pid: u32, kind: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix(kind).and_then(|r| r.strip_prefix(':')))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .map_or(0, |kb: u64| kb << 10)
}

/// The `some` stall total of a pressure file, µs.
fn some_total(file: &Path) -> u64 {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|t| t.lines().next().and_then(|l| l.rsplit_once("total=")).and_then(|(_, n)| n.trim().parse().ok()))
        .unwrap_or(0)
}

struct Setup {
    dir: PathBuf,
    set: certs::CertSet,
    agg: Aggregator,
    proxy: FaultProxy,
    scenario: PathBuf,
    cg: PressureCgroup,
}

async fn setup(test: &str, tag: &str, limit: u64) -> Option<Setup> {
    let cg = match PressureCgroup::new(tag, limit) {
        Ok(c) => c,
        Err(reason) => {
            skip(test, &reason);
            return None;
        }
    };
    let dir = std::env::temp_dir().join(format!("rw-memcg-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let set = certs::init(&dir, &[certs::node_name(0)]).expect("certificates");
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], 0)), agg.quic_addr, 23).await.expect("proxy");
    proxy.set(Direction::ToServer, Faults { rate_limit_bytes_per_s: Some(LINK_BYTES_PER_S), ..Faults::default() });
    let scenario = scenario(&dir);
    Some(Setup { dir, set, agg, proxy, scenario, cg })
}

fn wait_exit(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Some(st) = child.try_wait().expect("wait") {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Loss of `cause` per class at the aggregator for node 0.
fn lost_at_aggregator(n: &NodesDto, class: &str, cause: &str) -> u64 {
    n.nodes
        .iter()
        .filter(|x| x.name == certs::node_name(0))
        .flat_map(|x| &x.streams)
        .filter(|s| s.class == class)
        .map(|s| s.lost.get(cause).copied().unwrap_or(0))
        .sum()
}

fn shed_at_aggregator(n: &NodesDto, class: &str) -> u64 {
    lost_at_aggregator(n, class, "psi_shed")
}

/// SIGTERM, the exit, and the report on stdout.
fn terminate(sh: &mut Shipper) -> serde_json::Value {
    let pid = sh.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let st = wait_exit(&mut sh.child, ringwatch_tests_limit()).expect("the shipper exits after SIGTERM");
    assert_eq!(st.code(), Some(0), "{st:?}");
    sh.lines.try_iter().filter_map(|l| serde_json::from_str(&l).ok()).last().expect("the report on stdout")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_shipper_in_a_64_mib_memcg_sheds_under_pressure_and_lives_while_static_caps_are_oom_killed() {
    let test = "kernel_shipper_in_a_64_mib_memcg_sheds_under_pressure_and_lives_while_static_caps_are_oom_killed";

    // 1. Watcher on, cgroup-derived budget.
    let Some(mut s) = setup(test, "accept", LIMIT).await else { return };
    let mut sh = start(&s.cg, &args(&s.set, s.proxy.addr, &s.scenario, &[("psi", "on"), ("memory-budget", "cgroup")]));
    let h = ringwatch_tests_wait(sh.http, "connected and nominal", |h| {
        h["connected"] == true && h["pressure"]["level"] == "nominal"
    })
    .await;
    println!("budget: {}", h["memory_budget"]);
    assert_eq!(h["memory_budget"]["limit_bytes"], LIMIT, "the limit read from the cgroup: {h}");
    let spool_cap = h["memory_budget"]["spool_cap_bytes"].as_u64().expect("spool cap");
    let headroom = h["memory_budget"]["headroom_bytes"].as_u64().expect("headroom");
    assert!(
        spool_cap + (24 << 20) <= LIMIT,
        "the spool's cap comes from the limit less headroom, not the 256 MiB default: {h}"
    );

    let pressure_file = s.cg.pressure_file();
    let base = some_total(&pressure_file);
    s.cg.thrash(Path::new(env!("CARGO_TARGET_TMPDIR")), 80 << 20, 2);
    let started = Instant::now();
    let mut first_stall = None;
    let mut shed_onset = None;
    let mut levels = Vec::new();
    let mut last_level = String::new();
    let mut frames_at_10s = None;
    let (mut peak_anon, mut peak_file) = (0, 0);
    while started.elapsed() < RUN {
        if let Some(st) = sh.child.try_wait().expect("wait") {
            panic!(
                "the shipper ended under pressure after {:?}: {st:?} (oom kills {}; its anonymous peak {peak_anon} bytes, file-backed resident peak {peak_file} bytes)",
                started.elapsed(),
                s.cg.oom_kills()
            );
        }
        peak_anon = peak_anon.max(rss(sh.child.id(), "RssAnon"));
        peak_file = peak_file.max(rss(sh.child.id(), "RssFile"));
        if first_stall.is_none() && some_total(&pressure_file) > base {
            first_stall = Some(started.elapsed());
        }
        if let Some(h) = healthz(sh.http).await {
            let level = h["pressure"]["level"].as_str().unwrap_or("?").to_owned();
            if level != last_level {
                levels.push((started.elapsed(), level.clone()));
                last_level.clone_from(&level);
            }
            if shed_onset.is_none() && level != "nominal" {
                shed_onset = Some(started.elapsed());
            }
            if frames_at_10s.is_none() && started.elapsed() >= Duration::from_secs(10) {
                frames_at_10s = h["frames_in"].as_u64().map(|f| (f, started.elapsed()));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first_stall = first_stall.expect("the thrash stalled the cgroup");
    let shed_onset = shed_onset.expect("the shipper entered pressure");
    println!("levels: {levels:?}");
    println!(
        "first stall {first_stall:?}, shedding engaged {shed_onset:?} ({:?} later); oom kills {}",
        shed_onset.saturating_sub(first_stall),
        s.cg.oom_kills()
    );
    // The trigger needs 100 ms of stall within its 2 s window; the test looks every 20 ms.
    assert!(
        shed_onset.saturating_sub(first_stall) <= Duration::from_secs(3),
        "shedding within one 2 s trigger window (+1 s for the test's look) of the first stall"
    );
    s.cg.stop_thrashers();
    s.proxy.heal();
    let report = terminate(&mut sh);
    let shed = report["frames_lost_psi_shed"].as_u64().expect("psi_shed");
    let p0_acked = report["frames_acked_by_lane"][0].as_u64().expect("p0 acked");
    if let Some((f, at)) = frames_at_10s {
        #[allow(clippy::cast_precision_loss, reason = "a rate")]
        let rate = f as f64 / at.as_secs_f64();
        println!("offered: {rate:.0} frames/s read in the first 10 s, link {LINK_BYTES_PER_S} B/s");
    }
    println!(
        "report: frames_in {}, psi_shed {shed} ({} batches), spool_full {}, p0 acked {p0_acked}, flushed {}",
        report["frames_in"], report["batches_shed_pressure"], report["frames_lost_spool_full"], report["flushed"]
    );
    assert!(shed > 0, "bulk was shed: {report}");
    println!(
        "P3: {}; heartbeats {} ({} coalesced under full)",
        report["p3"], report["heartbeats"], report["heartbeats_coalesced"]
    );
    assert!(report["p3"]["sheds"].as_u64() >= Some(1), "P3 shed on entering pressure: {report}");
    assert_eq!(report["flushed"], true, "{report}");
    assert_eq!(report["frames_lost_by_lane"][0], 0, "P0 never lost: {report}");
    assert_eq!(report["frames_in_by_lane"][0].as_u64(), Some(p0_acked), "every P0 frame acked: {report}");
    let http = s.agg.http_addr;
    // A batch shed after it was sent may still have been applied (its frames then count
    // received, not lost): the shipper counts those apart, and the aggregator's count lies
    // between the shed total less them and the total.
    let maybe_applied = report["frames_lost_psi_shed_after_send"].as_u64().expect("psi_shed after send");
    let counted = (shed - maybe_applied)..=shed;
    let n: NodesDto =
        wait_nodes_until(http, "the aggregator counted the shed", |n| counted.contains(&shed_at_aggregator(n, "p2")))
            .await;
    assert!(
        counted.contains(&shed_at_aggregator(&n, "p2")),
        "the aggregator counts what the shipper shed: {} of {shed} ({maybe_applied} after send)",
        shed_at_aggregator(&n, "p2")
    );
    let p0: Vec<_> = n.nodes.iter().flat_map(|x| &x.streams).filter(|x| x.class == "p0").collect();
    assert!(!p0.is_empty());
    assert!(p0.iter().all(|x| x.lost_total == 0), "no P0 loss at the aggregator: {p0:?}");
    assert_eq!(p0.iter().map(|x| x.received).sum::<u64>(), p0_acked, "every P0 frame arrived");
    // The thrashers run with oom_score_adj 1000: when the kernel's reclaim gives up under
    // their thrash (this v1 memcg has OOM-killed with 28 MB anonymous and 38 MB of clean
    // inactive cache charged), the OOM killer takes one of them, and the shipper lives
    // (asserted above). Printed: the kills, and the shipper's anonymous and file-backed peaks
    // (the OOM killer's score counts both).
    println!(
        "oom kills in the cgroup (thrashers): {}; shipper anonymous peak {peak_anon} bytes, file-backed resident peak {peak_file} bytes (limit {LIMIT}, headroom {headroom})",
        s.cg.oom_kills()
    );
    s.agg.shutdown();
    drop(s.cg);
    let _ = std::fs::remove_dir_all(&s.dir);

    // 2. The same run, watcher off, static 256 MiB cap: the OOM killer ends it.
    let Some(mut s) = setup(test, "baseline", LIMIT).await else { return };
    let mut sh = start(&s.cg, &args(&s.set, s.proxy.addr, &s.scenario, &[("psi", "off"), ("memory-budget", "static")]));
    s.cg.thrash(Path::new(env!("CARGO_TARGET_TMPDIR")), 80 << 20, 2);
    let started = Instant::now();
    let st = wait_exit(&mut sh.child, RUN);
    let kills = s.cg.oom_kills();
    println!("static caps, no watcher: {st:?} after {:?}, oom kills {kills}", started.elapsed());
    let st = st.expect("the static-cap shipper was OOM-killed within the run");
    assert_eq!(st.signal(), Some(9), "killed by SIGKILL (exit 137): {st:?}");
    assert!(kills >= 1, "by the OOM killer");
    s.agg.shutdown();
    drop(s.cg);
    let _ = std::fs::remove_dir_all(&s.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_a_cgroup_too_small_for_the_spool_floor_exits_2_naming_the_numbers() {
    let test = "kernel_a_cgroup_too_small_for_the_spool_floor_exits_2_naming_the_numbers";
    // 28 MiB less 24 MiB headroom, QUIC's 10 MiB send window and 8 MiB of buffer pools
    // leaves nothing; the floor is 16 MiB of reserves + 2 batches.
    let Some(s) = setup(test, "floor", 28 << 20).await else { return };
    let mut child =
        s.cg.command(&binary(), &args(&s.set, s.proxy.addr, &s.scenario, &[("psi", "off")]))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("node-shipper");
    let st = wait_exit(&mut child, ringwatch_tests_limit()).expect("exits");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err).expect("stderr");
    println!("{st:?}: {err}");
    assert_eq!(st.code(), Some(2), "{err}");
    for n in ["29360128", "(25165824)", "(10485760)", "(8388608)", "leaves 0 bytes", "17301504"] {
        assert!(err.contains(n), "{n} named in: {err}");
    }
    s.agg.shutdown();
    let _ = std::fs::remove_dir_all(&s.dir);
}

/// How long a state may take to come about on a loaded machine.
fn ringwatch_tests_limit() -> Duration {
    Duration::from_secs(60)
}

async fn ringwatch_tests_wait(
    addr: SocketAddr,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let until = Instant::now() + ringwatch_tests_limit();
    let mut last = None;
    while Instant::now() < until {
        if let Some(h) = healthz(addr).await {
            if ok(&h) {
                return h;
            }
            last = Some(h);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not reached; last /healthz {last:?}")
}

async fn wait_nodes_until(addr: SocketAddr, what: &str, ok: impl Fn(&NodesDto) -> bool) -> NodesDto {
    let until = Instant::now() + ringwatch_tests_limit();
    loop {
        let n: NodesDto = aggregator::api::client::get_json(addr, "/v1/nodes").await.expect("/v1/nodes");
        if ok(&n) || Instant::now() > until {
            if !ok(&n) {
                println!("{what}: not reached");
            }
            return n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Anonymous growth gives no stall signal before the OOM killer (no swap): what keeps
/// the shipper inside its cgroup then is the budget. Its spool grows against a policed
/// link with the watcher off and no other load; the derived cap holds it (spool
/// pressure raises bulk sampling — counted as sampled out — and anything over the cap is
/// evicted as `shipper_spool_full` loss, counted the same at the aggregator), and the
/// OOM killer never comes — where the static cap was killed in seconds (above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_without_a_stall_signal_the_cgroup_budget_alone_keeps_a_growing_spool_inside_the_limit() {
    let test = "kernel_without_a_stall_signal_the_cgroup_budget_alone_keeps_a_growing_spool_inside_the_limit";
    let Some(s) = setup(test, "budget", LIMIT).await else { return };
    let mut sh = start(&s.cg, &args(&s.set, s.proxy.addr, &s.scenario, &[("psi", "off"), ("memory-budget", "cgroup")]));
    // Full enough that sampling rose: half of bulk's share (the cap less both reserves).
    let h = ringwatch_tests_wait(sh.http, "the spool filling", |h| {
        let cap = h["memory_budget"]["spool_cap_bytes"].as_u64().unwrap_or(u64::MAX);
        h["spool_used_bytes"].as_u64().unwrap_or(0) * 2 >= cap.saturating_sub(16 << 20)
    })
    .await;
    let cap = h["memory_budget"]["spool_cap_bytes"].as_u64().expect("cap");
    // Twenty seconds of a spool held full.
    let until = Instant::now() + Duration::from_secs(20);
    let mut peak = 0;
    while Instant::now() < until {
        assert!(sh.child.try_wait().expect("wait").is_none(), "the shipper ended (oom kills {})", s.cg.oom_kills());
        if let Some(h) = healthz(sh.http).await {
            peak = peak.max(h["spool_used_bytes"].as_u64().unwrap_or(0));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.proxy.heal();
    let report = terminate(&mut sh);
    let evicted = report["frames_lost_spool_full"].as_u64().expect("spool_full");
    println!(
        "cap {cap}, peak spool {peak}, frames in {}, acked {}, spool_full {evicted}, oom kills {}",
        report["frames_in"],
        report["frames_acked"],
        s.cg.oom_kills()
    );
    assert!(peak <= cap, "the spool never passed its derived cap");
    assert_eq!(s.cg.oom_kills(), 0);
    // As with the shed above: frames evicted after their batch was sent may have arrived.
    let counted = (evicted - report["frames_lost_spool_full_after_send"].as_u64().expect("after send"))..=evicted;
    let n = wait_nodes_until(s.agg.http_addr, "the aggregator counted the eviction", |n| {
        counted.contains(&lost_at_aggregator(n, "p2", "shipper_spool_full"))
    })
    .await;
    assert!(counted.contains(&lost_at_aggregator(&n, "p2", "shipper_spool_full")), "{counted:?}");
    s.agg.shutdown();
    let _ = std::fs::remove_dir_all(&s.dir);
}
