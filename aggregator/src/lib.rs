//! `aggregator`: the central service.
//!
//! It will accept shipper connections over QUIC + mTLS, validate batches
//! (`proto_flat::batch::BatchView`), turn frames into `ringwatch-core` records, and serve
//! verdicts and health over HTTP (axum), `/metrics` and OTLP.
//!
//! Status: the workspace skeleton (issue 2); ingest and API arrive with issues 7–9. The
//! pure logic lives in `ringwatch-core` (`aggregator/core`), which this crate drives.

pub use ringwatch_core as core;

/// Where each part of the aggregator lands, for `aggregator --help`.
pub const STATUS: &str = "aggregator: skeleton only — QUIC ingest arrives with issue 7, the HTTP API with issue 9";
