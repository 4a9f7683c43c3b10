//! `node-shipper`: the per-node sidecar.
//!
//! It will read fixed-layout frames from BPF ring buffers (and, for tests and load, from
//! capture files or the simulator), batch them unparsed into `proto-flat` envelopes,
//! spool them with reserved room for P0/P1, and ship them over QUIC with mutual TLS,
//! turning every batch it cannot deliver into loss records.
//!
//! Status: the pure, clock-free core of issue 7 is here ([`core`]: the batcher, the
//! per-class spool and the conversion of undeliverable batches into loss ranges). The
//! configuration ([`config`]: flags > env > TOML > defaults, every problem reported at
//! once) is here too. The QUIC client, mTLS and the binary's I/O shell are still to come, as are the
//! eBPF sources of issues 10–11.

pub mod config;
pub mod core;

pub use proto_flat as wire;

/// Where each part of the shipper lands, for `node-shipper --help`.
pub const STATUS: &str = "node-shipper: pure batcher and spool only — QUIC client and I/O shell arrive with issue 7, eBPF sources with issues 10-11";
