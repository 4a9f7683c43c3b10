//! Network faults between shippers and the aggregator, through the UDP fault proxy
//! (issue 8): a partition longer than the spool holds, and P0 under bulk saturation.
//!
//! Named `net_*`: real timers, run alone.

use std::collections::BTreeMap;
use std::time::Instant;

use aggregator::api::dto::{NodesDto, VerdictsDto};
use aggregator::{Aggregator, AggregatorConfig};
use loadgen_sim::{SimOptions, builtin};
use node_shipper::config::Source;
use node_shipper::core::spool::SpoolConfig;
use node_shipper::driver::RunOptions;
use node_shipper::source::SimSource;
use ringwatch_faultproxy::{Direction, FaultProxy, Faults};
use ringwatch_tests::{
    TempDir, cert_set, get_json, shipper_config, spawn_shipper, stop, streams_settled, truth, wait_json, wait_nodes,
};
use ringwatch_transport::Tuning;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_partition_longer_than_the_spool_evicts_bulk_keeps_p0_and_accounts_exactly() {
    let dir = TempDir::new("partition");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let proxy = FaultProxy::start("127.0.0.1:0".parse().expect("addr"), agg.quic_addr, 11).await.expect("proxy");
    const CUT: u32 = 1;

    let start = Instant::now();
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, start, |node, cfg, opts| {
        if node == CUT {
            // Node 1 talks through the proxy, with a spool whose bulk share (512 KiB)
            // holds ~1.6 s of its bulk; its connection gives up after 2 s of silence.
            cfg.aggregator = proxy.addr.into();
            cfg.spool = SpoolConfig {
                cap_bytes: (512 << 10) + (2 << 20),
                p0_reserve_bytes: 1 << 20,
                p1_reserve_bytes: 1 << 20,
            };
            opts.tuning = Tuning { idle_timeout_ms: 2000, keep_alive_ms: 300, ..Tuning::default() };
        }
    });
    let cut_name = aggregator::certs::node_name(CUT);
    let heard = |n: &NodesDto, name: &str| {
        n.nodes.iter().any(|x| x.name == name && x.streams.iter().any(|st| st.class == "p0" && st.received > 0))
    };
    wait_nodes(agg.http_addr, "node 1 shipped P0 frames through the proxy", |n| heard(n, &cut_name)).await;
    proxy.set(Direction::Both, Faults { drop_all: true, ..Faults::default() });
    let cut_at = start.elapsed();
    // Past the silent timer (5 s): node 1 is silent or unreachable, and its ranks are
    // unknown_silent; nothing may be called degraded, stuck or not joined meanwhile.
    let silent = |n: &NodesDto| {
        n.nodes.iter().any(|x| x.name == cut_name && matches!(x.liveness.as_str(), "silent" | "unreachable"))
    };
    let during = wait_nodes(agg.http_addr, "node 1 silent or unreachable", silent).await;
    let verdicts_during: VerdictsDto =
        wait_json(agg.http_addr, "/v1/verdicts?limit=100000", "node 1's ranks unknown_silent", |v: &VerdictsDto| {
            v.verdicts.iter().any(|v| v.outcome == "unknown_silent" && v.node.as_deref() == Some(cut_name.as_str()))
        })
        .await;
    proxy.heal();
    let healed_at = start.elapsed();
    // The run ends on state: every stream settled (the backlog drained, evictions
    // reported), not after a fixed time.
    let truth = truth(&s, options);
    let after =
        wait_nodes(agg.http_addr, "every stream settled after healing", |n| streams_settled(n, &truth, |_| true)).await;
    let verdicts_after: VerdictsDto = get_json(agg.http_addr, "/v1/verdicts?limit=100000").await;
    let reports = stop(shippers).await;
    let pstats = proxy.stats();
    agg.shutdown();
    println!("partition {cut_at:?} → {healed_at:?}; proxy {pstats:?}");

    let liveness: BTreeMap<_, _> = during.nodes.iter().map(|n| (n.name.clone(), n.liveness.clone())).collect();
    println!("during the partition: {liveness:?}");
    // Silent (no data for 5 s), or unreachable once its connection timed out.
    assert!(matches!(liveness.get(&cut_name).map(String::as_str), Some("silent" | "unreachable")), "{liveness:?}");
    for (when, nodes, verdicts) in [("during", &during, &verdicts_during), ("after", &after, &verdicts_after)] {
        assert!(nodes.nodes.iter().all(|n| n.health != "degraded"), "{when}: a node called degraded");
        let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
        for v in &verdicts.verdicts {
            *outcomes.entry(v.outcome.split('(').next().unwrap_or("").to_owned()).or_default() += 1;
        }
        println!("{when}: {outcomes:?}");
        for bad in ["stuck", "not_joined"] {
            assert!(!outcomes.contains_key(bad), "{when}: {bad} verdicts while only telemetry was cut");
        }
    }
    assert!(
        verdicts_during
            .verdicts
            .iter()
            .any(|v| v.outcome == "unknown_silent" && v.node.as_deref() == Some(cut_name.as_str())),
        "the cut node's ranks are unknown_silent during the partition"
    );

    let cut_report = &reports[CUT as usize];
    println!("{cut_name}: {cut_report:?}");
    assert!(cut_report.frames_lost_spool_full > 0, "the partition outlasted the spool: bulk was evicted");
    assert!(cut_report.connections >= 2, "it reconnected after healing");
    // Accounting exact on every stream: P0 intact, bulk = received + evicted.
    let mut evicted_seen = 0;
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = after.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        let evicted = got.lost.get("shipper_spool_full").copied().unwrap_or(0);
        evicted_seen += evicted;
        if t.class == "p0" || t.node != CUT {
            assert_eq!((got.received, evicted), (t.delivered, 0), "{name} {:#x} ({})", t.stream_id, t.class);
        } else {
            assert_eq!(got.received + evicted, t.delivered, "{name} {:#x}: {got:?}", t.stream_id);
        }
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
        assert_eq!((got.pending, got.in_transit), (0, 0), "{name} {:#x} settled", t.stream_id);
    }
    // The aggregator counts what the shipper evicted — except batches it had applied
    // whose acks the partition ate: their loss reports are ignored there (the frames were
    // delivered, and counted received above), so it can count fewer, never more.
    assert!(evicted_seen > 0, "the aggregator counts the evictions");
    assert!(
        evicted_seen <= cut_report.frames_lost_spool_full,
        "the aggregator counts no more than the shipper evicted: {evicted_seen} vs {}",
        cut_report.frames_lost_spool_full
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_p0_latency_stays_low_while_bulk_saturates_the_link() {
    let dir = TempDir::new("saturate");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    // Node 0 alone, bulk at 1e-3 of line rate: ≈ 3.2 MB/s offered through a 1 MB/s link.
    let options = SimOptions { bulk_scale: 1e-3, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let proxy = FaultProxy::start("127.0.0.1:0".parse().expect("addr"), agg.quic_addr, 12).await.expect("proxy");
    let one_way_ms = 2;
    proxy.set(
        Direction::ToServer,
        Faults { delay_ms: one_way_ms, rate_limit_bytes_per_s: Some(1_000_000), ..Faults::default() },
    );
    proxy.set(Direction::ToClient, Faults { delay_ms: one_way_ms, ..Faults::default() });
    let source = SimSource::new(&s, options, 0, Instant::now()).expect("sim");
    let placeholder = Source::Sim { scenario: s.name.clone(), node: 0, bulk_scale_ppm: 0, seed: None };
    let mut cfg = shipper_config(&set, proxy.addr, 0, placeholder);
    cfg.shutdown_deadline_ms = 500;
    let flush_ms = cfg.batcher.flush_interval_ns / 1_000_000;
    let shipper = spawn_shipper(cfg, Box::new(source), RunOptions::default());
    // The whole scenario offered (the heartbeats report everything the generator made),
    // however long this machine takes.
    let truth = truth(&s, options);
    let offered = |n: &NodesDto| {
        truth.streams.iter().filter(|t| t.node == 0).all(|t| {
            n.nodes
                .iter()
                .flat_map(|x| &x.streams)
                .any(|x| x.epoch == t.epoch && x.stream_id == t.stream_id && x.attempted + x.sampled_out == t.generated)
        })
    };
    wait_nodes(agg.http_addr, "node 0 offered its whole scenario", offered).await;
    let reports = stop(vec![shipper]).await;
    let pstats = proxy.stats();
    agg.shutdown();
    let r = &reports[0];
    let rtt_ms = 2 * one_way_ms;
    let bound_ms = 2 * rtt_ms + flush_ms;
    println!("offered {} frames; proxy to_server {:?}\n{r:?}", r.frames_in, pstats.to_server);
    println!(
        "batch latency, first frame in → ack (µs), RTT {rtt_ms} ms, flush {flush_ms} ms, 2·RTT + flush = {bound_ms} ms:"
    );
    println!("  P0 {:?}", r.latency_p0);
    println!("  P1 {:?}", r.latency_p1);
    println!("  P2 {:?}", r.latency_p2);
    println!(
        "  P0 p99 / (2·RTT + flush) = {:.1} (a figure, not asserted: it depends on how busy this machine is)",
        r.latency_p0.p99_us as f64 / (bound_ms * 1000) as f64
    );
    assert!(pstats.to_server.dropped_rate > 0, "bulk really exceeded the link");
    // Enough P0 batches for a distribution (how many depends on how the batcher
    // coalesces under load, so no more than that).
    assert!(r.latency_p0.count >= 20, "{:?}", r.latency_p0);
    // Relative, so it holds on a loaded machine too: bulk queues behind the policed link,
    // P0 does not queue behind bulk.
    assert!(r.latency_p2.p99_us > r.latency_p0.p99_us, "bulk queues, P0 does not");
    assert!(r.latency_p2.p50_us > r.latency_p0.p50_us, "the typical P0 batch does not wait behind bulk");
}

/// Issue 16: a shipper stopped (SIGTERM's path) with a backlog it cannot flush before its
/// deadline — its link to the aggregator is policed to 1 MB/s while it offers ≈ 3 MB/s —
/// names what it gives up in `shipper_shutdown` loss records: at the aggregator every
/// frame of every stream is received or lost with a known cause, nothing `unknown`, and
/// the shipper's report balances per lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_sigterm_with_a_backlog_is_shipper_shutdown_never_unknown_regression_issue_16() {
    let dir = TempDir::new("sigterm-backlog");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-3, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let proxy = FaultProxy::start("127.0.0.1:0".parse().expect("addr"), agg.quic_addr, 13).await.expect("proxy");
    proxy.set(Direction::ToServer, Faults { rate_limit_bytes_per_s: Some(1_000_000), ..Faults::default() });
    let source = SimSource::new(&s, options, 0, Instant::now()).expect("sim");
    let placeholder = Source::Sim { scenario: s.name.clone(), node: 0, bulk_scale_ppm: 0, seed: None };
    let mut cfg = shipper_config(&set, proxy.addr, 0, placeholder);
    cfg.shutdown_deadline_ms = 200;
    let shipper = spawn_shipper(cfg, Box::new(source), RunOptions::default());
    // The whole scenario offered (the heartbeats say so), with a backlog behind the link.
    let truth = truth(&s, options);
    let ours = |n: u32| n == 0;
    let offered = |n: &NodesDto| {
        truth.streams.iter().filter(|t| ours(t.node)).all(|t| {
            n.nodes
                .iter()
                .flat_map(|x| &x.streams)
                .any(|x| x.epoch == t.epoch && x.stream_id == t.stream_id && x.attempted + x.sampled_out == t.generated)
        })
    };
    wait_nodes(agg.http_addr, "node 0 offered its whole scenario", offered).await;
    let reports = stop(vec![shipper]).await;
    let r = &reports[0];
    println!("{r:?}");
    assert!(!r.flushed, "the backlog outlasted the 200 ms deadline");
    assert!(r.frames_lost_shutdown > 0, "what was not flushed was given up as shipper_shutdown");
    for lane in 0..4 {
        assert_eq!(
            r.frames_in_by_lane[lane],
            r.frames_acked_by_lane[lane] + r.frames_lost_by_lane[lane],
            "lane {lane}: in = acked + lost"
        );
    }
    // The aggregator: everything settles (the loss records arrived), nothing unknown.
    let nodes =
        wait_nodes(agg.http_addr, "node 0's streams settled after the stop", |n| streams_settled(n, &truth, ours))
            .await;
    agg.shutdown();
    let mut shutdown_seen = 0;
    for t in truth.streams.iter().filter(|t| ours(t.node)) {
        let got =
            nodes.nodes.iter().flat_map(|n| &n.streams).find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id);
        let got = got.expect("stream");
        assert!(!got.lost.contains_key("unknown"), "{:#x}: {:?}", t.stream_id, got.lost);
        for cause in got.lost.keys() {
            assert!(
                matches!(cause.as_str(), "shipper_shutdown" | "shipper_spool_full" | "kernel_ring_full" | "oversized"),
                "{:#x}: {:?}",
                t.stream_id,
                got.lost
            );
        }
        shutdown_seen += got.lost.get("shipper_shutdown").copied().unwrap_or(0);
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{:#x}: {got:?}", t.stream_id);
    }
    println!("aggregator: {shutdown_seen} frames lost as shipper_shutdown; shipper gave up {}", r.frames_lost_shutdown);
    assert!(shutdown_seen > 0);
    // Batches applied whose acks had not come back are given up too; their reports are
    // ignored there (the frames were delivered): never more at the aggregator.
    assert!(shutdown_seen <= r.frames_lost_shutdown);
}

/// Issue 21: an unthrottled source (a ring in a burst) keeps being read while the link
/// (policed to 2 MB/s) and the reader's queue to the core (256 KiB, under one bulk batch
/// plus a little) cannot keep up: the reader sheds whole staged batches and the spool
/// evicts, and every frame generated is, at the aggregator, received or lost with the
/// shipper's cause — nothing pending, nothing `unknown` — and the shipper's report
/// balances per lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_an_unthrottled_source_is_read_on_and_every_frame_not_shipped_is_accounted() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use node_shipper::source::SyntheticSource;

    let dir = TempDir::new("unthrottled");
    let set = cert_set(dir.path(), 1);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let proxy = FaultProxy::start("127.0.0.1:0".parse().expect("addr"), agg.quic_addr, 21).await.expect("proxy");
    proxy.set(Direction::ToServer, Faults { rate_limit_bytes_per_s: Some(2_000_000), ..Faults::default() });
    let stop_source = Arc::new(AtomicBool::new(false));
    let cpus = 4u16;
    let source = SyntheticSource::new(f64::INFINITY, cpus, 100_000_000, Arc::clone(&stop_source));
    let placeholder = Source::Sim { scenario: "synthetic".into(), node: 0, bulk_scale_ppm: 0, seed: None };
    let mut cfg = shipper_config(&set, proxy.addr, 0, placeholder);
    cfg.spool = SpoolConfig { cap_bytes: 4 << 20, p0_reserve_bytes: 1 << 20, p1_reserve_bytes: 1 << 20 };
    cfg.shutdown_deadline_ms = 2_000;
    // Small bulk batches: the 2 MiB bulk share of this spool holds 32 of them.
    cfg.batcher.bulk_batch_bytes = 64 << 10;
    let frames_in = Arc::new(AtomicU64::new(0));
    let opts = RunOptions {
        frames_in: Some(Arc::clone(&frames_in)),
        reader_queue_bytes: Some(256 << 10),
        ..RunOptions::default()
    };
    let shipper = spawn_shipper(cfg, Box::new(source), opts);
    // Offer at least 20× what the link carries in the time it takes (the link carries
    // ≈ 42,000 frames/s): on state, not on time.
    let target = 4_000_000u64;
    let t = Instant::now();
    while frames_in.load(Ordering::Relaxed) < target {
        assert!(
            t.elapsed() < ringwatch_tests::STATE_LIMIT,
            "the reader stalled at {}",
            frames_in.load(Ordering::Relaxed)
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    stop_source.store(true, Ordering::Relaxed);
    // The source is finished: its counters are final. Every stream settles (received +
    // lost = attempted, nothing pending or in transit) once the backlog drained.
    let settled = |n: &NodesDto| {
        let streams: Vec<_> = n.nodes.iter().flat_map(|x| &x.streams).filter(|s| s.class == "p2").collect();
        streams.len() == usize::from(cpus)
            && streams.iter().all(|s| {
                s.attempted > 0 && s.received + s.lost_total == s.attempted && s.pending == 0 && s.in_transit == 0
            })
            && n.nodes.iter().flat_map(|x| &x.streams).all(|s| s.pending == 0 && s.in_transit == 0)
    };
    let nodes = wait_nodes(agg.http_addr, "every bulk stream settled", settled).await;
    let reports = stop(vec![shipper]).await;
    agg.shutdown();
    let r = &reports[0];
    println!(
        "frames in {}; acked {}; shed by the reader {} ({} batches); evicted from the spool {}; lost spool_full {}",
        r.frames_in,
        r.frames_acked_by_lane[2],
        r.stats.frames_shed,
        r.stats.batches_shed,
        r.spool_evicted,
        r.frames_lost_spool_full
    );
    let mut generated = 0;
    for s in nodes.nodes.iter().flat_map(|x| &x.streams).filter(|s| s.class == "p2") {
        println!("stream {:#x}: attempted {} received {} lost {:?}", s.stream_id, s.attempted, s.received, s.lost);
        generated += s.attempted;
        let known: u64 = s.lost.iter().filter(|(c, _)| c.as_str() != "unknown").map(|(_, n)| n).sum();
        assert_eq!(known, s.lost_total, "every lost frame has the shipper's cause: {:?}", s.lost);
        assert_eq!(s.lost.get("unknown").copied().unwrap_or(0), 0);
    }
    assert!(generated >= target, "the aggregator heard of every frame offered: {generated}");
    assert_eq!(r.frames_in, generated, "the shipper took every frame the source generated");
    assert!(r.stats.frames_shed > 0, "the reader shed while the spool was full");
    assert!(r.frames_lost_spool_full >= r.stats.frames_shed, "shed frames are lost spool_full");
    for lane in 0..4 {
        assert_eq!(
            r.frames_in_by_lane[lane],
            r.frames_acked_by_lane[lane] + r.frames_lost_by_lane[lane] + r.unflushed_frames_by_lane[lane],
            "lane {lane} balances: {r:?}"
        );
    }
}

/// The core's pump panics (a test hook) while a source keeps producing: the run ends
/// `Ended::Failed` at once — the reader is stopped, not left shedding into a queue nobody
/// reads — and the report still says what was read (the binary then exits 70).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_a_failed_core_pump_ends_the_run_instead_of_shedding_forever() {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    let dir = TempDir::new("pump-panic");
    let set = cert_set(dir.path(), 1);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let halt = Arc::new(AtomicBool::new(false));
    let source = node_shipper::source::SyntheticSource::new(200_000.0, 2, 100_000_000, Arc::clone(&halt));
    let placeholder = Source::Sim { scenario: "synthetic".into(), node: 0, bulk_scale_ppm: 0, seed: None };
    let cfg = shipper_config(&set, agg.quic_addr, 0, placeholder);
    let opts = RunOptions { test_panic_pump_after: Some(20), ..RunOptions::default() };
    // No stop signal is ever sent: the run must end by itself.
    let (_never, task) = spawn_shipper(cfg, Box::new(source), opts);
    let report = tokio::time::timeout(ringwatch_tests::STATE_LIMIT, task)
        .await
        .expect("the run ends by itself after the pump failed")
        .expect("shipper task");
    halt.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(report.ended, node_shipper::driver::Ended::Failed, "{report:?}");
    assert!(report.frames_in > 0, "{report:?}");
    agg.shutdown();
}
