//! The `aggregator` binary as a process: `certs init`, `run` (HTTP answers, SIGTERM
//! stops it with exit 0), usage errors (exit 2).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use rustls::pki_types::pem::PemObject;

fn aggregator() -> Command {
    Command::new(env!("CARGO_BIN_EXE_aggregator"))
}

fn get(addr: &str, path: &str) -> (u16, String) {
    request(addr, "GET", path)
}

fn request(addr: &str, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let (head, body) = text.split_once("\r\n\r\n").expect("HTTP");
    (head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status"), body.to_owned())
}

#[test]
fn net_certs_init_then_run_serves_http_and_stops_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("rw-agg-cli-{}", std::process::id()));
    let out = aggregator().args(["certs", "init", "--nodes", "3", "--dir"]).arg(&dir).output().expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["ca.pem", "ca.key", "aggregator.pem", "aggregator.key", "node-00.pem", "node-02.key"] {
        assert!(dir.join(f).exists(), "{f} written");
    }
    // The node certificate's only DNS SAN is the node's name (its identity).
    let pem = std::fs::read(dir.join("node-01.pem")).expect("node cert");
    let der = rustls::pki_types::CertificateDer::from_pem_slice(&pem).expect("PEM");
    assert_eq!(ringwatch_transport::name_of(&der).expect("a DNS SAN"), "node-01");

    let mut child = aggregator()
        .args(["run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--certs"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let quic = lines.next().expect("quic line").expect("utf-8");
    let http = lines.next().expect("http line").expect("utf-8");
    assert!(quic.starts_with("quic 127.0.0.1:"), "{quic}");
    let addr = http.trim_start_matches("http http://").to_owned();
    let (status, body) = get(&addr, "/healthz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"status\":\"ok\""), "{body}");
    let (status, body) = get(&addr, "/v1/nodes");
    assert_eq!((status, body.contains("\"nodes\":[]")), (200, true), "{body}");
    // Bad queries: 400 with a message that names the problem.
    for (path, want) in [
        ("/v1/verdicts?limit=0", "limit"),
        ("/v1/verdicts?final=maybe", "final"),
        ("/v1/verdicts?colour=red", "unknown query parameter"),
        ("/v1/verdicts?cursor=c.1.2", "cursor"),
        ("/v1/nodes?x=1", "unknown query parameter"),
        // Issue 22: duplicates, values outside their set, unknown parameters on every route.
        ("/v1/verdicts?limit=abc&limit=5", "more than once"),
        ("/v1/verdicts?limit=5&limit=5", "more than once"),
        ("/v1/verdicts?outcome=bogus", "outcome"),
        ("/healthz?verbose=1", "unknown query parameter"),
        ("/readyz?x", "unknown query parameter"),
        ("/v1/ingest?node=node-01", "unknown query parameter"),
    ] {
        let (status, body) = get(&addr, path);
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains(want), "{path}: {body}");
        assert!(body.starts_with("{\"error\":"), "{path}: a JSON error body: {body}");
    }
    let (status, _) = get(&addr, "/v1/verdicts?outcome=indeterminate(uninstrumented)");
    assert_eq!(status, 200, "a whole outcome name is a valid filter");
    let (status, body) = get(&addr, "/v1/verdicts?node=node-99");
    assert_eq!(status, 404);
    assert!(body.contains("node-99"), "{body}");
    let (status, body) = get(&addr, "/v1/no-such-route");
    assert_eq!(status, 404);
    assert!(body.contains("\"error\":\"no route for GET /v1/no-such-route\""), "{body}");
    let (status, body) = request(&addr, "DELETE", "/v1/nodes");
    assert_eq!(status, 405);
    assert!(body.contains("\"error\":\"DELETE is not allowed on /v1/nodes"), "{body}");
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(kill.success());
    assert_eq!(child.wait().expect("exits").code(), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TempDir-like directory for this binary's tests.
fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rw-agg-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn certs_init_refuses_a_non_empty_directory_unless_forced_and_keys_are_0600() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("certs-again");
    let out = aggregator().args(["certs", "init", "--nodes", "3", "--dir"]).arg(&dir).output().expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["ca.key", "aggregator.key", "node-00.key", "node-02.key"] {
        let mode = std::fs::metadata(dir.join(f)).expect("key").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
    let ca = std::fs::read(dir.join("ca.pem")).expect("CA");
    let out = aggregator().args(["certs", "init", "--nodes", "1", "--dir"]).arg(&dir).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("not empty") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(dir.join("ca.pem")).expect("CA"), ca, "the CA is left as it was");
    let out =
        aggregator().args(["certs", "init", "--nodes", "1", "--force", "--dir"]).arg(&dir).output().expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_ne!(std::fs::read(dir.join("ca.pem")).expect("CA"), ca, "a new CA");
    assert!(dir.join("node-00.pem").exists());
    assert!(!dir.join("node-02.pem").exists(), "no node certificate of the old CA is left beside the new one");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_config_checks_the_files_and_lists_every_problem_with_exit_2() {
    let dir = scratch("check");
    let out = aggregator().args(["certs", "init", "--nodes", "2", "--dir"]).arg(&dir).output().expect("runs");
    assert!(out.status.success());
    let d = |f: &str| dir.join(f).display().to_string();
    // A good set: 0, and the configuration printed.
    let out = aggregator().args(["run", "--check-config", "--certs", &d(""), "--snapshot", &d("agg.snap")]).output();
    let out = out.expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("agg.snap"));
    // Missing files, a node certificate as the CA, a key of another certificate, a
    // snapshot in a directory that does not exist: each named, at once, for
    // --check-config and for a run alike.
    for check in [true, false] {
        let mut cmd = aggregator();
        cmd.args(["run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]);
        cmd.args(["--ca", &d("node-00.pem"), "--cert", &d("aggregator.pem"), "--key", &d("node-01.key")]);
        cmd.args(["--snapshot", &d("no-such-dir/agg.snap")]);
        if check {
            cmd.arg("--check-config");
        }
        let out = cmd.output().expect("runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        for want in [
            "3 configuration problem(s)",
            "ca (file check)",
            "is not a CA certificate",
            "key (file check)",
            "does not match",
            "snapshot (file check)",
            "is not writable",
        ] {
            assert!(err.contains(want), "check={check}: missing {want:?} in:\n{err}");
        }
    }
    let out = aggregator()
        .args(["run", "--ca", &d("missing-ca.pem"), "--cert", &d("missing.pem"), "--key", &d("missing.key")])
        .arg("--check-config")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for want in ["ca (file check)", "cert (file check)", "key (file check)", "missing-ca.pem", "missing.key"] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    // The config layer: a file with an unknown key and a bad value, the environment, a
    // flag — every problem with its layer.
    let file = dir.join("agg.toml");
    std::fs::write(&file, "listen = \"nowhere\"\nsnapshot_intervall_ms = 5\n").expect("write");
    let out = aggregator()
        .args(["run", "--check-config", "--config"])
        .arg(&file)
        .args(["--certs", &d(""), "--log-format", "yaml"])
        .env("RINGWATCH_AGGREGATOR_DEAD_AFTER_S", "soon")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for want in [
        "listen (config file)",
        "snapshot_intervall_ms (config file): unknown key",
        "dead_after_s (environment)",
        "log_format (command line)",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn net_garbage_quic_initials_are_counted_and_logged_once_per_10_s() {
    let dir = scratch("garbage");
    let out = aggregator().args(["certs", "init", "--nodes", "1", "--dir"]).arg(&dir).output().expect("runs");
    assert!(out.status.success());
    let log = std::fs::File::create(dir.join("stderr")).expect("log file");
    let started = std::time::Instant::now();
    let mut child = aggregator()
        .args(["run", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--certs"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let quic = lines.next().expect("quic line").expect("utf-8").trim_start_matches("quic ").to_owned();
    let http = lines.next().expect("http line").expect("utf-8").trim_start_matches("http http://").to_owned();
    // 20,000 QUIC Initials (long header, version 1, 1,200 bytes) whose payload is noise.
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let mut p = vec![0xc3, 0, 0, 0, 1, 8];
        p.extend_from_slice(&noise().to_le_bytes());
        p.push(8);
        p.extend_from_slice(&noise().to_le_bytes());
        p.extend_from_slice(&[0, 0x40 | 0x04, 0x8a]); // token length 0, length 1162
        while p.len() < 1200 {
            p.extend_from_slice(&noise().to_le_bytes());
        }
        p.truncate(1200);
        let _ = sock.send_to(&p, &quic);
    }
    // Wait on the state: the aggregator counted them.
    let mut failures = 0;
    while started.elapsed() < std::time::Duration::from_secs(120) {
        let (_, body) = get(&http, "/v1/ingest");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        failures = v["handshake_failures"].as_u64().unwrap_or(0);
        if failures >= 1_000 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let elapsed = started.elapsed();
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(kill.success());
    assert_eq!(child.wait().expect("exits").code(), Some(0));
    let text = std::fs::read_to_string(dir.join("stderr")).expect("log");
    let logged = text.lines().filter(|l| l.contains("handshake failed")).count();
    let allowed = 1 + usize::try_from(elapsed.as_secs() / 10).unwrap_or(usize::MAX);
    println!("{failures} handshake failures counted in {elapsed:?}, {logged} log lines");
    assert!(failures >= 1_000, "{failures}");
    assert!((1..=allowed).contains(&logged), "{logged} lines in {elapsed:?}:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(aggregator().output().expect("runs").status.code(), Some(2));
    assert_eq!(aggregator().args(["run"]).output().expect("runs").status.code(), Some(2), "no certificates given");
    let out = aggregator().args(["certs", "init", "--nodes", "0", "--dir", "/tmp/x"]).output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
}
