//! What `GET /v1/events` subscribers cost ingest: the seed-case cluster (8 in-process
//! shippers on simulated sources, real QUIC + mTLS into one in-process aggregator) with
//! its bulk rate raised until this machine is saturated, run once per subscriber count;
//! every subscriber follows the whole run and reads every event (as `curl -N` would: raw
//! bytes, events counted by their `id:` lines, so the harness's own parsing does not
//! weigh on the figure — it shares the machine). The aggregator runs on a runtime of its
//! own (threads `agg-rt`), as on its own machine. Prints a table: frames the aggregator
//! received per wall second from the start until every stream settled and per CPU-second
//! of its runtime, events, events delivered, gaps, and both against the runs without
//! subscribers.
//!
//!     cargo run -p ringwatch-tests --profile ci --example sse_subscribers [-- BULK_SCALE [COUNTS]]
//!
//! BULK_SCALE defaults to 0.02 (of the scenario's line rate), COUNTS to `0,100,0,100`
//! (alternating, so drift of the machine shows). `.ci/long` runs it at 0.05, three pairs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use aggregator::Aggregator;
use aggregator::api::dto::IngestDto;
use loadgen_sim::{SimOptions, builtin};
use ringwatch_tests::{TempDir, cert_set, get_json, stop, streams_settled, truth, wait_nodes};

/// CPU seconds used so far by this process's threads named `prefix…`.
fn threads_cpu_s(prefix: &str) -> f64 {
    let mut ticks = 0u64;
    for t in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        // Fields 14 and 15 of stat (utime, stime): the 12th and 13th from the state field.
        let field = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
        ticks += field(11) + field(12);
    }
    ticks as f64 / 100.0
}

struct Row {
    subscribers: usize,
    wall_s: f64,
    cpu_s: f64,
    frames: u64,
    verdict_events: u64,
    delivered: u64,
    gaps: u64,
}

async fn one(subscribers: usize, bulk_scale: f64) -> Row {
    let dir = TempDir::new("sse-bench");
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale, seed: None };
    let truth = truth(&s, options);
    let set = cert_set(dir.path(), s.cluster.nodes);
    let mut cfg = loadgen::cluster::aggregator_config(&set, &s, 1.0);
    cfg.events.max_subscribers = 1_000;
    // The aggregator on a runtime of its own (its threads `agg-rt`, measured), as on its
    // own machine: its tasks never queue behind the shippers' or the subscribers'.
    let agg_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("agg-rt")
        .enable_all()
        .build()
        .expect("runtime");
    let agg = agg_rt.spawn(Aggregator::start(cfg)).await.expect("start task").expect("aggregator starts");
    let sub_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("subscribers")
        .enable_all()
        .build()
        .expect("runtime");
    let http = agg.http_addr;
    let listed: IngestDto = get_json(http, "/v1/ingest").await;
    let delivered = Arc::new(AtomicU64::new(0));
    let gaps = Arc::new(AtomicU64::new(0));
    let mut followers = Vec::new();
    for _ in 0..subscribers {
        let (delivered, gaps) = (Arc::clone(&delivered), Arc::clone(&gaps));
        let after = listed.as_of.event_id.clone();
        followers.push(sub_rt.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let Ok(mut s) = tokio::net::TcpStream::connect(http).await else { return };
            let req = format!("GET /v1/events HTTP/1.1\r\nHost: x\r\nLast-Event-ID: {after}\r\n\r\n");
            if s.write_all(req.as_bytes()).await.is_err() {
                return;
            }
            let mut buf = vec![0u8; 64 * 1024];
            // The last bytes of the previous read: a marker may straddle two reads.
            let mut tail: Vec<u8> = Vec::new();
            let mut kept = 0usize;
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&buf[..n]);
                // Matches wholly inside the kept bytes were counted by the previous read.
                let count = |marker: &[u8]| {
                    let from = kept.saturating_sub(marker.len() - 1);
                    tail[from..].windows(marker.len()).filter(|w| *w == marker).count() as u64
                };
                let (ids, g) = (count(b"\nid: "), count(b"event: gap\n"));
                delivered.fetch_add(ids, Relaxed);
                gaps.fetch_add(g, Relaxed);
                kept = tail.len().min(10);
                tail.drain(..tail.len() - kept);
            }
        }));
    }
    let started = Instant::now();
    let cpu0 = threads_cpu_s("agg-rt");
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, started, |_, _, _| {});
    wait_nodes(http, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_s = threads_cpu_s("agg-rt") - cpu0;
    let ingest: IngestDto = get_json(http, "/v1/ingest").await;
    let _ = stop(shippers).await;
    agg.shutdown();
    for f in followers {
        let _ = f.await;
    }
    drop(agg);
    agg_rt.shutdown_background();
    sub_rt.shutdown_background();
    let verdict_events = ingest.events.last_id.split(['.', '@']).nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    Row {
        subscribers,
        wall_s,
        cpu_s,
        frames: ingest.frames,
        verdict_events,
        delivered: delivered.load(Relaxed),
        gaps: gaps.load(Relaxed),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale: f64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(0.02);
    let counts: Vec<usize> =
        args.get(1).map_or("0,100,0,100", String::as_str).split(',').filter_map(|c| c.parse().ok()).collect();
    let mut rows = Vec::new();
    for &n in &counts {
        rows.push(one(n, scale).await);
    }
    let mean = |f: &dyn Fn(&Row) -> f64| {
        let v: Vec<f64> = rows.iter().filter(|r| r.subscribers == 0).map(f).collect();
        if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }
    };
    let per_cpu = |r: &Row| r.frames as f64 / r.cpu_s;
    let (base_rate, base_per_cpu) = (mean(&|r| r.frames as f64 / r.wall_s), mean(&per_cpu));
    println!("seed-case, bulk scale {scale}; until every stream settled: frames the aggregator received per wall");
    println!("second, and per CPU-second of the aggregator's own runtime (`agg-rt`: ingest, API, event stream)");
    println!(
        "{:>11} {:>7} {:>7} {:>11} {:>10} {:>9} {:>7} {:>10} {:>5} {:>8} {:>8}",
        "subscribers",
        "wall s",
        "cpu s",
        "frames",
        "frames/s",
        "f/cpu-s",
        "events",
        "delivered",
        "gaps",
        "rate",
        "per cpu"
    );
    for r in &rows {
        let rate = r.frames as f64 / r.wall_s;
        println!(
            "{:>11} {:>7.2} {:>7.2} {:>11} {:>10.0} {:>9.0} {:>7} {:>10} {:>5} {:>7.1}% {:>7.1}%",
            r.subscribers,
            r.wall_s,
            r.cpu_s,
            r.frames,
            rate,
            per_cpu(r),
            r.verdict_events,
            r.delivered,
            r.gaps,
            100.0 * rate / base_rate,
            100.0 * per_cpu(r) / base_per_cpu
        );
    }
}
