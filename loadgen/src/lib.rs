//! `loadgen`: the tool a user runs first, and the proof of the product.
//!
//! - [`cluster`]: run a simulated cluster for real (embedded aggregator, in-process
//!   shippers fed by the simulator, QUIC + mTLS on loopback), read the verdicts back
//!   through the HTTP API;
//! - [`score`]: score them against the simulator's ground truth (pure);
//! - [`demo`]: the README's demo table;
//! - [`progress`]: progress bars with live rates.
//!
//! It depends on `loadgen-sim` for the truth, never the other way round.

pub mod cluster;
pub mod demo;
pub mod progress;
pub mod score;

/// A simulation sink that keeps nothing (computing ground truth).
#[derive(Debug)]
pub struct Discard;

impl loadgen_sim::sim::Sink for Discard {
    fn frame(&mut self, _: u32, _: &[u8]) {}
    fn snapshot(&mut self, _: u32, _: &loadgen_sim::sim::Snapshot<'_>) {}
    fn epoch(&mut self, _: u32, _: &loadgen_sim::sim::EpochInfo) {}
}
