//! `/v1/verdicts` latency against the verdict store's size (issue 19): a real aggregator
//! on loopback, its store filled with synthetic ops (9 in 10 completed and compacted, 1
//! in 10 `stuck` and kept whole, 8 ranks each), and 300 requests per query shape; prints
//! p50/p99/max per size, the store's estimated bytes per rank verdict and the RSS it
//! added. A table, not a criterion run: the figure is a latency distribution. Then, per
//! size, a snapshot taken 5 times (`snapshot_now`, as the snapshot task does): the file's
//! size and how long the core's lock was held (the store is serialized under it).
//!
//! `cargo bench -p aggregator --bench verdict_queries` (SIZES=10000,100000 for others)

#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "latency and size figures for a table"
)]

use std::time::Instant;

use aggregator::api::client::get;
use ringwatch_core::records::{Comm, NodeId};
use ringwatch_core::verdict::{Evidence, FrameRef, MatcherEvent, OpRef, Outcome, Verdict};

const RANKS: u32 = 8;
const REQUESTS: usize = 300;

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn events(first_op: u64, ops: u64) -> Vec<MatcherEvent> {
    let comm = Comm { hash: 0x19, disambiguator: 0, instance: 1 };
    let mut out = Vec::new();
    for seq in first_op..first_op + ops {
        let outcome = if seq % 10 == 0 { Outcome::Stuck } else { Outcome::Completed };
        for rank in 0..RANKS {
            let node = NodeId(u64::from(rank / 4));
            out.push(MatcherEvent::Verdict(Verdict {
                op: OpRef::Coll { comm, seq },
                rank,
                node: Some(node),
                gpu_uuid: [u8::try_from(rank).unwrap_or(0); 16],
                outcome,
                tags: Vec::new(),
                is_final: true,
                decided_at_ns: seq,
                evidence: Evidence {
                    frames: (0..3).map(|i| FrameRef { node, stream_id: 1, seq: seq * 3 + i, phase: 3 }).collect(),
                    watermarks: vec![(node, 1)],
                    ..Evidence::default()
                },
                revision: 0,
            }));
        }
    }
    out
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let sizes: Vec<u64> = std::env::var("SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10_000, 100_000, 1_000_000, 4_000_000]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let dir = std::env::temp_dir().join(format!("ringwatch-verdict-bench-{}", std::process::id()));
        let set = aggregator::certs::init(&dir, &["node-0".to_owned()]).expect("certs");
        let mut cfg = aggregator::AggregatorConfig::local(&set);
        cfg.store.max_bytes = u64::MAX;
        cfg.store.retention_ns = u64::MAX;
        let agg = aggregator::Aggregator::start(cfg).await.expect("starts");
        let http = agg.http_addr;
        println!(
            "{:>10} {:>9} {:>9} {:>8} {:>8}  {:<28} {:>8} {:>8} {:>8}",
            "verdicts", "est_MB", "B/verdict", "rss_MB", "B/v_rss", "query", "p50_ms", "p99_ms", "max_ms"
        );
        let base_rss = rss_kb();
        let mut ops_in = 0u64;
        let snap_path = dir.join("bench.snap");
        let mut snaps = Vec::new();
        for size in sizes {
            let ops = size / u64::from(RANKS);
            while ops_in < ops {
                let n = (ops - ops_in).min(10_000);
                let now = agg.shared.now();
                agg.shared.store().apply(now, events(ops_in + 1, n));
                ops_in += n;
            }
            let (held, bytes) = {
                let s = agg.shared.store();
                (s.len(), s.bytes())
            };
            let rss = rss_kb().saturating_sub(base_rss);
            for query in ["limit=1", "final=true&limit=1", "outcome=stuck&limit=1", "limit=1000"] {
                let path = format!("/v1/verdicts?{query}");
                let mut ms: Vec<f64> = Vec::with_capacity(REQUESTS);
                for _ in 0..REQUESTS {
                    let t = Instant::now();
                    let (status, _) = get(http, &path).await.expect("answered");
                    assert_eq!(status, 200, "{path}");
                    ms.push(t.elapsed().as_secs_f64() * 1e3);
                }
                ms.sort_by(f64::total_cmp);
                let q = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
                println!(
                    "{:>10} {:>9.1} {:>9} {:>8.1} {:>8} {:<28} {:>8.2} {:>8.2} {:>8.2}",
                    held,
                    bytes as f64 / 1048576.0,
                    bytes / held.max(1),
                    rss as f64 / 1024.0,
                    rss * 1024 / held.max(1),
                    query,
                    q(0.5),
                    q(0.99),
                    ms[ms.len() - 1]
                );
            }
            let mut hold_ms: Vec<f64> = Vec::new();
            let mut total_ms: Vec<f64> = Vec::new();
            for _ in 0..5 {
                let t = Instant::now();
                assert!(aggregator::snapshot_now(&agg.shared, &snap_path), "snapshot written");
                total_ms.push(t.elapsed().as_secs_f64() * 1e3);
                hold_ms.push(
                    agg.shared.counters.last_snapshot_hold_us.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e3,
                );
            }
            hold_ms.sort_by(f64::total_cmp);
            total_ms.sort_by(f64::total_cmp);
            let file = std::fs::metadata(&snap_path).map_or(0, |m| m.len());
            snaps.push((held, file, hold_ms[2], hold_ms[4], total_ms[2]));
        }
        println!();
        println!(
            "{:>10} {:>9} {:>12} {:>12} {:>12}",
            "verdicts", "file_MB", "hold_p50_ms", "hold_max_ms", "total_p50_ms"
        );
        for (held, file, p50, max, total) in snaps {
            println!("{held:>10} {:>9.1} {p50:>12.2} {max:>12.2} {total:>12.2}", file as f64 / 1048576.0);
        }
        agg.shutdown();
        let _ = std::fs::remove_dir_all(&dir);
    });
}
