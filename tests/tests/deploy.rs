//! `deploy/`, checked offline: every Kubernetes overlay renders (`kubectl kustomize`),
//! its core objects pass `kubernetes-validate --strict` with no warning, its custom
//! resources (cert-manager, Prometheus Operator) pass their published JSON schemas, every
//! ringwatch container's arguments pass the real binary's `--check-config` in a staged
//! tree of what its volumes mount, and the objects agree with one another (ports,
//! Service and Secret names, certificate names, monitor selectors, policies). Fixtures
//! under `deploy/kubernetes/tests/broken/` must each fail with the problem they name.
//! The systemd units pass `systemd-analyze verify` with no output in a staged root.
//!
//! Tools: kubectl, kubernetes-validate (PyPI, with PyYAML), node with
//! `deploy/kubernetes/schema-check/node_modules` (`npm ci`), systemd-analyze. `.ci/run`
//! installs them; without one a test prints why and skips, and under `CI=true` fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use ringwatch_tests::{TempDir, repo_root};
use serde_json::Value;

fn kube_dir() -> PathBuf {
    repo_root().join("deploy/kubernetes")
}

/// Whether every tool is here; if not, says why (a failure under `CI=true`).
fn tools(test: &str) -> bool {
    let mut missing = Vec::new();
    for (name, args) in [
        ("kubectl", &["version", "--client"][..]),
        ("kubernetes-validate", &["--version"][..]),
        ("node", &["--version"][..]),
        ("python3", &["-c", "import yaml"][..]),
    ] {
        if !Command::new(name).args(args).output().is_ok_and(|o| o.status.success()) {
            missing.push(name.to_owned());
        }
    }
    if !kube_dir().join("schema-check/node_modules/@kubernetes-models/cert-manager").is_dir() {
        missing.push(
            "deploy/kubernetes/schema-check/node_modules (npm ci --prefix deploy/kubernetes/schema-check)".into(),
        );
    }
    if missing.is_empty() {
        return true;
    }
    let why = format!("{test}: missing {}", missing.join(", "));
    assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {why}");
    println!("skipped: {why}");
    false
}

fn run(cmd: &mut Command) -> (bool, String) {
    match cmd.output() {
        Ok(o) => (
            o.status.success(),
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        ),
        Err(e) => (false, format!("{cmd:?}: {e}")),
    }
}

fn run_stdin(cmd: &mut Command, input: &[u8]) -> (bool, String) {
    use std::io::Write as _;
    let mut child = match cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return (false, format!("{cmd:?}: {e}")),
    };
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("wait");
    let _ = writer.join();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// YAML documents → JSON values (PyYAML, which kubernetes-validate brings).
fn yaml_to_json(yaml: &str) -> Result<Vec<Value>, String> {
    let (ok, out) = run_stdin(
        Command::new("python3").args([
            "-c",
            "import sys, yaml, json; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)",
        ]),
        yaml.as_bytes(),
    );
    if !ok {
        return Err(format!("YAML → JSON: {out}"));
    }
    serde_json::from_str(&out).map_err(|e| format!("YAML → JSON: {e}"))
}

/// `kubectl kustomize dir`, as JSON objects.
fn render(dir: &Path) -> Result<Vec<Value>, String> {
    let (ok, out) = run(Command::new("kubectl").arg("kustomize").arg(dir));
    if !ok {
        return Err(format!("kubectl kustomize {}: {out}", dir.display()));
    }
    yaml_to_json(&out)
}

fn is_custom(o: &Value) -> bool {
    let api = o["apiVersion"].as_str().unwrap_or("");
    ["cert-manager.io/", "monitoring.coreos.com/"].iter().any(|g| api.starts_with(g))
}

fn name_of(o: &Value) -> String {
    format!("{}/{}", o["kind"].as_str().unwrap_or("?"), o["metadata"]["name"].as_str().unwrap_or("?"))
}

/// Core objects through `kubernetes-validate --strict`: any WARN or ERROR line, or a
/// failing exit, is a problem.
fn validate_core(objs: &[Value], scratch: &Path) -> Vec<String> {
    let dir = scratch.join("core");
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for (i, o) in objs.iter().filter(|o| !is_custom(o)).enumerate() {
        let f = dir.join(format!("{i:03}.json"));
        std::fs::write(&f, serde_json::to_vec_pretty(o).unwrap()).unwrap();
        files.push(f);
    }
    let (ok, out) = run(Command::new("kubernetes-validate").args(["--strict", "--quiet"]).args(&files));
    let mut problems: Vec<String> = out
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("INFO"))
        .map(|l| format!("kubernetes-validate: {l}"))
        .collect();
    if !ok && problems.is_empty() {
        problems.push(format!("kubernetes-validate failed: {out}"));
    }
    problems
}

/// Custom resources through the published schemas (schema-check/validate.mjs).
fn validate_custom(objs: &[Value]) -> Vec<String> {
    let custom: Vec<&Value> = objs.iter().filter(|o| is_custom(o)).collect();
    if custom.is_empty() {
        return Vec::new();
    }
    let (ok, out) = run_stdin(
        Command::new("node").arg("validate.mjs").current_dir(kube_dir().join("schema-check")),
        &serde_json::to_vec(&custom).unwrap(),
    );
    let mut problems: Vec<String> =
        out.lines().filter(|l| l.starts_with("FAIL")).map(|l| format!("schema: {l}")).collect();
    if !ok && problems.is_empty() {
        problems.push(format!("schema check failed: {out}"));
    }
    problems
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objs.iter().find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

fn all<'a>(objs: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    objs.iter().filter(move |o| o["kind"] == kind)
}

fn arr(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

/// A container's `--key=value` argument.
fn flag<'a>(container: &'a Value, key: &str) -> Option<&'a str> {
    let prefix = format!("--{key}=");
    arr(&container["args"]).iter().filter_map(Value::as_str).find_map(|a| a.strip_prefix(prefix.as_str()))
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    arr(&container["env"]).iter().find(|e| e["name"] == name).and_then(|e| e["value"].as_str())
}

/// The ringwatch containers of the rendered workloads: (workload, pod spec, container,
/// binary). A StatefulSet's claim templates count among its pod's volumes.
fn ringwatch_containers(objs: &[Value]) -> Vec<(String, Value, Value, &'static str)> {
    let mut out = Vec::new();
    for o in
        objs.iter().filter(|o| ["DaemonSet", "StatefulSet", "Deployment"].contains(&o["kind"].as_str().unwrap_or("")))
    {
        let mut spec = o["spec"]["template"]["spec"].clone();
        let claims: Vec<Value> = arr(&o["spec"]["volumeClaimTemplates"])
            .iter()
            .map(|t| serde_json::json!({"name": t["metadata"]["name"], "persistentVolumeClaim": {"claimName": t["metadata"]["name"]}}))
            .collect();
        if !claims.is_empty() {
            let mut volumes = arr(&spec["volumes"]).to_vec();
            volumes.extend(claims);
            spec["volumes"] = Value::Array(volumes);
        }
        for c in arr(&spec["containers"]) {
            let image = c["image"].as_str().unwrap_or("");
            let binary = if image.starts_with("ringwatch/node-shipper") {
                "node-shipper"
            } else if image.starts_with("ringwatch/aggregator") {
                "aggregator"
            } else {
                continue;
            };
            out.push((name_of(o), spec.clone(), c.clone(), binary));
        }
    }
    out
}

fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// A container port by name or number: (number, protocol).
fn container_port(c: &Value, port: &Value) -> Option<(u64, String)> {
    arr(&c["ports"]).iter().find_map(|p| {
        let matches = match port {
            Value::String(s) => p["name"] == s.as_str(),
            Value::Number(n) => p["containerPort"].as_u64() == n.as_u64(),
            _ => false,
        };
        matches.then(|| (p["containerPort"].as_u64().unwrap_or(0), p["protocol"].as_str().unwrap_or("TCP").to_owned()))
    })
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector.as_object().is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels[k] == *v))
}

/// What the objects say of one another: every problem found.
fn cross_references(objs: &[Value]) -> Vec<String> {
    let mut p = Vec::new();
    let containers = ringwatch_containers(objs);
    let shipper = containers.iter().find(|c| c.3 == "node-shipper");
    let aggregator = containers.iter().find(|c| c.3 == "aggregator");
    let (Some(shipper), Some(aggregator)) = (shipper, aggregator) else {
        return vec!["the render lacks the shipper or the aggregator".into()];
    };
    let produced_secrets: BTreeSet<&str> =
        all(objs, "Certificate").filter_map(|c| c["spec"]["secretName"].as_str()).collect();
    // Secrets the cluster provides by documentation (base/kustomization.yaml).
    let external_secrets = ["aggregator-tls"];

    // Volumes: every mount has a volume; ConfigMaps exist; Secrets are produced.
    for (workload, spec, c, _) in &containers {
        let volumes = arr(&spec["volumes"]);
        for m in arr(&c["volumeMounts"]) {
            let Some(v) = volumes.iter().find(|v| v["name"] == m["name"]) else {
                p.push(format!("{workload}: mount {} has no volume", m["name"]));
                continue;
            };
            if m.get("subPath").is_some() {
                p.push(format!("{workload}: mount {} uses subPath (its updates would never arrive)", m["name"]));
            }
            if let Some(cm) = v["configMap"]["name"].as_str()
                && find(objs, "ConfigMap", cm).is_none()
            {
                p.push(format!("{workload}: ConfigMap {cm} is not in the render"));
            }
            let mut secrets: Vec<&str> = v["secret"]["secretName"].as_str().into_iter().collect();
            secrets.extend(arr(&v["projected"]["sources"]).iter().filter_map(|s| s["secret"]["name"].as_str()));
            for s in secrets {
                if !produced_secrets.contains(s)
                    && (!external_secrets.contains(&s) || find(objs, "Certificate", s).is_some())
                {
                    p.push(format!("{workload}: Secret {s} is produced by no Certificate in the render"));
                }
            }
        }
    }

    // The shipper dials a Service that leads to the aggregator's QUIC port.
    let (_, agg_spec, agg, _) = aggregator;
    let (_, _, ship, _) = shipper;
    let ns = |o: &Value| o["metadata"]["namespace"].as_str().unwrap_or("default").to_owned();
    match flag(ship, "aggregator") {
        None => p.push("the shipper has no --aggregator".into()),
        Some(addr) => {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            let parts: Vec<&str> = host.split('.').collect();
            let svc = all(objs, "Service").find(|s| {
                let name = s["metadata"]["name"].as_str().unwrap_or("");
                parts[0] == name && (parts.len() == 1 || parts.get(1) == Some(&ns(s).as_str()))
            });
            match (svc, port_of(addr)) {
                (None, _) => p.push(format!("--aggregator={addr}: no Service of that name and namespace")),
                (_, None) => p.push(format!("--aggregator={addr}: no port")),
                (Some(svc), Some(port)) => {
                    if svc["spec"]["clusterIP"] == "None" {
                        p.push(format!(
                            "--aggregator={addr}: a headless Service (the pod may move; use the ClusterIP one)"
                        ));
                    }
                    if !labels_match(&svc["spec"]["selector"], &agg_spec_labels(objs)) {
                        p.push(format!("--aggregator={addr}: the Service does not select the aggregator's pods"));
                    }
                    let sp = arr(&svc["spec"]["ports"]).iter().find(|sp| sp["port"].as_u64() == Some(u64::from(port)));
                    match sp {
                        None => p.push(format!("--aggregator={addr}: {} has no port {port}", name_of(svc))),
                        Some(sp) => {
                            if sp["protocol"] != "UDP" {
                                p.push(format!("--aggregator={addr}: Service port {port} is not UDP"));
                            }
                            let target =
                                if sp["targetPort"].is_null() { sp["port"].clone() } else { sp["targetPort"].clone() };
                            match container_port(agg, &target) {
                                None => p.push(format!(
                                    "Service port {port} targets {target}, which the aggregator does not expose"
                                )),
                                Some((n, proto)) => {
                                    if proto != "UDP" {
                                        p.push(format!("the aggregator's container port {n} is {proto}, not UDP"));
                                    }
                                    if flag(agg, "listen").and_then(port_of).map(u64::from) != Some(n) {
                                        p.push(format!("the aggregator's --listen is not its QUIC container port {n}"));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // The shipper checks the aggregator's certificate against --server-name.
    let server_name = flag(ship, "server-name").unwrap_or("aggregator");
    let agg_secret = arr(&agg_spec["volumes"]).iter().find_map(|v| v["secret"]["secretName"].as_str());
    if let Some(cert) = all(objs, "Certificate").find(|c| c["spec"]["secretName"].as_str() == agg_secret) {
        if !arr(&cert["spec"]["dnsNames"]).iter().any(|d| d == server_name) {
            p.push(format!("--server-name={server_name} is not among Certificate {}'s dnsNames", name_of(cert)));
        }
        if !arr(&cert["spec"]["usages"]).iter().any(|u| u == "server auth") {
            p.push(format!("Certificate {} lacks the `server auth` usage", name_of(cert)));
        }
    }
    for cert in all(objs, "Certificate")
        .filter(|c| c["spec"]["secretName"].as_str().is_some_and(|s| s.starts_with("ringwatch-node-")))
    {
        let node = cert["spec"]["secretName"].as_str().unwrap_or("").trim_start_matches("ringwatch-node-");
        if arr(&cert["spec"]["dnsNames"]) != [Value::from(node)] {
            p.push(format!("Certificate {}: its only DNS name must be the node name {node}", name_of(cert)));
        }
        if !arr(&cert["spec"]["usages"]).iter().any(|u| u == "client auth") {
            p.push(format!("Certificate {} lacks the `client auth` usage", name_of(cert)));
        }
    }
    // HTTP ports: listen flags, container ports and probes agree.
    for (who, c, listen_flag, port_name) in
        [("aggregator", agg, "http", "http"), ("shipper", ship, "http-listen", "metrics")]
    {
        let want = container_port(c, &Value::from(port_name)).map(|x| x.0);
        let listen = flag(c, listen_flag).and_then(port_of).map(u64::from);
        if want.is_none() || listen != want {
            p.push(format!(
                "the {who}'s --{listen_flag} port {listen:?} is not its container port `{port_name}` {want:?}"
            ));
        }
        for probe in ["livenessProbe", "readinessProbe"] {
            let port = &c[probe]["httpGet"]["port"];
            if container_port(c, port).map(|x| x.0) != want {
                p.push(format!("the {who}'s {probe} port {port} is not its HTTP port"));
            }
        }
    }
    // One aggregator, with a governing headless Service.
    for sts in all(objs, "StatefulSet") {
        if sts["spec"]["replicas"] != 1 {
            p.push(format!("{}: replicas must be 1 (one aggregator sees every collective)", name_of(sts)));
        }
        let governing = sts["spec"]["serviceName"].as_str().and_then(|n| find(objs, "Service", n));
        if !governing.is_some_and(|s| s["spec"]["clusterIP"] == "None") {
            p.push(format!("{}: serviceName is not a headless Service in the render", name_of(sts)));
        }
    }
    // Monitors select what exists, by ports that exist.
    for sm in all(objs, "ServiceMonitor") {
        let selected: Vec<&Value> = all(objs, "Service")
            .filter(|s| labels_match(&sm["spec"]["selector"]["matchLabels"], &s["metadata"]["labels"]))
            .collect();
        if selected.len() != 1 {
            p.push(format!("{} selects {} Services (want the aggregator's one)", name_of(sm), selected.len()));
        }
        for e in arr(&sm["spec"]["endpoints"]) {
            if !selected.iter().all(|s| arr(&s["spec"]["ports"]).iter().any(|sp| sp["name"] == e["port"])) {
                p.push(format!("{}: port {} is not a port of the selected Service", name_of(sm), e["port"]));
            }
        }
    }
    for pm in all(objs, "PodMonitor") {
        let pods: Vec<&Value> = objs
            .iter()
            .filter(|o| {
                labels_match(&pm["spec"]["selector"]["matchLabels"], &o["spec"]["template"]["metadata"]["labels"])
            })
            .collect();
        if pods.is_empty() {
            p.push(format!("{} selects no pods", name_of(pm)));
        }
        for e in arr(&pm["spec"]["podMetricsEndpoints"]) {
            let exposes = |w: &&Value| {
                arr(&w["spec"]["template"]["spec"]["containers"])
                    .iter()
                    .any(|c| container_port(c, &e["port"]).is_some())
            };
            if !pods.iter().all(exposes) {
                p.push(format!("{}: port {} is not a container port of the selected pods", name_of(pm), e["port"]));
            }
        }
    }
    // Network policies (when rendered) admit the aggregator's two ports.
    let policies: Vec<&Value> = all(objs, "NetworkPolicy").collect();
    if !policies.is_empty() {
        let labels = agg_spec_labels(objs);
        for (port, proto) in [("quic", "UDP"), ("http", "TCP")] {
            let Some((n, _)) = container_port(agg, &Value::from(port)) else { continue };
            let admitted = policies
                .iter()
                .filter(|np| labels_match(&np["spec"]["podSelector"]["matchLabels"], &labels))
                .any(|np| {
                    arr(&np["spec"]["ingress"]).iter().any(|r| {
                        arr(&r["ports"])
                            .iter()
                            .any(|rp| rp["protocol"] == proto && (rp["port"].as_u64() == Some(n) || rp["port"] == port))
                    })
                });
            if !admitted {
                p.push(format!("no NetworkPolicy admits the aggregator's {proto} port {n}"));
            }
        }
    }
    // The monitoring `release` label is the same on every Prometheus Operator object.
    let releases: BTreeSet<&str> = objs
        .iter()
        .filter(|o| is_custom(o) && o["apiVersion"].as_str().unwrap_or("").starts_with("monitoring.coreos.com/"))
        .filter_map(|o| o["metadata"]["labels"]["release"].as_str())
        .collect();
    if releases.len() > 1 {
        p.push(format!("monitoring objects carry different release labels: {releases:?}"));
    }
    p
}

fn agg_spec_labels(objs: &[Value]) -> Value {
    ringwatch_containers(objs)
        .into_iter()
        .find(|c| c.3 == "aggregator")
        .and_then(|(w, _, _, _)| {
            let name = w.split_once('/').map(|x| x.1.to_owned())?;
            objs.iter()
                .find(|o| o["metadata"]["name"] == name.as_str() && o["spec"]["template"].is_object())
                .map(|o| o["spec"]["template"]["metadata"]["labels"].clone())
        })
        .unwrap_or(Value::Null)
}

/// A workspace binary: `$RINGWATCH_BIN_DIR/<name>` if set, else the one beside this
/// test in the target directory. A workspace test run (the README's command) builds both
/// binaries before any test starts (their packages' own tests use them); a run of this
/// crate alone builds a missing one, and uses one that is there as it is (run
/// `cargo build --bins` first after changing a binary's code).
fn workspace_binary(package: &str, name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("RINGWATCH_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let path = profile_dir.join(name);
    if path.exists() {
        return path;
    }
    let target = profile_dir.parent().unwrap();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(p) => p.to_owned(),
    };
    let (ok, out) = run(Command::new(env!("CARGO"))
        .args(["build", "-q", "--locked", "-p", package, "--bin", name, "--profile", &profile, "--target-dir"])
        .arg(target)
        .current_dir(repo_root()));
    assert!(ok, "cargo build {name}: {out}");
    path
}

/// Certificates for the staged tree: a CA, the aggregator's certificate, one per node.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn new(scratch: &Path, nodes: &[String]) -> Self {
        let dir = scratch.join("certs");
        aggregator::certs::init(&dir, nodes).expect("certificates");
        Self { dir }
    }

    /// The file a Secret key holds: `ca.crt`, `tls.crt`, `tls.key` of `secret`.
    fn file(&self, secret: &str, key: &str) -> Option<PathBuf> {
        let stem = match secret.strip_prefix("ringwatch-node-") {
            Some(node) => node.to_owned(),
            None => "aggregator".to_owned(),
        };
        match key {
            "ca.crt" => Some(self.dir.join("ca.pem")),
            "tls.crt" => Some(self.dir.join(format!("{stem}.pem"))),
            "tls.key" => Some(self.dir.join(format!("{stem}.key"))),
            _ => None,
        }
    }
}

/// Stages what one container's volumes mount under `root` and returns the path map
/// (mount path → where it is here), longest first.
fn stage(objs: &[Value], spec: &Value, c: &Value, root: &Path, certs: &Certs, node: &str) -> Vec<(String, PathBuf)> {
    let mut map = Vec::new();
    let volumes = arr(&spec["volumes"]);
    for m in arr(&c["volumeMounts"]) {
        let mount = m["mountPath"].as_str().unwrap_or("/").to_owned();
        let Some(v) = volumes.iter().find(|v| v["name"] == m["name"]) else { continue };
        let here = root.join(mount.trim_start_matches('/'));
        if let Some(host) = v["hostPath"]["path"].as_str() {
            if Path::new(host).exists() && !host.starts_with("/etc/ringwatch") {
                map.push((mount, PathBuf::from(host)));
                continue;
            }
            std::fs::create_dir_all(&here).unwrap();
            if host == "/etc/ringwatch/tls" {
                // Provisioned with the node: /etc/ringwatch/tls/<node>/.
                let d = here.join(node);
                std::fs::create_dir_all(&d).unwrap();
                for key in ["ca.crt", "tls.crt", "tls.key"] {
                    std::fs::copy(certs.file(&format!("ringwatch-node-{node}"), key).unwrap(), d.join(key)).unwrap();
                }
            } else if host == "/opt/ringwatch/lib" {
                // What the nccl-shim init container installs (a stand-in: --check-config
                // checks that the file is there).
                std::fs::write(here.join("libnccl-profiler-ringwatch.so"), b"\x7fELF stand-in").unwrap();
            }
        } else if let Some(cm) = v["configMap"]["name"].as_str() {
            std::fs::create_dir_all(&here).unwrap();
            if let Some(cm) = find(objs, "ConfigMap", cm) {
                for (k, data) in cm["data"].as_object().into_iter().flatten() {
                    std::fs::write(here.join(k), data.as_str().unwrap_or("")).unwrap();
                }
            }
        } else if v["secret"].is_object() || v["projected"].is_object() {
            std::fs::create_dir_all(&here).unwrap();
            let mut sources: Vec<(String, &Value)> = Vec::new();
            if let Some(s) = v["secret"]["secretName"].as_str() {
                sources.push((s.to_owned(), &v["secret"]["items"]));
            }
            for s in arr(&v["projected"]["sources"]) {
                if let Some(n) = s["secret"]["name"].as_str() {
                    sources.push((n.to_owned(), &s["secret"]["items"]));
                }
            }
            for (secret, items) in sources {
                let items: Vec<(String, String)> = if items.is_array() {
                    arr(items)
                        .iter()
                        .map(|i| {
                            (i["key"].as_str().unwrap_or("").to_owned(), i["path"].as_str().unwrap_or("").to_owned())
                        })
                        .collect()
                } else {
                    ["ca.crt", "tls.crt", "tls.key"].iter().map(|k| ((*k).to_owned(), (*k).to_owned())).collect()
                };
                for (key, path) in items {
                    if let Some(src) = certs.file(&secret, &key) {
                        let dst = here.join(&path);
                        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
                        std::fs::copy(src, dst).unwrap();
                    }
                }
            }
        } else {
            // An emptyDir or a claim: an empty, writable directory.
            std::fs::create_dir_all(&here).unwrap();
        }
        map.push((mount, here));
    }
    map.sort_by_key(|(m, _)| std::cmp::Reverse(m.len()));
    map
}

/// `text` with every path under a mount moved to where that mount is staged.
fn remap(text: &str, map: &[(String, PathBuf)]) -> String {
    let mut out = text.to_owned();
    for (mount, here) in map {
        let prefix = format!("{}/", mount.trim_end_matches('/'));
        let mut next = String::new();
        let mut rest = out.as_str();
        while let Some(i) = rest.find(&prefix) {
            // A path starts at the text's start, after `=`, a quote or a space.
            let starts = i == 0 || matches!(rest.as_bytes()[i - 1], b'=' | b'"' | b'\'' | b' ');
            next.push_str(&rest[..i]);
            if starts {
                next.push_str(&format!("{}/", here.display()));
            } else {
                next.push_str(&prefix);
            }
            rest = &rest[i + prefix.len()..];
        }
        next.push_str(rest);
        out = next;
    }
    out
}

/// Every ringwatch container's arguments through its binary's `--check-config`.
fn check_configs(objs: &[Value], scratch: &Path) -> Vec<String> {
    let nodes: Vec<String> = {
        let mut n: Vec<String> = all(objs, "Certificate")
            .filter_map(|c| c["spec"]["secretName"].as_str()?.strip_prefix("ringwatch-node-").map(str::to_owned))
            .collect();
        if n.is_empty() {
            n.push("gpu-node-0".into());
        }
        n
    };
    let certs = Certs::new(scratch, &nodes);
    let mut problems = Vec::new();
    for (i, (workload, spec, c, binary)) in ringwatch_containers(objs).into_iter().enumerate() {
        let root = scratch.join(format!("root-{i}"));
        let node = &nodes[0];
        let map = stage(objs, &spec, &c, &root, &certs, node);
        let mut vars: BTreeMap<String, String> = BTreeMap::new();
        let mut env: Vec<(String, String)> = Vec::new();
        for e in arr(&c["env"]) {
            let name = e["name"].as_str().unwrap_or("").to_owned();
            let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("spec.nodeName") => node.clone(),
                Some("status.hostIP" | "status.podIP") => "127.0.0.1".into(),
                // A StatefulSet pod's ordinal (the shard roles' index): the first pod's.
                Some(f) if f.contains("apps.kubernetes.io/pod-index") => "0".into(),
                Some(other) => format!("<{other}>"),
                None => e["value"].as_str().unwrap_or("").to_owned(),
            };
            vars.insert(name.clone(), value.clone());
            env.push((name, remap(&value, &map)));
        }
        let args: Vec<String> = arr(&c["args"])
            .iter()
            .filter_map(Value::as_str)
            .map(|a| {
                let mut a = a.to_owned();
                for (k, v) in &vars {
                    a = a.replace(&format!("$({k})"), v);
                }
                remap(&a, &map)
            })
            .collect();
        // The staged config files name mounted paths too.
        for (_, here) in &map {
            if here.starts_with(&root) && here.is_dir() {
                for f in std::fs::read_dir(here).unwrap().flatten() {
                    if f.path().extension().is_some_and(|e| e == "toml") {
                        let text = std::fs::read_to_string(f.path()).unwrap();
                        std::fs::write(f.path(), remap(&text, &map)).unwrap();
                    }
                }
            }
        }
        let exe = workspace_binary(binary, binary);
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .arg("--check-config")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(env);
        let (ok, out) = run(&mut cmd);
        println!("{workload} ({binary}) --check-config: {}", if ok { "ok" } else { "FAILED" });
        if !ok {
            problems.push(format!("{workload}: {binary} {} --check-config:\n{out}", args.join(" ")));
        }
    }
    problems
}

/// Every check on one kustomization directory.
fn all_problems(dir: &Path, scratch: &Path) -> Vec<String> {
    let objs = match render(dir) {
        Ok(o) => o,
        Err(e) => return vec![e],
    };
    let mut p = validate_core(&objs, scratch);
    p.extend(validate_custom(&objs));
    let containers = ringwatch_containers(&objs);
    if !containers.is_empty() {
        let scaled_out =
            containers.iter().any(|c| c.3 == "aggregator" && flag(&c.2, "role").is_some_and(|r| r != "all"));
        p.extend(if scaled_out { scale_out_references(&objs) } else { cross_references(&objs) });
        p.extend(check_configs(&objs, scratch));
    }
    p
}

/// `<pod>.<service>.<namespace>.svc:<port>` → the StatefulSet whose pod it names (its
/// governing Service headless, the ordinal below its replicas) and the Service's port
/// entry for `port`, or what is wrong.
fn pod_address<'a>(objs: &'a [Value], addr: &str) -> Result<(&'a Value, &'a Value), String> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| format!("{addr}: no port"))?;
    let port: u64 = port.parse().map_err(|_| format!("{addr}: bad port"))?;
    let parts: Vec<&str> = host.split('.').collect();
    let (pod, svc_name, ns) = match parts.as_slice() {
        [pod, svc, ns, "svc", ..] => (*pod, *svc, *ns),
        _ => return Err(format!("{addr}: not <pod>.<service>.<namespace>.svc:<port>")),
    };
    let (sts_name, ordinal) = pod.rsplit_once('-').ok_or_else(|| format!("{addr}: {pod} is no StatefulSet pod"))?;
    let ordinal: u64 = ordinal.parse().map_err(|_| format!("{addr}: {pod} is no StatefulSet pod"))?;
    let sts = find(objs, "StatefulSet", sts_name).ok_or_else(|| format!("{addr}: no StatefulSet {sts_name}"))?;
    if sts["metadata"]["namespace"].as_str().unwrap_or("default") != ns {
        return Err(format!("{addr}: StatefulSet {sts_name} is not in namespace {ns}"));
    }
    if ordinal >= sts["spec"]["replicas"].as_u64().unwrap_or(1) {
        return Err(format!("{addr}: {sts_name} has no pod {ordinal}"));
    }
    if sts["spec"]["serviceName"] != svc_name {
        return Err(format!("{addr}: {svc_name} is not {sts_name}'s governing Service"));
    }
    let svc = find(objs, "Service", svc_name).ok_or_else(|| format!("{addr}: no Service {svc_name}"))?;
    if svc["spec"]["clusterIP"] != "None" {
        return Err(format!("{addr}: Service {svc_name} is not headless (no per-pod names)"));
    }
    let sp = arr(&svc["spec"]["ports"])
        .iter()
        .find(|sp| sp["port"].as_u64() == Some(port))
        .ok_or_else(|| format!("{addr}: Service {svc_name} has no port {port}"))?;
    Ok((sts, sp))
}

/// The scale-out overlay's agreements: the roles each present once, on one NATS
/// cluster, agreeing on the matcher shard count (= the matcher StatefulSet's replicas),
/// their shard index from the pod's ordinal; the shippers list exactly the ingest pods,
/// by names that reach their QUIC port; the scheduler's `aggregator` Service leads to
/// the API role.
fn scale_out_references(objs: &[Value]) -> Vec<String> {
    let mut p = Vec::new();
    let containers = ringwatch_containers(objs);
    let sts_of = |workload: &str| workload.strip_prefix("StatefulSet/").and_then(|n| find(objs, "StatefulSet", n));
    let mut roles: BTreeMap<String, Vec<(&String, &Value)>> = BTreeMap::new();
    for (w, _, c, binary) in &containers {
        if *binary == "aggregator" {
            roles.entry(flag(c, "role").unwrap_or("all").to_owned()).or_default().push((w, c));
        }
    }
    for role in ["ingest", "matcher", "api"] {
        if roles.get(role).map_or(0, Vec::len) != 1 {
            p.push(format!(
                "want one {role} workload, got {:?}",
                roles.get(role).map(|v| v.iter().map(|x| x.0).collect::<Vec<_>>())
            ));
        }
    }
    if roles.contains_key("all") {
        p.push("an aggregator in role `all` beside shard roles".into());
    }
    let one = |role: &str| roles.get(role).and_then(|v| v.first()).copied();
    let (Some(ingest), Some(matcher), Some(api)) = (one("ingest"), one("matcher"), one("api")) else { return p };
    // One NATS cluster, every server a pod of it with its client port.
    let urls: BTreeSet<&str> = [ingest, matcher, api].iter().filter_map(|(_, c)| flag(c, "nats-url")).collect();
    if urls.len() != 1 {
        p.push(format!("the roles name different NATS servers: {urls:?}"));
    }
    for u in urls.iter().flat_map(|u| u.split(',')) {
        match u.strip_prefix("nats://").map(|a| pod_address(objs, a)) {
            None => p.push(format!("{u}: not nats://host:port")),
            Some(Err(e)) => p.push(format!("--nats-url: {e}")),
            Some(Ok(_)) => {}
        }
    }
    // The matcher shard count.
    let matcher_replicas = sts_of(matcher.0).and_then(|s| s["spec"]["replicas"].as_u64());
    for (w, c) in [ingest, matcher, api] {
        let n = flag(c, "matcher-shards").and_then(|n| n.parse::<u64>().ok()).unwrap_or(1);
        if Some(n) != matcher_replicas {
            p.push(format!("{w}: --matcher-shards={n}, but {} has {matcher_replicas:?} replicas", matcher.0));
        }
    }
    // Shard index from the pod's ordinal.
    for (w, c) in [ingest, matcher] {
        let from_ordinal = arr(&c["env"]).iter().any(|e| {
            e["name"] == "RINGWATCH_AGGREGATOR_SHARD"
                && e["valueFrom"]["fieldRef"]["fieldPath"]
                    .as_str()
                    .is_some_and(|f| f.contains("apps.kubernetes.io/pod-index"))
        });
        if !from_ordinal || flag(c, "shard").is_some() {
            p.push(format!("{w}: the shard index must come from the pod's ordinal (RINGWATCH_AGGREGATOR_SHARD from apps.kubernetes.io/pod-index)"));
        }
    }
    // Shippers list exactly the ingest pods, each reaching its QUIC port.
    let ingest_sts = sts_of(ingest.0);
    let ingest_replicas = ingest_sts.and_then(|s| s["spec"]["replicas"].as_u64()).unwrap_or(0);
    let listen = flag(ingest.1, "listen").and_then(port_of).map(u64::from);
    for (w, _, ship, binary) in &containers {
        if *binary != "node-shipper" {
            continue;
        }
        let Some(list) = flag(ship, "aggregator") else {
            p.push(format!("{w}: no --aggregator"));
            continue;
        };
        let mut pods = BTreeSet::new();
        for a in list.split(',') {
            match pod_address(objs, a) {
                Err(e) => p.push(format!("{w}: --aggregator: {e}")),
                Ok((sts, sp)) => {
                    if sts != ingest_sts.unwrap_or(&Value::Null) {
                        p.push(format!("{w}: --aggregator {a} is not an ingest shard"));
                    }
                    if sp["protocol"] != "UDP" {
                        p.push(format!("{w}: --aggregator {a}: the Service port is not UDP"));
                    }
                    let target = if sp["targetPort"].is_null() { sp["port"].clone() } else { sp["targetPort"].clone() };
                    if container_port(ingest.1, &target).map(|x| x.0) != listen {
                        p.push(format!("{w}: --aggregator {a}: the port does not lead to the ingest shard's --listen"));
                    }
                    pods.insert(a.split('.').next().unwrap_or("").to_owned());
                }
            }
        }
        if pods.len() as u64 != ingest_replicas {
            p.push(format!(
                "{w}: --aggregator lists {} ingest pods, the StatefulSet has {ingest_replicas}",
                pods.len()
            ));
        }
    }
    // The scheduler's Service leads to the API role only.
    match find(objs, "Service", "aggregator") {
        None => p.push("no `aggregator` Service for the scheduler".into()),
        Some(svc) => {
            for (w, _, _, _) in &containers {
                let labels =
                    sts_of(w).map(|s| s["spec"]["template"]["metadata"]["labels"].clone()).unwrap_or(Value::Null);
                let selected = labels_match(&svc["spec"]["selector"], &labels);
                if selected != (*w == *api.0) && sts_of(w).is_some() {
                    p.push(format!(
                        "the `aggregator` Service {} {w}",
                        if selected { "selects" } else { "does not select" }
                    ));
                }
            }
        }
    }
    for sts in all(objs, "StatefulSet") {
        let governing = sts["spec"]["serviceName"].as_str().and_then(|n| find(objs, "Service", n));
        if !governing.is_some_and(|s| s["spec"]["clusterIP"] == "None") {
            p.push(format!("{}: serviceName is not a headless Service in the render", name_of(sts)));
        }
    }
    p
}

fn overlays() -> Vec<PathBuf> {
    let mut o: Vec<PathBuf> = std::fs::read_dir(kube_dir().join("overlays"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("kustomization.yaml").exists())
        .collect();
    o.sort();
    o.insert(0, kube_dir().join("base"));
    o
}

#[test]
fn ext_kubernetes_overlays_render_validate_and_agree() {
    if !tools("ext_kubernetes_overlays_render_validate_and_agree") {
        return;
    }
    let scratch = TempDir::new("deploy-ok");
    let mut failures = Vec::new();
    for dir in overlays() {
        let name = dir.strip_prefix(kube_dir()).unwrap().display().to_string();
        let s = scratch.0.join(name.replace('/', "-"));
        let problems = all_problems(&dir, &s);
        println!("{name}: {} problem(s)", problems.len());
        if !problems.is_empty() {
            failures.push(format!("{name}:\n  {}", problems.join("\n  ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each fixture names, in `expect.txt`, a piece of the problem it must produce.
#[test]
fn ext_kubernetes_broken_fixtures_fail_with_their_problem() {
    if !tools("ext_kubernetes_broken_fixtures_fail_with_their_problem") {
        return;
    }
    let scratch = TempDir::new("deploy-broken");
    let dir = kube_dir().join("tests/broken");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    cases.sort();
    assert!(cases.len() >= 6, "only {} broken fixtures in {}", cases.len(), dir.display());
    let mut wrong = Vec::new();
    for case in cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let expect =
            std::fs::read_to_string(case.join("expect.txt")).unwrap_or_else(|e| panic!("{name}/expect.txt: {e}"));
        let expect = expect.trim();
        let problems = all_problems(&case, &scratch.0.join(&name));
        let joined = problems.join("\n");
        println!("{name}: {} problem(s); expected {expect:?}: {}", problems.len(), joined.contains(expect));
        if !joined.contains(expect) {
            wrong.push(format!("{name}: expected a problem containing {expect:?}, got:\n{joined}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

#[test]
fn ext_kubernetes_prometheus_rule_equals_the_rules_file() {
    if !tools("ext_kubernetes_prometheus_rule_equals_the_rules_file") {
        return;
    }
    let rule = std::fs::read_to_string(kube_dir().join("components/monitoring/prometheus-rule.yaml")).unwrap();
    let file = std::fs::read_to_string(repo_root().join("deploy/prometheus/ringwatch.rules.yml")).unwrap();
    let rule = yaml_to_json(&rule).unwrap();
    let file = yaml_to_json(&file).unwrap();
    assert_eq!(
        rule[0]["spec"]["groups"], file[0]["groups"],
        "the PrometheusRule differs from deploy/prometheus/ringwatch.rules.yml: run deploy/kubernetes/components/monitoring/generate-rule.py"
    );
}

/// The training component points NCCL at the very file the shipper probes, through the
/// same host directory.
#[test]
fn ext_kubernetes_training_pods_load_the_shim_the_shipper_probes() {
    if !tools("ext_kubernetes_training_pods_load_the_shim_the_shipper_probes") {
        return;
    }
    let shipper = render(&kube_dir().join("overlays/node-local-tls")).unwrap();
    let training = render(&kube_dir().join("overlays/training-job")).unwrap();
    let (_, sspec, sc, _) = ringwatch_containers(&shipper).into_iter().find(|c| c.3 == "node-shipper").unwrap();
    let probed = env_value(&sc, "RINGWATCH_SHIPPER_NCCL_PROFILER_SHIM").expect("the shipper probes a shim");
    let host_dir = |spec: &Value, c: &Value, path: &str| -> Option<String> {
        let m = arr(&c["volumeMounts"])
            .iter()
            .find(|m| m["mountPath"].as_str().is_some_and(|mp| path.starts_with(&format!("{mp}/"))))?;
        let v = arr(&spec["volumes"]).iter().find(|v| v["name"] == m["name"])?;
        let rel = path.strip_prefix(m["mountPath"].as_str()?)?;
        Some(format!("{}{rel}", v["hostPath"]["path"].as_str()?))
    };
    let on_host = host_dir(&sspec, &sc, probed).expect("the shim lies on a hostPath");
    let mut trainers = 0;
    for job in all(&training, "Job") {
        let spec = &job["spec"]["template"]["spec"];
        let c = arr(&spec["containers"]).iter().find(|c| c["name"] == "trainer").expect("a trainer container");
        assert!(c["image"].is_string(), "the component added a trainer container instead of patching one");
        let plugin = env_value(c, "NCCL_PROFILER_PLUGIN").expect("NCCL_PROFILER_PLUGIN");
        assert_eq!(
            host_dir(spec, c, plugin).as_deref(),
            Some(on_host.as_str()),
            "NCCL loads another file than the shipper probes"
        );
        let mount = arr(&c["volumeMounts"]).iter().find(|m| m["name"] == "ringwatch-nccl-shim").unwrap();
        assert_eq!(mount["readOnly"], true);
        trainers += 1;
    }
    assert_eq!(trainers, 1);
    println!("shipper probes {on_host} (as {probed}); the training Job loads the same file");
}

/// The units in a staged root (the binaries built here, the distribution's own units
/// for the targets they name): `systemd-analyze verify` says nothing and exits 0.
#[test]
fn ext_systemd_units_verify_with_no_warnings() {
    let ok = Command::new("systemd-analyze").arg("--version").output().is_ok_and(|o| o.status.success())
        && Path::new("/lib/systemd/system/sysinit.target").exists();
    if !ok {
        let why = "systemd-analyze or /lib/systemd/system is missing (Debian package systemd)";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {why}");
        println!("skipped: {why}");
        return;
    }
    let root = TempDir::new("systemd-root");
    let r = &root.0;
    for d in ["usr/local/bin", "usr/bin", "etc/systemd/system", "usr/lib/systemd", "etc/ringwatch/certs"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    std::fs::copy(workspace_binary("node-shipper", "node-shipper"), r.join("usr/local/bin/node-shipper")).unwrap();
    std::fs::copy(workspace_binary("aggregator", "aggregator"), r.join("usr/local/bin/aggregator")).unwrap();
    std::fs::copy("/usr/bin/systemctl", r.join("usr/bin/systemctl")).unwrap();
    let (copied, out) = run(Command::new("cp").args(["-a", "/lib/systemd/system"]).arg(r.join("usr/lib/systemd/")));
    assert!(copied, "{out}");
    let units = repo_root().join("deploy/systemd");
    let mut names: Vec<String> = std::fs::read_dir(&units)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".service") || n.ends_with(".path"))
        .collect();
    names.sort();
    assert!(names.len() >= 3, "{names:?}");
    for n in &names {
        std::fs::copy(units.join(n), r.join("etc/systemd/system").join(n)).unwrap();
    }
    let mut bad = Vec::new();
    for n in &names {
        let (ok, out) =
            run(Command::new("systemd-analyze").arg("verify").arg(format!("--root={}", r.display())).arg(n));
        println!("systemd-analyze verify {n}: {}", if ok && out.trim().is_empty() { "clean" } else { "PROBLEMS" });
        if !ok || !out.trim().is_empty() {
            bad.push(format!("{n}: {out}"));
        }
    }
    for n in names.iter().filter(|n| n.as_str() == "node-shipper.service" || n.as_str() == "aggregator.service") {
        let (_, out) = run(Command::new("systemd-analyze")
            .args(["security", "--offline=yes"])
            .arg(format!("--root={}", r.display()))
            .arg(n));
        if let Some(line) = out.lines().find(|l| l.contains("Overall exposure level")) {
            println!("{line}");
        }
    }
    // The syscall filters let through what each binary calls: the shipper's list is what
    // `strace -f -c` saw a real node-shipper (source bpf, uprobes on the shim,
    // reader_cpus, a DNS name for the aggregator, HTTP listener, SIGTERM) call.
    let shipper_calls = [
        "accept4",
        "bind",
        "bpf",
        "clock_nanosleep",
        "clone3",
        "close",
        "connect",
        "epoll_create1",
        "epoll_ctl",
        "epoll_wait",
        "eventfd2",
        "execve",
        "fcntl",
        "futex",
        "getdents64",
        "getpid",
        "getrandom",
        "getsockname",
        "gettid",
        "ioctl",
        "listen",
        "lseek",
        "madvise",
        "mkdir",
        "mmap",
        "mprotect",
        "mremap",
        "munmap",
        "newfstatat",
        "openat",
        "perf_event_open",
        "poll",
        "prctl",
        "pread64",
        "prlimit64",
        "read",
        "readlinkat",
        "recvfrom",
        "recvmmsg",
        "rseq",
        "rt_sigaction",
        "rt_sigprocmask",
        "rt_sigreturn",
        "sched_getaffinity",
        "sched_setaffinity",
        "sendmsg",
        "sendto",
        "set_robust_list",
        "set_tid_address",
        "setsockopt",
        "shutdown",
        "sigaltstack",
        "socket",
        "socketpair",
        "statfs",
        "statx",
        "uname",
        "unlink",
        "write",
        "writev",
    ];
    let aggregator_calls: Vec<&str> = shipper_calls
        .iter()
        .copied()
        .filter(|c| !["bpf", "perf_event_open", "sched_setaffinity"].contains(c))
        .collect();
    for (unit, calls) in [("node-shipper.service", &shipper_calls[..]), ("aggregator.service", &aggregator_calls[..])] {
        let text = std::fs::read_to_string(units.join(unit)).unwrap();
        let allowed = effective_syscall_filter(&text);
        let blocked: Vec<&&str> = calls.iter().filter(|c| !allowed.contains(**c)).collect();
        println!("{unit}: {} system calls allowed; of the {} needed, blocked: {blocked:?}", allowed.len(), calls.len());
        if !blocked.is_empty() {
            bad.push(format!("{unit}: its SystemCallFilter blocks {blocked:?}"));
        }
    }
    // A misspelled directive is reported (the check can fail).
    let unit = std::fs::read_to_string(units.join("aggregator.service")).unwrap();
    std::fs::write(r.join("etc/systemd/system/broken.service"), unit.replace("NoNewPrivileges=", "NoNewPrivilege="))
        .unwrap();
    let (_, out) =
        run(Command::new("systemd-analyze").arg("verify").arg(format!("--root={}", r.display())).arg("broken.service"));
    assert!(out.contains("Unknown key"), "a misspelled directive went unreported: {out}");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The images build with no base image to pull (a root filesystem from Debian's
/// packages by mmdebstrap), and what they hold runs: each binary, executed inside its
/// image's root filesystem (chroot into `podman image mount`; containers themselves
/// cannot start on this machine kind: crun cannot set RLIMIT_NPROC without
/// CAP_SYS_RESOURCE), the shell tools the shim's init container uses, and the users and
/// entrypoints the manifests assume.
#[test]
fn ext_container_images_build_from_debian_packages_and_their_binaries_run() {
    let have = |c: &str| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success());
    if !(have("podman") && have("mmdebstrap") && have("cc")) {
        let why = "podman, mmdebstrap or cc is missing (Debian packages podman, mmdebstrap, gcc)";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {why}");
        println!("skipped: {why}");
        return;
    }
    let bins = TempDir::new("container-bins");
    for (package, name) in [("node-shipper", "node-shipper"), ("aggregator", "aggregator")] {
        std::fs::copy(workspace_binary(package, name), bins.0.join(name)).unwrap();
    }
    let tag = format!("test-{}", std::process::id());
    let (ok, out) = run(Command::new(repo_root().join("deploy/container/build.sh"))
        .args(["--tag", &tag, "--binaries"])
        .arg(&bins.0)
        .current_dir(repo_root()));
    let images = [format!("localhost/ringwatch/node-shipper:{tag}"), format!("localhost/ringwatch/aggregator:{tag}")];
    let cleanup = || {
        for i in &images {
            let _ = Command::new("podman").args(["image", "unmount", i]).output();
            let _ = Command::new("podman").args(["rmi", "-f", i]).output();
        }
    };
    if !ok {
        cleanup();
        panic!("deploy/container/build.sh: {out}");
    }
    let mut problems = Vec::new();
    for (image, binary, args, user) in [
        (&images[0], "node-shipper", &["--help"][..], "0:0"),
        (&images[1], "aggregator", &["run", "--help"][..], "65532:65532"),
    ] {
        let (_, cfg) = run(Command::new("podman").args([
            "image",
            "inspect",
            "--format",
            "{{.Config.User}} {{json .Config.Entrypoint}}",
            image,
        ]));
        let want = format!("{user} [\"/usr/local/bin/{binary}\"]");
        if cfg.trim() != want {
            problems.push(format!("{image}: user and entrypoint {:?}, want {want:?}", cfg.trim()));
        }
        let (mounted, root) = run(Command::new("podman").args(["image", "mount", image]));
        if !mounted {
            problems.push(format!("podman image mount {image}: {root}"));
            continue;
        }
        let root = root.trim();
        let (ran, help) = run(Command::new("chroot").arg(root).arg(format!("/usr/local/bin/{binary}")).args(args));
        println!(
            "{image}: /usr/local/bin/{binary} {} in the image's root: {}",
            args.join(" "),
            if ran { "ran" } else { "FAILED" }
        );
        if !ran || !help.contains("--config") {
            problems.push(format!("{image}: {binary} {} did not run in the image: {help}", args.join(" ")));
        }
        if binary == "node-shipper" {
            let (tools, out) = run(Command::new("chroot").arg(root).args([
                "/bin/sh",
                "-c",
                "command -v cmp cp mv chmod && test -r /usr/lib/ringwatch/libnccl-profiler-ringwatch.so",
            ]));
            if !tools {
                problems.push(format!("{image}: the init container's tools or the shim are missing: {out}"));
            }
        } else {
            let meta = std::fs::metadata(Path::new(root).join("var/lib/ringwatch"));
            use std::os::unix::fs::MetadataExt as _;
            if !meta.as_ref().is_ok_and(|m| m.uid() == 65532) {
                problems.push(format!("{image}: /var/lib/ringwatch is not owned by 65532: {meta:?}"));
            }
        }
    }
    let (_, sizes) = run(Command::new("podman").args([
        "images",
        "--format",
        "{{.Repository}}:{{.Tag}} {{.Size}}",
        "--filter",
        "reference=localhost/ringwatch/*",
    ]));
    println!("{sizes}");
    cleanup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The system calls a unit's `SystemCallFilter=` lines allow: the first line an allow
/// list, each `~` line removing from it (groups expanded by `systemd-analyze
/// syscall-filter`, nested groups included).
fn effective_syscall_filter(unit: &str) -> BTreeSet<String> {
    let (ok, listing) = run(Command::new("systemd-analyze").arg("syscall-filter"));
    assert!(ok, "systemd-analyze syscall-filter: {listing}");
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = None;
    for line in listing.lines() {
        let word = line.split_whitespace().next().unwrap_or("");
        if word.is_empty() || word.starts_with('#') {
            continue;
        }
        if !line.starts_with(char::is_whitespace) && word.starts_with('@') {
            current = Some(word.to_owned());
            groups.entry(word.to_owned()).or_default();
        } else if let Some(g) = &current {
            groups.get_mut(g).unwrap().push(word.to_owned());
        }
    }
    fn expand(name: &str, groups: &BTreeMap<String, Vec<String>>, out: &mut BTreeSet<String>) {
        match groups.get(name) {
            Some(members) => members.iter().for_each(|m| expand(m, groups, out)),
            None => {
                out.insert(name.to_owned());
            }
        }
    }
    let mut allowed = BTreeSet::new();
    for line in unit.lines().filter_map(|l| l.strip_prefix("SystemCallFilter=")) {
        let (deny, list) = match line.strip_prefix('~') {
            Some(rest) => (true, rest),
            None => (false, line),
        };
        let mut set = BTreeSet::new();
        for item in list.split_whitespace() {
            expand(item, &groups, &mut set);
        }
        if deny {
            allowed.retain(|c| !set.contains(c));
        } else {
            allowed.extend(set);
        }
    }
    allowed
}

/// The Slurm TaskProlog sets NCCL_PROFILER_PLUGIN to the node's shim, keeps a plugin a
/// job already names, and says so when the shim is missing.
#[test]
fn slurm_task_prolog_points_tasks_at_the_node_shim() {
    let script = repo_root().join("deploy/systemd/slurm-task-prolog.sh");
    let dir = TempDir::new("prolog");
    let shim = dir.0.join("libnccl-profiler-ringwatch.so");
    let prolog = |plugin: Option<&str>| {
        let mut c = Command::new("sh");
        c.arg(&script).env("RINGWATCH_NCCL_SHIM", &shim).env_remove("NCCL_PROFILER_PLUGIN");
        if let Some(p) = plugin {
            c.env("NCCL_PROFILER_PLUGIN", p);
        }
        let (ok, out) = run(&mut c);
        assert!(ok, "{out}");
        out
    };
    let missing = prolog(None);
    assert!(
        missing.starts_with("print ringwatch:") && missing.contains("is missing") && !missing.contains("export"),
        "{missing}"
    );
    std::fs::write(&shim, b"").unwrap();
    let out = prolog(None);
    assert!(out.lines().any(|l| l == format!("export NCCL_PROFILER_PLUGIN={}", shim.display())), "{out}");
    let kept = prolog(Some("/opt/other/inspector.so"));
    assert!(!kept.contains("export"), "{kept}");
}
