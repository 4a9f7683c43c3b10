//! Helpers the kernel tests share: pin directories and the skip-or-fail rule.

use std::path::Path;

use aggregator::{Aggregator, certs};
use node_shipper::bpf::{BpfConfig, LoadError, Producer};
use node_shipper::config::{Inputs, ShipperConfig};

/// A pin directory of the test's own, removed with everything in it on drop.
pub(crate) use node_shipper::bpf::ScratchPins as Pins;

/// Whether this is CI (`CI=true`): kernel tests must run there, never skip.
pub(crate) fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Prints why `test` skips; under `CI=true`, fails instead.
pub(crate) fn skip(test: &str, reason: String) -> Option<String> {
    assert!(!ci(), "CI=true: {test} must run, but cannot here: {reason}");
    println!("SKIP {test}: {reason}");
    Some(reason)
}

/// None when eBPF loads here; else why not (see [`skip`]).
pub(crate) fn kernel_unavailable(test: &str) -> Option<String> {
    let pins = Pins::new("probe");
    let reason = match Producer::open(&BpfConfig::new(pins.0.clone())) {
        Ok(_) => return None,
        Err(
            e @ (LoadError::NotBuilt { .. }
            | LoadError::Permission { .. }
            | LoadError::NoBpfFs { .. }
            | LoadError::NoBtf { .. }),
        ) => e.to_string(),
        Err(e) => panic!("loading the eBPF object failed for a reason that is a bug, not the machine: {e}"),
    };
    skip(test, reason)
}

/// Node 0's shipper on the eBPF rings pinned at `pins`, shipping to `agg`, 250 ms
/// heartbeats, through the same flag parsing as the binary; `extra` flags on top.
pub(crate) fn shipper_cfg(
    set: &certs::CertSet,
    agg: &Aggregator,
    pins: &Path,
    extra: &[(&str, String)],
) -> ShipperConfig {
    let (cert, key) = set.node(&certs::node_name(0));
    let mut i = Inputs::default();
    for (k, v) in [
        ("aggregator", agg.quic_addr.to_string()),
        ("server_name", "localhost".into()),
        ("node_name", certs::node_name(0)),
        ("ca", set.ca.display().to_string()),
        ("cert", cert.display().to_string()),
        ("key", key.display().to_string()),
        ("source", "bpf".into()),
        ("bpf_pin_dir", pins.display().to_string()),
        ("heartbeat_interval_ms", "250".into()),
        // Memory pressure on the test machine must not shed these tests' bulk; the
        // pressure tests turn it on.
        ("psi", "off".into()),
    ] {
        i.flag(k, &v);
    }
    for (k, v) in extra {
        i.flag(k, v);
    }
    i.validate().unwrap_or_else(|e| panic!("{e}"))
}

/// The eBPF part of a shipper configuration.
pub(crate) fn bpf_of(cfg: &ShipperConfig) -> BpfConfig {
    match &cfg.source {
        node_shipper::config::Source::Bpf(b) => b.clone(),
        other => panic!("not a bpf source: {other:?}"),
    }
}
