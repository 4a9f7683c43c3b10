//! `node-shipper` binary: configuration (flags > env > file > defaults, every problem at
//! once, `--check-config`), logs, the source, then [`node_shipper::driver::run`] until
//! SIGTERM/SIGINT. Exit codes: 0 ok (SIGTERM included; the final report on stdout says
//! what, if anything, was not flushed), 1 runtime failure, 2 usage or configuration (a
//! cgroup memory limit too small for the spool included), 70 the core pump failed.

use std::process::ExitCode;

use clap::{Arg, ArgAction, Command};
use node_shipper::config;
use node_shipper::driver::RunOptions;

fn command() -> Command {
    let mut cmd = Command::new("node-shipper")
        .about("ringwatch per-node sidecar: BPF rings → batches → spool → QUIC")
        .after_help(
            "Precedence: flag > environment (RINGWATCH_SHIPPER_<FIELD>) > --config file > default.\n\
             Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error (a cgroup too small for the spool included), 70 the core pump failed.",
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
        cmd = cmd.arg(Arg::new(name).long(long).value_name("VALUE").help(help));
    }
    cmd
}

fn main() -> ExitCode {
    let m = command().get_matches(); // usage errors: clap prints them and exits 2
    // Every problem at once, the files it names included (a node name that is not the
    // certificate's DNS SAN among them: every batch would be refused).
    let loaded = ringwatch_transport::config::load_or_exit::<config::Shipper>(
        "node-shipper",
        m.get_one::<String>("config").map(String::as_str),
        |name| m.get_one::<String>(name).cloned(),
    );
    let cfg = match loaded {
        Ok(c) => c,
        Err(code) => return code,
    };
    if m.get_flag("check-config") {
        println!("{cfg:#?}");
        return ExitCode::SUCCESS;
    }
    ringwatch_transport::shell::init_logs(cfg.log_json);
    // A cgroup too small for the spool's floor: refused before the source is opened.
    if let Err(e) = node_shipper::driver::memory_budget(&cfg, &RunOptions::default().tuning) {
        eprintln!("node-shipper: memory budget: {e}");
        return ExitCode::from(2);
    }
    let source = match node_shipper::source::open(&cfg.source, std::time::Instant::now()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("node-shipper: source: {e}");
            // The kernel refusing the eBPF side is a runtime failure; a bad capture or
            // scenario is the configuration's.
            let code = if matches!(e, node_shipper::source::SourceError::Bpf(_)) { 1 } else { 2 };
            return ExitCode::from(code);
        }
    };
    // quinn costs less CPU on a current-thread runtime (docs/quic-notes.md); the ring
    // reader has its own thread.
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("node-shipper: runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let mut options = RunOptions::default();
    if let Some(addr) = cfg.http_listen {
        match std::net::TcpListener::bind(addr).and_then(|l| l.set_nonblocking(true).map(|()| l)) {
            Ok(l) => {
                // Scripts read this line to find the port (`http_listen` may say :0).
                if let Ok(a) = l.local_addr() {
                    println!("http http://{a}");
                }
                options.http = Some((std::sync::Arc::new(l), ringwatch_transport::http::HttpLimits::default()));
            }
            Err(e) => {
                eprintln!("node-shipper: http_listen {addr}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let report =
        rt.block_on(node_shipper::driver::run(&cfg, options, source, ringwatch_transport::shell::terminated()));
    match report {
        Ok(r) => {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
            if !r.flushed {
                tracing::warn!(
                    frames_lost_shutdown = r.frames_lost_shutdown,
                    unflushed_batches = r.unflushed_batches,
                    unflushed_frames = r.unflushed_frames,
                    "shutdown deadline passed with unacked batches: given up as shipper_shutdown (reported above)"
                );
            }
            if r.ended == node_shipper::driver::Ended::Failed { ExitCode::from(70) } else { ExitCode::SUCCESS }
        }
        Err(e) => {
            eprintln!("node-shipper: {e}");
            // A cgroup too small for the configured reserves is the configuration's.
            let code = if matches!(
                e,
                node_shipper::driver::ShipperError::Budget(_) | node_shipper::driver::ShipperError::Throttle(_)
            ) {
                2
            } else {
                1
            };
            ExitCode::from(code)
        }
    }
}
