//! Scenario files: every problem reported at once; unknown fields refused; the
//! documentation lists every field and fault kind.

use loadgen_sim::{Scenario, builtin};

#[test]
fn every_problem_is_reported_at_once() {
    let text = r#"
name = "bad"
duration_ms = 0
[cluster]
nodes = 2
gpus_per_node = 3
pods_per_node = 2
[[comms]]
name = "w"
group = "world"
[[comms.ops]]
op = "all_reduce_typo"
bytes = 1
period_ms = 10
duration = { median_ms = 5, p99_ms = 1 }
[[faults]]
kind = "gpu_hang"
node = 7
gpu = 0
at_ms = 1
mode = "before_contributing"
[[faults]]
kind = "mismatch"
node = 0
gpu = 9
comm = "nope"
at_ms = 1
field = "op"
"#;
    let err = Scenario::parse(text).unwrap_err();
    let all = err.problems.join("\n");
    for needle in [
        "duration_ms must be > 0",
        "pods_per_node = 2 must divide gpus_per_node = 3",
        "unknown op \"all_reduce_typo\"",
        "duration needs 0 < median_ms ≤ p99_ms",
        "faults[0] (gpu_hang): node 7 does not exist",
        "faults[1] (mismatch): gpu 9 does not exist",
        "faults[1] (mismatch): communicator \"nope\" does not exist",
    ] {
        assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
    }
    assert_eq!(err.problems.len(), 7, "{all}");
}

#[test]
fn unknown_fields_and_kinds_are_refused() {
    let base = "name = \"x\"\nduration_ms = 10\n[cluster]\nnodes = 1\ngpus_per_node = 1\n";
    assert!(Scenario::parse(&format!("{base}colour = 3\n")).is_err());
    assert!(Scenario::parse(&format!("{base}[[faults]]\nkind = \"meteor\"\nnode = 0\n")).is_err());
    assert!(Scenario::parse(base).is_ok());
}

#[test]
fn fault_kinds_no_harness_applies_are_refused_by_name_regression_issue_17() {
    // `loadgen run` accepted these and never applied them: a run was scored as if they
    // happened.
    let base = "name = \"x\"\nduration_ms = 10\n[cluster]\nnodes = 1\ngpus_per_node = 1\n";
    for (kind, fields) in [
        ("spool_overflow", "node = 0\nfrom_ms = 1\nuntil_ms = 2\n"),
        ("partition", "node = 0\nfrom_ms = 1\nuntil_ms = 2\n"),
        ("duplicate_batches", "node = 0\nfrom_ms = 1\nuntil_ms = 2\n"),
    ] {
        let err = Scenario::parse(&format!("{base}[[faults]]\nkind = \"{kind}\"\n{fields}")).unwrap_err().to_string();
        assert!(err.contains(kind) && err.contains("no harness applies"), "{kind}: {err}");
    }
    let ok = format!("{base}[[faults]]\nkind = \"node_dead\"\nnode = 0\nat_ms = 1\n");
    assert!(Scenario::parse(&ok).is_ok());
    // Issue 20: `loadgen run`'s restart driver applies these two.
    for (kind, fields) in [
        ("shipper_restart", "node = 0\nat_ms = 1\ndown_ms = 2\n"),
        ("aggregator_restart", "at_ms = 1\ndown_ms = 2\nkill = true\n"),
    ] {
        let s = format!("{base}[[faults]]\nkind = \"{kind}\"\n{fields}");
        assert!(Scenario::parse(&s).is_ok(), "{kind}");
    }
}

#[test]
fn documentation_lists_every_fault_kind_and_scenario() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/README.md")).unwrap();
    for kind in [
        "ring_overflow",
        "spool_overflow",
        "not_joined",
        "gpu_hang",
        "gpu_pause",
        "channel_hang",
        "gpu_straggler",
        "host_straggler",
        "mismatch",
        "node_dead",
        "shipper_restart",
        "counter_reset",
        "reorder",
        "key_collision",
        "graph",
        "uninstrumented",
        "aggregator_restart",
        "partition",
        "duplicate_batches",
    ] {
        assert!(doc.contains(&format!("`{kind}`")), "scenarios/README.md lacks fault kind {kind}");
    }
    for (name, _) in builtin::BUILTIN {
        assert!(doc.contains(&format!("`{name}`")), "scenarios/README.md lacks scenario {name}");
    }
}
