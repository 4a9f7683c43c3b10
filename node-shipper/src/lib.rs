//! `node-shipper`: the per-node sidecar.
//!
//! It will read fixed-layout frames from BPF ring buffers (and, for tests and load, from
//! capture files or the simulator), batch them unparsed into `proto-flat` envelopes,
//! spool them with reserved room for P0/P1, and ship them over QUIC with mutual TLS,
//! turning every batch it cannot deliver into loss records.
//!
//! Status: the workspace skeleton (issue 2). The batcher, spool and QUIC client arrive
//! with issue 7, the eBPF sources with issues 10–11. Until then this crate only re-exports
//! the wire contract it is built on.

pub use proto_flat as wire;

/// Where each part of the shipper lands, for `node-shipper --help`.
pub const STATUS: &str =
    "node-shipper: skeleton only — batcher, spool and QUIC client arrive with issue 7, eBPF sources with issues 10-11";
