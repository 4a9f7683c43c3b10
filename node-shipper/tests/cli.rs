//! The binary's configuration handling, run as a process.

use std::process::Command;

fn shipper() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_node-shipper"));
    // Only what the test sets reaches the shipper.
    for (k, _) in std::env::vars() {
        if k.starts_with("RINGWATCH_SHIPPER_") {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn bad_fields_in_every_layer_are_all_reported_with_exit_2() {
    let dir = std::env::temp_dir().join(format!("rw-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shipper.toml");
    std::fs::write(&file, "aggregator = \"nowhere\"\nmax_batch_bytes = 12\nsourse = \"sim:demo\"\n").unwrap();
    let out = shipper()
        .arg("--config")
        .arg(&file)
        .args(["--flush-interval-ms", "0", "--check-config"])
        .env("RINGWATCH_SHIPPER_HEARTBEAT_INTERVAL_MS", "soon")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for want in [
        "aggregator (config file)",
        "max_batch_bytes (config file)",
        "sourse (config file): unknown key",
        "flush_interval_ms (command line)",
        "heartbeat_interval_ms (environment)",
        "node_name (default): required",
        "source (default): required",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}

#[test]
fn a_good_configuration_checks_out_and_usage_errors_exit_2() {
    let out = shipper()
        .args(["--aggregator", "127.0.0.1:4433", "--node-name", "node-0", "--ca", "ca.pem", "--cert", "c.pem"])
        .args(["--key", "k.pem", "--source", "sim:demo", "--check-config"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("127.0.0.1:4433"));
    let out = shipper().arg("--no-such-flag").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
