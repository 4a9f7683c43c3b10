//! `aggregator` binary: `aggregator run ...` serves; `aggregator certs init` writes a dev
//! certificate set. Exit codes: 0 ok (SIGTERM included), 1 runtime failure, 2 usage, 70
//! the core failed (a panic while it was being updated): no snapshot is written, so a
//! supervisor's restart resumes from the last good one.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use aggregator::{Aggregator, AggregatorConfig, certs};
use clap::{Arg, ArgAction, Command, value_parser};

fn command() -> Command {
    Command::new("aggregator")
        .about("ringwatch central service: QUIC ingest, verdicts over HTTP")
        .subcommand_required(true)
        .subcommand(
            Command::new("run")
                .about("serve shippers (QUIC + mTLS) and the HTTP API")
                .arg(
                    Arg::new("listen")
                        .long("listen")
                        .default_value("0.0.0.0:4433")
                        .value_parser(value_parser!(SocketAddr))
                        .help("QUIC listen address"),
                )
                .arg(
                    Arg::new("http")
                        .long("http")
                        .default_value("127.0.0.1:8080")
                        .value_parser(value_parser!(SocketAddr))
                        .help("HTTP listen address"),
                )
                .arg(
                    Arg::new("certs")
                        .long("certs")
                        .value_name("DIR")
                        .value_parser(value_parser!(PathBuf))
                        .help("a directory written by `certs init` (ca.pem, aggregator.pem, aggregator.key)"),
                )
                .arg(
                    Arg::new("ca")
                        .long("ca")
                        .value_parser(value_parser!(PathBuf))
                        .help("CA that signs node certificates (overrides --certs)"),
                )
                .arg(
                    Arg::new("cert")
                        .long("cert")
                        .value_parser(value_parser!(PathBuf))
                        .help("server certificate (overrides --certs)"),
                )
                .arg(
                    Arg::new("key")
                        .long("key")
                        .value_parser(value_parser!(PathBuf))
                        .help("server key (overrides --certs)"),
                )
                .arg(
                    Arg::new("snapshot")
                        .long("snapshot")
                        .value_name("FILE")
                        .value_parser(value_parser!(PathBuf))
                        .help("snapshot the core here periodically, and restore from it at start; P0/P1 batches are then acked durable once a snapshot holds them (hello: durability snapshot), and shippers keep them until then"),
                )
                .arg(
                    Arg::new("snapshot-interval-ms")
                        .long("snapshot-interval-ms")
                        .default_value("10000")
                        .value_parser(value_parser!(u64).range(10..=3_600_000)),
                )
                .arg(
                    Arg::new("dedup-window")
                        .long("dedup-window")
                        .value_name("HOLES")
                        .value_parser(value_parser!(u32).range(1..=1_048_576))
                        .help("per shipper session, holes (unsettled batch ranges) remembered before batches are refused [default: 8192]"),
                )
                .arg(
                    Arg::new("expect-nodes")
                        .long("expect-nodes")
                        .value_name("N")
                        .value_parser(value_parser!(u32).range(1..=1_000_000))
                        .help("the cluster's node count: a rank that never reports (no profiler shim) is then final as indeterminate(uninstrumented) once every node's data is in, instead of after the stuck deadline"),
                )
                .arg(
                    Arg::new("verdict-retention-s")
                        .long("verdict-retention-s")
                        .value_name("SECONDS")
                        .default_value("3600")
                        .value_parser(value_parser!(u64).range(1..=30 * 86_400))
                        .help("an op's verdicts are forgotten this long after their last update"),
                )
                .arg(
                    Arg::new("verdict-store-mb")
                        .long("verdict-store-mb")
                        .value_name("MIB")
                        .default_value("256")
                        .value_parser(value_parser!(u64).range(1..=1_048_576))
                        .help("the verdict store's size cap (estimated); the least recently updated ops go first past it"),
                )
                .arg(
                    Arg::new("final-memory-s")
                        .long("final-memory-s")
                        .value_name("SECONDS")
                        .default_value("600")
                        .value_parser(value_parser!(u64).range(1..=86_400))
                        .help("how long a final op is remembered, so a late frame for it is counted and ignored (at most 65,536 ops)"),
                )
                .arg(
                    Arg::new("dead-after-s")
                        .long("dead-after-s")
                        .value_name("SECONDS")
                        .default_value("300")
                        .value_parser(value_parser!(u64).range(0..=86_400))
                        .help("how long an unreachable node still gates finality: its ranks' unknown_silent verdicts are final once it is back and its watermark passes, or after this (presumed dead)"),
                )
                .arg(Arg::new("log-format").long("log-format").default_value("text").value_parser(["text", "json"]))
                .arg(Arg::new("test-hold-acks").long("test-hold-acks").action(ArgAction::SetTrue).hide(true))
                .arg(
                    // Tests: 2 stands in for the previous release (refuses protocol 3).
                    Arg::new("test-max-control-version")
                        .long("test-max-control-version")
                        .value_parser(value_parser!(u16).range(2..=3))
                        .hide(true),
                )
                .arg(
                    Arg::new("test-hold-acks-after-ms")
                        .long("test-hold-acks-after-ms")
                        .value_parser(value_parser!(u64))
                        .hide(true),
                ),
        )
        .subcommand(
            Command::new("certs").about("certificate set-up").subcommand_required(true).subcommand(
                Command::new("init")
                    .about("write a dev CA, a server certificate and per-node client certificates")
                    .arg(Arg::new("dir").long("dir").required(true).value_parser(value_parser!(PathBuf)))
                    .arg(
                        Arg::new("nodes").long("nodes").required(true).value_parser(value_parser!(u32).range(1..=4096)),
                    ),
            ),
        )
}

/// Exit code when the core failed (EX_SOFTWARE).
const EXIT_CORE_FAILED: u8 = 70;

fn main() -> ExitCode {
    let m = command().get_matches();
    match m.subcommand() {
        Some(("certs", c)) => {
            let Some(("init", i)) = c.subcommand() else { return ExitCode::from(2) };
            let dir = i.get_one::<PathBuf>("dir").cloned().unwrap_or_default();
            let n = i.get_one::<u32>("nodes").copied().unwrap_or(1);
            let names: Vec<String> = (0..n).map(certs::node_name).collect();
            match certs::init(&dir, &names) {
                Ok(set) => {
                    println!(
                        "wrote {} (CA), {} (server), {} node certificates in {}",
                        set.ca.display(),
                        set.server_cert.display(),
                        n,
                        dir.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("aggregator: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Some(("run", r)) => {
            ringwatch_transport::shell::init_logs(r.get_one::<String>("log-format").is_some_and(|f| f == "json"));
            let dir = r.get_one::<PathBuf>("certs");
            let set = dir.map(|d| certs::CertSet::at(d));
            let pick = |flag: &str, from_set: Option<PathBuf>| r.get_one::<PathBuf>(flag).cloned().or(from_set);
            let (Some(ca), Some(cert), Some(key)) = (
                pick("ca", set.as_ref().map(|s| s.ca.clone())),
                pick("cert", set.as_ref().map(|s| s.server_cert.clone())),
                pick("key", set.as_ref().map(|s| s.server_key.clone())),
            ) else {
                eprintln!("aggregator: give --certs DIR, or --ca, --cert and --key");
                return ExitCode::from(2);
            };
            let mut cfg = AggregatorConfig {
                ca,
                cert,
                key,
                ..AggregatorConfig::local(&certs::CertSet::at(std::path::Path::new(".")))
            };
            cfg.listen = r.get_one::<SocketAddr>("listen").copied().unwrap_or(cfg.listen);
            cfg.http = r.get_one::<SocketAddr>("http").copied().unwrap_or(cfg.http);
            cfg.hold_acks = r.get_flag("test-hold-acks");
            cfg.hold_acks_after_ms = r.get_one::<u64>("test-hold-acks-after-ms").copied();
            cfg.snapshot_path = r.get_one::<PathBuf>("snapshot").cloned();
            if let Some(&v) = r.get_one::<u16>("test-max-control-version") {
                cfg.max_control_version = v;
            }
            cfg.snapshot_interval_ms = r.get_one::<u64>("snapshot-interval-ms").copied().unwrap_or(10_000);
            if let Some(&w) = r.get_one::<u32>("dedup-window") {
                cfg.ingest.dedup.window = w;
            }
            if let Some(&s) = r.get_one::<u64>("verdict-retention-s") {
                cfg.store.retention_ns = s.saturating_mul(1_000_000_000);
            }
            if let Some(&mb) = r.get_one::<u64>("verdict-store-mb") {
                cfg.store.max_bytes = mb.saturating_mul(1 << 20);
            }
            if let Some(&s) = r.get_one::<u64>("final-memory-s") {
                cfg.matcher.final_memory_ns = s.saturating_mul(1_000_000_000);
            }
            if let Some(&s) = r.get_one::<u64>("dead-after-s") {
                cfg.matcher.dead_after_ns = s.saturating_mul(1_000_000_000);
            }
            if let Some(&n) = r.get_one::<u32>("expect-nodes") {
                cfg.matcher.expected_nodes = n;
            }
            // The snapshot task serializes on a blocking thread every 10 s, with rkyv's
            // thread-local scratch arena; tokio's default 10 s keep-alive can let that
            // thread exit just before the next snapshot, and a new one builds the arena
            // again. A long keep-alive keeps one thread (and its arena) between snapshots.
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_keep_alive(std::time::Duration::from_secs(3600))
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("aggregator: runtime: {e}");
                    return ExitCode::from(1);
                }
            };
            rt.block_on(async move {
                let agg = match Aggregator::start(cfg).await {
                    Ok(a) => a,
                    Err(e) => {
                        eprintln!("aggregator: {e}");
                        return ExitCode::from(1);
                    }
                };
                // Scripts read these two lines to find the ports.
                println!("quic {}", agg.quic_addr);
                println!("http http://{}", agg.http_addr);
                tokio::select! {
                    () = ringwatch_transport::shell::terminated() => {
                        agg.shutdown_with_snapshot().await;
                        // The core may have failed meanwhile (or in the final snapshot).
                        if let Some(why) = agg.shared.failure() {
                            eprintln!("aggregator: core failed ({why}); exiting {EXIT_CORE_FAILED}");
                            return ExitCode::from(EXIT_CORE_FAILED);
                        }
                        ExitCode::SUCCESS
                    }
                    why = agg.failed() => {
                        // Logged by the core's failure; the state behind the lock may be
                        // half-updated, so nothing is snapshotted: exit at once.
                        eprintln!("aggregator: core failed ({why}); exiting {EXIT_CORE_FAILED} to restart from the last snapshot");
                        agg.shutdown();
                        std::process::exit(i32::from(EXIT_CORE_FAILED));
                    }
                }
            })
        }
        _ => ExitCode::from(2),
    }
}
