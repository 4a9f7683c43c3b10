//! The demo scenario for simulated hours through the real state machines: every node's
//! `ShipperCore` and the aggregator's `Core`, wired by the pair harness
//! (`ringwatch_tests::pair`) over a modelled QUIC network with partitions and resets, in
//! simulated time (no sleeps, no clock: the same seeds give the same run).
//!
//! The workload is `loadgen/scenarios/demo.toml` (what `loadgen demo` runs: 8 nodes × 4
//! GPUs, a world all-reduce and a per-node tensor-parallel all-gather, 8 channels each,
//! the demo's timers), compressed so that an hour runs in CI's debug test build in well
//! under its budget (see [`demo`] for exactly what changes), with the demo's three faults
//! — a P0 ring overflow on node 3, node 5's GPU 2 hanging before contributing, node 7
//! dying — the overflow repeated through the run and the hang and the death moved to its
//! last minutes (at the demo's 4 s and 7 s the world all-reduce would stay hung for the
//! rest of the run).
//!
//! Checked: every final verdict against the simulator's truth with the scorer's table
//! and equivalences (judged as the core yields it, then dropped); nothing owed left
//! non-final; every stream conserved exactly (`loadgen::score::conservation`); each
//! shipper's per-lane identity (`in = acked + lost + unacked`); every map the core
//! reports within its cap at every simulated minute. Nothing here asserts on wall time.

use std::fmt::Write as _;

use loadgen_sim::scenario::{Fault, HangMode, RingKind};
use loadgen_sim::{Scenario, SimOptions, builtin};
use ringwatch_core::MatcherConfig;
use ringwatch_tests::pair::{NetConfig, NetFault, Pair, PairConfig, Report};

const S: u64 = 1_000_000_000;
const MIN: u64 = 60 * S;

/// The demo scenario run for `duration_ms`, compressed for a debug build: collectives 20 times
/// less often (the world all-reduce every 4 s instead of 200 ms, the tensor-parallel
/// all-gather every 2 s instead of 100 ms), bulk at scale 2·10⁻⁷ (≈ 13 packet frames/s
/// per node) instead of `loadgen demo`'s 10⁻⁴. The cluster (8 nodes × 4 GPUs, 2 CPUs each),
/// the communicators, op sizes, durations, channels, run-ahead and timers are the demo's.
/// Faults: the demo's 60 ms P0 ring overflow on node 3 at 2 s and again every 15
/// minutes; node 5's GPU 2 hangs before contributing 3 minutes before the end; node 7
/// dies 2 minutes before the end.
fn demo(duration_ms: u64) -> (Scenario, SimOptions) {
    let mut s = builtin::builtin("demo").expect("the demo is built in").expect("it validates");
    s.duration_ms = duration_ms;
    for comm in &mut s.comms {
        for op in &mut comm.ops {
            op.period_ms *= 20.0;
        }
    }
    s.faults.clear();
    let mut at = 2_000;
    while at < duration_ms {
        s.faults.push(Fault::RingOverflow {
            node: 3,
            ring: RingKind::P0,
            from_ms: at,
            until_ms: at + 60,
            fraction: 1.0,
        });
        at += 15 * 60_000;
    }
    s.faults.push(Fault::GpuHang { node: 5, gpu: 2, at_ms: duration_ms - 180_000, mode: HangMode::BeforeContributing });
    s.faults.push(Fault::NodeDead { node: 7, at_ms: duration_ms - 120_000 });
    (s, SimOptions { bulk_scale: 2e-7, seed: None })
}

/// Network faults for `hours`, the same pattern every hour: resets (two of them 10 ms
/// into a world all-reduce), a partition shorter than the silent timer (5 s), one longer
/// than QUIC's idle timeout (10 s: the connection dies inside it, and the next handshake
/// completes when it heals), and one longer than the unreachable timer (60 s: handshakes
/// fail until it heals). None on node 7 (it dies), and none in the last hour's last
/// minutes, where the hang and the death play out.
fn net_faults(hours: u64) -> Vec<NetFault> {
    let mut out = Vec::new();
    for h in 0..hours {
        let base = h * 60 * MIN;
        let last = h + 1 == hours;
        out.extend([
            NetFault::Reset { node: 2, at_ns: base + 7 * MIN + 10 * 1_000_000 },
            NetFault::Partition { node: 1, from_ns: base + 15 * MIN, until_ns: base + 15 * MIN + 3 * S },
            NetFault::Reset { node: 6, at_ns: base + 23 * MIN + 32 * S + 12 * 1_000_000 },
            NetFault::Partition { node: 5, from_ns: base + 32 * MIN, until_ns: base + 32 * MIN + 20 * S },
            NetFault::Reset { node: 0, at_ns: base + 41 * MIN + 10 * S },
            NetFault::Partition { node: 3, from_ns: base + 48 * MIN, until_ns: base + 48 * MIN + 70 * S },
        ]);
        if !last {
            out.push(NetFault::Reset { node: 4, at_ns: base + 55 * MIN });
        }
    }
    out
}

fn config(duration_ms: u64, faults: Vec<NetFault>) -> PairConfig {
    let (scenario, options) = demo(duration_ms);
    PairConfig {
        scenario,
        options,
        net: NetConfig { seed: 7, ..NetConfig::default() },
        faults,
        // Longer than the unreachable timer plus the time an unreachable node still
        // gates finality (`dead_after_ns`, 300 s), and many stuck deadlines: whatever can
        // be final by then is (node 7 dies near the end).
        settle_ns: 90 * S + MatcherConfig::default().dead_after_ns,
        poll_ns: 1_000_000,
        map_check_ns: MIN,
        keep_verdicts: false,
        role: ringwatch_core::shard::Role::All,
    }
}

fn table(r: &Report) -> String {
    let mut o = String::new();
    let v = &r.verdicts;
    let _ = writeln!(
        o,
        "verdicts: decidable ranks {}, judged {}, right {}, wrong {} ({} right only through lost frames); \
         re-finals {} ({} wrong); not scored {}; unknown {}; non-final events {}; recovered {}",
        v.decidable_ranks,
        v.judged,
        v.right,
        v.wrong,
        v.right_by_lost_frames,
        v.refinals,
        v.refinals_wrong,
        v.not_scored,
        v.unknown,
        v.non_final_events,
        v.recovered_events
    );
    let _ = writeln!(
        o,
        "left without a final verdict: {} ({} old, {} of them gated by the dead node); ops never issued {}",
        v.non_final, v.non_final_old, v.non_final_old_gated_by_dead, v.ops_never_issued
    );
    for (k, n) in &v.right_by_outcome {
        let _ = writeln!(o, "  right {k:<28} {n}");
    }
    for (k, n) in &v.wrong_by_kind {
        let _ = writeln!(o, "  WRONG {k:<40} {n}");
    }
    if !v.wrong_by_node.is_empty() {
        let _ = writeln!(o, "  wrong by the rank's node: {:?}", v.wrong_by_node);
    }
    for w in &v.wrong_examples {
        let _ = writeln!(o, "  WRONG {w}");
    }
    for w in &v.non_final_examples {
        let _ = writeln!(o, "  NOT FINAL {w}");
    }
    let _ = writeln!(o, "maps ({} checks): {:<32} {:>12} {:>20}", r.map_checks, "name", "high-water", "cap");
    for (name, w) in &r.maps {
        let _ = writeln!(o, "  {name:<46} {:>12} {:>20}", w.high, w.cap);
    }
    for (name, len, cap, at) in &r.map_violations {
        let _ = writeln!(o, "  OVER CAP {name}: {len} > {cap} at {} s", at / S);
    }
    let _ = writeln!(
        o,
        "{:<10} {:>7} {:>6} {:>6} {:>10} {:>10} {:>8} {:>8}  note",
        "node", "streams", "exact", "=gen", "generated", "received", "lost", "sampled"
    );
    for c in &r.conservation {
        let note = if c.dead { format!("died: {} never reported", c.unknowable_tail) } else { String::new() };
        let _ = writeln!(
            o,
            "{:<10} {:>7} {:>6} {:>6} {:>10} {:>10} {:>8} {:>8}  {note}",
            c.node, c.streams, c.exact, c.equal_to_generator, c.generated, c.received, c.lost, c.sampled_out
        );
    }
    for s in &r.shippers {
        let st = &s.stats;
        let _ = writeln!(
            o,
            "shipper {}: frames from sim {}, in {}, acked {} ({} batches), lost {:?}, unacked {} frames; \
             connections {} (failed handshakes {}), lane resends {}, nacked {}{}",
            s.node,
            s.frames_from_sim,
            st.frames_in,
            st.frames_acked,
            st.batches_acked,
            st.frames_lost_by_lane,
            s.unacked.frames,
            s.connections,
            s.connect_failures,
            st.lane_resends,
            st.batches_nacked,
            if s.dead { " — node dead" } else { "" }
        );
    }
    let _ = writeln!(o, "net: {:?}", r.net);
    let _ = writeln!(o, "ingest: {:?}", r.ingest);
    let _ = writeln!(o, "matcher: {:?}", r.matcher);
    let _ = writeln!(
        o,
        "records {}, timer turns {}, simulated {} s + {} s settling",
        r.records,
        r.timer_turns,
        r.sim_end_ns / S,
        (r.end_ns - r.sim_end_ns) / S
    );
    o
}

/// Every check of the module docs; returns the ones that failed (all of them, so one
/// run shows everything wrong).
fn check(r: &Report) -> Vec<String> {
    let mut failed = Vec::new();
    let mut need = |ok: bool, what: String| {
        if !ok {
            failed.push(what);
        }
    };
    let v = &r.verdicts;
    need(r.map_violations.is_empty(), format!("maps within their caps: {:?}", r.map_violations));
    need(r.map_checks >= r.sim_end_ns / MIN, format!("maps checked every simulated minute: {} checks", r.map_checks));
    need(
        (v.wrong, v.refinals_wrong, v.unknown) == (0, 0, 0),
        format!(
            "every final verdict right: {} wrong, {} wrong re-finals, {} of unknown ops; {:?}",
            v.wrong, v.refinals_wrong, v.unknown, v.wrong_by_kind
        ),
    );
    need(
        v.non_final_old == v.non_final_old_gated_by_dead,
        format!("nothing owed left non-final but behind the dead node: {:?}", v.non_final_examples),
    );
    need(v.judged + v.non_final == v.decidable_ranks, "every decidable rank judged or counted non-final".into());
    need(v.right_by_outcome.get("stuck").copied().unwrap_or(0) >= 1, "the hung GPU found stuck".into());
    // Conservation: every stream exact; the live nodes' streams also equal to what the
    // generator made, cause by cause (the shippers lost nothing: their spools held through
    // every partition).
    for c in &r.conservation {
        need(c.exact == c.streams, format!("{}: every stream exact: {c:?}", c.node));
        need(
            c.dead || c.equal_to_generator == c.streams,
            format!("{}: streams equal to the generator's: {c:?}", c.node),
        );
    }
    need(r.conservation.iter().any(|c| c.lost > 0), "the ring overflows counted as loss".into());
    for s in r.shippers.iter().filter(|s| !s.dead) {
        let st = &s.stats;
        need(st.frames_in == s.frames_from_sim, format!("shipper {}: every ring frame handed in", s.node));
        for lane in 0..4 {
            let sum = st.frames_acked_by_lane[lane] + st.frames_lost_by_lane[lane] + s.unacked.frames_by_lane[lane];
            need(
                st.frames_in_by_lane[lane] == sum,
                format!(
                    "shipper {} lane {lane}: in {} = acked + lost + unacked {sum}",
                    s.node, st.frames_in_by_lane[lane]
                ),
            );
        }
        need(
            st.frames_lost.iter().sum::<u64>() == 0,
            format!("shipper {}: nothing lost: {:?}", s.node, st.frames_lost),
        );
    }
    let i = &r.ingest;
    need(
        (
            i.implausible_batches,
            i.implausible_resumes,
            i.malformed_frames,
            i.streams_refused_frames,
            i.nodes_refused_batches,
        ) == (0, 0, 0, 0, 0),
        format!("ingest refused nothing: {i:?}"),
    );
    need(r.matcher.revisions_after_final == 0, "no verdict changed after it was final".into());
    need(
        r.net.resets > 0 && r.net.partition_closes > 0 && r.net.handshakes_failed > 0,
        format!("the faults happened: {:?}", r.net),
    );
    failed
}

fn run(hours: u64) {
    let started = std::time::Instant::now();
    let report = Pair::new(config(hours * 3_600_000, net_faults(hours))).run();
    print!("{}", table(&report));
    println!("wall time {:.1} s (printed only; nothing depends on it)", started.elapsed().as_secs_f64());
    let failed = check(&report);
    assert!(failed.is_empty(), "{} check(s) failed:\n{}", failed.len(), failed.join("\n"));
}

#[test]
fn simulated_hour_of_the_demo_scenario_is_judged_right() {
    run(1);
}

/// The same for 24 simulated hours (`.ci/long`).
#[test]
#[ignore = "24 simulated hours: minutes of CPU; run by .ci/long"]
fn simulated_day_of_the_demo_scenario() {
    run(24);
}

/// The harness is a function of its configuration: two runs of 4 simulated minutes with
/// a reset and a partition past the idle timeout give the same report, field for field.
#[test]
fn pair_runs_are_deterministic() {
    let faults = vec![
        NetFault::Reset { node: 2, at_ns: 30 * S },
        NetFault::Partition { node: 1, from_ns: 50 * S, until_ns: 65 * S },
    ];
    let a = Pair::new(config(4 * 60_000, faults.clone())).run();
    let b = Pair::new(config(4 * 60_000, faults)).run();
    assert!(a.verdicts.judged > 1_000 && a.net.resets == 1 && a.net.partition_closes == 1, "{a:?}");
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
}
