//! The scheduler thread: it owns the model and its slots, and runs continuous batching.
//!
//! Every step it (1) admits waiting requests into free slots, (2) drops the requests whose
//! client went away, (3) evaluates, for every active slot, either the next chunk of its prompt
//! or its last sampled token, through one [`Backend::forward`] call, and (4) samples and
//! sends each request its new text; a request that finishes leaves its slot at once.
//!
//! The forward pass is the [`Backend`]'s: all the step's slots in one call (on the CPU one
//! matrix-matrix product per weight over every slot's tokens, attention per slot's cache).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrolm_engine::constraint::Constraint;
use ferrolm_engine::sequence::{Sequence, SequenceParams};
use ferrolm_engine::{Backend, BackendError, FinishReason, SlotInput};
use ferrolm_model::Logits;
use ferrolm_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::ServerConfig;

/// What the scheduler sends a request.
#[derive(Debug)]
pub enum Event {
    /// Final text.
    Text(String),
    /// The end.
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The request failed; nothing follows.
    Error(ApiError),
}

/// A request for the scheduler.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SequenceParams,
    /// The grammar the output must follow, if any.
    pub constraint: Option<Constraint>,
    /// Special tokens appear in the text (a tool-call format's control-token markers).
    pub special_text: bool,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

struct Shared {
    /// Set at shutdown: requests in flight are cancelled at this instant.
    deadline: Mutex<Option<Instant>>,
    metrics: Arc<Metrics>,
    max_queue: usize,
    /// False once the scheduler thread has ended (or died): `/health` says so.
    running: AtomicBool,
}

/// A place in the queue, taken before any heavy work on a request (parsing, the template,
/// tokenization) and given back if the request is not queued after all.
pub struct Ticket {
    shared: Arc<Shared>,
    used: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.used {
            self.shared.metrics.queue_depth.fetch_sub(1, Relaxed);
        }
    }
}

/// What `/health` reports about the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerState {
    /// Taking requests.
    Running,
    /// Finishing the requests in flight; refusing new ones.
    ShuttingDown,
    /// The scheduler thread has ended: nothing will be answered.
    Stopped,
}

/// The HTTP layer's side of the scheduler.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Job>,
    shared: Arc<Shared>,
}

impl SchedulerHandle {
    /// Takes a place in the queue, or refuses with 503 when the queue is full or the server
    /// is stopping.
    pub fn reserve(&self) -> Result<Ticket, ApiError> {
        match self.state() {
            SchedulerState::Running => {}
            SchedulerState::ShuttingDown => {
                return Err(ApiError::unavailable("the server is shutting down", 5))
            }
            SchedulerState::Stopped => {
                return Err(ApiError::unavailable("the scheduler has stopped", 5))
            }
        }
        let depth = &self.shared.metrics.queue_depth;
        if depth.fetch_add(1, Relaxed) >= self.shared.max_queue {
            depth.fetch_sub(1, Relaxed);
            self.shared
                .metrics
                .rejected_queue_full
                .fetch_add(1, Relaxed);
            return Err(ApiError::unavailable(
                format!(
                    "the server is busy: every slot is in use and {} requests are waiting; retry later",
                    self.shared.max_queue
                ),
                1,
            ));
        }
        Ok(Ticket {
            shared: self.shared.clone(),
            used: false,
        })
    }

    /// Queues a job in the place `ticket` holds.
    pub fn submit(&self, job: Job, mut ticket: Ticket) -> Result<(), ApiError> {
        if self.stopping() {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
        self.tx
            .send(job)
            .map_err(|_| ApiError::unavailable("the scheduler has stopped", 5))?;
        // The scheduler gives the place back when it takes the job.
        ticket.used = true;
        Ok(())
    }

    /// Whether the scheduler takes requests, is finishing them, or has ended.
    pub fn state(&self) -> SchedulerState {
        if !self.shared.running.load(Relaxed) {
            SchedulerState::Stopped
        } else if self.stopping() {
            SchedulerState::ShuttingDown
        } else {
            SchedulerState::Running
        }
    }

    fn stopping(&self) -> bool {
        self.shared.deadline.lock().map_or(true, |d| d.is_some())
    }

    /// Stops admitting requests; those in flight are cancelled after `grace`.
    pub fn shut_down_after(&self, grace: Duration) {
        if let Ok(mut d) = self.shared.deadline.lock() {
            let at = Instant::now() + grace;
            *d = Some(d.map_or(at, |old| old.min(at)));
        }
    }

    /// Cancels everything now; the thread ends.
    pub fn shut_down(&self) {
        self.shut_down_after(Duration::ZERO);
    }
}

/// What the server serves: the backend, opened on the scheduler's own thread (a GPU backend
/// binds its context there), which it then owns until the server stops.
pub trait BackendSource: Send + 'static {
    /// The backend with up to `slots` sequences of `n_ctx` positions each (it may hold
    /// fewer: [`Backend::n_slots`]), or why it cannot be opened.
    fn open(&self, slots: usize, n_ctx: usize) -> Result<Box<dyn Backend + '_>, String>;
}

/// Starts the scheduler thread with `config.parallel` slots on the backend `source` opens;
/// returns once it is open (an error if it could not be).
pub fn start(
    source: Box<dyn BackendSource>,
    tokenizer: Arc<Tokenizer>,
    config: &ServerConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<(SchedulerHandle, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared {
        deadline: Mutex::new(None),
        metrics,
        max_queue: config.max_queue,
        running: AtomicBool::new(true),
    });
    let (parallel, n_ctx, chunk) = (config.parallel.max(1), config.n_ctx, config.prefill_chunk);
    let inner = shared.clone();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<usize, String>>();
    let join = std::thread::Builder::new()
        .name("ferrolm-scheduler".into())
        .spawn(move || {
            let mut backend = match source.open(parallel, n_ctx) {
                Ok(b) => b,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let n_slots = backend.n_slots().clamp(1, parallel);
            let _ = ready_tx.send(Ok(n_slots));
            let moe = backend
                .expert_counts()
                .is_some_and(|c| c.iter().any(|l| !l.is_empty()));
            let n_ctx = backend.n_ctx().min(n_ctx);
            Scheduler::new(&tokenizer, moe, n_slots, rx, inner, chunk, n_ctx).run(backend.as_mut())
        })?;
    match ready_rx.recv() {
        Ok(Ok(_)) => Ok((SchedulerHandle { tx, shared }, join)),
        Ok(Err(e)) => Err(std::io::Error::other(e)),
        Err(_) => Err(std::io::Error::other(
            "the scheduler thread ended before its backend was open",
        )),
    }
}

/// What a step gave a slot: logits to sample from, or the backend's greedy choice.
#[derive(Clone)]
enum Next {
    Logits(Vec<f32>),
    Chosen(u32),
    Top(Vec<(u32, f32)>),
}

/// The most candidates a step asks a backend for; a sampler with a larger top-k gets every logit.
const TOP_MAX: usize = 256;

/// Marks the scheduler stopped when dropped.
struct Running(Arc<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.store(false, Relaxed);
    }
}

/// A request in a slot.
struct Active<'t> {
    seq: Sequence<'t>,
    events: UnboundedSender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
    /// When it was admitted (a counter): the youngest request pauses first.
    order: u64,
}

/// Where [`Scheduler::place`] put a request.
enum Placed {
    /// In this slot, whose cache holds this many of its first ids.
    Slot(usize, usize),
    /// Nowhere yet: other requests hold the backend's room.
    NoRoom,
    /// Nowhere, ever: the message says why.
    Failed(String),
}

struct Scheduler<'t> {
    tokenizer: &'t Tokenizer,
    /// A mixture-of-experts model, whose expert counts `/metrics` reports after each step.
    experts: bool,
    slots: Vec<Option<Active<'t>>>,
    /// The ids each slot's cache holds, in order: a new request takes the free slot that
    /// shares the longest start with its prompt and evaluates only the rest (prefix caching).
    cached: Vec<Vec<u32>>,
    rx: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
    chunk: usize,
    n_ctx: usize,
    /// Requests paused to give their room to older ones (a device whose caches are paged),
    /// oldest first: they go back into slots before any new request.
    paused: Vec<Active<'t>>,
    /// A request taken from the queue that found no room yet.
    waiting: Option<Job>,
    /// Slots whose room is set aside ([`Backend::reserve`]), given back when they empty.
    holding: Vec<bool>,
    /// Requests admitted so far.
    admitted: u64,
}

impl<'t> Scheduler<'t> {
    fn new(
        tokenizer: &'t Tokenizer,
        experts: bool,
        n_slots: usize,
        rx: mpsc::Receiver<Job>,
        shared: Arc<Shared>,
        chunk: usize,
        n_ctx: usize,
    ) -> Scheduler<'t> {
        Scheduler {
            tokenizer,
            experts,
            slots: (0..n_slots).map(|_| None).collect(),
            cached: vec![Vec::new(); n_slots],
            rx,
            shared,
            chunk,
            n_ctx,
            paused: Vec::new(),
            waiting: None,
            holding: vec![false; n_slots],
            admitted: 0,
        }
    }

    fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn run(mut self, forward: &mut dyn Backend) {
        // However the loop ends (a panic included), the handle sees that it has.
        let _running = Running(self.shared.clone());
        loop {
            let deadline = self
                .shared
                .deadline
                .lock()
                .map_or(Some(Instant::now()), |d| *d);
            if let Some(deadline) = deadline {
                self.reject_queued();
                if Instant::now() >= deadline {
                    let gone = || ApiError::unavailable("the server shut down before the end", 5);
                    for slot in 0..self.slots.len() {
                        self.end_with_error(slot, gone());
                    }
                    for a in self.paused.drain(..) {
                        let _ = a.events.send(Event::Error(gone()));
                    }
                }
                // Paused requests still finish within the grace.
                self.resume_paused(forward);
                if self.active() == 0 && self.paused.is_empty() {
                    return;
                }
            } else if !self.admit(forward) {
                return;
            }
            self.metrics().active_slots.store(self.active(), Relaxed);
            if self.active() > 0 {
                self.step(forward);
            }
            self.metrics().active_slots.store(self.active(), Relaxed);
        }
    }

    /// Fills free slots, with paused requests first, then from the queue (waiting a little
    /// when nothing is active). False when every handle has gone.
    fn admit(&mut self, forward: &mut dyn Backend) -> bool {
        if !self.resume_paused(forward) {
            return true;
        }
        while self.slots.iter().any(|s| s.is_none()) {
            let job = match self.waiting.take() {
                Some(job) => job,
                None => {
                    let job = if self.active() == 0 {
                        match self.rx.recv_timeout(Duration::from_millis(50)) {
                            Ok(job) => job,
                            Err(RecvTimeoutError::Timeout) => return true,
                            Err(RecvTimeoutError::Disconnected) => return false,
                        }
                    } else {
                        match self.rx.try_recv() {
                            Ok(job) => job,
                            Err(TryRecvError::Empty) => return true,
                            Err(TryRecvError::Disconnected) => return false,
                        }
                    };
                    self.metrics().queue_depth.fetch_sub(1, Relaxed);
                    job
                }
            };
            if job.events.is_closed() {
                self.metrics().cancelled.fetch_add(1, Relaxed);
                continue;
            }
            let (slot, kept) = match self.place(forward, &job.prompt) {
                Placed::Slot(slot, kept) => (slot, kept),
                Placed::NoRoom => {
                    self.waiting = Some(job);
                    return true;
                }
                Placed::Failed(why) => {
                    let _ = job.events.send(Event::Error(ApiError::internal(why)));
                    continue;
                }
            };
            let mut seq = Sequence::new(self.tokenizer, job.prompt, job.params, self.n_ctx)
                .with_constraint(job.constraint)
                .with_special_text(job.special_text);
            seq.reuse_prefix(kept);
            if kept > 0 {
                self.metrics().prefix_hits.fetch_add(1, Relaxed);
                self.metrics()
                    .prefix_tokens_reused
                    .fetch_add(kept as u64, Relaxed);
            }
            self.metrics()
                .prompt_tokens
                .fetch_add(seq.prompt_tokens() as u64, Relaxed);
            self.admitted += 1;
            self.slots[slot] = Some(Active {
                seq,
                events: job.events,
                arrived: job.arrived,
                last_token: None,
                order: self.admitted,
            });
            if let Some(reason) = self.slots[slot].as_ref().and_then(|a| a.seq.finished()) {
                self.finish(slot, reason);
            }
        }
        true
    }

    /// Puts paused requests back into free slots, oldest first; true when none is left
    /// paused (new requests may come in).
    fn resume_paused(&mut self, forward: &mut dyn Backend) -> bool {
        while !self.paused.is_empty() && self.slots.iter().any(|s| s.is_none()) {
            let mut a = self.paused.remove(0);
            if a.events.is_closed() {
                self.metrics().cancelled.fetch_add(1, Relaxed);
                continue;
            }
            match self.place(forward, a.seq.ids()) {
                Placed::Slot(slot, kept) => {
                    // It evaluates again what the slot's cache no longer holds, then goes on.
                    a.seq.rewind(kept);
                    self.slots[slot] = Some(a);
                }
                Placed::NoRoom => {
                    self.paused.insert(0, a);
                    return false;
                }
                Placed::Failed(why) => {
                    self.metrics().failed.fetch_add(1, Relaxed);
                    let _ = a.events.send(Event::Error(ApiError::internal(why)));
                }
            }
        }
        self.paused.is_empty()
    }

    /// Gives back the room of slots whose request has left.
    fn release_left(&mut self, forward: &mut dyn Backend) {
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_none() && std::mem::take(&mut self.holding[slot]) {
                forward.release(slot);
            }
        }
    }

    /// A free slot for a request whose ids are `ids` (the prompt, or all a paused request
    /// has), gone back to the longest start it shares with them, with room set aside for them.
    fn place(&mut self, forward: &mut dyn Backend, ids: &[u32]) -> Placed {
        self.release_left(forward);
        // A cache the backend gave to another slot since holds nothing now.
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_none() {
                self.cached[slot].truncate(forward.position(slot));
            }
        }
        let (slot, common) = self.best_free_slot(ids);
        // The slot goes back to the common start (a cache that cannot go back that far
        // keeps less, down to nothing) and the sequence evaluates from there.
        let kept = match forward.truncate(slot, common) {
            Ok(kept) => kept.min(common),
            Err(e) => {
                self.cached[slot].clear();
                return Placed::Failed(format!("the model failed: {e}"));
            }
        };
        self.cached[slot].truncate(kept);
        match forward.reserve(slot, ids.len()) {
            Ok(true) => {
                self.holding[slot] = true;
                Placed::Slot(slot, kept)
            }
            Ok(false) => Placed::NoRoom,
            Err(e) => Placed::Failed(e.to_string()),
        }
    }

    /// Room for every active slot's next input, oldest request first; where a slot cannot
    /// grow, the youngest request (perhaps its own) pauses until room frees, keeping what it
    /// has generated.
    fn make_room(&mut self, forward: &mut dyn Backend) {
        self.release_left(forward);
        let mut by_age: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, a)| a.as_ref().map(|a| (a.order, slot)))
            .collect();
        by_age.sort_unstable();
        for &(_, slot) in &by_age {
            while let Some(a) = self.slots[slot].as_ref() {
                let needed = forward.position(slot) + a.seq.next_input(self.chunk).0.len();
                match forward.reserve(slot, needed) {
                    Ok(true) => break,
                    Ok(false) => {
                        let youngest = by_age
                            .iter()
                            .rev()
                            .map(|&(_, s)| s)
                            .find(|&s| self.slots[s].is_some())
                            .expect("this slot is active");
                        self.pause(forward, youngest);
                    }
                    Err(e) => {
                        self.metrics().failed.fetch_add(1, Relaxed);
                        let err =
                            ApiError::invalid(e.to_string()).with_code("context_length_exceeded");
                        self.end_with_error(slot, err);
                    }
                }
            }
        }
    }

    /// Takes `slot`'s request out until room frees ([`Scheduler::resume_paused`]).
    fn pause(&mut self, forward: &mut dyn Backend, slot: usize) {
        if let Some(a) = self.slots[slot].take() {
            self.holding[slot] = false;
            forward.release(slot);
            self.metrics().paused.fetch_add(1, Relaxed);
            let at = self.paused.partition_point(|p| p.order < a.order);
            self.paused.insert(at, a);
        }
    }

    /// The free slot whose cache shares the longest start with `prompt` (the first free one
    /// when none does), and how many ids it can reuse (never the prompt's last: its logits
    /// are needed).
    fn best_free_slot(&self, prompt: &[u32]) -> (usize, usize) {
        let mut best = None;
        for (slot, cached) in self.cached.iter().enumerate() {
            if self.slots[slot].is_some() {
                continue;
            }
            let common = cached
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count();
            let common = common.min(prompt.len().saturating_sub(1));
            if best.is_none_or(|(_, c)| common > c) {
                best = Some((slot, common));
            }
        }
        best.expect("the caller checked that a slot is free")
    }

    fn reject_queued(&mut self) {
        while let Ok(job) = self.rx.try_recv() {
            self.metrics().queue_depth.fetch_sub(1, Relaxed);
            let _ = job.events.send(Event::Error(ApiError::unavailable(
                "the server is shutting down",
                5,
            )));
        }
    }

    /// One step over every active slot.
    fn step(&mut self, forward: &mut dyn Backend) {
        // A client that went away is a normal end: its slot is free for this very step.
        for slot in 0..self.slots.len() {
            if self.slots[slot]
                .as_ref()
                .is_some_and(|a| a.events.is_closed())
            {
                self.slots[slot] = None;
                self.metrics().cancelled.fetch_add(1, Relaxed);
            }
        }
        self.make_room(forward);
        let mut inputs = Vec::new();
        for (slot, active) in self.slots.iter().enumerate() {
            if let Some(a) = active {
                let (ids, last) = a.seq.next_input(self.chunk);
                let want = if last { Logits::Last } else { Logits::None };
                inputs.push(SlotInput { slot, ids, want });
            }
        }
        if inputs.is_empty() {
            return;
        }
        self.metrics().batch_size(inputs.len());
        let done: Vec<(usize, usize, bool)> = inputs
            .iter()
            .map(|i| (i.slot, i.ids.len(), i.want != Logits::None))
            .collect();
        let evaluated: Vec<Vec<u32>> = inputs.iter().map(|i| i.ids.to_vec()).collect();
        // When no sequence needs every logit (greedy, or top-k samplers without penalties or
        // constraints), the backend returns only the ids or the largest logits (a GPU then
        // keeps the logits in its memory).
        let top = self
            .slots
            .iter()
            .flatten()
            .map(|a| a.seq.top_needed())
            .try_fold(1, |k, t| t.map(|t| k.max(t)))
            .filter(|&k| k <= TOP_MAX);
        let outputs = catch_unwind(AssertUnwindSafe(|| {
            if top == Some(1) {
                forward
                    .forward_greedy(&inputs)
                    .into_iter()
                    .map(|r| r.map(Next::Chosen))
                    .collect()
            } else if let Some(k) = top {
                forward
                    .forward_top(&inputs, k)
                    .into_iter()
                    .map(|r| r.map(Next::Top))
                    .collect()
            } else {
                forward
                    .forward(&inputs)
                    .into_iter()
                    .map(|r| r.map(Next::Logits))
                    .collect::<Vec<_>>()
            }
        }))
        .unwrap_or_else(|_| {
            let e = Arc::new(BackendError::Device("the forward pass panicked".into()));
            vec![Err(e); inputs.len()]
        });
        drop(inputs);
        if self.experts {
            self.metrics()
                .set_expert_counts(forward.expert_counts().unwrap_or_default());
            self.metrics()
                .set_expert_cache(forward.expert_cache_stats());
            self.metrics().set_expert_tiers(forward.expert_tier_stats());
        }
        for (((slot, n, wanted), output), ids) in done.into_iter().zip(outputs).zip(evaluated) {
            let logits = match output {
                Ok(next) => {
                    self.cached[slot].extend_from_slice(&ids);
                    wanted.then_some(next)
                }
                Err(e) => {
                    // What the slot's cache holds is no longer known: nothing is reused.
                    self.cached[slot].clear();
                    self.metrics().failed.fetch_add(1, Relaxed);
                    let err = if e.is_context_full() {
                        ApiError::invalid(e.to_string()).with_code("context_length_exceeded")
                    } else {
                        ApiError::internal(format!("the model failed: {e}"))
                    };
                    self.end_with_error(slot, err);
                    continue;
                }
            };
            let Some(active) = self.slots[slot].as_mut() else {
                continue;
            };
            let before = active.seq.completion_tokens();
            let step = match logits {
                Some(Next::Chosen(id)) => active.seq.advance_chosen(n, Some(id)),
                Some(Next::Top(top)) => active.seq.advance_top(n, Some(&top)),
                Some(Next::Logits(l)) => active.seq.advance(n, Some(&l)),
                None => active.seq.advance(n, None),
            };
            let step = match step {
                Ok(step) => step,
                Err(e) => {
                    self.metrics().failed.fetch_add(1, Relaxed);
                    self.end_with_error(slot, ApiError::internal(e.to_string()));
                    continue;
                }
            };
            if step.token.is_some() {
                let now = Instant::now();
                match active.last_token {
                    None => self
                        .shared
                        .metrics
                        .time_to_first_token((now - active.arrived).as_secs_f64()),
                    Some(t) => self.shared.metrics.time_per_token((now - t).as_secs_f64()),
                }
                active.last_token = Some(now);
            }
            let generated = active.seq.completion_tokens() - before;
            self.shared
                .metrics
                .generated_tokens
                .fetch_add(generated as u64, Relaxed);
            let mut gone = false;
            if !step.text.is_empty() {
                gone = active.events.send(Event::Text(step.text)).is_err();
            }
            if gone {
                self.slots[slot] = None;
                self.metrics().cancelled.fetch_add(1, Relaxed);
            } else if let Some(reason) = step.finished {
                self.finish(slot, reason);
            }
        }
    }

    fn finish(&mut self, slot: usize, finish: FinishReason) {
        if let Some(a) = self.slots[slot].take() {
            let _ = a.events.send(Event::Done {
                finish,
                prompt_tokens: a.seq.prompt_tokens(),
                completion_tokens: a.seq.completion_tokens(),
            });
        }
    }

    fn end_with_error(&mut self, slot: usize, error: ApiError) {
        if let Some(a) = self.slots[slot].take() {
            let _ = a.events.send(Event::Error(error));
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferrolm_engine::{SamplerParams, SlotOutput};
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    /// The default model's file (fetched by `scripts/test` before the tests).
    pub(crate) fn model_path() -> std::path::PathBuf {
        let home = std::env::var_os("FERROLM_HOME")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferrolm")
            });
        home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    }

    /// The default model's tokenizer.
    fn tokenizer() -> Tokenizer {
        let path = model_path();
        let file = ferrolm_gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run `ferrolm pull`)", path.display()));
        Tokenizer::from_metadata(file.metadata()).unwrap()
    }

    /// Every step's inputs: (slot, ids) per slot.
    type Steps = Arc<Mutex<Vec<Vec<(usize, usize)>>>>;

    /// A forward pass whose logits always pick token `TOKEN`, that records every step's inputs
    /// and fails (or panics) at a chosen step.
    struct Fake {
        n_vocab: usize,
        steps: Steps,
        fail_at: Option<usize>,
        panic_at: Option<usize>,
        /// Each slot's position.
        pos: [usize; 2],
    }

    const TOKEN: usize = 100;

    impl Backend for Fake {
        fn describe(&self) -> String {
            "fake".into()
        }
        fn n_slots(&self) -> usize {
            2
        }
        fn n_ctx(&self) -> usize {
            64
        }
        fn n_vocab(&self) -> usize {
            self.n_vocab
        }
        fn position(&self, slot: usize) -> usize {
            self.pos[slot]
        }
        fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError> {
            self.pos[slot] = self.pos[slot].min(pos);
            Ok(self.pos[slot])
        }
        fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
            let mut steps = self.steps.lock().unwrap();
            steps.push(inputs.iter().map(|i| (i.slot, i.ids.len())).collect());
            let step = steps.len();
            drop(steps);
            for i in inputs {
                self.pos[i.slot] += i.ids.len();
            }
            // Slow enough for requests to arrive while others run.
            std::thread::sleep(Duration::from_millis(2));
            if self.panic_at == Some(step) {
                panic!("a kernel bug");
            }
            if self.fail_at == Some(step) {
                let e = Arc::new(BackendError::Device("injected failure".into()));
                return vec![Err(e); inputs.len()];
            }
            inputs
                .iter()
                .map(|i| {
                    let mut l = vec![0.0; self.n_vocab];
                    if i.want != Logits::None {
                        l[TOKEN] = 10.0;
                    } else {
                        l.clear();
                    }
                    Ok(l)
                })
                .collect()
        }
    }

    fn job(prompt_len: usize, max_tokens: usize) -> (Job, UnboundedReceiver<Event>) {
        let (tx, rx) = unbounded_channel();
        let job = Job {
            prompt: vec![1; prompt_len],
            params: SequenceParams {
                max_tokens,
                sampler: SamplerParams::greedy(),
                stop: Vec::new(),
                stop_at_eog: true,
            },
            events: tx,
            arrived: Instant::now(),
            constraint: None,
            special_text: false,
        };
        (job, rx)
    }

    /// Waits for the end of a request: Ok(completion tokens) or Err(the error's message).
    fn outcome(rx: &mut UnboundedReceiver<Event>) -> Result<usize, String> {
        loop {
            match rx.blocking_recv() {
                Some(Event::Text(_)) => {}
                Some(Event::Done {
                    completion_tokens, ..
                }) => return Ok(completion_tokens),
                Some(Event::Error(e)) => return Err(e.message),
                None => return Err("dropped".into()),
            }
        }
    }

    /// Runs a scheduler over `fake` while `body` submits requests through the handle.
    fn with_scheduler(fake: Fake, chunk: usize, body: impl FnOnce(&SchedulerHandle)) {
        with_backend(fake, chunk, 64, |h, _| body(h));
    }

    /// Runs a scheduler over `backend` (two slots of `n_ctx`) while `body` submits requests.
    fn with_backend(
        backend: impl Backend + Send,
        chunk: usize,
        n_ctx: usize,
        body: impl FnOnce(&SchedulerHandle, &Metrics),
    ) {
        let tok = tokenizer();
        let (tx, rx) = mpsc::channel();
        let metrics = Arc::new(Metrics::new(2));
        let shared = Arc::new(Shared {
            deadline: Mutex::new(None),
            metrics: metrics.clone(),
            max_queue: 8,
            running: AtomicBool::new(true),
        });
        let handle = SchedulerHandle {
            tx,
            shared: shared.clone(),
        };
        std::thread::scope(|s| {
            let tok = &tok;
            s.spawn(move || {
                let mut backend = backend;
                Scheduler::new(tok, false, 2, rx, shared, chunk, n_ctx).run(&mut backend)
            });
            body(&handle, &metrics);
            handle.shut_down();
        });
    }

    fn fake(fail_at: Option<usize>, panic_at: Option<usize>) -> (Fake, Steps) {
        let steps = Arc::new(Mutex::new(Vec::new()));
        let n_vocab = tokenizer().vocab_size();
        (
            Fake {
                n_vocab,
                steps: steps.clone(),
                fail_at,
                panic_at,
                pos: [0; 2],
            },
            steps,
        )
    }

    #[test]
    fn a_failed_step_fails_every_request_in_it_and_serving_goes_on() {
        for (fail, panic) in [(Some(3), None), (None, Some(3))] {
            let (fake, _) = fake(fail, panic);
            with_scheduler(fake, 16, |h| {
                let (a, mut ra) = job(4, 10);
                let (b, mut rb) = job(4, 10);
                h.submit(a, h.reserve().unwrap()).unwrap();
                h.submit(b, h.reserve().unwrap()).unwrap();
                // Both were admitted together; step 3 fails for both of them.
                let (ea, eb) = (outcome(&mut ra), outcome(&mut rb));
                assert!(ea.is_err() && eb.is_err(), "{ea:?} {eb:?}");
                let (c, mut rc) = job(4, 10);
                h.submit(c, h.reserve().unwrap()).unwrap();
                assert_eq!(outcome(&mut rc), Ok(10));
            });
        }
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_while_another_sequence_decodes() {
        let (fake, steps) = fake(None, None);
        with_scheduler(fake, 4, |h| {
            let (a, mut ra) = job(2, 12);
            h.submit(a, h.reserve().unwrap()).unwrap();
            // Let A start decoding before B arrives.
            while steps.lock().unwrap().len() < 3 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (b, mut rb) = job(10, 3);
            h.submit(b, h.reserve().unwrap()).unwrap();
            assert_eq!(outcome(&mut rb), Ok(3));
            assert_eq!(outcome(&mut ra), Ok(12));
        });
        let steps = steps.lock().unwrap();
        // B (slot 1) enters in chunks of at most 4 prompt tokens, 10 in all, then decodes one
        // token per step; A (slot 0) decodes one token in every step it shares with B.
        let b: Vec<usize> = steps
            .iter()
            .filter_map(|s| s.iter().find(|(slot, _)| *slot == 1).map(|x| x.1))
            .collect();
        assert_eq!(b[..3], [4, 4, 2], "{steps:?}");
        assert!(b[3..].iter().all(|&n| n == 1), "{steps:?}");
        for s in steps.iter().filter(|s| s.len() == 2) {
            assert_eq!(s[0], (0, 1), "{steps:?}");
        }
        assert!(steps.iter().any(|s| s.len() == 2), "{steps:?}");
    }

    fn job_with(prompt: Vec<u32>, max_tokens: usize) -> (Job, UnboundedReceiver<Event>) {
        let (mut job, rx) = job(0, max_tokens);
        job.prompt = prompt;
        (job, rx)
    }

    /// The text a request streamed, or its error.
    fn text(rx: &mut UnboundedReceiver<Event>) -> Result<String, String> {
        let mut out = String::new();
        loop {
            match rx.blocking_recv() {
                Some(Event::Text(t)) => out.push_str(&t),
                Some(Event::Done { .. }) => return Ok(out),
                Some(Event::Error(e)) => return Err(e.message),
                None => return Err("dropped".into()),
            }
        }
    }

    fn handle(max_queue: usize) -> (SchedulerHandle, mpsc::Receiver<Job>, Arc<Shared>) {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            deadline: Mutex::new(None),
            metrics: Arc::new(Metrics::new(1)),
            max_queue,
            running: AtomicBool::new(true),
        });
        let handle = SchedulerHandle {
            tx,
            shared: shared.clone(),
        };
        (handle, rx, shared)
    }

    #[test]
    fn a_place_in_the_queue_is_taken_before_the_work_and_given_back_unused() {
        let (h, _rx, _) = handle(2);
        let a = h.reserve().unwrap();
        let b = h.reserve().unwrap();
        let full = h.reserve().err().expect("a third place in a queue of two");
        assert_eq!(full.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        drop(a); // its request failed to parse: the place is free again
        let c = h.reserve().unwrap();
        let (job, _events) = job(4, 1);
        h.submit(job, b).unwrap();
        drop(c);
        // The submitted job still holds its place until the scheduler takes it.
        assert_eq!(h.shared.metrics.queue_depth.load(Relaxed), 1);
    }

    /// A forward pass that panics where the scheduler does not catch it.
    struct Dies;

    impl Backend for Dies {
        fn describe(&self) -> String {
            "dies".into()
        }
        fn n_slots(&self) -> usize {
            1
        }
        fn n_ctx(&self) -> usize {
            64
        }
        fn n_vocab(&self) -> usize {
            1
        }
        fn position(&self, _slot: usize) -> usize {
            0
        }
        fn truncate(&mut self, _slot: usize, _pos: usize) -> Result<usize, BackendError> {
            panic!("a bug outside the forward pass");
        }
        fn forward(&mut self, _inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
            Vec::new()
        }
    }

    #[test]
    fn a_prompt_that_starts_with_a_slots_ids_evaluates_only_the_rest() {
        let (fake, steps) = fake(None, None);
        let prompt: Vec<u32> = (1..=10).collect();
        let mut other = prompt.clone();
        other[0] = 99;
        with_backend(fake, 16, 64, |h, m| {
            let (a, mut ra) = job_with(prompt.clone(), 3);
            h.submit(a, h.reserve().unwrap()).unwrap();
            assert_eq!(outcome(&mut ra), Ok(3));
            // The same prompt again: the slot that holds it serves it, from its last id on.
            let before = steps.lock().unwrap().len();
            let (b, mut rb) = job_with(prompt.clone(), 3);
            h.submit(b, h.reserve().unwrap()).unwrap();
            assert_eq!(outcome(&mut rb), Ok(3));
            assert_eq!(steps.lock().unwrap()[before], [(0, 1)]);
            assert_eq!(m.prefix_hits.load(Relaxed), 1);
            assert_eq!(m.prefix_tokens_reused.load(Relaxed), 9);
            // A prompt that differs at its first id reuses nothing, wherever it goes.
            let before = steps.lock().unwrap().len();
            let (c, mut rc) = job_with(other.clone(), 3);
            h.submit(c, h.reserve().unwrap()).unwrap();
            assert_eq!(outcome(&mut rc), Ok(3));
            let first = steps.lock().unwrap()[before].clone();
            assert_eq!(first.len(), 1);
            assert_eq!(first[0].1, 10, "{first:?}");
            assert_eq!(m.prefix_hits.load(Relaxed), 1);
        });
    }

    /// The default model on the CPU: a prompt served again after another request with the same
    /// system prompt replaced it in its slot (so only the shared start is reused) gives the
    /// same greedy text as the first time.
    #[test]
    fn a_cached_prefix_gives_the_tokens_of_a_full_evaluation() {
        let model = ferrolm_model::Model::load(model_path(), 1).unwrap();
        let tok = tokenizer();
        let system = tok.encode_prompt("You are a helpful assistant. Answer briefly and well.");
        let ask = |q: &str| {
            let mut p = system.clone();
            p.extend(tok.encode(q, false, false));
            p
        };
        let (first, second) = (
            ask(" What is the capital of France?"),
            ask(" Name a colour."),
        );
        let backend = ferrolm_engine::CpuBackend::new(&model, 2, 256);
        with_backend(backend, 8, 256, |h, m| {
            let run = |p: &Vec<u32>| {
                let (j, mut r) = job_with(p.clone(), 12);
                h.submit(j, h.reserve().unwrap()).unwrap();
                text(&mut r).unwrap()
            };
            let cold = run(&first);
            let other = run(&second);
            assert_eq!(
                m.prefix_hits.load(Relaxed),
                1,
                "the system prompt is shared"
            );
            let warm = run(&first);
            assert_eq!(cold, warm);
            assert_ne!(cold, other);
            assert_eq!(m.prefix_hits.load(Relaxed), 2);
            assert!(m.prefix_tokens_reused.load(Relaxed) >= 2 * system.len() as u64);
        });
    }

    /// Two slots over a pool of `capacity` positions, as a paged device cache: room is set
    /// aside per slot, a released slot keeps its cache until another needs the room, and
    /// every evaluation outside a slot's room is counted as a violation.
    struct Pooled<B> {
        inner: B,
        capacity: usize,
        room: [usize; 2],
        idle: [bool; 2],
        /// Evaluations of a slot past its room, or of a released slot.
        violations: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl<B: Backend> Backend for Pooled<B> {
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn n_slots(&self) -> usize {
            2
        }
        fn n_ctx(&self) -> usize {
            self.inner.n_ctx()
        }
        fn n_vocab(&self) -> usize {
            self.inner.n_vocab()
        }
        fn position(&self, slot: usize) -> usize {
            self.inner.position(slot)
        }
        fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError> {
            self.inner.truncate(slot, pos)
        }
        fn reserve(&mut self, slot: usize, positions: usize) -> Result<bool, BackendError> {
            if positions > self.capacity {
                return Err(BackendError::Device("never fits".into()));
            }
            let other = 1 - slot;
            if self.room[slot] < positions {
                if self.room[other] + positions > self.capacity {
                    return Ok(false);
                }
                self.room[slot] = positions;
            }
            self.idle[slot] = false;
            // An idle cache that no longer fits beside this one is given away.
            if self.idle[other] && self.inner.position(other) + positions > self.capacity {
                self.inner.truncate(other, 0)?;
            }
            Ok(true)
        }
        fn release(&mut self, slot: usize) {
            self.room[slot] = 0;
            self.idle[slot] = true;
        }
        fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
            for i in inputs {
                if self.idle[i.slot] || self.position(i.slot) + i.ids.len() > self.room[i.slot] {
                    self.violations.fetch_add(1, Relaxed);
                }
            }
            self.inner.forward(inputs)
        }
    }

    fn pooled<B: Backend>(
        inner: B,
        capacity: usize,
    ) -> (Pooled<B>, Arc<std::sync::atomic::AtomicUsize>) {
        let violations = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let p = Pooled {
            inner,
            capacity,
            room: [0; 2],
            idle: [true; 2],
            violations: violations.clone(),
        };
        (p, violations)
    }

    /// Four requests that each grow to 32 positions over a pool of 48: two never fit at once,
    /// so the younger pauses, gives its room away and resumes; every request ends whole and
    /// nothing is ever evaluated outside its room.
    #[test]
    fn requests_pause_when_the_pool_runs_out_and_all_finish() {
        let (fake, steps) = fake(None, None);
        let (backend, violations) = pooled(fake, 48);
        with_backend(backend, 8, 64, |h, m| {
            let jobs: Vec<_> = (0..4).map(|_| job(8, 24)).collect();
            let mut events = Vec::new();
            for (j, rx) in jobs {
                h.submit(j, h.reserve().unwrap()).unwrap();
                events.push(rx);
            }
            for rx in &mut events {
                assert_eq!(outcome(rx), Ok(24));
            }
            assert!(m.paused.load(Relaxed) >= 1, "the pool forced a pause");
        });
        assert_eq!(violations.load(Relaxed), 0);
        // Two slots did run side by side while both fit.
        assert!(steps.lock().unwrap().iter().any(|s| s.len() == 2));
    }

    /// The default model on the CPU over a pool too small for two requests at once: the
    /// paused one evaluates its ids again and gives the greedy text it gives alone.
    #[test]
    fn a_paused_request_gives_the_text_it_gives_alone() {
        let model = ferrolm_model::Model::load(model_path(), 1).unwrap();
        let tok = tokenizer();
        let prompts: Vec<Vec<u32>> = [" The capital of France is", " Once upon a time"]
            .iter()
            .map(|q| tok.encode_prompt(q))
            .collect();
        let run_all = |capacity: usize, together: bool| -> (Vec<String>, u64) {
            let (backend, violations) =
                pooled(ferrolm_engine::CpuBackend::new(&model, 2, 96), capacity);
            let mut out = Vec::new();
            let mut paused = 0;
            with_backend(backend, 8, 96, |h, m| {
                let mut rxs = Vec::new();
                for p in &prompts {
                    let (j, r) = job_with(p.clone(), 24);
                    h.submit(j, h.reserve().unwrap()).unwrap();
                    if together {
                        rxs.push(r);
                    } else {
                        let mut r = r;
                        out.push(text(&mut r).unwrap());
                    }
                }
                for mut r in rxs {
                    out.push(text(&mut r).unwrap());
                }
                paused = m.paused.load(Relaxed);
            });
            assert_eq!(violations.load(Relaxed), 0);
            (out, paused)
        };
        let (alone, _) = run_all(96, false);
        let longest = prompts.iter().map(Vec::len).max().unwrap() + 24;
        let (squeezed, paused) = run_all(longest + 8, true);
        assert!(paused >= 1, "the pool forced a pause");
        assert_eq!(alone, squeezed);
    }

    #[test]
    fn the_handle_reports_a_scheduler_thread_that_died() {
        let tok: &'static Tokenizer = Box::leak(Box::new(tokenizer()));
        let (h, rx, shared) = handle(4);
        let thread = std::thread::spawn(move || {
            Scheduler::new(tok, false, 1, rx, shared, 16, 64).run(&mut Dies)
        });
        assert_eq!(h.state(), SchedulerState::Running);
        let (job, _events) = job(4, 1);
        h.submit(job, h.reserve().unwrap()).unwrap();
        assert!(thread.join().is_err(), "the thread panicked");
        assert_eq!(h.state(), SchedulerState::Stopped);
        assert!(h.reserve().is_err());
    }
}
