//! node-shipper → aggregator over real QUIC and real mutual TLS on loopback (issue 7).
//!
//! Tests are named `net_*`: they run one at a time (nextest group `network-timing`),
//! because their timers are real.

use std::collections::BTreeMap;
use std::time::Instant;

use aggregator::api::dto::{NodesDto, VerdictsDto};
use aggregator::{Aggregator, AggregatorConfig};
use loadgen_sim::{Scenario, SimOptions, builtin};
use node_shipper::driver::RunOptions;
use ringwatch_tests::{Running, TempDir, cert_set, get_json, stop, streams_settled, truth, wait_json, wait_nodes};

/// Runs `nodes` shippers (simulator sources, one per node, sharing one start instant)
/// into one aggregator; returns the aggregator (still running) and the shippers'
/// shutdown handles.
async fn cluster(
    dir: &TempDir,
    s: &Scenario,
    options: SimOptions,
    agg_config: impl FnOnce(AggregatorConfig) -> AggregatorConfig,
    run_options: impl Fn(u32) -> RunOptions,
) -> (Aggregator, Vec<Running>) {
    let set = cert_set(dir.path(), s.cluster.nodes);
    // The scenario's timers, as loadgen configures them (time not compressed).
    let cfg = loadgen::cluster::aggregator_config(&set, s, 1.0);
    let agg = Aggregator::start(agg_config(cfg)).await.expect("aggregator starts");
    let start = Instant::now();
    let shippers = ringwatch_tests::spawn_sim_shippers(s, options, &set, agg.quic_addr, start, |node, _, opts| {
        *opts = run_options(node);
    });
    (agg, shippers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_eight_shippers_from_the_simulator_match_ground_truth() {
    let dir = TempDir::new("e2e8");
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let truth = truth(&s, options);
    // The scorer's table; slack: the aggregator's default reorder timeout (500 ms).
    let table = loadgen_sim::expect::Table::new(&truth, 500.0);
    let decidable: u64 = table.ranks().filter(|(c, _, e)| c.comm_op_seq > 0 && e.decidable).count() as u64;
    let (agg, shippers) = cluster(&dir, &s, options, |c| c, |_| RunOptions::default()).await;
    let http = agg.http_addr;

    // The run ends on state: every stream settled (the generator's whole count reported,
    // nothing pending or in transit), then every decidable verdict final — however long
    // this machine takes (bounded: the test fails rather than hangs).
    wait_nodes(http, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    wait_json(http, "/v1/verdicts?final=true&limit=1", "every decidable verdict final", |v: &VerdictsDto| {
        v.total.unwrap_or(0) >= decidable
    })
    .await;
    let nodes: NodesDto = get_json(http, "/v1/nodes").await;
    let verdicts: VerdictsDto = get_json(http, "/v1/verdicts?limit=100000").await;
    // Freshness: the answer names the oldest P0 watermark among the nodes (cluster time)
    // and the node holding it back; the verdict page is at least as fresh.
    let a = &nodes.as_of;
    let cluster_watermark = |n: &aggregator::api::dto::NodeDto| {
        i64::try_from(n.watermark_p0_node_ns).unwrap() + n.clock_offset_ns.unwrap_or(0)
    };
    let with: Vec<_> = nodes.nodes.iter().filter(|n| n.watermark_p0_node_ns > 0).collect();
    assert_eq!(a.nodes_with_watermark, with.len() as u64, "{a:?}");
    let lowest = with.iter().map(|n| cluster_watermark(n)).min().expect("watermarks");
    assert_eq!(a.p0_watermark_min_cluster_ns, Some(lowest), "{a:?}");
    let named = with.iter().find(|n| Some(n.name.as_str()) == a.p0_watermark_min_node.as_deref()).expect("named");
    assert_eq!(cluster_watermark(named), lowest, "the node named holds the minimum: {a:?}");
    assert_eq!(a.aggregator_epoch, 1);
    assert!(verdicts.as_of.aggregator_ms >= a.aggregator_ms && verdicts.as_of.nodes_with_watermark >= 1);
    let reports = stop(shippers).await;
    agg.shutdown();

    // Every shipper flushed everything; nothing was nacked.
    for r in &reports {
        assert!(r.flushed, "{} did not flush: {r:?}", r.node_name);
        assert_eq!(r.batches_nacked, 0, "{}", r.node_name);
        assert_eq!(r.frames_lost_spool_full, 0, "{}", r.node_name);
    }

    // Per stream: delivered + lost + sampled_out = generated, and each term equals the
    // generator's own count.
    let by_name: BTreeMap<&str, _> = nodes.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut streams_checked = 0;
    let mut kernel_lost = 0;
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = by_name.get(name.as_str()).unwrap_or_else(|| panic!("{name} missing from /v1/nodes"));
        let got = node
            .streams
            .iter()
            .find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id)
            .unwrap_or_else(|| panic!("{name} stream {:#x} epoch {} missing", t.stream_id, t.epoch));
        let lost: u64 = t.dropped.values().sum();
        assert_eq!(got.received, t.delivered, "{name} stream {:#x}: received", t.stream_id);
        assert_eq!(got.lost, t.dropped, "{name} stream {:#x}: lost by cause", t.stream_id);
        assert_eq!(got.sampled_out, t.sampled_out, "{name} stream {:#x}: sampled out", t.stream_id);
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
        assert_eq!((got.pending, got.in_transit), (0, 0), "{name} {:#x} settled", t.stream_id);
        streams_checked += 1;
        kernel_lost += lost;
    }
    assert!(streams_checked >= 8 * 4, "{streams_checked} streams");
    assert!(kernel_lost > 0, "the scenario's P0 overflow dropped frames");

    // Health per node equals the truth: node 3 healthy_lossy (never degraded).
    for n in &truth.nodes {
        let got = by_name.get(n.name.as_str()).map(|x| x.health.as_str());
        assert_eq!(got, Some(n.health.as_str()), "{} health", n.name);
    }

    // Every decidable rank of every collective has a final verdict that agrees.
    let by_key: BTreeMap<(String, u64, u32), _> =
        verdicts.verdicts.iter().map(|v| ((v.op.comm.clone(), v.op.seq, v.rank), v)).collect();
    let missing: Vec<_> = truth
        .collectives
        .iter()
        .filter(|c| c.comm_op_seq > 0)
        .flat_map(|c| c.ranks.iter().filter(|r| table.expected(c, r).decidable).map(move |r| (c, r)))
        .filter(|(c, r)| !by_key.contains_key(&(format!("{:016x}", c.comm_hash), c.comm_op_seq, r.rank)))
        .map(|(c, r)| (c.comm.clone(), c.comm_op_seq, r.rank, c.sched_ms))
        .collect();
    if !missing.is_empty() {
        for n in &nodes.nodes {
            println!(
                "{} wm_p0 {} wm_bulk {} offset {:?} eps {:?}",
                n.name, n.watermark_p0_node_ns, n.watermark_bulk_node_ns, n.clock_offset_ns, n.clock_epsilon_ns
            );
        }
        let ops: std::collections::BTreeSet<_> =
            missing.iter().map(|m| (format!("{:.0} ms", m.3), m.0.clone(), m.1)).collect();
        panic!("{} of {decidable} rank verdicts missing, ops {ops:?}", missing.len());
    }
    let (mut checked, mut inferred) = (0, 0);
    for c in truth.collectives.iter().filter(|c| c.comm_op_seq > 0) {
        for r in &c.ranks {
            let e = table.expected(c, r);
            if !e.decidable {
                continue;
            }
            let key = (format!("{:016x}", c.comm_hash), c.comm_op_seq, r.rank);
            let v = by_key.get(&key).unwrap_or_else(|| panic!("no verdict for {key:?} (truth {})", e.outcome));
            assert!(v.is_final, "{key:?} not final: {}", v.outcome);
            assert!(
                loadgen::score::agrees_expected(
                    &e,
                    &v.outcome,
                    r.lost_frames,
                    loadgen::score::NodeFate::Alive,
                    r.completed
                ),
                "{key:?}: truth {} verdict {}",
                e.outcome,
                v.outcome
            );
            if v.outcome == "completed_inferred" {
                inferred += 1;
                assert!(v.tags.iter().any(|t| t == "telemetry_loss"), "{key:?} inferred without telemetry_loss");
            }
            checked += 1;
        }
    }
    println!("{checked} rank verdicts agree with the truth ({inferred} inferred through telemetry loss)");
    for r in &reports {
        println!(
            "{}: frames {} acked {} batches {} heartbeats {} connections {}",
            r.node_name, r.frames_in, r.frames_acked, r.batches_acked, r.heartbeats, r.connections
        );
    }
    assert!(checked > 1000, "{checked}");
    assert!(inferred > 0, "node 3's lost completions were inferred");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_a_poisoned_batch_is_nacked_accounted_as_rejected_and_flow_continues() {
    let dir = TempDir::new("poison");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let (agg, shippers) = cluster(
        &dir,
        &s,
        options,
        |c| c,
        |node| RunOptions { poison_bulk_batch_from: (node == 1).then_some(20), ..RunOptions::default() },
    )
    .await;
    let truth = truth(&s, options);
    let nodes = wait_nodes(agg.http_addr, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let reports = stop(shippers).await;
    let rejected = agg.shared.counters.rejected();
    agg.shutdown();

    let poisoned = &reports[1];
    assert_eq!(poisoned.batches_nacked, 1, "{poisoned:?}");
    assert!(poisoned.frames_lost_rejected > 0);
    assert_eq!(rejected.get(&6).copied(), Some(1), "one summary_mismatch (code 6) rejection: {rejected:?}");
    assert!(poisoned.flushed, "the shipper kept flowing and flushed the rest");
    // Exact accounting on every stream of every node: the nacked batch's frames are
    // `rejected`, every other frame received.
    let mut rejected_seen = 0;
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        let r = got.lost.get("rejected").copied().unwrap_or(0);
        rejected_seen += r;
        assert_eq!(got.received + r, t.delivered, "{name} {:#x}", t.stream_id);
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
    }
    assert_eq!(rejected_seen, poisoned.frames_lost_rejected, "the aggregator counts what the shipper reported");
}
