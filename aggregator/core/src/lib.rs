//! `ringwatch-core`: the aggregator's pure core.
//!
//! What it is: deterministic state machines that take time as an argument — per-stream
//! sequence accounting (every lost frame an explicit, counted gap with a cause),
//! watermarks, liveness, cluster-time estimates, the collective matcher, verdicts and
//! health.
//!
//! What it is not: I/O. It never imports tokio, quinn, aya or axum and never reads a
//! clock; its own crate lets the compiler hold that boundary (as `quinn-proto` does),
//! and `tests/tests/boundaries.rs` holds its dependency graph to it.
//!
//! Modules: [`records`] (what ingest produces and the matcher consumes), [`loss`]
//! (`SeqTracker`), [`ingest`] (batches → records; watermarks, liveness, knowledge
//! gaps), [`clock`] (cluster time), [`matcher`] and [`verdict`] (collectives → verdicts,
//! health), [`plausible`] (what a batch may say before any arithmetic on it), [`pipeline`]
//! (`Core`: ingest and matcher together), [`store`] (`VerdictStore`: what the API serves,
//! bounded by age and bytes), [`bounds`] (every map's cap), [`snapshot`] (the versioned
//! state format), [`shard`] (the scale-out roles: what goes to which matcher shard).

#![cfg_attr(not(test), warn(clippy::arithmetic_side_effects))]

pub mod bounds;
pub mod clock;
pub mod dedup;
pub mod ingest;
pub mod loss;
pub mod matcher;
pub mod outbox;
pub mod pipeline;
pub mod plausible;
pub mod rates;
pub mod records;
pub mod shard;
pub mod snapshot;
pub mod store;
mod tally;
pub mod verdict;

pub use bounds::MapSize;
pub use dedup::{Admit, BatchDedup, DedupConfig};
pub use ingest::{Ingest, IngestConfig, IngestStats};
pub use loss::SeqTracker;
pub use matcher::{CollectiveMatcher, Health, MatcherConfig};
pub use pipeline::{BusLivenessCounts, Core, Receipt, Resumed};
pub use records::{NodeId, Record, StreamKey};
pub use store::{Cursor, OpPage, Page, PageItem, StoreConfig, StoreStats, StoreTally, Stored, VerdictStore};
