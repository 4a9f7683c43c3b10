//! `node-shipper`: the per-node sidecar.
//!
//! What it is: a reader that takes fixed-layout frames from a [`source`] (capture files,
//! the simulator with feature `sim-source`, or the eBPF rings in [`bpf`]), a pure [`core`]
//! that batches them unparsed into `proto-flat` envelopes and spools them with reserved
//! room for P0/P1, and a [`driver`] that ships the spool over QUIC with mutual TLS,
//! applies acks and nacks, and turns every batch it cannot deliver into loss records.
//! Under memory pressure (PSI triggers) it sheds bulk and, where configured, throttles
//! listed background cgroups ([`throttle`]).
//!
//! What it is not: a parser. Frames are copied once into a batch; only header fields
//! are read (to fill the stream summary).

pub mod bpf;
pub mod config;
pub mod core;
pub mod driver;
pub mod metrics;
pub mod source;
pub mod throttle;

pub use proto_flat as wire;
