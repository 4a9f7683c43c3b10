//! A drained-in-order output queue for the `poll_*` side of a sans-IO state machine.
//! Its memory is reused: it empties whenever everything pushed has been polled.

use rkyv::{Archive, Deserialize, Serialize};

/// Items waiting to be polled, in push order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Outbox<T> {
    items: Vec<T>,
    read: usize,
}

impl<T> Default for Outbox<T> {
    fn default() -> Self {
        Self { items: Vec::new(), read: 0 }
    }
}

impl<T: Clone> Outbox<T> {
    /// Queues one item.
    pub fn push(&mut self, item: T) {
        self.items.push(item);
    }

    /// Queues many.
    pub fn extend(&mut self, items: impl IntoIterator<Item = T>) {
        self.items.extend(items);
    }

    /// The next item.
    pub fn poll(&mut self) -> Option<T> {
        let item = self.items.get(self.read).cloned();
        if item.is_some() {
            self.read = self.read.saturating_add(1);
        }
        if self.read >= self.items.len() {
            self.items.clear();
            self.read = 0;
        }
        item
    }
}
