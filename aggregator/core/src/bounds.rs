//! Bounded state: every map the core keeps has a cap, and what a cap or a retention
//! turned away is counted. [`MapSize`] is what [`crate::Core::map_sizes`] reports, so a
//! long run can check each map against its cap and print its high-water size.

/// One map's size and cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapSize {
    /// `component.map`, e.g. `matcher.ops`.
    pub name: &'static str,
    /// Entries now.
    pub len: usize,
    /// The most it may hold.
    pub cap: usize,
}

impl MapSize {
    /// A map's size against its cap.
    #[must_use]
    pub const fn new(name: &'static str, len: usize, cap: usize) -> Self {
        Self { name, len, cap }
    }

    /// Whether the map is within its cap.
    #[must_use]
    pub const fn within(&self) -> bool {
        self.len <= self.cap
    }
}
