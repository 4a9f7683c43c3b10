//! SIGTERM with unacked batches, as a process (issue 7): the aggregator holds every ack
//! back (its test hook), the shipper gets SIGTERM with hundreds of batches unacked, waits
//! out its shutdown deadline, exits 0, and reports exactly what it could not flush.
//!
//! Named `net_*`: real timers, run alone (nextest group `network-timing`).

use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use aggregator::{Aggregator, AggregatorConfig, certs};
use loadgen_sim::capture::CaptureWriter;
use loadgen_sim::{SimOptions, Simulation, builtin};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_sigterm_with_unacked_batches_reports_them_and_exits_0() {
    let dir = std::env::temp_dir().join(format!("rw-sigterm-{}", std::process::id()));
    let set = certs::init(&dir, &[certs::node_name(0)]).expect("certificates");
    // A capture of node 0 of a 4-node scenario, replayed unpaced.
    let capture = dir.join("run.rwcap");
    let s = builtin::builtin("bulk-heavy-loss").expect("built in").expect("valid");
    let mut sim = Simulation::new(&s, SimOptions { bulk_scale: 1e-4, seed: None }).expect("sim");
    let mut w = CaptureWriter::new(std::fs::File::create(&capture).expect("capture file"), s.cluster.nodes, s.seed)
        .expect("capture header");
    sim.run(&mut w);
    w.finish().expect("capture written");

    let mut cfg = AggregatorConfig::local(&set);
    cfg.hold_acks = true;
    let agg = Aggregator::start(cfg).await.expect("aggregator");
    let (cert, key) = set.node(&certs::node_name(0));
    let child = Command::new(env!("CARGO_BIN_EXE_node-shipper"))
        .args(["--aggregator", &agg.quic_addr.to_string(), "--server-name", "localhost"])
        .args(["--node-name", &certs::node_name(0)])
        .arg("--ca")
        .arg(&set.ca)
        .arg("--cert")
        .arg(&cert)
        .arg("--key")
        .arg(&key)
        .arg("--source")
        .arg(format!("capture:{}", capture.display()))
        .args(["--replay-speed-pct", "0", "--max-batch-bytes", "4096", "--bulk-batch-bytes", "4096"])
        .args(["--shutdown-deadline-ms", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node-shipper starts");

    // Wait until the aggregator has applied (and withheld acks for) ≥ 100 batches.
    let by = Instant::now() + Duration::from_secs(30);
    while agg.shared.counters.batches_applied.load(Ordering::Relaxed) < 100 && Instant::now() < by {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let applied = agg.shared.counters.batches_applied.load(Ordering::Relaxed);
    assert!(applied >= 100, "only {applied} batches reached the aggregator");
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(kill.success());
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.expect("join").expect("wait");
    let took = started.elapsed();
    agg.shutdown();
    let _ = std::fs::remove_dir_all(&dir);

    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "exit 0 after SIGTERM; stderr:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("a JSON report");
    println!("report: {report}\nshutdown took {took:?}");
    let n = |k: &str| report[k].as_u64().unwrap_or_else(|| panic!("{k} in {report}"));
    let lanes = |k: &str| -> Vec<u64> { report[k].as_array().expect(k).iter().map(|x| x.as_u64().unwrap()).collect() };
    assert_eq!(report["ended"], "shutdown");
    assert_eq!(report["flushed"], false, "nothing was acked, so the deadline passed");
    assert_eq!(n("batches_acked"), 0);
    // Issue 16: the ring frames of the ≥ 100 unacked batches are given up as
    // `shipper_shutdown` loss records (held acks keep those records unacked too, so the
    // P1 batches carrying them are what is left unflushed).
    assert!(n("frames_lost_shutdown") > 0, "{report}");
    assert!(n("unflushed_batches") >= 1, "{report}");
    assert!(stderr.contains("unacked"), "the shutdown warning names what was not flushed:\n{stderr}");
    // Every ring frame read is acked, named in a loss record, or reported unflushed.
    let acked = lanes("frames_acked_by_lane");
    let unflushed = lanes("unflushed_frames_by_lane");
    let ring = |v: &[u64]| v[0] + v[2] + v[3];
    assert!(n("frames_in") > 0);
    assert_eq!(
        n("frames_in"),
        ring(&acked)
            + n("frames_lost_spool_full")
            + n("frames_lost_rejected")
            + n("frames_lost_shutdown")
            + ring(&unflushed),
        "{report}"
    );
    // Per lane, P1 (the shipper's own frames) included: in = acked + lost (unflushed
    // batches are counted lost there).
    let (inn, lost) = (lanes("frames_in_by_lane"), lanes("frames_lost_by_lane"));
    for lane in 0..4 {
        assert_eq!(inn[lane], acked[lane] + lost[lane], "lane {lane}: {report}");
    }
    assert!(inn[1] > 0, "P1 carried heartbeats and loss records");
}
