//! PSI triggers against the anti-pattern they replace — polling RSS every 5 s against a
//! threshold — on the same real loads in a 64 MiB memory cgroup, observed side by side.
//! Prints a table: for each load and method, when pressure was first acted on (from the
//! load's start), how long the method said "under pressure", and the OOM kills.
//!
//! Loads: two page-cache thrashers (80 MiB file in 64 MiB: RSS stays at a few MiB, the
//! memory stall is real), and anonymous growth at 8 MiB/s with no swap (the OOM killer
//! comes before any stall). Needs root and cgroups (the test machines' hybrid hierarchy
//! or a unified one with the memory controller).
//!
//!     cargo run -p ringwatch-tests --example psi_vs_rss [-- SECONDS]

use std::path::Path;
use std::time::{Duration, Instant};

use ringwatch_faultproxy::cgroup::PressureCgroup;
use ringwatch_transport::pressure::Level;
use ringwatch_transport::psi::{self, PsiConfig};

const LIMIT: u64 = 64 << 20;
const POLL: Duration = Duration::from_secs(5);
/// The RSS baseline sheds above this share of the limit.
const RSS_THRESHOLD_PCT: u64 = 80;

#[derive(Debug, Default)]
struct Row {
    first_act: Option<Duration>,
    in_pressure: Duration,
}

fn rss_bytes(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .sum()
}

fn fmt(d: Option<Duration>) -> String {
    d.map_or_else(|| "never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()))
}

/// Runs `load` for `run` (or until the cgroup empties: the OOM killer), watching it with
/// a PSI watcher and a 5 s RSS poll at once.
async fn observe(name: &str, run: Duration, load: impl FnOnce(&mut PressureCgroup)) -> (Row, Row, u64, Duration) {
    let mut cg = PressureCgroup::new(name, LIMIT).unwrap_or_else(|e| panic!("cannot make a cgroup here: {e}"));
    let mut w = psi::start(&PsiConfig { file: Some(cg.pressure_file()), ..PsiConfig::default() }).expect("watcher");
    let start = Instant::now();
    load(&mut cg);
    let (mut psi_row, mut rss_row) = (Row::default(), Row::default());
    let mut next_poll = start + POLL;
    let mut rss_over = false;
    let mut last = start;
    let tick = Duration::from_millis(20);
    loop {
        tokio::time::sleep(tick).await;
        let now = Instant::now();
        let dt = now - last;
        last = now;
        if w.state.borrow_and_update().level != Level::Nominal {
            psi_row.first_act.get_or_insert(now - start);
            psi_row.in_pressure += dt;
        }
        if now >= next_poll {
            next_poll += POLL;
            rss_over = rss_bytes(&cg.pids()) * 100 >= LIMIT * RSS_THRESHOLD_PCT;
            if rss_over {
                rss_row.first_act.get_or_insert(now - start);
            }
        }
        if rss_over {
            rss_row.in_pressure += dt;
        }
        if now - start >= run || cg.pids().is_empty() {
            break;
        }
    }
    let took = start.elapsed();
    let kills = cg.oom_kills();
    w.task.abort();
    (psi_row, rss_row, kills, took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let secs: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(30);
    let run = Duration::from_secs(secs);
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let thrash = observe("cmp-thrash", run, |cg| cg.thrash(&target, 80 << 20, 2)).await;
    let anon = observe("cmp-anon", run, |cg| {
        // 4 MiB of touched anonymous memory every 0.5 s, kept.
        cg.spawn(r#"exec perl -e "my @a; for (1..1000) { push @a, q(x) x (4<<20); select(undef,undef,undef,0.5) }""#);
    })
    .await;
    println!();
    println!(
        "64 MiB memcg, {secs} s per load (or until the OOM killer emptied the cgroup); PSI: some/full 100 ms in 2 s windows, 3 quiet windows; RSS: VmRSS of the cgroup's processes polled every 5 s, shed at ≥ {RSS_THRESHOLD_PCT} % of the limit"
    );
    println!(
        "{:<34} {:<10} {:>16} {:>16} {:>10} {:>10}",
        "load", "method", "onset→first act", "in pressure", "OOM kills", "ran"
    );
    for (load, (p, r, kills, took)) in
        [("page-cache thrash (2 × cat 80 MiB)", thrash), ("anonymous growth 8 MiB/s", anon)]
    {
        for (method, row) in [("PSI", &p), ("RSS 5 s", &r)] {
            println!(
                "{load:<34} {method:<10} {:>16} {:>16} {kills:>10} {:>10}",
                fmt(row.first_act),
                format!("{:.1} s", row.in_pressure.as_secs_f64()),
                format!("{:.1} s", took.as_secs_f64())
            );
        }
    }
}
