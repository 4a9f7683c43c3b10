//! Dependency boundaries, read from the committed Cargo.lock (what CI builds):
//! - the pure core never links tokio, quinn, aya, axum or hyper (docs/design.md, "Crates
//!   and boundaries": the compiler holds that boundary; this test holds the dependency
//!   graph to it);
//! - the simulator never depends on the code it judges;
//! - one crypto provider: aws-lc is never built.

use std::collections::{BTreeMap, BTreeSet};

use ringwatch_tests::repo_root;

/// package name → names of its direct dependencies, from Cargo.lock.
fn lock_graph() -> BTreeMap<String, BTreeSet<String>> {
    let lock = std::fs::read_to_string(repo_root().join("Cargo.lock")).expect("Cargo.lock is committed");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for block in lock.split("[[package]]").skip(1) {
        let mut name = None;
        let mut deps = BTreeSet::new();
        let mut in_deps = false;
        for line in block.lines() {
            let line = line.trim();
            if let Some(v) = line.strip_prefix("name = ") {
                name = Some(v.trim_matches('"').to_owned());
            } else if line.starts_with("dependencies = [") {
                in_deps = true;
            } else if in_deps && line == "]" {
                in_deps = false;
            } else if in_deps {
                // `"name"`, or `"name version"` when several versions are locked.
                let dep = line.trim_end_matches(',').trim_matches('"');
                deps.insert(dep.split(' ').next().unwrap_or(dep).to_owned());
            }
        }
        if let Some(name) = name {
            graph.entry(name).or_default().extend(deps);
        }
    }
    graph
}

fn closure(graph: &BTreeMap<String, BTreeSet<String>>, root: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![root.to_owned()];
    while let Some(p) = stack.pop() {
        if seen.insert(p.clone())
            && let Some(deps) = graph.get(&p)
        {
            stack.extend(deps.iter().cloned());
        }
    }
    seen.remove(root);
    seen
}

#[test]
fn core_links_no_io_crates() {
    let graph = lock_graph();
    assert!(graph.contains_key("ringwatch-core"), "ringwatch-core missing from Cargo.lock");
    let deps = closure(&graph, "ringwatch-core");
    for banned in ["tokio", "quinn", "quinn-proto", "aya", "axum", "hyper", "mio"] {
        assert!(!deps.contains(banned), "ringwatch-core must not depend on {banned} (it does, via Cargo.lock)");
    }
}

#[test]
fn simulator_does_not_depend_on_what_it_judges() {
    let graph = lock_graph();
    let deps = closure(&graph, "loadgen-sim");
    for banned in ["aggregator", "ringwatch-core", "node-shipper"] {
        assert!(!deps.contains(banned), "loadgen-sim must not depend on {banned}");
    }
    assert!(deps.contains("proto-flat"), "loadgen-sim speaks the wire contract");
}

#[test]
fn one_crypto_provider_aws_lc_never_built() {
    let graph = lock_graph();
    for banned in ["aws-lc-sys", "aws-lc-rs", "aws-lc-fips-sys"] {
        assert!(!graph.contains_key(banned), "{banned} is in Cargo.lock: a dependency enabled its default features");
    }
}

/// The crates `cargo tree -p PACKAGE -e normal` lists.
fn cargo_tree(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args(["tree", "-p", package, "-e", "normal", "--prefix", "none", "--offline", "--locked"])
        .current_dir(repo_root())
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn cargo_tree_of_the_simulator_has_no_aggregator_or_shipper() {
    // Issue 3's acceptance line, literally: `cargo tree -p loadgen-sim -e normal`.
    let crates = cargo_tree("loadgen-sim");
    assert!(crates.contains("proto-flat"), "{crates:?}");
    for banned in ["aggregator", "ringwatch-core", "node-shipper"] {
        assert!(!crates.contains(banned), "loadgen-sim depends on {banned}: {crates:?}");
    }
}

#[test]
fn cargo_tree_of_the_core_has_no_io_crates() {
    // Issue 4's acceptance line, literally: `cargo tree -p ringwatch-core -e normal`.
    let crates = cargo_tree("ringwatch-core");
    assert!(crates.contains("rkyv"), "{crates:?}");
    for banned in ["tokio", "quinn", "axum", "aya", "hyper", "mio"] {
        assert!(!crates.contains(banned), "ringwatch-core depends on {banned}: {crates:?}");
    }
}
