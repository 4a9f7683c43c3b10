//! `loadgen`: run, score, demo, bench. Exit codes: 0 ok, 1 runtime failure (or, with
//! `--check`, a score that is not perfect), 2 usage.

use std::process::ExitCode;

use clap::{Arg, ArgAction, ArgMatches, Command, value_parser};
use loadgen::cluster::{self, RunResult, RunSpec};
use loadgen::{demo, score};
use loadgen_sim::{Scenario, builtin};

fn common(cmd: Command) -> Command {
    cmd.arg(Arg::new("seed").long("seed").value_parser(value_parser!(u64)).help("replace the scenario's seed"))
        .arg(
            Arg::new("scale")
                .long("scale")
                .value_parser(value_parser!(f64))
                .help("bulk event rate as a fraction of the scenario's line rate"),
        )
        .arg(
            Arg::new("time-scale")
                .long("time-scale")
                .default_value("1")
                .value_parser(value_parser!(f64))
                .help("run simulated time (and the aggregator's clock) this many times faster than real time"),
        )
        .arg(Arg::new("quiet").long("quiet").action(ArgAction::SetTrue).help("no progress bar"))
}

fn command() -> Command {
    Command::new("loadgen")
        .about("ringwatch load generator: run a simulated cluster for real and score the verdicts")
        .subcommand_required(true)
        .subcommand(
            common(
                Command::new("run")
                    .about("run a scenario through real shippers and an embedded aggregator; score against the truth"),
            )
            .arg(Arg::new("scenario").required(true).help("a built-in scenario name, or a scenario TOML file"))
            .arg(Arg::new("json").long("json").action(ArgAction::SetTrue).help("print the score as JSON"))
            .arg(Arg::new("check").long("check").action(ArgAction::SetTrue).help("exit 1 unless the score is perfect"))
            .arg(
                Arg::new("net-drop")
                    .long("net-drop")
                    .value_parser(value_parser!(f64))
                    .help("put the UDP fault proxy between shippers and aggregator: drop this fraction of datagrams"),
            )
            .arg(
                Arg::new("net-delay-ms")
                    .long("net-delay-ms")
                    .value_parser(value_parser!(u64))
                    .help("fault proxy: delay every datagram this long"),
            )
            .arg(
                Arg::new("net-jitter-ms")
                    .long("net-jitter-ms")
                    .value_parser(value_parser!(u64))
                    .help("fault proxy: add up to this much random delay"),
            )
            .arg(
                Arg::new("aggregator")
                    .long("aggregator")
                    .value_parser(value_parser!(std::net::SocketAddr))
                    .requires_all(["api", "certs"])
                    .help("drive an aggregator already running at this QUIC address (with --api and --certs)"),
            )
            .arg(
                Arg::new("api")
                    .long("api")
                    .value_parser(value_parser!(std::net::SocketAddr))
                    .requires("aggregator")
                    .help("that aggregator's HTTP address"),
            )
            .arg(
                Arg::new("certs")
                    .long("certs")
                    .value_parser(value_parser!(std::path::PathBuf))
                    .requires("aggregator")
                    .help("the certificate directory that aggregator was started with (`aggregator certs init`)"),
            ),
        )
        .subcommand(
            common(Command::new("demo").about("the demo cluster: 8 nodes, a P0 overflow, a hung GPU, a dead node"))
                .arg(
                    Arg::new("hold")
                        .long("hold")
                        .action(ArgAction::SetTrue)
                        .help("keep the aggregator serving; print its URL"),
                ),
        )
        .subcommand(Command::new("list").about("list the built-in scenarios"))
        .subcommand(
            Command::new("soak")
                .about("run aggregator and shippers for a long while with restarts of either side; a line per minute (RSS, snapshot, accounting, verdicts)")
                .arg(
                    Arg::new("minutes")
                        .long("minutes")
                        .value_parser(value_parser!(u64).range(1..=10_080))
                        .conflicts_with("seconds")
                        .help("how long [default: 30]"),
                )
                .arg(
                    Arg::new("seconds")
                        .long("seconds")
                        .value_parser(value_parser!(u64).range(10..=604_800))
                        .help("how long, in seconds (short runs: CI)"),
                )
                .arg(
                    Arg::new("restart-every-s")
                        .long("restart-every-s")
                        .default_value("60")
                        .value_parser(value_parser!(u64).range(0..=86_400))
                        .help("about how often the aggregator or a shipper restarts (±25 %); 0: never"),
                )
                .arg(
                    Arg::new("aggregator-bin")
                        .long("aggregator-bin")
                        .value_parser(value_parser!(std::path::PathBuf))
                        .help("the aggregator binary to run as its own process [default: the one beside loadgen; else embedded]"),
                )
                .arg(Arg::new("embedded").long("embedded").action(ArgAction::SetTrue).conflicts_with("aggregator-bin").help("run the aggregator inside loadgen"))
                .arg(Arg::new("scale").long("scale").default_value("0.0001").value_parser(value_parser!(f64)).help("bulk rate, fraction of line rate"))
                .arg(Arg::new("seed").long("seed").default_value("1").value_parser(value_parser!(u64)))
                .arg(Arg::new("net-drop").long("net-drop").value_parser(value_parser!(f64)).help("fault proxy: drop this fraction of datagrams"))
                .arg(Arg::new("net-delay-ms").long("net-delay-ms").value_parser(value_parser!(u64)).help("fault proxy: delay every datagram this long"))
                .arg(Arg::new("net-jitter-ms").long("net-jitter-ms").value_parser(value_parser!(u64)).help("fault proxy: add up to this much random delay"))
                .arg(Arg::new("json").long("json").action(ArgAction::SetTrue).help("print the result as JSON at the end")),
        )
        .subcommand(
            Command::new("size")
                .about("ring, spool and aggregator sizing for a scenario (or `all`), from this machine's measured figures")
                .arg(Arg::new("scenario").required(true).help("a built-in scenario, a scenario file, or `all`"))
                .arg(
                    Arg::new("drain-gap-us")
                        .long("drain-gap-us")
                        .value_parser(value_parser!(f64))
                        .help("p99.9 gap between ring drains, µs (default: measured here by loadgen bench)"),
                )
                .arg(
                    Arg::new("ingest-ns")
                        .long("ingest-ns")
                        .value_parser(value_parser!(f64))
                        .help("aggregator ingest ns per frame (default: measured here)"),
                )
                .arg(
                    Arg::new("aggregator-ns")
                        .long("aggregator-ns")
                        .value_parser(value_parser!(f64))
                        .help("whole aggregator (QUIC + ingest + API) ns per frame (default: measured here)"),
                ),
        )
        .subcommand(
            Command::new("scale")
                .about("the scale-out roles on this machine: matcher records/s and ingest frames/s through 1 and 2 shards over a local JetStream, and a 1,000-node run (use --profile perf; needs nats-server)")
                .arg(Arg::new("nodes").long("nodes").default_value("64").value_parser(value_parser!(u32).range(1..=4096)).help("nodes of the matcher measurement"))
                .arg(Arg::new("rounds").long("rounds").default_value("400").value_parser(value_parser!(u64).range(1..=1_000_000)).help("all-reduce rounds of the matcher measurement"))
                .arg(Arg::new("ingest-batches").long("ingest-batches").default_value("4096").value_parser(value_parser!(u32).range(8..=1_000_000)).help("pre-built batches per ingest shard"))
                .arg(Arg::new("big-nodes").long("big-nodes").default_value("1000").value_parser(value_parser!(u32).range(1..=4096)).help("nodes of the large run"))
                .arg(Arg::new("big-rounds").long("big-rounds").default_value("400").value_parser(value_parser!(u64).range(1..=1_000_000)).help("rounds of the large run")),
        )
        .subcommand(
            Command::new("bench")
                .about("per-component figures: shipper core, aggregator ingest, end to end over QUIC, raw quinn, protobuf (use --profile perf)")
                .arg(
                    Arg::new("seconds")
                        .long("seconds")
                        .default_value("5")
                        .value_parser(value_parser!(f64))
                        .help("length of the end-to-end run"),
                ),
        )
}

fn scenario(name: &str) -> Result<Scenario, String> {
    match builtin::builtin(name) {
        Some(s) => s.map_err(|e| e.to_string()),
        None => {
            let text = std::fs::read_to_string(name).map_err(|e| {
                format!("{name:?} is not a built-in scenario (`loadgen list`), and reading it as a file: {e}")
            })?;
            Scenario::parse(&text).map_err(|e| e.to_string())
        }
    }
}

fn spec(m: &ArgMatches, s: Scenario, default_scale: f64) -> RunSpec {
    RunSpec {
        scenario: s,
        seed: m.get_one::<u64>("seed").copied(),
        scale: m.get_one::<f64>("scale").copied().unwrap_or(default_scale),
        time_scale: m.get_one::<f64>("time-scale").copied().unwrap_or(1.0).max(0.01),
        progress: !m.get_flag("quiet"),
        net_faults: net_faults(m),
        external: external(m),
        demo_rows: false,
    }
}

fn external(m: &ArgMatches) -> Option<cluster::External> {
    let quic = m.try_get_one::<std::net::SocketAddr>("aggregator").ok().flatten().copied()?;
    let http = m.try_get_one::<std::net::SocketAddr>("api").ok().flatten().copied()?;
    let certs = m.try_get_one::<std::path::PathBuf>("certs").ok().flatten().cloned()?;
    Some(cluster::External { quic, ingest_shards: Vec::new(), http, certs, time_scale: 1.0, settled: None })
}

fn net_faults(m: &ArgMatches) -> Option<ringwatch_faultproxy::Faults> {
    let get_f = |k: &str| m.try_get_one::<f64>(k).ok().flatten().copied();
    let get_u = |k: &str| m.try_get_one::<u64>(k).ok().flatten().copied();
    let (drop, delay, jitter) = (get_f("net-drop"), get_u("net-delay-ms"), get_u("net-jitter-ms"));
    (drop.is_some() || delay.is_some() || jitter.is_some()).then(|| ringwatch_faultproxy::Faults {
        drop_fraction: drop.unwrap_or(0.0).clamp(0.0, 1.0),
        delay_ms: delay.unwrap_or(0),
        jitter_ms: jitter.unwrap_or(0),
        ..ringwatch_faultproxy::Faults::default()
    })
}

fn rate_note(r: &RunResult) {
    let (t, a) = (r.target_frames_per_s, r.achieved_frames_per_s);
    if a < 0.9 * t {
        eprintln!(
            "loadgen: the target rate was not reached: target {t:.0} frames/s, achieved {a:.0} ({:.0} %) — this machine could not generate and ship that fast; lower --scale or --time-scale",
            100.0 * a / t.max(1e-9)
        );
    }
}

async fn run_cmd(m: &ArgMatches) -> Result<bool, String> {
    let name = m.get_one::<String>("scenario").cloned().unwrap_or_default();
    let s = scenario(&name)?;
    let r = cluster::run(spec(m, s, 1e-4)).await.map_err(|e| e.to_string())?;
    let sc = score::score(&r.truth, &r.nodes, &r.verdicts, r.ended_at_ms, cluster::reorder_sim_ms(r.spec.time_scale));
    if m.get_flag("json") {
        let out = serde_json::json!({
            "score": sc,
            "perfect": sc.perfect(),
            "scale": r.spec.scale,
            "time_scale": r.spec.time_scale,
            "target_frames_per_s": r.target_frames_per_s,
            "achieved_frames_per_s": r.achieved_frames_per_s,
            "wall_ms": r.wall.as_millis(),
            "settled_in_ms": r.settled_in.as_millis(),
        });
        println!("{out}");
    } else {
        print!("{}", sc.table());
        if let Some(p) = &r.proxy {
            println!(
                "network faults (proxy): to aggregator {} datagrams, {} dropped; to shippers {}, {} dropped",
                p.to_server.received, p.to_server.dropped_random, p.to_client.received, p.to_client.dropped_random
            );
        }
        println!(
            "rate: target {:.0} frames/s, achieved {:.0}; scale {:e}, time ×{}; wall {:.1} s (settled {:.1} s after the simulated end); perfect: {}",
            r.target_frames_per_s,
            r.achieved_frames_per_s,
            r.spec.scale,
            r.spec.time_scale,
            r.wall.as_secs_f64(),
            r.settled_in.as_secs_f64(),
            sc.perfect()
        );
    }
    rate_note(&r);
    if let Some(a) = &r.aggregator {
        a.shutdown();
    }
    Ok(sc.perfect())
}

async fn demo_cmd(m: &ArgMatches) -> Result<bool, String> {
    let s = scenario("demo")?;
    let mut r = cluster::run(RunSpec { demo_rows: true, ..spec(m, s, 1e-4) }).await.map_err(|e| e.to_string())?;
    // Read through the scheduler's resources, as a scheduler reads them; the lists read
    // at the same point (the score's input) must agree.
    let rows = r.demo_rows.take().unwrap_or_default();
    if rows != demo::rows(&r.truth, &r.nodes, &r.verdicts) {
        eprintln!("loadgen: the per-GPU resources and the lists disagree (the table shows the resources')");
    }
    let sc = score::score(&r.truth, &r.nodes, &r.verdicts, r.ended_at_ms, cluster::reorder_sim_ms(r.spec.time_scale));
    println!(
        "ringwatch demo — {} nodes × {} GPUs, seed {}, bulk scale {:e}: real shippers → QUIC + mTLS → aggregator, verdicts read from its HTTP API",
        r.spec.scenario.cluster.nodes, r.spec.scenario.cluster.gpus_per_node, r.truth.seed, r.spec.scale
    );
    print!("{}", demo::table(&rows));
    let matching = rows.iter().filter(|x| x.matches()).count();
    println!(
        "{matching}/{} GPUs match the ground truth; final verdicts right {}/{}; false degraded {}; streams exact {}/{}",
        rows.len(),
        sc.final_right,
        sc.final_verdicts,
        sc.false_degraded,
        sc.conservation.iter().map(|c| c.exact).sum::<u64>(),
        sc.conservation.iter().map(|c| c.streams).sum::<u64>()
    );
    rate_note(&r);
    if m.get_flag("hold") {
        r.certs.keep = true;
        println!("aggregator serving at http://{}; certificates in {}", r.http_addr, r.certs.path.display());
        println!("the live page: open http://{}/ in a browser", r.http_addr);
        println!(
            "try: curl -s http://{}/v1/nodes ; curl -s 'http://{}/v1/verdicts?outcome=stuck'",
            r.http_addr, r.http_addr
        );
        println!("Ctrl-C to stop");
        ringwatch_transport::shell::terminated().await;
    }
    if let Some(a) = &r.aggregator {
        a.shutdown();
    }
    Ok(matching == rows.len() && sc.perfect())
}

async fn soak_cmd(m: &ArgMatches) -> ExitCode {
    let secs = match (m.get_one::<u64>("minutes"), m.get_one::<u64>("seconds")) {
        (Some(min), _) => min * 60,
        (None, Some(&s)) => s,
        (None, None) => 30 * 60,
    };
    let aggregator_bin = if m.get_flag("embedded") {
        None
    } else {
        m.get_one::<std::path::PathBuf>("aggregator-bin").cloned().or_else(loadgen::soak::sibling_aggregator)
    };
    eprintln!(
        "loadgen soak: {secs} s, aggregator {}",
        aggregator_bin.as_ref().map_or_else(|| "embedded".to_owned(), |b| format!("process {}", b.display()))
    );
    let spec = loadgen::soak::SoakSpec {
        duration: std::time::Duration::from_secs(secs),
        restart_every: std::time::Duration::from_secs(m.get_one::<u64>("restart-every-s").copied().unwrap_or(60)),
        aggregator_bin,
        scale: m.get_one::<f64>("scale").copied().unwrap_or(1e-4),
        seed: m.get_one::<u64>("seed").copied().unwrap_or(1),
        net_faults: net_faults(m),
        print: true,
    };
    match loadgen::soak::run(spec).await {
        Ok(r) => {
            print!("{}", r.table());
            if m.get_flag("json") {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            }
            if r.passed() {
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "loadgen soak: FAILED (unaccounted frames, a wrong final verdict, an inexact stream, or an RSS slope ≥ 1 MB/10 min)"
                );
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("loadgen soak: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let m = command().get_matches();
    if let Some(("list", _)) = m.subcommand() {
        for s in builtin::all().unwrap_or_default() {
            println!(
                "{:<20} {} s, {} nodes — {}",
                s.name,
                s.duration_ms / 1000,
                s.cluster.nodes,
                s.description.lines().next().unwrap_or("")
            );
        }
        return ExitCode::SUCCESS;
    }
    if let Some(("size", sub)) = m.subcommand() {
        let d = loadgen::size::Measured::default();
        let measured = loadgen::size::Measured {
            drain_gap_p999_us: sub.get_one::<f64>("drain-gap-us").copied().unwrap_or(d.drain_gap_p999_us),
            ingest_ns: sub.get_one::<f64>("ingest-ns").copied().unwrap_or(d.ingest_ns),
            aggregator_ns: sub.get_one::<f64>("aggregator-ns").copied().unwrap_or(d.aggregator_ns),
        };
        let name = sub.get_one::<String>("scenario").cloned().unwrap_or_default();
        let scenarios =
            if name == "all" { builtin::all().map_err(|e| e.to_string()) } else { scenario(&name).map(|s| vec![s]) };
        return match scenarios {
            Ok(list) => {
                for s in &list {
                    println!("{}", loadgen::size::table(&loadgen::size::size(s, measured)));
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("loadgen size: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(("bench", sub)) = m.subcommand() {
        let secs = sub.get_one::<f64>("seconds").copied().unwrap_or(5.0);
        return match loadgen::bench::run(secs) {
            Ok(table) => {
                print!("{table}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("loadgen bench: {e}");
                ExitCode::from(1)
            }
        };
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("loadgen: runtime: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(("soak", sub)) = m.subcommand() {
        return rt.block_on(soak_cmd(sub));
    }
    if let Some(("scale", sub)) = m.subcommand() {
        let d = loadgen::scale::ScaleSpec::default();
        let spec = loadgen::scale::ScaleSpec {
            nodes: sub.get_one::<u32>("nodes").copied().unwrap_or(d.nodes),
            rounds: sub.get_one::<u64>("rounds").copied().unwrap_or(d.rounds),
            ingest_batches: sub.get_one::<u32>("ingest-batches").map_or(d.ingest_batches, |&n| n as usize),
            big_nodes: sub.get_one::<u32>("big-nodes").copied().unwrap_or(d.big_nodes),
            big_rounds: sub.get_one::<u64>("big-rounds").copied().unwrap_or(d.big_rounds),
        };
        return match rt.block_on(loadgen::scale::run(spec)) {
            Ok(table) => {
                print!("{table}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("loadgen scale: {e}");
                ExitCode::from(1)
            }
        };
    }
    let (result, check) = match m.subcommand() {
        Some(("run", sub)) => (rt.block_on(run_cmd(sub)), sub.get_flag("check")),
        Some(("demo", sub)) => (rt.block_on(demo_cmd(sub)), false),
        _ => return ExitCode::from(2),
    };
    match result {
        Ok(perfect) if check && !perfect => ExitCode::from(1),
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadgen: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_accepts_the_documented_proxy_and_external_flags_regression_issue_17() {
        // The README documented these flags; the CLI refused every one of them.
        let m = command()
            .try_get_matches_from([
                "loadgen",
                "run",
                "demo",
                "--net-drop",
                "0.02",
                "--net-delay-ms",
                "2",
                "--net-jitter-ms",
                "3",
                "--aggregator",
                "127.0.0.1:4433",
                "--api",
                "127.0.0.1:8080",
                "--certs",
                "/tmp/rw-certs",
            ])
            .expect("documented flags parse");
        let (_, run) = m.subcommand().expect("run");
        let f = net_faults(run).expect("proxy faults");
        assert_eq!((f.drop_fraction, f.delay_ms, f.jitter_ms), (0.02, 2, 3));
        let x = external(run).expect("external aggregator");
        assert_eq!((x.quic.port(), x.http.port()), (4433, 8080));
        // Half an external aggregator is a usage error, not a silent embedded run.
        assert!(command().try_get_matches_from(["loadgen", "run", "demo", "--aggregator", "127.0.0.1:4433"]).is_err());
        assert!(command().try_get_matches_from(["loadgen", "run", "demo", "--api", "127.0.0.1:8080"]).is_err());
    }
}
