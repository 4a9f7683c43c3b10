//! `proto-flat`: ringwatch's wire contract, version 1.
//!
//! What it is: the fixed-layout little-endian frames that the eBPF C programs write into
//! BPF ring buffers (one C header, `include/ringwatch.h`, checked against these structs
//! and against the BPF object's BTF), the batch envelope the shipper sends, the control
//! messages the aggregator answers with, and decoders that never panic.
//!
//! What it is not: a serializer. Nothing here copies or converts a frame; readers cast
//! bytes in place (every field is alignment 1) and writers fill `#[repr(C)]` structs.
//!
//! `no_std`. Features: `alloc` (frame writers), `std` (default; batch envelopes, whose
//! CRC32C uses the `crc32c` crate's CPU detection).
//!
//! Byte order: little-endian on the wire. The C side writes native order and refuses to
//! compile on a big-endian target.
#![no_std]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic))]

#[cfg(feature = "alloc")]
extern crate alloc;
#[cfg(any(feature = "std", test))]
extern crate std;

#[cfg(feature = "std")]
pub mod batch;
pub mod codes;
pub mod control;
pub mod decode;
#[cfg(feature = "alloc")]
pub mod encode;
pub mod error;
pub mod frames;
pub mod header;
pub mod identity;
pub mod kernel;
#[cfg(feature = "alloc")]
pub mod sample;
pub mod sections;

/// `"RWB1"` read as a little-endian u32: the first four bytes of every batch.
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"RWB1");

pub use codes::{Class, FrameKind, LossCause, WireEnum};
pub use decode::{Frame, FrameIter};
pub use error::DecodeError;
pub use header::{FrameHeader, StreamId, WIRE_VERSION};
pub use identity::node_id_of;
