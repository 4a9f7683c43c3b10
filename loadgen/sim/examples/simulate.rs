//! Runs a scenario and writes its capture and ground truth side by side, then prints a
//! summary table.
//!
//! `cargo run -p loadgen-sim --example simulate -- SCENARIO [--scale F] [--seed N] [--out DIR]`
//!
//! SCENARIO is a built-in name (`seed-case`, `counter-case`, …) or a path to a TOML file.
//! Writes `DIR/<name>.rwcap` and `DIR/<name>.truth.json` (DIR defaults to `target/sim`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use loadgen_sim::capture::CaptureWriter;
use loadgen_sim::{Scenario, SimOptions, Simulation, builtin};

fn usage(msg: &str) -> ExitCode {
    eprintln!("error: {msg}\nusage: simulate SCENARIO [--scale F] [--seed N] [--out DIR]");
    eprintln!("built-in scenarios: {}", builtin::BUILTIN.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "));
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(what) = args.next() else { return usage("no scenario") };
    let (mut scale, mut seed, mut out) = (1e-4, None, PathBuf::from("target/sim"));
    while let Some(flag) = args.next() {
        let value = args.next();
        match (flag.as_str(), value) {
            ("--scale", Some(v)) => match v.parse() {
                Ok(v) => scale = v,
                Err(_) => return usage("--scale takes a number"),
            },
            ("--seed", Some(v)) => match v.parse() {
                Ok(v) => seed = Some(v),
                Err(_) => return usage("--seed takes an integer"),
            },
            ("--out", Some(v)) => out = PathBuf::from(v),
            _ => return usage(&format!("unexpected argument {flag}")),
        }
    }
    let scenario = match builtin::builtin(&what) {
        Some(s) => s,
        None => match std::fs::read_to_string(&what) {
            Ok(text) => Scenario::parse(&text),
            Err(e) => return usage(&format!("{what}: not a built-in scenario and not readable: {e}")),
        },
    };
    let scenario = match scenario {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut sim = match Simulation::new(&scenario, SimOptions { bulk_scale: scale, seed }) {
        Ok(sim) => sim,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("cannot create {}: {e}", out.display());
        return ExitCode::from(1);
    }
    let cap_path = out.join(format!("{}.rwcap", scenario.name));
    let truth_path = out.join(format!("{}.truth.json", scenario.name));
    let file = match std::fs::File::create(&cap_path) {
        Ok(f) => std::io::BufWriter::new(f),
        Err(e) => {
            eprintln!("cannot create {}: {e}", cap_path.display());
            return ExitCode::from(1);
        }
    };
    let started = std::time::Instant::now();
    let mut writer = match CaptureWriter::new(file, scenario.cluster.nodes, sim.scenario().seed) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(1);
        }
    };
    sim.run(&mut writer);
    let records = writer.records();
    if let Err(e) = writer.finish() {
        eprintln!("{e}");
        return ExitCode::from(1);
    }
    let truth = sim.ground_truth();
    let json = match serde_json::to_string_pretty(&truth) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(1);
        }
    };
    if let Err(e) = std::fs::write(&truth_path, json) {
        eprintln!("cannot write {}: {e}", truth_path.display());
        return ExitCode::from(1);
    }

    println!(
        "scenario {} (seed {}, bulk scale {scale}), {} ms simulated in {:.2?}",
        truth.scenario,
        truth.seed,
        truth.duration_ms,
        started.elapsed()
    );
    println!("{records} capture records → {}", cap_path.display());
    println!("ground truth → {}\n", truth_path.display());
    println!(
        "{:<6} {:<8} {:>12} {:>12} {:>10} {:>12}  health",
        "node", "class", "generated", "delivered", "dropped", "sampled_out"
    );
    let mut rows: BTreeMap<(u32, String), [u64; 4]> = BTreeMap::new();
    for s in &truth.streams {
        let r = rows.entry((s.node, s.class.clone())).or_default();
        r[0] += s.generated;
        r[1] += s.delivered;
        r[2] += s.dropped.values().sum::<u64>();
        r[3] += s.sampled_out;
    }
    for ((node, class), r) in &rows {
        let health = &truth.nodes[*node as usize].health;
        println!("{node:<6} {class:<8} {:>12} {:>12} {:>10} {:>12}  {health}", r[0], r[1], r[2], r[3]);
    }
    // What each rank is owed, by the scorer's table (slack: a 500 ms reorder timeout).
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for (_, _, e) in loadgen_sim::expect::Table::new(&truth, 500.0).ranks() {
        *outcomes.entry(e.outcome.split('(').next().unwrap_or("").to_owned()).or_default() += 1;
    }
    println!("\nrank outcomes owed: {outcomes:?}");
    for f in &truth.faults {
        println!("fault {:<20} applied by {:<9} identifiable={:<5} {}", f.kind, f.applied_by, f.identifiable, f.why);
    }
    ExitCode::SUCCESS
}
