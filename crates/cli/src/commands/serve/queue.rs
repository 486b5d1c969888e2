//! The bounded queue between the request handlers and the scheduler.
//!
//! A place in the queue belongs only to a request that is still waiting: each push returns
//! a [`Ticket`], and dropping it (the request finished, failed, or its client went away and
//! the handler was dropped) takes the request's jobs that are still waiting out at once, so
//! the next request gets the place and the queue gauge says so.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::job::Job;
use super::metrics::Metrics;

/// Why jobs were not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError {
    /// The jobs do not fit beside the `--max-queue` already waiting.
    Full,
    /// The server is shutting down.
    Closed,
}

struct State {
    /// Waiting jobs, oldest first, each with its place number.
    jobs: VecDeque<(u64, Job)>,
    next: u64,
    closed: bool,
}

struct Inner {
    state: Mutex<State>,
    ready: Condvar,
    capacity: usize,
    metrics: Arc<Metrics>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A handler that panicked holding the lock leaves the queue consistent: every
        // change below is one call on the deque.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The gauge follows the deque; called with the lock held.
    fn gauge(&self, state: &State) {
        let n = state.jobs.len() as u64;
        self.metrics.queue_length.store(n, Ordering::Relaxed);
    }
}

/// The handlers' and the scheduler's handle on the queue.
#[derive(Clone)]
pub struct Queue {
    inner: Arc<Inner>,
}

impl Queue {
    /// A queue of at most `capacity` waiting jobs.
    pub fn new(capacity: usize, metrics: Arc<Metrics>) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    jobs: VecDeque::new(),
                    next: 0,
                    closed: false,
                }),
                ready: Condvar::new(),
                capacity,
                metrics,
            }),
        }
    }

    /// Queues all of `jobs` (a request's choices) or none of them.
    pub fn push(&self, jobs: Vec<Job>) -> Result<Ticket, QueueError> {
        let mut state = self.inner.lock();
        if state.closed {
            return Err(QueueError::Closed);
        }
        if state.jobs.len() + jobs.len() > self.inner.capacity {
            return Err(QueueError::Full);
        }
        let mut places = Vec::with_capacity(jobs.len());
        for job in jobs {
            let place = state.next;
            state.next += 1;
            state.jobs.push_back((place, job));
            places.push(place);
        }
        self.inner.gauge(&state);
        drop(state);
        self.inner.ready.notify_one();
        Ok(Ticket {
            inner: self.inner.clone(),
            places,
        })
    }

    /// The oldest waiting job, waiting up to `timeout` for one.
    pub fn pop_wait(&self, timeout: Duration) -> Option<Job> {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        loop {
            if let Some(job) = self.take(&mut state) {
                return Some(job);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if left.is_zero() || state.closed {
                return None;
            }
            state = match self.inner.ready.wait_timeout(state, left) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// The oldest waiting job, if any.
    pub fn try_pop(&self) -> Option<Job> {
        let mut state = self.inner.lock();
        self.take(&mut state)
    }

    fn take(&self, state: &mut State) -> Option<Job> {
        let (_, job) = state.jobs.pop_front()?;
        self.inner.gauge(state);
        self.inner
            .metrics
            .queue_wait
            .observe(job.queued_at.elapsed().as_secs_f64());
        Some(job)
    }

    /// Refuses every later push and hands back the jobs still waiting.
    pub fn close(&self) -> Vec<Job> {
        let mut state = self.inner.lock();
        state.closed = true;
        let jobs = state.jobs.drain(..).map(|(_, j)| j).collect();
        self.inner.gauge(&state);
        jobs
    }

    /// Jobs waiting now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().jobs.len()
    }
}

/// The places one request holds; dropping it takes back those still waiting.
pub struct Ticket {
    inner: Arc<Inner>,
    places: Vec<u64>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.inner.lock();
        let before = state.jobs.len();
        // Places are numbered in order, so the deque is sorted by them: each is found by
        // binary search (a request holds at most a few places).
        for place in &self.places {
            if let Ok(i) = state.jobs.binary_search_by_key(place, |(p, _)| *p) {
                state.jobs.remove(i);
            }
        }
        if state.jobs.len() != before {
            self.inner.gauge(&state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpt_blocks::SamplingParams;
    use std::sync::atomic::AtomicBool;

    fn job(index: usize) -> Job {
        Job {
            index,
            prompt: vec![1],
            max_tokens: 1,
            sampler: gpt_blocks::Sampler::new(SamplingParams::default()).unwrap(),
            stop_ids: Vec::new(),
            logprobs: None,
            constraint: None,
            events: tokio::sync::mpsc::unbounded_channel().0,
            cancel: Arc::new(AtomicBool::new(false)),
            queued_at: Instant::now(),
        }
    }

    /// A request's jobs go in together or not at all; a dropped ticket frees its places at
    /// once and the gauge follows; the rest keep their order.
    #[test]
    fn places_are_freed_when_the_request_goes() {
        let metrics = Arc::new(Metrics::default());
        let q = Queue::new(4, metrics.clone());
        let a = q.push(vec![job(0), job(1)]).unwrap();
        let b = q.push(vec![job(2)]).unwrap();
        assert_eq!(q.push(vec![job(3), job(4)]).err(), Some(QueueError::Full));
        assert_eq!(q.len(), 3);
        assert_eq!(metrics.queue_length.load(Ordering::Relaxed), 3);
        drop(a);
        assert_eq!(q.len(), 1);
        assert_eq!(metrics.queue_length.load(Ordering::Relaxed), 1);
        let c = q.push(vec![job(5), job(6), job(7)]).unwrap();
        assert_eq!(q.try_pop().map(|j| j.index), Some(2));
        drop(b); // already taken: nothing to remove
        assert_eq!(q.len(), 3);
        assert_eq!(q.pop_wait(Duration::ZERO).map(|j| j.index), Some(5));
        drop(c);
        assert_eq!(q.len(), 0);
        assert_eq!(metrics.queue_length.load(Ordering::Relaxed), 0);
        assert!(q.pop_wait(Duration::from_millis(5)).is_none());
        let _d = q.push(vec![job(8)]).unwrap();
        assert_eq!(q.close().len(), 1);
        assert_eq!(q.push(vec![job(9)]).err(), Some(QueueError::Closed));
        assert_eq!(metrics.queue_length.load(Ordering::Relaxed), 0);
    }

    /// A waiting scheduler wakes for a job pushed from another thread.
    #[test]
    fn pop_wait_wakes_on_push() {
        let q = Queue::new(2, Arc::new(Metrics::default()));
        let q2 = q.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            std::mem::forget(q2.push(vec![job(1)]).unwrap());
        });
        let got = q.pop_wait(Duration::from_secs(10)).map(|j| j.index);
        t.join().unwrap();
        assert_eq!(got, Some(1));
    }
}
