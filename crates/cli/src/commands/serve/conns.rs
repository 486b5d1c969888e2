//! Open connections, so that a flood of idle ones cannot lock out a client with work.
//!
//! Every connection is registered when accepted. A connection is busy while it holds a
//! request that is queued, generating or streaming ([`Busy`]); otherwise it is idle: waiting
//! for headers (slow or half-open clients), sending a body, or kept alive between requests.
//! At `--max-connections`, a new connection is taken by closing the oldest idle one, so idle
//! and slow clients can delay nobody: only when every connection is busy is a new one
//! refused.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use super::metrics::Metrics;

struct Entry {
    busy: Arc<AtomicUsize>,
    close: Arc<Notify>,
}

/// The registry: connections by the order they were accepted in.
pub struct Conns {
    open: Mutex<BTreeMap<u64, Entry>>,
    next: AtomicU64,
    limit: usize,
    /// The gauge of open connections, set under the registry's lock: an evicted connection
    /// leaves it as its place is given away, so it never reads above `limit` while the
    /// evicted one's task is still winding down.
    gauge: Arc<Metrics>,
}

impl Conns {
    /// A registry of at most `limit` connections, counted in `metrics.connections`.
    pub fn new(limit: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            open: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            limit,
            gauge: metrics,
        })
    }

    fn count(&self, open: &BTreeMap<u64, Entry>) {
        self.gauge
            .connections
            .store(open.len() as u64, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a new connection. At the limit, the oldest idle connection is told to close
    /// and its place given to this one; `None` when every open connection is busy.
    pub fn open(self: &Arc<Self>) -> Option<Conn> {
        let mut open = self.lock();
        if open.len() >= self.limit {
            let oldest_idle = open
                .iter()
                .find(|(_, e)| e.busy.load(Ordering::SeqCst) == 0)
                .map(|(&id, _)| id)?;
            if let Some(e) = open.remove(&oldest_idle) {
                // Stored as a permit if its task is not waiting yet.
                e.close.notify_one();
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let busy = Arc::new(AtomicUsize::new(0));
        let close = Arc::new(Notify::new());
        open.insert(
            id,
            Entry {
                busy: busy.clone(),
                close: close.clone(),
            },
        );
        self.count(&open);
        Some(Conn {
            conns: self.clone(),
            id,
            busy: ConnBusy(busy),
            close,
        })
    }

    /// Connections registered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// One registered connection, held by its task; dropping it unregisters it.
pub struct Conn {
    conns: Arc<Conns>,
    id: u64,
    /// Handed to the connection's requests (a request extension).
    pub busy: ConnBusy,
    close: Arc<Notify>,
}

impl Conn {
    /// Resolves when the registry wants this connection closed.
    pub async fn evicted(&self) {
        self.close.notified().await
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut open = self.conns.lock();
        open.remove(&self.id);
        self.conns.count(&open);
    }
}

/// A connection's count of requests in progress, as a request extension.
#[derive(Clone)]
pub struct ConnBusy(Arc<AtomicUsize>);

impl ConnBusy {
    /// Marks the connection busy until the guard drops.
    pub fn hold(&self) -> Busy {
        self.0.fetch_add(1, Ordering::SeqCst);
        Busy(self.0.clone())
    }
}

/// Keeps a connection from being evicted while a request on it is in progress.
pub struct Busy(Arc<AtomicUsize>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At the limit the oldest idle connection makes room; busy ones are kept; with every
    /// connection busy, a new one is refused.
    #[test]
    fn the_oldest_idle_connection_makes_room() {
        let metrics = Arc::new(Metrics::default());
        let gauge = || metrics.connections.load(Ordering::Relaxed);
        let conns = Conns::new(3, metrics.clone());
        let a = conns.open().unwrap();
        let b = conns.open().unwrap();
        let c = conns.open().unwrap();
        let hold_a = a.busy.hold();
        let d = conns.open().unwrap(); // b (oldest idle) is evicted
        assert_eq!(conns.len(), 3);
        // The gauge follows the registry: b's place is given away at once, whenever its
        // task winds down.
        assert_eq!(gauge(), 3);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let evicted = |conn: &Conn| {
            rt.block_on(async {
                tokio::time::timeout(std::time::Duration::from_millis(20), conn.evicted())
                    .await
                    .is_ok()
            })
        };
        assert!(evicted(&b));
        assert!(!evicted(&a) && !evicted(&c));
        drop(b); // its task ends: nothing else changes
        assert_eq!(conns.len(), 3);
        let (_hold_c, _hold_d) = (c.busy.hold(), d.busy.hold());
        assert!(conns.open().is_none(), "every connection is busy");
        drop(hold_a);
        let _e = conns.open().unwrap();
        assert!(evicted(&a));
        drop(a);
        assert_eq!(conns.len(), 3);
    }
}
