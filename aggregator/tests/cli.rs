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
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request");
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
    ] {
        let (status, body) = get(&addr, path);
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains(want), "{path}: {body}");
    }
    let (status, _) = get(&addr, "/v1/verdicts?node=node-99");
    assert_eq!(status, 404);
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(kill.success());
    assert_eq!(child.wait().expect("exits").code(), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(aggregator().output().expect("runs").status.code(), Some(2));
    assert_eq!(aggregator().args(["run"]).output().expect("runs").status.code(), Some(2), "no certificates given");
    let out = aggregator().args(["certs", "init", "--nodes", "0", "--dir", "/tmp/x"]).output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
}
