//! `aggregator` binary: `aggregator run ...` serves; `aggregator certs init` writes a dev
//! certificate set; `aggregator query …` asks a running one (`aggregator::query`, with
//! its own exit codes). Exit codes of `run`: 0 ok (SIGTERM included), 1 runtime failure,
//! 2 usage or configuration (every problem listed, the files it names checked too), 70
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
        .subcommand(query_command())
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

fn query_command() -> Command {
    let name = || Arg::new("name").required(true);
    Command::new("query")
        .about("ask a running aggregator's API: tables for people, --json for scripts")
        .after_help(
            "Examples:\n  aggregator query summary\n  aggregator query collectives -q state=open -q node=node-03\n  \
             aggregator query events --follow --json -q kind=verdict,revision -q final=true\n\n\
             Exit codes: 0 ok, 1 unreachable / stream broken / 5xx, 2 usage or a refused query (400),\n\
             3 not found (404), 4 unauthorized (401: give --token-file).",
        )
        .subcommand_required(true)
        .arg(
            Arg::new("http")
                .long("http")
                .global(true)
                .value_name("ADDR")
                .value_parser(value_parser!(std::net::SocketAddr))
                .help("the aggregator's HTTP address (else RINGWATCH_AGGREGATOR_HTTP, else 127.0.0.1:8080)"),
        )
        .arg(
            Arg::new("token-file")
                .long("token-file")
                .global(true)
                .value_name("FILE")
                .help("a file holding the API's bearer token"),
        )
        .arg(
            Arg::new("tls-ca")
                .long("tls-ca")
                .global(true)
                .value_name("FILE")
                .help("speak HTTPS, trusting servers this CA (PEM) signed (an aggregator with http_tls_cert)"),
        )
        .arg(
            Arg::new("tls-cert")
                .long("tls-cert")
                .global(true)
                .value_name("FILE")
                .requires("tls-key")
                .help("with --tls-ca: a client certificate (PEM), for an aggregator with http_client_ca"),
        )
        .arg(Arg::new("tls-key").long("tls-key").global(true).value_name("FILE").requires("tls-cert").help("its key"))
        .arg(
            Arg::new("tls-server-name")
                .long("tls-server-name")
                .global(true)
                .value_name("NAME")
                .help("with --tls-ca: the name the server's certificate holds (default localhost)"),
        )
        .arg(Arg::new("json").long("json").global(true).action(ArgAction::SetTrue).help("print the API's JSON"))
        .arg(
            Arg::new("q")
                .short('q')
                .long("query")
                .global(true)
                .value_name("KEY=VALUE")
                .action(ArgAction::Append)
                .help("a query parameter, passed through (the aggregator checks it): node=…, state=open, kind=…"),
        )
        .subcommand(Command::new("nodes").about("every node: health, liveness, P0 loss"))
        .subcommand(Command::new("node").about("one node: GPUs, loss by class and cause, recent verdicts").arg(name()))
        .subcommand(
            Command::new("collectives")
                .about("collectives (filters: -q state= outcome= comm= node= gpu= from_ms= to_ms= limit=)")
                .arg(Arg::new("all").long("all").action(ArgAction::SetTrue).help("follow next_cursor to the end")),
        )
        .subcommand(Command::new("collective").about("one collective, every rank's verdict").arg(name()))
        .subcommand(Command::new("loss").about("frames lost by class, stream and cause (-q node= class= cause=)"))
        .subcommand(Command::new("summary").about("the cluster at a glance"))
        .subcommand(
            Command::new("events")
                .about("the event stream: what the log holds, or --follow (resumes after a drop)")
                .arg(Arg::new("follow").long("follow").short('f').action(ArgAction::SetTrue)),
        )
}

fn query(m: &clap::ArgMatches) -> ExitCode {
    use aggregator::query::{Query, What, run};
    let Some((sub, sm)) = m.subcommand() else { return ExitCode::from(2) };
    let name = || sm.get_one::<String>("name").cloned().unwrap_or_default();
    let what = match sub {
        "nodes" => What::Nodes,
        "node" => What::Node(name()),
        "collectives" => What::Collectives { all: sm.get_flag("all") },
        "collective" => What::Collective(name()),
        "loss" => What::Loss,
        "summary" => What::Summary,
        "events" => What::Events { follow: sm.get_flag("follow") },
        _ => return ExitCode::from(2),
    };
    let mut params = Vec::new();
    for kv in sm.get_many::<String>("q").into_iter().flatten() {
        let Some((k, v)) = kv.split_once('=') else {
            eprintln!("aggregator query: -q {kv:?}: expected KEY=VALUE");
            return ExitCode::from(2);
        };
        params.push((k.to_owned(), v.to_owned()));
    }
    let token = match sm.get_one::<String>("token-file") {
        Some(f) => match aggregator::api::auth::read_token(std::path::Path::new(f)) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("aggregator query: --token-file {e}");
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let http = match sm.get_one::<std::net::SocketAddr>("http").copied() {
        Some(a) => a,
        None => match std::env::var("RINGWATCH_AGGREGATOR_HTTP") {
            Ok(v) => match v.parse() {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("aggregator query: RINGWATCH_AGGREGATOR_HTTP={v:?}: {e}");
                    return ExitCode::from(2);
                }
            },
            Err(_) => std::net::SocketAddr::from(([127, 0, 0, 1], 8080)),
        },
    };
    let tls = match sm.get_one::<String>("tls-ca") {
        None => {
            if sm.get_one::<String>("tls-cert").is_some() || sm.get_one::<String>("tls-server-name").is_some() {
                eprintln!("aggregator query: --tls-cert / --tls-server-name need --tls-ca");
                return ExitCode::from(2);
            }
            None
        }
        Some(ca) => {
            let client = sm
                .get_one::<String>("tls-cert")
                .zip(sm.get_one::<String>("tls-key"))
                .map(|(c, k)| (std::path::Path::new(c), std::path::Path::new(k)));
            let cfg = match ringwatch_transport::http_client_tls_config(std::path::Path::new(ca), client) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("aggregator query: TLS: {e}");
                    return ExitCode::from(2);
                }
            };
            let name = sm.get_one::<String>("tls-server-name").map_or("localhost", String::as_str).to_owned();
            match rustls::pki_types::ServerName::try_from(name.clone()) {
                Ok(n) => Some((cfg, n)),
                Err(e) => {
                    eprintln!("aggregator query: --tls-server-name {name:?}: {e}");
                    return ExitCode::from(2);
                }
            }
        }
    };
    let q = Query { http, tls, token, json: sm.get_flag("json"), params, what };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aggregator query: runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(&q)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aggregator query: {e}");
            ExitCode::from(e.exit_code())
        }
    }
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
        Some(("query", q)) => query(q),
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
