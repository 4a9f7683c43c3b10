//! Aggregator SIGKILL and restart mid-run (issue 8), with real processes and in-process
//! shippers fed by the simulator: nothing the shippers created goes unaccounted, the new
//! instance restores the snapshot, exposes its knowledge gap, judges nothing across it
//! as stuck or not joined, and counts exactly the resent batches its snapshot had
//! already applied as duplicates.
//!
//! Named `net_*`: real timers, run alone.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aggregator::api::dto::{HealthzDto, IngestDto, NodesDto, VerdictsDto};
use loadgen_sim::{SimOptions, builtin};
use node_shipper::config::Source;
use node_shipper::core::shipper::BatchEvent;
use node_shipper::driver::RunOptions;
use node_shipper::source::SimSource;
use ringwatch_core::NodeId;
use ringwatch_tests::{TempDir, cert_set, get_json, shipper_config, spawn_shipper, stop, truth};
use ringwatch_transport::Tuning;

/// Starts `aggregator run` and reads the two address lines it prints.
fn spawn_aggregator(certs: &Path, listen: &str, snapshot: &Path, extra: &[&str]) -> (Child, SocketAddr, SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_aggregator"))
        .args(["run", "--listen", listen, "--http", "127.0.0.1:0", "--snapshot-interval-ms", "300"])
        .args(extra)
        .arg("--certs")
        .arg(certs)
        .arg("--snapshot")
        .arg(snapshot)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aggregator starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let quic = lines.next().expect("quic line").expect("utf-8");
    let http = lines.next().expect("http line").expect("utf-8");
    let quic = quic.trim_start_matches("quic ").parse().expect("quic address");
    let http = http.trim_start_matches("http http://").parse().expect("http address");
    (child, quic, http)
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().expect("kill");
    assert!(ok.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_aggregator_sigkill_and_restart_from_snapshot() {
    let dir = TempDir::new("restart");
    let s = builtin::builtin("mixed").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let snap = dir.path().join("aggregator.snap");

    // Instance 1 stops acking 2 s in (a test hook): what it applies and snapshots after
    // that is resent to instance 2, which must count exactly those as duplicates.
    let (mut first, quic, http1) =
        spawn_aggregator(dir.path(), "127.0.0.1:0", &snap, &["--test-hold-acks-after-ms", "2000"]);
    let h1: HealthzDto = get_json(http1, "/healthz").await;
    assert!(!h1.restored);

    // Shippers notice a dead aggregator within 1.5 s (idle timeout) and reconnect.
    let tuning = Tuning { idle_timeout_ms: 1500, keep_alive_ms: 300, ..Tuning::default() };
    let start = Instant::now();
    let mut shippers = Vec::new();
    for node in 0..s.cluster.nodes {
        let source = SimSource::new(&s, options, node, start).expect("sim source");
        let cfg = shipper_config(
            &set,
            quic,
            node,
            Source::Sim { scenario: s.name.clone(), node, bulk_scale_ppm: 0, seed: None },
        );
        let opts = RunOptions { tuning, batch_log: true, ..RunOptions::default() };
        shippers.push(spawn_shipper(cfg, Box::new(source), opts));
    }

    // SIGKILL mid-run; keep the snapshot instance 2 will restore.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    signal(&first, "-KILL");
    let _ = first.wait();
    let killed_at = start.elapsed();
    let restored_from = dir.path().join("restored-from.snap");
    std::fs::copy(&snap, &restored_from).expect("instance 1 wrote a snapshot");
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let (mut second, quic2, http2) = spawn_aggregator(dir.path(), &quic.to_string(), &snap, &[]);
    assert_eq!(quic2, quic, "instance 2 listens where instance 1 did");
    let h2: HealthzDto = get_json(http2, "/healthz").await;
    assert!(h2.restored, "instance 2 restored the snapshot");
    assert_eq!(h2.aggregator_epoch, 2);
    assert_ne!(h2.instance, h1.instance);

    // Let the run finish and everything settle.
    let until = Duration::from_millis(s.duration_ms + 4000);
    tokio::time::sleep(until.saturating_sub(start.elapsed())).await;
    let nodes: NodesDto = get_json(http2, "/v1/nodes").await;
    let verdicts: VerdictsDto = get_json(http2, "/v1/verdicts?limit=100000").await;
    let reports = stop(shippers).await;
    let ingest: IngestDto = get_json(http2, "/v1/ingest").await;
    signal(&second, "-TERM");
    assert_eq!(second.wait().expect("exits").code(), Some(0));
    println!("killed at {killed_at:?}; instance 2: {ingest:?}");

    let i1 = u64::from_str_radix(&h1.instance, 16).expect("hex");
    let i2 = u64::from_str_radix(&h2.instance, 16).expect("hex");
    let restored = aggregator::snapshots::load(&restored_from).expect("readable").expect("present");

    let mut expected_duplicates = 0u64;
    for r in &reports {
        // (a) From the shipper's own log: every batch it created was acked by instance 1
        // or 2, nacked, or named in a loss record.
        let mut fate: BTreeMap<u64, &str> = BTreeMap::new();
        let mut created = BTreeSet::new();
        let mut sent_on: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
        for e in &r.batch_log {
            match *e {
                BatchEvent::Created { batch_seq, .. } => {
                    created.insert(batch_seq);
                }
                BatchEvent::Sent { batch_seq, connection } => {
                    sent_on.entry(batch_seq).or_default().insert(connection);
                }
                BatchEvent::Acked { batch_seq, aggregator_instance } => {
                    let who = if aggregator_instance == i1 {
                        "acked by instance 1"
                    } else if aggregator_instance == i2 {
                        "acked by instance 2"
                    } else {
                        "acked by an unknown instance"
                    };
                    fate.insert(batch_seq, who);
                }
                BatchEvent::Nacked { batch_seq, .. } => {
                    fate.insert(batch_seq, "nacked");
                }
                BatchEvent::Lost { batch_seq, .. } => {
                    fate.entry(batch_seq).or_insert("named in a loss record");
                }
                BatchEvent::Abandoned { batch_seq } => {
                    fate.insert(batch_seq, "abandoned");
                }
            }
        }
        let mut tally: BTreeMap<&str, u64> = BTreeMap::new();
        for seq in &created {
            *tally.entry(fate.get(seq).copied().unwrap_or("unaccounted")).or_default() += 1;
        }
        println!("{}: {} batches created: {tally:?}; {} connections", r.node_name, created.len(), r.connections);
        assert!(!created.is_empty());
        for bad in ["unaccounted", "abandoned", "acked by an unknown instance"] {
            assert!(!tally.contains_key(bad), "{}: {tally:?}", r.node_name);
        }
        assert!(tally.contains_key("acked by instance 1") && tally.contains_key("acked by instance 2"), "{tally:?}");
        // (d) Resent batches (sent on two connections) that instance 2's snapshot had
        // already applied must be its duplicates — exactly those.
        let node = NodeId(proto_flat::node_id_of(&r.node_name));
        expected_duplicates += sent_on
            .iter()
            .filter(|(_, conns)| conns.len() > 1)
            .filter(|(seq, _)| restored.core.ingest.dedup().is_settled(node, r.shipper_session, **seq))
            .count() as u64;
    }
    println!("duplicates: counted {}, expected {expected_duplicates}", ingest.batches_duplicate);
    assert!(expected_duplicates > 0, "batches applied and snapshotted but not acked were resent");
    assert_eq!(ingest.batches_duplicate, expected_duplicates);

    // (b) Instance 2 exposes its knowledge gap for every node.
    for n in &nodes.nodes {
        assert!(!n.knowledge_gaps.is_empty(), "{}: no knowledge gap", n.name);
        assert!(!n.awaiting_first_batch, "{}: never heard from after the restart", n.name);
    }
    // (c) Nothing across the gap is stuck, not joined or degraded.
    for v in &verdicts.verdicts {
        assert!(!v.outcome.starts_with("stuck") && !v.outcome.starts_with("not_joined"), "{v:?}");
    }
    assert!(
        nodes.nodes.iter().all(|n| n.health != "degraded"),
        "{:?}",
        nodes.nodes.iter().map(|n| &n.health).collect::<Vec<_>>()
    );
    let gap = verdicts
        .verdicts
        .iter()
        .filter(|v| v.tags.iter().any(|t| t == "aggregator_gap") || v.outcome.contains("aggregator_gap"))
        .count();
    println!("{} verdicts, {gap} marked aggregator_gap", verdicts.verdicts.len());
    assert!(gap > 0, "collectives overlapping the gap say so");

    // And the streams still add up exactly on instance 2: received + lost + sampled out =
    // generated, per stream, against the generator's own counts. Frames instance 1 acked
    // after its last snapshot are gone with it (an ack means applied, not durable): they
    // are explicit `unknown` loss on instance 2, never silent.
    let truth = truth(&s, options);
    let mut lost_in_gap = 0;
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        assert!(got.received <= t.delivered, "{name} {:#x}", t.stream_id);
        let unknown = got.lost.get("unknown").copied().unwrap_or(0);
        assert_eq!(
            got.lost_total - unknown,
            t.dropped.values().sum::<u64>(),
            "{name} {:#x}: {:?}",
            t.stream_id,
            got.lost
        );
        lost_in_gap += unknown;
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
    }
    println!(
        "frames acked by instance 1 after its last snapshot, accounted as unknown loss on instance 2: {lost_in_gap}"
    );
}
