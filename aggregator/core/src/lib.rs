//! `ringwatch-core`: the aggregator's pure core.
//!
//! What it is: deterministic state machines that take time as an argument — per-stream
//! sequence accounting (every lost frame an explicit, counted gap with a cause),
//! watermarks, liveness, the collective matcher, verdicts and health.
//!
//! What it is not: I/O. It never imports tokio, quinn, aya or axum and never reads a
//! clock; its own crate lets the compiler hold that boundary (as `quinn-proto` does).
//!
//! Status: the workspace skeleton (issue 2); records and loss accounting arrive with
//! issue 4, the matcher with issues 5–6.
