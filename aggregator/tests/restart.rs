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
use ringwatch_tests::{
    TempDir, cert_set, get_json, shipper_config, spawn_shipper, stop, streams_settled, truth, wait_ingest, wait_nodes,
};
use ringwatch_transport::Tuning;

/// An aggregator process, killed (by its pid) and reaped when dropped, so a failing test
/// leaves nothing running.
struct Proc(Child);

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A child already reaped by `wait` is not signalled again (std keeps its status).
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `aggregator run` and reads the two address lines it prints.
fn spawn_aggregator(certs: &Path, listen: &str, snapshot: &Path, extra: &[&str]) -> (Proc, SocketAddr, SocketAddr) {
    spawn_aggregator_with(certs, listen, Some(snapshot), extra)
}

/// [`spawn_aggregator`], snapshots optional (without: durability `none`).
fn spawn_aggregator_with(
    certs: &Path,
    listen: &str,
    snapshot: Option<&Path>,
    extra: &[&str],
) -> (Proc, SocketAddr, SocketAddr) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_aggregator"));
    cmd.args(["run", "--listen", listen, "--http", "127.0.0.1:0"]);
    if !extra.contains(&"--snapshot-interval-ms") {
        cmd.args(["--snapshot-interval-ms", "300"]);
    }
    if let Some(snapshot) = snapshot {
        cmd.arg("--snapshot").arg(snapshot);
    }
    let mut child = cmd
        .args(extra)
        .arg("--certs")
        .arg(certs)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aggregator starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let quic = lines.next().expect("quic line").expect("utf-8");
    let http = lines.next().expect("http line").expect("utf-8");
    let quic = quic.trim_start_matches("quic ").parse().expect("quic address");
    let http = http.trim_start_matches("http http://").parse().expect("http address");
    (Proc(child), quic, http)
}

/// In-process shippers for `nodes` of `s`, fed by the simulator in real time from `start`,
/// noticing a dead aggregator within 1.5 s (idle timeout) and keeping a batch log;
/// offering at most control protocol `max_control_version` (2: a shipper one release
/// behind; `None`: this build's).
fn sim_shippers(
    s: &loadgen_sim::Scenario,
    options: SimOptions,
    set: &aggregator::certs::CertSet,
    quic: SocketAddr,
    nodes: std::ops::Range<u32>,
    start: Instant,
    max_control_version: Option<u16>,
) -> Vec<ringwatch_tests::Running> {
    let tuning = Tuning { idle_timeout_ms: 1500, keep_alive_ms: 300, ..Tuning::default() };
    nodes
        .map(|node| {
            let source = SimSource::new(s, options, node, start).expect("sim source");
            let sim = Source::Sim { scenario: s.name.clone(), node, bulk_scale_ppm: 0, seed: None };
            let cfg = shipper_config(set, quic, node, sim);
            let opts = RunOptions { tuning, batch_log: true, max_control_version, ..RunOptions::default() };
            spawn_shipper(cfg, Box::new(source), opts)
        })
        .collect()
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
    let start = Instant::now();
    let shippers = sim_shippers(&s, options, &set, quic, 0..s.cluster.nodes, start, None);

    // SIGKILL mid-run, once a snapshot taken after the hold began has applied-but-unacked
    // batches in it; keep that snapshot for instance 2 to restore.
    wait_ingest(http1, "instance 1 snapshotted while holding acks", |i| {
        i.last_snapshot_at_ms > 2_300 && i.batches_applied > 100
    })
    .await;
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

    // The run ends on state: every stream of every node settled at instance 2.
    let truth = truth(&s, options);
    wait_nodes(http2, "every stream settled at instance 2", |n| streams_settled(n, &truth, |_| true)).await;
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
                BatchEvent::Durable { .. } => {}
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
            .filter(|(seq, _)| restored.core.ingest().dedup().is_settled(node, r.shipper_session, **seq))
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
    // generated, per stream, against the generator's own counts. Instance 1 acked
    // nothing after its last snapshot (the hold), so it forgot nothing: no
    // `aggregator_crash`, no `prior_instance`.
    let mut lost_in_gap = 0;
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        assert!(got.received <= t.delivered, "{name} {:#x}", t.stream_id);
        let unknown = got.lost.get("unknown").copied().unwrap_or(0);
        let crash = got.lost.get("aggregator_crash").copied().unwrap_or(0);
        assert_eq!(
            got.lost_total - unknown - crash,
            t.dropped.values().sum::<u64>(),
            "{name} {:#x}: {:?}",
            t.stream_id,
            got.lost
        );
        lost_in_gap += got.prior_instance + crash;
        assert_eq!(unknown, 0, "{name} {:#x}: {:?}", t.stream_id, got.lost);
        assert_eq!(
            got.received + got.lost_total + got.prior_instance + got.sampled_out,
            t.generated,
            "{name} {:#x}",
            t.stream_id
        );
    }
    println!("frames instance 2 counts as forgotten by instance 1: {lost_in_gap}");
    assert_eq!(lost_in_gap, 0, "nothing was acked after the snapshot instance 2 restored");
}

/// Issue 20: with snapshots on, the aggregator declares durability `snapshot` and acks
/// P0/P1 batches `durable` once a snapshot on disk holds them; the shippers keep them
/// until then. SIGKILLed mid-run, the restarted instance gets every P0 and P1 frame
/// (resent), and what it forgot — bulk acked after its snapshot — is counted exactly as
/// `aggregator_crash`: the frames of the bulk batches instance 1 acked that the restored
/// snapshot does not hold, by the shippers' own batch logs. Nothing `unknown`, nothing
/// `prior_instance`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_aggregator_sigkill_with_durable_acks_loses_no_p0_or_p1_frame_issue_20() {
    let dir = TempDir::new("durable");
    let s = builtin::builtin("mixed").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let snap = dir.path().join("aggregator.snap");
    // One snapshot a second: at any moment up to a second of P0/P1 awaits its durable ack.
    let interval = ["--snapshot-interval-ms", "1000"];
    let (mut first, quic, http1) = spawn_aggregator(dir.path(), "127.0.0.1:0", &snap, &interval);
    let h1: HealthzDto = get_json(http1, "/healthz").await;
    assert_eq!(h1.durability, "snapshot");
    let start = Instant::now();
    let shippers = sim_shippers(&s, options, &set, quic, 0..s.cluster.nodes, start, None);
    wait_ingest(http1, "instance 1 acked batches durable", |i| i.batches_durable > 50 && i.snapshots_written >= 2)
        .await;
    signal(&first, "-KILL");
    let _ = first.wait();
    let restored_from = dir.path().join("restored-from.snap");
    std::fs::copy(&snap, &restored_from).expect("instance 1 wrote a snapshot");
    let (mut second, _, http2) = spawn_aggregator(dir.path(), &quic.to_string(), &snap, &interval);
    let h2: HealthzDto = get_json(http2, "/healthz").await;
    assert!(h2.restored);

    let truth = truth(&s, options);
    wait_nodes(http2, "every stream settled at instance 2", |n| streams_settled(n, &truth, |_| true)).await;
    let nodes: NodesDto = get_json(http2, "/v1/nodes").await;
    let reports = stop(shippers).await;
    signal(&second, "-TERM");
    assert_eq!(second.wait().expect("exits").code(), Some(0));

    let i1 = u64::from_str_radix(&h1.instance, 16).expect("hex");
    let restored = aggregator::snapshots::load(&restored_from).expect("readable").expect("present");
    // Per node: the frames of bulk batches instance 1 acked that the snapshot does not
    // hold (forgotten), and the P0/P1 batches it applied but never acked durable that the
    // snapshot does not hold (kept by the shipper, resent).
    let mut forgotten: BTreeMap<String, u64> = BTreeMap::new();
    let mut saved_p0_p1 = 0u64;
    for r in &reports {
        assert_eq!((r.control_version, r.durability.as_str()), (3, "snapshot"), "{}", r.node_name);
        assert!(r.batches_durable > 0 && r.durable_lag.count > 0, "{}: {r:?}", r.node_name);
        let node = NodeId(proto_flat::node_id_of(&r.node_name));
        let mut lane_frames: BTreeMap<u64, (u8, u32)> = BTreeMap::new();
        let mut acked_by_1 = BTreeSet::new();
        let mut durable_by_1 = BTreeSet::new();
        for e in &r.batch_log {
            match *e {
                BatchEvent::Created { batch_seq, lane, frames } => {
                    lane_frames.insert(batch_seq, (lane, frames));
                }
                BatchEvent::Acked { batch_seq, aggregator_instance } if aggregator_instance == i1 => {
                    acked_by_1.insert(batch_seq);
                }
                BatchEvent::Durable { batch_seq, aggregator_instance } if aggregator_instance == i1 => {
                    durable_by_1.insert(batch_seq);
                }
                _ => {}
            }
        }
        let snapshotted = |seq: u64| restored.core.ingest().dedup().is_settled(node, r.shipper_session, seq);
        for &seq in &acked_by_1 {
            let (lane, frames) = lane_frames[&seq];
            if snapshotted(seq) {
                continue;
            }
            if lane >= 2 {
                *forgotten.entry(r.node_name.clone()).or_default() += u64::from(frames);
            } else {
                assert!(
                    !durable_by_1.contains(&seq),
                    "{}: batch {seq} acked durable, not in the snapshot",
                    r.node_name
                );
                saved_p0_p1 += 1;
            }
        }
    }
    println!("P0/P1 batches applied by instance 1 after its snapshot, kept and resent: {saved_p0_p1}");
    assert!(saved_p0_p1 > 0, "the kill left P0/P1 batches awaiting their durable ack");

    let mut crash_by_node: BTreeMap<String, u64> = BTreeMap::new();
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        let cause = |c: &str| got.lost.get(c).copied().unwrap_or(0);
        assert_eq!(cause("unknown"), 0, "{name} {:#x}: {:?}", t.stream_id, got.lost);
        assert_eq!(
            got.prior_instance, 0,
            "{name} {:#x}: a restored instance counts a crash, not another instance",
            t.stream_id
        );
        assert_eq!(
            cause("kernel_ring_full") + cause("oversized"),
            t.dropped.values().sum::<u64>(),
            "{name} {:#x}: {:?}",
            t.stream_id,
            got.lost
        );
        let class = proto_flat::StreamId(t.stream_id).class_code();
        if class < 2 {
            assert_eq!(cause("aggregator_crash"), 0, "{name} {:#x}: a P0/P1 frame was lost", t.stream_id);
        }
        *crash_by_node.entry(name.clone()).or_default() += cause("aggregator_crash");
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}: {got:?}", t.stream_id);
    }
    println!("bulk frames lost as aggregator_crash, per node: {crash_by_node:?}; forgotten by the logs: {forgotten:?}");
    for (name, n) in &crash_by_node {
        assert_eq!(
            *n,
            forgotten.get(name).copied().unwrap_or(0),
            "{name}: aggregator_crash is exactly what was forgotten"
        );
    }
}

/// Nothing refused, nothing closed for abuse, no dedup window full on an instance.
fn assert_nobody_refused(who: &str, i: &IngestDto) {
    assert_eq!(i.dedup_window_full, 0, "{who}: {i:?}");
    assert_eq!(i.connections_closed_abuse, 0, "{who}: {i:?}");
    assert!(i.rejected.is_empty(), "{who}: {i:?}");
}

/// Issue 16: the aggregator restarted once of each kind — SIGTERM (final snapshot),
/// SIGKILL with an older snapshot, SIGKILL with no state at all — under two shippers,
/// each restart followed by more applied batches than the (test-sized) dedup window
/// holds. Nobody is refused or locked out; after the last restart every frame of every
/// stream is received, lost with a known cause, or counted `prior_instance` (another
/// instance had it), against the generator's own counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_aggregator_restarts_of_every_kind_lock_no_shipper_out_regression_issue_16() {
    // Above the disorder one connection can cause (112 batch streams read at once).
    const WINDOW: u64 = 256;
    let dir = TempDir::new("restarts");
    let mut s = builtin::builtin("seed-case").expect("built in").expect("valid");
    // Long enough for four aggregator lifetimes; the shippers run in real time.
    s.duration_ms = 30_000;
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let snap = dir.path().join("aggregator.snap");
    let window = WINDOW.to_string();
    let extra = ["--dedup-window", window.as_str()];

    let (mut agg, quic, mut http) = spawn_aggregator(dir.path(), "127.0.0.1:0", &snap, &extra);
    let shippers = sim_shippers(&s, options, &set, quic, 0..2, Instant::now(), None);
    // More applied batches than the window holds, before each restart and after it.
    let enough = |i: &IngestDto| i.batches_applied > 3 * WINDOW && i.resumes >= 2;
    let i = wait_ingest(http, "instance 1 applied > 3 windows", enough).await;
    assert_nobody_refused("instance 1", &i);

    // 1. SIGTERM: a final snapshot; the next instance knows everything that was acked.
    signal(&agg, "-TERM");
    assert_eq!(agg.wait().expect("exits").code(), Some(0));
    let (a, q, h) = spawn_aggregator(dir.path(), &quic.to_string(), &snap, &extra);
    assert_eq!(q, quic);
    (agg, http) = (a, h);
    let i = wait_ingest(http, "instance 2 (after SIGTERM) applied > 3 windows", enough).await;
    assert_nobody_refused("instance 2", &i);
    let nodes: NodesDto = get_json(http, "/v1/nodes").await;
    for n in &nodes.nodes {
        assert_eq!(n.prior_instance, 0, "{}: a final snapshot forgets nothing: {:?}", n.name, n.streams);
        for st in &n.streams {
            assert!(!st.lost.contains_key("aggregator_crash"), "{} {:#x}: {:?}", n.name, st.stream_id, st.lost);
        }
        for st in &n.streams {
            assert!(!st.lost.contains_key("unknown"), "{} {:#x}: {:?}", n.name, st.stream_id, st.lost);
        }
    }

    // 2. SIGKILL with an older snapshot (every 300 ms): what was acked after it is gone.
    signal(&agg, "-KILL");
    let _ = agg.wait();
    let (a, _, h) = spawn_aggregator(dir.path(), &quic.to_string(), &snap, &extra);
    (agg, http) = (a, h);
    let i = wait_ingest(http, "instance 3 (after SIGKILL, snapshot) applied > 3 windows", enough).await;
    assert_nobody_refused("instance 3", &i);
    let nodes: NodesDto = get_json(http, "/v1/nodes").await;
    for n in &nodes.nodes {
        let crash: u64 = n.streams.iter().map(|st| st.lost.get("aggregator_crash").copied().unwrap_or(0)).sum();
        println!(
            "instance 3: {} aggregator_crash {crash} (bulk acked by instance 2 after its last snapshot), prior_instance {}",
            n.name, n.prior_instance
        );
        for st in &n.streams {
            assert!(!st.lost.contains_key("unknown"), "{} {:#x}: {:?}", n.name, st.stream_id, st.lost);
        }
    }

    // 3. SIGKILL and no state at all — and no snapshots from here on: durability `none`
    // (issue 20), so the shippers drop what awaited a durable ack once it says hello.
    signal(&agg, "-KILL");
    let _ = agg.wait();
    std::fs::remove_file(&snap).expect("instance 3 wrote a snapshot");
    let (a, _, h) = spawn_aggregator_with(dir.path(), &quic.to_string(), None, &extra);
    (agg, http) = (a, h);
    let h4: HealthzDto = get_json(http, "/healthz").await;
    assert_eq!((h4.durability.as_str(), h4.restored), ("none", false));
    let i = wait_ingest(http, "instance 4 (no state) applied > 3 windows", enough).await;
    assert_nobody_refused("instance 4", &i);
    assert!(i.resume_batches_settled > 0 && i.resume_stream_windows > 0, "{i:?}");

    // The run ends on state: every stream of both nodes reports the generator's whole
    // count, then the shippers flush and stop, then nothing is pending or in transit.
    let truth = truth(&s, options);
    let ours: Vec<_> = truth.streams.iter().filter(|t| t.node < 2).collect();
    let nodes = wait_nodes(http, "the scenario ran to its end and settled on both nodes", |n| {
        streams_settled(n, &truth, |node| node < 2)
    })
    .await;
    let reports = stop(shippers).await;
    let i: IngestDto = get_json(http, "/v1/ingest").await;
    assert_nobody_refused("instance 4, at the end", &i);
    signal(&agg, "-TERM");
    assert_eq!(agg.wait().expect("exits").code(), Some(0));

    for r in &reports {
        println!(
            "{}: {} connections, {} batches acked, nacks {:?}, frames in {}",
            r.node_name, r.connections, r.batches_acked, r.stats.nacks_by_reason, r.frames_in
        );
        assert_eq!(r.batches_nacked, 0, "{}: no shipper was refused", r.node_name);
        assert!(r.connections >= 4, "{}: one connection per instance at least", r.node_name);
        assert!(r.flushed, "{}: everything was acked at the end", r.node_name);
    }
    for n in &nodes.nodes {
        assert!(!n.knowledge_gaps.is_empty(), "{}: instance 4 says what it does not know", n.name);
        println!("instance 4: {} prior_instance {}", n.name, n.prior_instance);
    }
    // Per stream: received + lost (known causes) + prior_instance + sampled out = the
    // generator's count; kernel drops equal the generator's; nothing unknown.
    for t in ours {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        assert!(!got.lost.contains_key("unknown"), "{name} {:#x}: {:?}", t.stream_id, got.lost);
        let kernel = |c: &str| got.lost.get(c).copied().unwrap_or(0);
        assert_eq!(
            kernel("kernel_ring_full") + kernel("oversized"),
            t.dropped.values().sum::<u64>(),
            "{name} {:#x}: {:?} vs {:?}",
            t.stream_id,
            got.lost,
            t.dropped
        );
        assert_eq!(
            got.received + got.lost_total + got.prior_instance + got.sampled_out,
            t.generated,
            "{name} {:#x}: {got:?}",
            t.stream_id
        );
    }
}

/// Issue 18: a panic inside the core — injected in the timer task with the core's lock
/// held (test builds only), once the instance has applied batches and written a snapshot —
/// ends the process with exit code 70; an aggregator started again on the same port
/// restores the last snapshot and continues: every shipper reconnects, every stream of every node ends
/// exact (received, lost with a known cause, or `prior_instance`), and the new instance
/// is healthy and ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_a_core_panic_exits_nonzero_and_a_restart_from_the_snapshot_continues() {
    use aggregator::api::dto::ReadyzDto;
    let dir = TempDir::new("core-panic");
    let s = builtin::builtin("mixed").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let snap = dir.path().join("aggregator.snap");

    let (mut first, quic, http1) = spawn_aggregator(dir.path(), "127.0.0.1:0", &snap, &[]);
    let start = Instant::now();
    let shippers = sim_shippers(&s, options, &set, quic, 0..s.cluster.nodes, start, None);
    wait_ingest(http1, "instance 1 applied batches and snapshotted", |i| {
        i.batches_applied > 100 && i.last_snapshot_at_ms > 0
    })
    .await;
    let h1: HealthzDto = get_json(http1, "/healthz").await;
    assert_eq!(h1.status, "ok");
    let (status, _) = aggregator::api::client::get(http1, "/test/arm-timer-panic").await.expect("armed");
    assert_eq!(status, 200);
    // The process ends by itself; a test that never sees it fails on nextest's timeout.
    let status = loop {
        if let Some(st) = first.try_wait().expect("wait") {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("instance 1 exited at {:?}: {status:?}", start.elapsed());
    assert_eq!(status.code(), Some(70), "a core panic exits non-zero (70)");
    assert!(snap.exists(), "snapshots were written before the panic");

    let (mut second, quic2, http2) = spawn_aggregator(dir.path(), &quic.to_string(), &snap, &[]);
    assert_eq!(quic2, quic);
    let h2: HealthzDto = get_json(http2, "/healthz").await;
    assert!(h2.restored, "instance 2 restored the last snapshot");
    let truth = truth(&s, options);
    wait_nodes(http2, "every stream settled at instance 2", |n| streams_settled(n, &truth, |_| true)).await;
    let nodes: NodesDto = get_json(http2, "/v1/nodes").await;
    let health: HealthzDto = get_json(http2, "/healthz").await;
    let ready: ReadyzDto = get_json(http2, "/readyz").await;
    let reports = stop(shippers).await;
    signal(&second, "-TERM");
    assert_eq!(second.wait().expect("exits").code(), Some(0));
    println!("instance 2: {health:?}");
    assert_eq!(health.status, "ok");
    assert!(ready.ready, "{ready:?}");
    assert!(
        health
            .tasks
            .iter()
            // Optional, or the shard roles' (this is role `all`).
            .filter(|t| !matches!(t.name.as_str(), "snapshots" | "pressure" | "otlp" | "cluster" | "cluster_state"))
            .all(|t| t.alive && t.panics == 0)
    );
    for r in &reports {
        assert!(r.connections >= 2, "{} reconnected to instance 2", r.node_name);
    }
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        assert_eq!(got.lost.get("unknown"), None, "{name} {:#x}: {:?}", t.stream_id, got.lost);
        assert_eq!(
            got.received + got.lost_total + got.prior_instance + got.sampled_out,
            t.generated,
            "{name} {:#x}",
            t.stream_id
        );
    }
}

/// Issue 18: supervision in process (test hooks). An HTTP handler's panic is answered
/// 500, counted and logged, and the server goes on; a panic with the core's lock held
/// fails the core: `failed()` resolves, `/healthz` says `failed` (503), `/readyz` is 503,
/// handlers that read the core or the verdicts answer 503 instead of reading half-updated
/// state, and no snapshot can be written any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_handler_panics_are_contained_and_a_core_panic_fails_the_service() {
    use aggregator::api::client::get;
    use aggregator::api::dto::ReadyzDto;
    let dir = TempDir::new("supervise");
    let set = cert_set(dir.path(), 1);
    let agg = aggregator::Aggregator::start(aggregator::AggregatorConfig::local(&set)).await.expect("starts");
    let http = agg.http_addr;

    let (status, _) = get(http, "/test/panic").await.expect("answered");
    assert_eq!(status, 500);
    let h: HealthzDto = get_json(http, "/healthz").await;
    assert_eq!((h.status.as_str(), h.handler_panics), ("ok", 1), "{h:?}");
    let r: ReadyzDto = get_json(http, "/readyz").await;
    assert!(r.ready, "{r:?}");
    let timers = h.tasks.iter().find(|t| t.name == "timers").expect("timers task");
    assert!(timers.alive && timers.last_progress_ago_ms.is_some(), "{timers:?}");

    let (status, _) = get(http, "/test/arm-timer-panic").await.expect("armed");
    assert_eq!(status, 200);
    // Waits on the state; a test that never sees it fails on nextest's timeout.
    let why = agg.failed().await;
    assert!(why.contains("timers"), "{why}");
    let (status, body) = get(http, "/healthz").await.expect("answered");
    assert_eq!(status, 503, "{body}");
    let h: HealthzDto = serde_json::from_str(&body).expect("json");
    assert_eq!(h.status, "failed");
    assert!(h.tasks.iter().any(|t| t.name == "timers" && !t.alive && t.panics == 1), "{h:?}");
    let (status, body) = get(http, "/readyz").await.expect("answered");
    assert_eq!(status, 503, "{body}");
    for path in ["/v1/nodes", "/v1/ingest", "/v1/verdicts"] {
        let (status, body) = get(http, path).await.expect("answered");
        assert_eq!(status, 503, "{path}: {body}");
    }
    let snap = dir.path().join("after-failure.snap");
    assert!(!aggregator::snapshot_now(&agg.shared, &snap), "a failed core is never snapshotted");
    assert!(!snap.exists());
    agg.shutdown();
}

/// Every stream of the nodes `include` accepts is exact against the generator: received,
/// kernel drops and sampled out add up to what it generated; nothing else is lost, and
/// nothing is another instance's.
fn assert_exact(nodes: &NodesDto, truth: &loadgen_sim::GroundTruth, include: impl Fn(u32) -> bool) {
    for t in truth.streams.iter().filter(|t| include(t.node)) {
        let name = aggregator::certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        let kernel =
            got.lost.get("kernel_ring_full").copied().unwrap_or(0) + got.lost.get("oversized").copied().unwrap_or(0);
        assert_eq!(kernel, t.dropped.values().sum::<u64>(), "{name} {:#x}: {:?}", t.stream_id, got.lost);
        assert_eq!(got.lost_total, kernel, "{name} {:#x}: {:?}", t.stream_id, got.lost);
        assert_eq!(got.prior_instance, 0, "{name} {:#x}", t.stream_id);
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}: {got:?}", t.stream_id);
    }
}

/// Issue 20, version skew on the wire: a rolling upgrade keeps working in both orders.
/// (a) A shipper one release behind (control protocol 2: its hello has no durability,
/// every ack is final) beside a current one, against this aggregator: both are served,
/// the old one is acked as before, the new one durably. (b) A current shipper against an
/// aggregator one release behind (it refuses protocol 3): the shipper falls back to 2
/// after one refused connection. Every stream of every node exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_a_shipper_or_an_aggregator_one_release_behind_keeps_working_issue_20() {
    let dir = TempDir::new("skew");
    let s = builtin::builtin("mixed").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let (mut current, quic, http) = spawn_aggregator(dir.path(), "127.0.0.1:0", &dir.path().join("a.snap"), &[]);
    let (mut old, quic_old, http_old) =
        spawn_aggregator(dir.path(), "127.0.0.1:0", &dir.path().join("b.snap"), &["--test-max-control-version", "2"]);
    let start = Instant::now();
    let mut shippers = sim_shippers(&s, options, &set, quic, 0..1, start, Some(2));
    shippers.extend(sim_shippers(&s, options, &set, quic, 1..2, start, None));
    shippers.extend(sim_shippers(&s, options, &set, quic_old, 2..3, start, None));
    let truth = truth(&s, options);
    let nodes = wait_nodes(http, "nodes 0 and 1 settled", |n| streams_settled(n, &truth, |node| node < 2)).await;
    let nodes_old = wait_nodes(http_old, "node 2 settled", |n| streams_settled(n, &truth, |node| node == 2)).await;
    let reports = stop(shippers).await;
    let ingest: IngestDto = get_json(http, "/v1/ingest").await;
    let ingest_old: IngestDto = get_json(http_old, "/v1/ingest").await;
    for (p, h) in [(&mut current, http), (&mut old, http_old)] {
        let _: HealthzDto = get_json(h, "/healthz").await;
        signal(p, "-TERM");
        assert_eq!(p.wait().expect("exits").code(), Some(0));
    }
    for r in &reports {
        println!(
            "{}: protocol {}, durability {}, kept {} durable {} lag {:?}, {} connections",
            r.node_name,
            r.control_version,
            r.durability,
            r.batches_kept_for_durable,
            r.batches_durable,
            r.durable_lag,
            r.connections
        );
        assert!(r.flushed && r.batches_nacked == 0, "{}: {r:?}", r.node_name);
    }
    let (behind, current_shipper, upgraded) = (&reports[0], &reports[1], &reports[2]);
    assert_eq!((behind.control_version, behind.durability.as_str()), (2, "none"));
    assert_eq!(behind.batches_kept_for_durable, 0, "a protocol-2 shipper's acks are final");
    assert_eq!((current_shipper.control_version, current_shipper.durability.as_str()), (3, "snapshot"));
    assert!(current_shipper.batches_durable > 0);
    assert_eq!((upgraded.control_version, upgraded.durability.as_str()), (2, "none"), "fell back to protocol 2");
    assert!(upgraded.connections >= 2, "one refused connection, then protocol 2");
    assert_eq!(ingest.connections_protocol_2, 1, "{ingest:?}");
    assert!(ingest_old.protocol_refused >= 1, "{ingest_old:?}");
    assert_exact(&nodes, &truth, |node| node < 2);
    assert_exact(&nodes_old, &truth, |node| node == 2);
}

/// Issue 20, version skew on disk: a snapshot of the previous format (version 11,
/// written by the build before this one — `tests/fixtures/snapshot-v11.snap`) does not
/// crash-loop the aggregator or make it start blind: it starts fresh, says so in
/// `/healthz`, keeps the file aside, continues the epoch, and every node it hears from
/// gets a knowledge gap from the snapshot's time; the next restart restores its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_a_snapshot_of_the_previous_format_starts_fresh_with_a_knowledge_gap_issue_20() {
    let dir = TempDir::new("old-snapshot");
    let fixture =
        std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/snapshot-v11.snap")).expect("fixture");
    let word = |i: usize| u64::from_le_bytes(fixture[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
    let (fixture_ns, fixture_epoch) = (word(0), word(2));
    assert_eq!(u32::from_le_bytes(fixture[48..52].try_into().expect("4 bytes")), 11, "a version-11 core inside");
    let snap = dir.path().join("aggregator.snap");
    std::fs::write(&snap, &fixture).expect("copy");

    let s = builtin::builtin("mixed").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let (mut agg, quic, http) = spawn_aggregator(dir.path(), "127.0.0.1:0", &snap, &[]);
    let h: HealthzDto = get_json(http, "/healthz").await;
    assert!(!h.restored);
    let skipped = h.snapshot_skipped.expect("the old snapshot is reported");
    assert_eq!(skipped.version, 11);
    assert_eq!(std::fs::read(&skipped.kept_at).expect("kept aside"), fixture);
    assert_eq!(h.aggregator_epoch, fixture_epoch + 1, "the epoch continues");
    let shippers = sim_shippers(&s, options, &set, quic, 0..1, Instant::now(), None);
    let truth = truth(&s, options);
    let nodes = wait_nodes(http, "node 0 settled", |n| streams_settled(n, &truth, |node| node == 0)).await;
    let reports = stop(shippers).await;
    assert!(reports[0].flushed);
    let node = &nodes.nodes[0];
    println!("{}: knowledge gaps {:?}", node.name, node.knowledge_gaps);
    assert_eq!(
        node.knowledge_gaps.first().map(|g| g.from_ms),
        Some(fixture_ns / 1_000_000),
        "from the old snapshot's time"
    );
    assert_exact(&nodes, &truth, |node| node == 0);

    // The next start restores the snapshot this build wrote.
    signal(&agg, "-TERM");
    assert_eq!(agg.wait().expect("exits").code(), Some(0));
    let (mut again, _, http2) = spawn_aggregator(dir.path(), "127.0.0.1:0", &snap, &[]);
    let h2: HealthzDto = get_json(http2, "/healthz").await;
    assert!(h2.restored && h2.snapshot_skipped.is_none(), "{h2:?}");
    assert_eq!(h2.aggregator_epoch, fixture_epoch + 2);
    signal(&again, "-TERM");
    assert_eq!(again.wait().expect("exits").code(), Some(0));
}
