//! The shipper's pure core: batching, spooling, and the loss records both produce. No
//! I/O, no clock: time is an argument, buffers circulate through a pool.
//!
//! Invariants:
//! - frames are copied once, unparsed, into a batch; only header fields are read;
//! - every frame that does not reach the aggregator becomes part of a loss record (one
//!   per stream-summary entry of the batch it was in), with its cause;
//! - the spool never holds more than its cap; P0/P1 have reserved room that P2 cannot
//!   use, and an incoming P0/P1 batch evicts P2 (oldest first) before it can be refused.

pub mod backoff;
pub mod batcher;
pub mod budget;
pub mod loss;
pub mod owner;
pub mod ringstats;
pub mod sampling;
pub mod shipper;
pub mod spool;
pub mod throttle;

pub use batcher::{Batch, Batcher, BatcherConfig, SessionMeta};
pub use loss::{LostRange, lost_ranges};
pub use sampling::{SamplingConfig, SamplingPolicy};
pub use shipper::{
    CoreConfig, EpochStart, ResumeState, SHIPPER_STREAM, ShipperCore, ShipperStats, SourceCounters, Unflushed,
};
pub use spool::{Admission, Spool, SpoolConfig, SpoolCounters};
