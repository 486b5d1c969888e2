//! A team of spinning helper threads for the short parallel regions of decoding.
//!
//! Decoding one token runs some fifty products of tens to hundreds of microseconds each,
//! with a little serial work between them. On rayon's pool an idle worker sleeps within
//! microseconds (a futex), so each product would pay a wake-up on the way in and another
//! on the way out when the caller waits for the last range. Here the helpers spin between
//! regions for a short while (`SPIN`) and only then sleep, as llama.cpp's threads do
//! between the operations of a graph.
//!
//! While they wait, helpers read ahead: a decoding product tells the team (`hint`) what
//! the next one will likely have a helper read, and a waiting helper brings its start into
//! its cache, so that the caller's serial work between products overlaps with memory reads.
//!
//! One caller at a time: a caller that finds the team busy (another thread's product, or
//! a task that itself calls in) runs on rayon's pool instead. Tasks are claimed one at a
//! time from a shared counter, so the caller works too and any number of tasks fits any
//! size of team.

use std::any::Any;
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long an idle helper spins before it sleeps: longer than the serial work between two
/// products of a decoding step, short enough that a helper left spinning after the last
/// one costs the other work of the process little.
const SPIN: Duration = Duration::from_micros(200);

/// Tasks per job below this: a job's task count and next index are 16 bits each of the word
/// they share with its epoch.
const MAX_TASKS: usize = 1 << 16;

/// `f(i)` for `i` in `0..n`, the results in order: on the team when it is free, else on
/// rayon's pool. Runs here when `n` is 1.
pub fn map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    // A caller inside a one-thread pool asked for no parallelism.
    if n <= 1 || rayon::current_num_threads() == 1 {
        return (0..n).map(f).collect();
    }
    let team = match Team::get() {
        Some(team) if n < MAX_TASKS => team,
        _ => return (0..n).into_par_iter().map(&f).collect(),
    };
    let Some(_busy) = team.claim() else {
        return (0..n).into_par_iter().map(&f).collect();
    };
    let mut out: Vec<MaybeUninit<T>> = (0..n).map(|_| MaybeUninit::uninit()).collect();
    let slots = Slots(out.as_mut_ptr());
    let task = |i: usize| {
        let y = f(i);
        // SAFETY: each index is claimed by one thread exactly once; `out` outlives the job.
        unsafe { slots.write(i, y) };
    };
    team.run(n, &task);
    // SAFETY: `run` returned normally, so every one of the `n` tasks wrote its slot.
    out.into_iter()
        .map(|y| unsafe { y.assume_init() })
        .collect()
}

/// How far into each stream of a [`hint`] a waiting helper reads ahead: two hints' streams
/// (1 MiB) fit a core's second-level cache (docs/PERFORMANCE.md, "Helper threads").
const AHEAD: usize = 256 << 10;

/// Tells a waiting helper what the next job will likely have it read (two streams of
/// `(address, bytes)`), so that it brings the first [`AHEAD`] bytes of each into its cache
/// while the caller works alone (the serial work between a decoding step's products, each
/// helper idle through it). Only a hint: the addresses are never
/// read, only prefetched, which cannot fault (a helper that reads the slots while the next
/// hint is written prefetches a mix of the two, in vain).
pub(crate) fn hint(streams: Streams) {
    if let Some(team) = Team::get() {
        let [(a, n), (b, m)] = streams;
        for (slot, v) in team.hint.iter().zip([a, n, b, m]) {
            slot.store(v, Relaxed);
        }
        team.hints.fetch_add(1, Release);
    }
}

/// Two streams of `(address, bytes)` that a decoding product will read.
pub(crate) type Streams = [(usize, usize); 2];

/// The decoding products seen, by their weights' address and first row, each with the
/// streams of its successor's second range once known; the bytes they read, and the
/// product that ran last.
#[derive(Default)]
struct Order {
    seen: HashMap<(usize, usize), Option<Streams>>,
    total: usize,
    last: Option<(usize, usize)>,
}

/// Below this many bytes of decoding products' weights, a model sits in the last-level
/// cache (of a desktop or server CPU), and reading ahead only costs.
const STREAMED: usize = 32 << 20;

/// Records that the decoding product `key`, reading `bytes` of weights, of which its
/// second range reads `streams`, follows the product that ran before it; returns the
/// streams of what followed `key` last time, if the products seen read more than
/// [`STREAMED`] bytes: a decoding step runs the same products in the same order, so that
/// is what a helper will read next, to [`hint`] at. Matrices come and go (models dropped,
/// a server's several), so the table is cleared when it grows past a few models'
/// products; a stale entry only makes a helper prefetch in vain.
pub(crate) fn follow(key: (usize, usize), bytes: usize, streams: Streams) -> Option<Streams> {
    static ORDER: Mutex<Option<Order>> = Mutex::new(None);
    let mut order = ORDER.lock().unwrap_or_else(|e| e.into_inner());
    let order = order.get_or_insert_with(Order::default);
    if order.seen.len() >= 4096 {
        *order = Order::default();
    }
    if let Some(next) = order.last.replace(key).and_then(|l| order.seen.get_mut(&l)) {
        *next = Some(streams);
    }
    let next = *order.seen.entry(key).or_insert_with(|| {
        order.total += bytes;
        None
    });
    STREAMING.store(order.total >= STREAMED, Relaxed);
    next.filter(|_| order.total >= STREAMED)
}

/// [`streaming`]'s answer, kept by [`follow`].
static STREAMING: AtomicBool = AtomicBool::new(false);

/// Whether decoding streams its weights from memory: the decoding products seen on several
/// threads read more than 32 MiB of weights (a last-level cache). Each step then streams
/// them through the caches, and what else it reads (a decoding cache's keys and values)
/// comes from memory too. False with one thread, and until a step's products have run
/// once.
pub fn streaming() -> bool {
    STREAMING.load(Relaxed)
}

/// A helper's progress through the latest [`hint`].
#[derive(Default)]
struct ReadAhead {
    seen: usize,
    streams: Streams,
    at: usize,
}

impl ReadAhead {
    /// Prefetches the next four lines of each stream of the latest hint; false once
    /// there is nothing left to ask for.
    fn step(&mut self, team: &Team) -> bool {
        let hints = team.hints.load(Acquire);
        if hints != self.seen {
            let v = team.hint.each_ref().map(|h| h.load(Relaxed));
            (self.seen, self.at) = (hints, 0);
            self.streams = [(v[0], v[1].min(AHEAD)), (v[2], v[3].min(AHEAD))];
        }
        if self.at >= self.streams[0].1.max(self.streams[1].1) {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        for (start, len) in self.streams {
            for line in (self.at..(self.at + 256).min(len)).step_by(64) {
                // SAFETY: a prefetch is a hint that never faults, whatever the address.
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                    _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(line) as *const i8)
                };
            }
        }
        self.at += 256;
        cfg!(target_arch = "x86_64")
    }
}

/// One turn of a wait: a pause, and every 64th turn the core offered to another thread
/// (a helper with a task that the system took off its core when there are more threads
/// than cores; a free core makes it a short system call).
fn pause(spins: u32) {
    match spins.is_multiple_of(64) {
        true => std::thread::yield_now(),
        false => std::hint::spin_loop(),
    }
}

struct Slots<T>(*mut MaybeUninit<T>);

impl<T> Slots<T> {
    /// # Safety
    /// `i` in bounds, and written by one thread once.
    unsafe fn write(&self, i: usize, y: T) {
        self.0.add(i).write(MaybeUninit::new(y));
    }
}
// SAFETY: the tasks write disjoint slots.
unsafe impl<T: Send> Sync for Slots<T> {}

type Task<'a> = &'a (dyn Fn(usize) + Sync);

struct Team {
    /// Epoch (high 32 bits), task count (16), next unclaimed task (16). A helper claims a
    /// task by a compare-exchange that also checks the epoch, so it never takes a task of a
    /// job other than the one it read.
    word: AtomicU64,
    /// The current job's tasks: written by the caller before it publishes the epoch, read
    /// only by a thread that holds a claimed task of that epoch (the job outlives it).
    task: UnsafeCell<Option<Task<'static>>>,
    /// Tasks of the current job finished (or panicked).
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Held by the one caller at a time.
    busy: AtomicBool,
    /// Helpers asleep, and where they sleep.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// What the next job will likely read: two streams, address and bytes each
    /// ([`hint`]), and how many hints have been given.
    hint: [AtomicUsize; 4],
    hints: AtomicUsize,
}

// SAFETY: `task` is written only by the caller holding `busy` while no task of the previous
// job is outstanding, and read under the protocol above.
unsafe impl Sync for Team {}

struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Release);
    }
}

impl Team {
    /// The process's team: one helper per rayon thread beyond the first (at most one per
    /// core beyond the first), started on first use; `None` with one thread (or when a
    /// helper cannot be started).
    fn get() -> Option<&'static Team> {
        static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();
        *TEAM.get_or_init(|| {
            // No more threads spinning than cores (`--threads` may ask for more).
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let helpers = rayon::current_num_threads().min(cores).saturating_sub(1);
            if helpers == 0 {
                return None;
            }
            let team: &'static Team = Box::leak(Box::new(Team {
                word: AtomicU64::new(0),
                task: UnsafeCell::new(None),
                done: AtomicUsize::new(0),
                panic: Mutex::new(None),
                busy: AtomicBool::new(false),
                sleepers: AtomicUsize::new(0),
                lock: Mutex::new(()),
                wake: Condvar::new(),
                hint: Default::default(),
                hints: AtomicUsize::new(0),
            }));
            for i in 0..helpers {
                let spawned = std::thread::Builder::new()
                    .name(format!("mha-team-{i}"))
                    .stack_size(8 << 20)
                    .spawn(move || team.help());
                if spawned.is_err() {
                    return None;
                }
            }
            Some(team)
        })
    }

    fn claim(&self) -> Option<Busy<'_>> {
        self.busy
            .compare_exchange(false, true, Acquire, Relaxed)
            .ok()
            .map(|_| Busy(&self.busy))
    }

    /// Runs `task(i)` for `i` in `0..n` (`2 <= n < MAX_TASKS`) on this thread and the
    /// helpers; returns when all are done, resuming a task's panic here.
    fn run(&self, n: usize, task: Task<'_>) {
        // SAFETY: only the lifetime is erased; every task of this job finishes (the wait
        // below) before `task` goes out of scope, and no helper reads it afterwards.
        let task: Task<'static> = unsafe { std::mem::transmute(task) };
        unsafe { *self.task.get() = Some(task) };
        self.done.store(0, Relaxed);
        let epoch = (self.word.load(Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        let word = epoch << 32 | (n as u64) << 16;
        self.word.store(word, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        self.work(word);
        // The helpers' last tasks take about as long as ours.
        let mut spins = 0u32;
        while self.done.load(Acquire) < n {
            spins = spins.wrapping_add(1);
            pause(spins);
        }
        if let Some(p) = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            panic::resume_unwind(p);
        }
    }

    /// Claims and runs tasks of the job published as `seen` until none is left.
    fn work(&self, seen: u64) {
        let mut cur = seen;
        loop {
            let (n, i) = ((cur >> 16) & 0xffff, cur & 0xffff);
            if cur >> 32 != seen >> 32 || i >= n {
                return;
            }
            match self
                .word
                .compare_exchange_weak(cur, cur + 1, AcqRel, Acquire)
            {
                Ok(_) => {
                    // SAFETY: task i of this epoch is ours; the job stays published until
                    // it is counted done.
                    let task = unsafe { (*self.task.get()).expect("a published job") };
                    let run = panic::catch_unwind(AssertUnwindSafe(|| task(i as usize)));
                    if let Err(p) = run {
                        *self.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                    }
                    self.done.fetch_add(1, Release);
                    cur = self.word.load(Acquire);
                }
                Err(now) => cur = now,
            }
        }
    }

    /// A helper's life: wait for a new epoch (spinning, then asleep), work on it, repeat.
    fn help(&self) {
        // The team starts at epoch 0. Reading the word here instead would let a helper that
        // starts after the first job is published skip that job (`work` returns at once on
        // a job already finished).
        let mut last = 0;
        let mut ahead = ReadAhead::default();
        loop {
            let start = Instant::now();
            let mut spins = 0u32;
            let word = loop {
                let w = self.word.load(Acquire);
                if w >> 32 != last {
                    break w;
                }
                // Reading ahead (at most AHEAD / 256 turns a hint) neither sleeps nor yields.
                if ahead.step(self) {
                    std::hint::spin_loop();
                    continue;
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                    let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                    self.sleepers.fetch_add(1, SeqCst);
                    let w = self.word.load(SeqCst);
                    if w >> 32 == last {
                        drop(self.wake.wait(guard));
                    }
                    self.sleepers.fetch_sub(1, SeqCst);
                    continue;
                }
                pause(spins);
            };
            last = word >> 32;
            self.work(word);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn results_in_order_for_any_count() {
        for n in (0..70).chain([1000, MAX_TASKS - 1, MAX_TASKS, MAX_TASKS + 1]) {
            let ys = map(n, |i| i * i);
            assert_eq!(ys, (0..n).map(|i| i * i).collect::<Vec<_>>(), "n {n}");
        }
    }

    /// Several threads at once (one holds the team, the others fall back to rayon), and a
    /// task that calls in again.
    #[test]
    fn concurrent_and_nested_callers() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..200 {
                        let n = 2 + (t + round) % 9;
                        let ys = map(n, |i| map(3, |j| t * 1000 + i * 10 + j));
                        let want: Vec<Vec<usize>> = (0..n)
                            .map(|i| (0..3).map(|j| t * 1000 + i * 10 + j).collect())
                            .collect();
                        assert_eq!(ys, want, "thread {t}, round {round}");
                    }
                });
            }
        });
    }

    #[test]
    fn a_task_panic_reaches_the_caller_and_the_team_goes_on() {
        for _ in 0..3 {
            let caught = panic::catch_unwind(|| {
                map(16, |i| {
                    assert!(i != 11, "task 11 fails");
                    i
                })
            });
            let msg = caught.expect_err("the panic must reach the caller");
            assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 11 fails"));
            assert_eq!(map(5, |i| i + 1), vec![1, 2, 3, 4, 5]);
        }
    }

    /// A helper reads ahead a hint's first AHEAD bytes (here fewer: 1000 bytes, four
    /// turns of four lines) and then stops, until the next hint. (Other tests' products
    /// give hints too, so the count is bounded rather than exact.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reading_ahead_stops_until_the_next_hint() {
        let Some(team) = Team::get() else {
            return; // one thread: no team to hint
        };
        let data = vec![0u8; 1000];
        let mut ahead = ReadAhead::default();
        for _ in 0..3 {
            hint([(data.as_ptr() as usize, data.len()), (0, 0)]);
            assert!(ahead.step(team));
            let turns = (0..1_000_000).take_while(|_| ahead.step(team)).count();
            assert!(turns < 1_000_000, "reading ahead never stopped");
        }
    }

    /// The first job of a process, published while the helpers start, is shared too:
    /// [`helpers_take_tasks`] alone in a fresh process, where no other test has started the
    /// team before it (a helper that started by reading the epoch it found missed that job).
    #[test]
    fn helpers_take_the_first_job_of_a_process() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["team::tests::helpers_take_tasks", "--exact"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The helpers do take tasks: 200 tasks of 0.5 ms run on more than one thread.
    #[test]
    fn helpers_take_tasks() {
        let Some(team) = Team::get() else {
            return; // one thread: no team to test
        };
        // Other tests may hold the team for a moment.
        let start = Instant::now();
        let busy = loop {
            if let Some(b) = team.claim() {
                break b;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "team never free");
            std::thread::sleep(Duration::from_millis(1));
        };
        let ids = Mutex::new(HashSet::new());
        team.run(200, &|_| {
            std::thread::sleep(Duration::from_micros(500));
            ids.lock().unwrap().insert(std::thread::current().id());
        });
        drop(busy);
        assert!(ids.into_inner().unwrap().len() >= 2);
    }
}
