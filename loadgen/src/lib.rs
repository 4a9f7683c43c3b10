//! `loadgen`: the tool a user runs first, and the proof of the product.
//!
//! - [`cluster`]: run a simulated cluster for real (embedded aggregator, in-process
//!   shippers fed by the simulator, QUIC + mTLS on loopback), read the verdicts back
//!   through the HTTP API;
//! - [`score`]: score them against the simulator's ground truth (pure);
//! - [`demo`]: the README's demo table;
//! - [`progress`]: progress bars with live rates;
//! - [`bench`]: per-component figures (`loadgen bench`, perf profile).
//!
//! It depends on `loadgen-sim` for the truth, never the other way round.

pub mod bench;
pub mod cluster;
pub mod demo;
pub mod progress;
pub mod scale;
pub mod score;
pub mod size;
pub mod soak;

/// A simulation sink that keeps nothing (computing ground truth).
#[derive(Debug)]
pub struct Discard;

impl loadgen_sim::sim::Sink for Discard {
    fn frame(&mut self, _: u32, _: &[u8]) {}
    fn snapshot(&mut self, _: u32, _: &loadgen_sim::sim::Snapshot<'_>) {}
    fn epoch(&mut self, _: u32, _: &loadgen_sim::sim::EpochInfo) {}
}

/// The generator's own account of a run (the simulator is deterministic: the same
/// scenario and options give what the shippers' simulators produce).
///
/// # Errors
/// The scenario does not validate.
pub fn truth(
    s: &loadgen_sim::Scenario,
    options: loadgen_sim::SimOptions,
) -> Result<loadgen_sim::GroundTruth, loadgen_sim::ScenarioError> {
    let mut sim = loadgen_sim::Simulation::new(s, options)?;
    sim.run(&mut Discard);
    Ok(sim.ground_truth())
}
