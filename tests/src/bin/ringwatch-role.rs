//! One aggregator shard role as a process of its own, with the demo's test configuration
//! (`ringwatch_tests::scaleout::role_config`): the scale-out fault tests (issue 29)
//! SIGKILL it. Arguments are `key=value` words ([`RoleArgs`]); once it serves it writes
//! `quic_addr http_addr` to `addr_file`. It runs until killed; SIGTERM stops it in order
//! (an ingest shard drains, a matcher writes its snapshot).

use std::time::{Duration, Instant};

use aggregator::{Aggregator, certs::CertSet};
use ringwatch_tests::scaleout::{RoleArgs, role_config};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let args = match RoleArgs::parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ringwatch-role: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let set = CertSet::at(&args.certs);
    let mut cfg = role_config(&set, &args.nats, args.role, args.origin_ms);
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    if let Some(s) = &args.snapshot {
        cfg.snapshot_path = Some(s.clone());
        cfg.snapshot_interval_ms = 500;
    }
    // The JetStream cluster may still be electing its meta leader (or one of its servers
    // was just killed): retry, as a supervisor would restart the process.
    let started = Instant::now();
    let agg = loop {
        match Aggregator::start(cfg.clone()).await {
            Ok(a) => break a,
            Err(e) if started.elapsed() < Duration::from_secs(120) => {
                eprintln!("ringwatch-role: not started yet ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => {
                eprintln!("ringwatch-role: did not start: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
    };
    let tmp = args.addr_file.with_extension("tmp");
    if let Err(e) = std::fs::write(&tmp, format!("{} {}\n", agg.quic_addr, agg.http_addr))
        .and_then(|()| std::fs::rename(&tmp, &args.addr_file))
    {
        eprintln!("ringwatch-role: writing {}: {e}", args.addr_file.display());
        return std::process::ExitCode::FAILURE;
    }
    eprintln!("ringwatch-role: {:?} serving on {} (HTTP {})", args.role, agg.quic_addr, agg.http_addr);
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
        return std::process::ExitCode::FAILURE;
    };
    term.recv().await;
    agg.shutdown_with_snapshot().await;
    std::process::ExitCode::SUCCESS
}
