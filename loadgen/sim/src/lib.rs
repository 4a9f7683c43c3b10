//! `loadgen-sim`: the causal cluster simulator, fault injection, ground truth, and the
//! capture format.
//!
//! What it is: a pure, deterministic library that turns a [`Scenario`] (TOML; see
//! `loadgen/scenarios/README.md`) into a cluster's telemetry as proto-flat frames —
//! exactly the ring records a shipper would read, with the kernel's counters and
//! PROGRESS snapshots — plus the [`GroundTruth`] of what really happened.
//!
//! What it is not: the shipper or the aggregator. It depends on `proto-flat` only, never
//! on the aggregator, so ground truth never comes from the code it judges
//! (`tests/tests/boundaries.rs` holds that). Shipper and transport faults (spool
//! overflow, shipper restart, aggregator restart, partitions, duplicate batches) are
//! only scheduled here; their harnesses apply them.
//!
//! Layers: [`scenario`] (the file), [`model`] (topology and the causal timeline),
//! [`sim`] (the simulated kernel side and emission), [`truth`] (physical facts),
//! [`expect`] (the table mapping those facts to the verdicts docs/design.md owes them),
//! [`capture`], and [`builtin`] scenarios.

#![allow(
    clippy::cast_possible_truncation,
    reason = "indices are bounded by scenario validation (≤ 4096 nodes × 64 GPUs, u16 CPUs); simulated times stay far below 2^63 ns"
)]

pub mod builtin;
pub mod capture;
pub mod expect;
pub mod model;
pub mod scenario;
pub mod sim;
pub mod truth;

pub use scenario::{Fault, Scenario, ScenarioError};
pub use sim::{EpochInfo, SimOptions, Simulation, Sink, Snapshot};
pub use truth::GroundTruth;
