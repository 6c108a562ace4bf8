//! A persistent thread pool for a forward pass: hundreds of small parallel steps per token,
//! where waking sleeping threads (as a general-purpose pool does after a few microseconds of
//! idleness) costs more than the steps themselves. Workers spin on an epoch counter for a while
//! after each step, then park; the caller takes a share of every step itself.
//!
//! The public face is safe: [`ThreadPool::run`] borrows its job only until it returns, and it
//! returns only after every worker has finished with it.
#![deny(missing_docs)]
#![deny(unsafe_code)] // one reasoned exception: handing a borrowed job to the workers

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A job: called once on every thread with (thread index, thread count).
type Job<'a> = dyn Fn(usize, usize) + Sync + 'a;

/// Busy-spins before a waiting thread starts yielding its core: a step's wait is usually this
/// short, and yielding early keeps an oversubscribed machine (another process on a core) from
/// starving the thread that is still working.
const SPINS_BEFORE_YIELDING: u32 = 1 << 11;

/// Waits (spins and yields) before a worker parks (a few milliseconds): long enough to bridge
/// the sequential work between two steps of a token, short enough not to burn a core while a
/// user types.
const SPINS_BEFORE_PARKING: u32 = 1 << 16;

/// One round of waiting: a pause instruction at first, then giving the core away.
#[inline]
fn backoff(spins: u32) {
    if spins < SPINS_BEFORE_YIELDING {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

struct Shared {
    /// Incremented to publish a job.
    epoch: AtomicUsize,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// The current job, valid while `pending > 0` (see `run`).
    job: UnsafeCell<Option<*const Job<'static>>>,
    panicked: AtomicBool,
    stop: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by `run` while no worker reads it (all workers have finished
// the previous job and none has seen the new epoch yet), and read by workers only between
// observing the new epoch (Acquire, after the Release that published it) and decrementing
// `pending`; the job it points to is `Sync`.
#[allow(unsafe_code)]
unsafe impl Sync for Shared {}
#[allow(unsafe_code)]
unsafe impl Send for Shared {}

/// A fixed set of threads that run jobs together.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes callers: one job at a time.
    running: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, the caller included (0 or 1: the caller alone).
    pub fn new(n_threads: usize) -> std::io::Result<ThreadPool> {
        let n = n_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(n - 1);
        for index in 1..n {
            let shared = Arc::clone(&shared);
            workers.push(
                std::thread::Builder::new()
                    .name(format!("ferrolm-worker-{index}"))
                    .spawn(move || worker(&shared, index, n))?,
            );
        }
        Ok(ThreadPool {
            shared,
            workers,
            running: Mutex::new(()),
        })
    }

    /// Threads in the pool, the caller included.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `job(thread, n_threads)` on every thread (the caller is thread 0) and returns when
    /// all have finished. A panic in any thread's share is raised here after all finished.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.n_threads();
        if n == 1 {
            job(0, 1);
            return;
        }
        let _one_at_a_time = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        #[allow(unsafe_code)]
        // SAFETY: every worker finished the previous job (`pending` was 0 when the last `run`
        // returned) and none reads `job` before the epoch below is published. The lifetime is
        // erased only for as long as this call: it waits below until every worker is done.
        unsafe {
            let job: *const Job<'_> = job;
            *s.job.get() = Some(std::mem::transmute::<*const Job<'_>, *const Job<'static>>(
                job,
            ));
        }
        s.pending.store(n - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        {
            // Parked workers re-check the epoch under this lock, so none misses the wake-up.
            let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| job(0, n)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            backoff(spins);
            spins = spins.saturating_add(1);
        }
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a ferrolm worker thread panicked");
        }
    }

    /// Calls `f(i, chunk)` for every `chunk_len`-long chunk of `data` (the last may be
    /// shorter), the chunks shared out dynamically among the threads.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunks: Vec<Mutex<&mut [T]>> =
            data.chunks_mut(chunk_len.max(1)).map(Mutex::new).collect();
        let next = AtomicUsize::new(0);
        self.run(&|_, _| loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = chunks.get(i) else { break };
            let mut chunk = chunk.lock().unwrap_or_else(|e| e.into_inner());
            f(i, &mut chunk);
        });
    }

    /// `f(i)` for `i` in `0..n`, shared out dynamically, results in order.
    pub fn map<R: Send>(&self, n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        let slots: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        self.run(&|_, _| loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            let r = f(i);
            *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        });
        slots
            .into_iter()
            .map(|s| {
                s.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .expect("every slot was filled")
            })
            .collect()
    }
}

fn worker(s: &Shared, index: usize, n: usize) {
    let mut seen = 0;
    loop {
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            if spins < SPINS_BEFORE_PARKING {
                backoff(spins);
                spins += 1;
            } else {
                let g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                if s.epoch.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Relaxed) {
                    drop(s.wake.wait(g));
                }
            }
        }
        #[allow(unsafe_code)]
        // SAFETY: the epoch was published after `job` was written (Release/Acquire), and `run`
        // keeps the job alive until `pending` reaches 0, which this worker's decrement below
        // contributes to only after its last use of the job.
        let result = unsafe {
            let job = (*s.job.get()).expect("a job is published with its epoch");
            catch_unwind(AssertUnwindSafe(|| (*job)(index, n)))
        };
        if result.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_each_job_once() {
        for n in [1, 2, 3, 5] {
            let pool = ThreadPool::new(n).unwrap();
            for round in 0..200 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|i, total| {
                    assert_eq!(total, n);
                    hits[i].fetch_add(round + 1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == round + 1));
            }
        }
    }

    #[test]
    fn chunks_and_maps_cover_everything_in_order() {
        let pool = ThreadPool::new(3).unwrap();
        let mut v = vec![0usize; 1001];
        pool.for_each_chunk_mut(&mut v, 10, |i, c| {
            c.iter_mut().enumerate().for_each(|(j, x)| *x = i * 10 + j)
        });
        assert!(v.iter().enumerate().all(|(i, &x)| i == x));
        assert_eq!(
            pool.map(100, |i| i * i),
            (0..100).map(|i| i * i).collect::<Vec<_>>()
        );
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = ThreadPool::new(2).unwrap();
        let count = AtomicUsize::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(std::time::Duration::from_millis(50)); // long enough to park
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_panicking_share_is_raised_and_the_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i, _| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }
}
