//! Supervision (issue 18): what happens when a task panics.
//!
//! - A panic inside the core — the state behind the lock may be half-mutated — is never
//!   survived: the core's lock is poisoned, [`Shared::core`] refuses it from then on (no
//!   ack, no snapshot, no verdict read), [`Shared::fail`] wakes `main`, and the process
//!   exits non-zero so its supervisor (systemd, Kubernetes) restarts it from the last
//!   snapshot. The timer task is the core's: any panic there, or its end, fails the core
//!   ([`spawn_core_task`]).
//! - A panic in pure I/O — one connection, one batch stream, one HTTP handler, the accept
//!   loop, the snapshot schedule — is caught where it happened, counted, logged, and the
//!   task goes on (a connection is closed and its shipper reconnects; a handler answers
//!   500; a long-lived task restarts in place, [`spawn_io_task`]). If the core's lock was
//!   poisoned by it, the core fails as above.
//!
//! `/healthz` shows every long-lived task (alive, panics, restarts, the age of its last
//! progress); `/readyz` whether the aggregator is serving.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::task::JoinHandle;

use crate::state::{Shared, TaskHealth};

/// A panic's message, for the log.
#[must_use]
pub fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// Which task of [`crate::state::Tasks`].
pub type Pick = fn(&Shared) -> &TaskHealth;

/// Runs the core's task `fut` (the timers): its panic or its end fails the core. Aborting
/// the returned handle stops it quietly (shutdown).
pub fn spawn_core_task<F>(shared: Arc<Shared>, pick: Pick, fut: F) -> JoinHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    // Alive from the moment it is spawned: `/healthz` never sees a task not yet polled as
    // dead.
    pick(&shared).alive.store(true, Relaxed);
    tokio::spawn(async move {
        let task = pick(&shared);
        let outcome = AssertUnwindSafe(fut).catch_unwind().await;
        task.alive.store(false, Relaxed);
        match outcome {
            Ok(()) => shared.fail(format!("the {} task ended", task.name)),
            Err(p) => {
                task.panics.fetch_add(1, Relaxed);
                shared.fail(format!("the {} task panicked: {}", task.name, panic_message(p.as_ref())));
            }
        }
    })
}

/// Runs the I/O task made by `make`, restarting it in place after a panic (counted,
/// logged; 100 ms apart) unless the panic poisoned the core's lock, which fails the core.
/// A normal end (its listener closed) ends it.
pub fn spawn_io_task<M, F>(shared: Arc<Shared>, pick: Pick, make: M) -> JoinHandle<()>
where
    M: Fn() -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    pick(&shared).alive.store(true, Relaxed);
    tokio::spawn(async move {
        loop {
            let task = pick(&shared);
            let outcome = AssertUnwindSafe(make()).catch_unwind().await;
            task.alive.store(false, Relaxed);
            let Err(p) = outcome else { return };
            task.panics.fetch_add(1, Relaxed);
            let why = panic_message(p.as_ref());
            if shared.core_poisoned() {
                shared.fail(format!("the {} task panicked holding the core: {why}", task.name));
                return;
            }
            task.restarts.fetch_add(1, Relaxed);
            tracing::error!(task = task.name, panic = %why, "task panicked; restarting it");
            tokio::time::sleep(Duration::from_millis(100)).await;
            task.alive.store(true, Relaxed);
        }
    })
}

/// Runs one short-lived I/O future (a connection, a batch stream) in place: a panic is
/// counted in `Tasks::connection_panics` and logged — or fails the core if it poisoned
/// the core's lock. Returns `None` after a panic.
pub async fn guard<F: Future>(shared: &Shared, what: &'static str, fut: F) -> Option<F::Output> {
    match AssertUnwindSafe(fut).catch_unwind().await {
        Ok(v) => Some(v),
        Err(p) => {
            shared.tasks.connection_panics.fetch_add(1, Relaxed);
            let why = panic_message(p.as_ref());
            if shared.core_poisoned() {
                shared.fail(format!("a {what} task panicked holding the core: {why}"));
            } else {
                tracing::error!(task = what, panic = %why, "task panicked; its connection is closed");
            }
            None
        }
    }
}
