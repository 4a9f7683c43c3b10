//! `aggregator` binary: `aggregator run ...` serves; `aggregator certs init` writes a dev
//! certificate set. Exit codes: 0 ok (SIGTERM included), 1 runtime failure, 2 usage or
//! configuration (every problem listed, the files it names checked too), 70
//! the core failed (a panic while it was being updated): no snapshot is written, so a
//! supervisor's restart resumes from the last good one.

use std::path::PathBuf;
use std::process::ExitCode;

use aggregator::{Aggregator, certs, config};
use clap::{Arg, ArgAction, Command, value_parser};

fn command() -> Command {
    let mut run = Command::new("run")
        .about("serve shippers (QUIC + mTLS) and the HTTP API")
        .after_help(
            "Precedence: flag > environment (RINGWATCH_AGGREGATOR_<FIELD>) > --config file > default.\n\
             Exit codes: 0 ok (SIGTERM included), 1 runtime failure, 2 usage or configuration error, 70 the core failed.",
        )
        .arg(Arg::new("config").long("config").value_name("FILE").help("TOML configuration file"))
        .arg(
            Arg::new("check-config")
                .long("check-config")
                .action(ArgAction::SetTrue)
                .help("validate the configuration and the files it names, print it, exit"),
        );
    for (name, help) in config::fields() {
        // clap wants 'static names; one short string per field, built once per process.
        let long: &'static str = name.replace('_', "-").leak();
        run = run.arg(Arg::new(name).long(long).value_name("VALUE").help(help));
    }
    let run = run
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
        );
    Command::new("aggregator")
        .about("ringwatch central service: QUIC ingest, verdicts over HTTP")
        .subcommand_required(true)
        .subcommand(run)
        .subcommand(
            Command::new("certs").about("certificate set-up").subcommand_required(true).subcommand(
                Command::new("init")
                    .about("write a dev CA, a server certificate and per-node client certificates (keys mode 0600)")
                    .arg(Arg::new("dir").long("dir").required(true).value_parser(value_parser!(PathBuf)))
                    .arg(
                        Arg::new("nodes").long("nodes").required(true).value_parser(value_parser!(u32).range(1..=4096)),
                    )
                    .arg(Arg::new("force").long("force").action(ArgAction::SetTrue).help(
                        "replace a non-empty directory's whole set (its files ending .pem or .key are removed first)",
                    )),
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
            match certs::init_checked(&dir, &names, i.get_flag("force")) {
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
                Err(e @ certs::CertError::NotEmpty { .. }) => {
                    eprintln!("aggregator: {e}");
                    ExitCode::from(2)
                }
                Err(e) => {
                    eprintln!("aggregator: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Some(("run", r)) => {
            let loaded = ringwatch_transport::config::load_or_exit::<config::Aggregator>(
                "aggregator",
                r.get_one::<String>("config").map(String::as_str),
                |name| r.get_one::<String>(name).cloned(),
            );
            let validated = match loaded {
                Ok(c) => c,
                Err(code) => return code,
            };
            if r.get_flag("check-config") {
                println!("{:#?}", validated.service);
                return ExitCode::SUCCESS;
            }
            ringwatch_transport::shell::init_logs(validated.log_json);
            let mut cfg = validated.service;
            cfg.hold_acks = r.get_flag("test-hold-acks");
            cfg.hold_acks_after_ms = r.get_one::<u64>("test-hold-acks-after-ms").copied();
            if let Some(&v) = r.get_one::<u16>("test-max-control-version") {
                cfg.max_control_version = v;
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
