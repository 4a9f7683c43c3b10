//! Progress bars with live rates (indicatif), on stderr; hidden when not wanted.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use loadgen_sim::{GroundTruth, Scenario};

/// Ring frames per real second the run asks of the shippers (all nodes): what the
/// generator delivered over the simulated duration, compressed by `time_scale`.
#[must_use]
pub fn target_frames_per_s(truth: &GroundTruth, time_scale: f64) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "rates")]
    let frames = truth.streams.iter().map(|s| s.delivered).sum::<u64>() as f64;
    #[allow(clippy::cast_precision_loss, reason = "rates")]
    let secs = (truth.duration_ms as f64 / 1000.0).max(1e-9);
    frames / secs * time_scale
}

/// A bar over simulated time.
#[must_use]
pub fn bar(show: bool, s: &Scenario, scale: f64, time_scale: f64, target: f64) -> ProgressBar {
    let b = ProgressBar::with_draw_target(
        Some(s.duration_ms),
        if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() },
    );
    b.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos:>6}/{len} ms simulated  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_prefix(format!("{} (scale {scale:e}, time ×{time_scale})", s.name));
    b.set_message(format!("target {:.0} frames/s", target));
    b
}

/// Updates the bar: simulated time reached and the live read rate.
pub fn tick(b: &ProgressBar, elapsed: Duration, time_scale: f64, frames: u64) {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "ms")]
    b.set_position((elapsed.as_secs_f64() * 1000.0 * time_scale) as u64);
    #[allow(clippy::cast_precision_loss, reason = "rates")]
    let rate = frames as f64 / elapsed.as_secs_f64().max(1e-3);
    b.set_message(format!("{frames} frames read, {rate:.0} frames/s"));
}

/// Done.
pub fn finish(b: &ProgressBar) {
    b.finish_and_clear();
}
