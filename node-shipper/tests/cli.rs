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

/// A dev certificate set (node-00, node-01) in a fresh directory.
fn certs(tag: &str) -> (std::path::PathBuf, aggregator::certs::CertSet) {
    let dir = std::env::temp_dir().join(format!("rw-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let set = aggregator::certs::init(&dir, &["node-00".into(), "node-01".into()]).unwrap();
    (dir, set)
}

#[test]
fn a_good_configuration_checks_out_and_usage_errors_exit_2() {
    let (dir, set) = certs("good");
    let (cert, key) = set.node("node-00");
    let out = shipper()
        .args(["--aggregator", "127.0.0.1:4433", "--node-name", "node-00", "--ca"])
        .arg(&set.ca)
        .arg("--cert")
        .arg(&cert)
        .arg("--key")
        .arg(&key)
        .args(["--source", "sim:demo", "--check-config"])
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("127.0.0.1:4433"));
    let out = shipper().arg("--no-such-flag").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn the_files_a_configuration_names_are_checked_and_every_problem_listed() {
    let (dir, set) = certs("files");
    let (cert, _) = set.node("node-00");
    let (_, other_key) = set.node("node-01");
    // Missing CA, certificate, key and capture: all four named, for --check-config and
    // for a run alike (exit 2 before anything starts).
    for check in [true, false] {
        let mut cmd = shipper();
        cmd.args(["--aggregator", "127.0.0.1:4433", "--node-name", "node-00"]);
        cmd.args(["--ca", "/nonexistent/ca.pem", "--cert", "/nonexistent/n.pem", "--key", "/nonexistent/n.key"]);
        cmd.args(["--source", "capture:/nonexistent/run.rwcap"]);
        if check {
            cmd.arg("--check-config");
        }
        let err = String::from_utf8_lossy(&cmd.output().unwrap().stderr).into_owned();
        for want in [
            "4 configuration problem(s)",
            "ca (file check): /nonexistent/ca.pem",
            "cert (file check): /nonexistent/n.pem",
            "key (file check): /nonexistent/n.key",
            "source (file check): /nonexistent/run.rwcap",
        ] {
            assert!(err.contains(want), "check={check}: missing {want:?} in:\n{err}");
        }
    }
    // --node-name that is not the certificate's DNS SAN, a key of another certificate,
    // a node certificate given as the CA, a scenario that is neither built in nor a file.
    let out = shipper()
        .args(["--aggregator", "127.0.0.1:4433", "--node-name", "node-07", "--ca"])
        .arg(&cert)
        .arg("--cert")
        .arg(&cert)
        .arg("--key")
        .arg(&other_key)
        .args(["--source", "sim:no-such-scenario"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for want in [
        "its DNS SAN is \"node-00\", not the node name \"node-07\"",
        "does not match",
        "is not a CA certificate",
        "source (file check): no-such-scenario",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn contradictions_are_refused_not_clamped() {
    let out = shipper()
        .args(["--aggregator", "127.0.0.1:4433", "--node-name", "node-00", "--ca", "a", "--cert", "b", "--key", "c"])
        .args(["--source", "sim:demo", "--bulk-sampling-level", "9", "--bulk-sampling-max-level", "2"])
        .args(["--max-batch-bytes", "65536", "--bulk-batch-bytes", "8192", "--http-listen", "localhost:80"])
        .arg("--check-config")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for want in [
        "bulk_sampling_max_level (command line): 2 is below bulk_sampling_level (9)",
        "bulk_batch_bytes (command line): 8192 is below max_batch_bytes (65536)",
        "http_listen (command line)",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}
