//! The scheduler thread: it owns the model and its slots, and runs continuous batching.
//!
//! Every step it (1) admits waiting requests into free slots, (2) drops the requests whose
//! client went away, (3) evaluates, for every active slot, either the next chunk of its prompt
//! or its last sampled token, through one [`StepForward::forward`] call, and (4) samples and
//! sends each request its new text; a request that finishes leaves its slot at once.
//!
//! The forward pass is [`BatchedForward`]: all the step's slots in one forward pass (one
//! matrix-matrix product per weight over every slot's tokens, attention per slot's cache).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrolm_engine::constraint::Constraint;
use ferrolm_engine::sequence::{BatchedForward, Sequence, SequenceParams, SlotInput, StepForward};
use ferrolm_engine::FinishReason;
use ferrolm_model::{Model, ModelError};
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

/// Makes the scheduler's forward pass on its own thread (a GPU backend binds its context
/// there) from the model, the slots asked for and their context size; it may serve fewer
/// slots ([`StepForward::n_slots`]).
pub type ForwardFactory =
    Box<dyn for<'m> FnOnce(&'m Model, usize, usize) -> Box<dyn StepForward + 'm> + Send>;

/// Starts the scheduler thread with `config.parallel` slots, on the CPU ([`BatchedForward`])
/// or through the forward pass `factory` makes.
pub fn start(
    model: Model,
    tokenizer: Arc<Tokenizer>,
    config: &ServerConfig,
    metrics: Arc<Metrics>,
    factory: Option<ForwardFactory>,
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
    let join = std::thread::Builder::new()
        .name("ferrolm-scheduler".into())
        .spawn(move || {
            let mut forward: Box<dyn StepForward + '_> = match factory {
                Some(make) => make(&model, parallel, n_ctx),
                None => Box::new(BatchedForward::new(&model, parallel, n_ctx)),
            };
            let n_slots = forward.n_slots().clamp(1, parallel);
            let moe = model.expert_counts().iter().any(|l| !l.is_empty());
            Scheduler {
                tokenizer: &tokenizer,
                experts: moe.then_some(&model),
                slots: (0..n_slots).map(|_| None).collect(),
                rx,
                shared: inner,
                chunk,
                n_ctx,
            }
            .run(forward.as_mut())
        })?;
    Ok((SchedulerHandle { tx, shared }, join))
}

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
}

struct Scheduler<'t> {
    tokenizer: &'t Tokenizer,
    /// A mixture-of-experts model, whose expert counts `/metrics` reports after each step.
    experts: Option<&'t Model>,
    slots: Vec<Option<Active<'t>>>,
    rx: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
    chunk: usize,
    n_ctx: usize,
}

impl<'t> Scheduler<'t> {
    fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn run(mut self, forward: &mut dyn StepForward) {
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
                    for slot in 0..self.slots.len() {
                        self.end_with_error(
                            slot,
                            ApiError::unavailable("the server shut down before the end", 5),
                        );
                    }
                }
                if self.active() == 0 {
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

    /// Fills free slots from the queue (waiting a little when nothing is active). False when
    /// every handle has gone.
    fn admit(&mut self, forward: &mut dyn StepForward) -> bool {
        while let Some(slot) = self.slots.iter().position(|s| s.is_none()) {
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
            if job.events.is_closed() {
                self.metrics().cancelled.fetch_add(1, Relaxed);
                continue;
            }
            forward.clear(slot);
            self.metrics()
                .prompt_tokens
                .fetch_add(job.prompt.len() as u64, Relaxed);
            let seq = Sequence::new(self.tokenizer, job.prompt, job.params, self.n_ctx)
                .with_constraint(job.constraint)
                .with_special_text(job.special_text);
            self.slots[slot] = Some(Active {
                seq,
                events: job.events,
                arrived: job.arrived,
                last_token: None,
            });
            if let Some(reason) = self.slots[slot].as_ref().and_then(|a| a.seq.finished()) {
                self.finish(slot, reason);
            }
        }
        true
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
    fn step(&mut self, forward: &mut dyn StepForward) {
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
        let mut inputs = Vec::new();
        for (slot, active) in self.slots.iter().enumerate() {
            if let Some(a) = active {
                let (ids, logits) = a.seq.next_input(self.chunk);
                inputs.push(SlotInput { slot, ids, logits });
            }
        }
        if inputs.is_empty() {
            return;
        }
        self.metrics().batch_size(inputs.len());
        let done: Vec<(usize, usize)> = inputs.iter().map(|i| (i.slot, i.ids.len())).collect();
        let outputs =
            catch_unwind(AssertUnwindSafe(|| forward.forward(&inputs))).unwrap_or_else(|_| {
                let e = Arc::new(ModelError::Invalid("the forward pass panicked".into()));
                vec![Err(e); inputs.len()]
            });
        drop(inputs);
        if let Some(model) = self.experts {
            self.metrics().set_expert_counts(model.expert_counts());
            self.metrics().set_expert_cache(model.expert_cache_stats());
        }
        for ((slot, n), output) in done.into_iter().zip(outputs) {
            let logits = match output {
                Ok(l) => l,
                Err(e) => {
                    self.metrics().failed.fetch_add(1, Relaxed);
                    let err = match &*e {
                        ModelError::ContextFull { .. } => {
                            ApiError::invalid(e.to_string()).with_code("context_length_exceeded")
                        }
                        _ => ApiError::internal(format!("the model failed: {e}")),
                    };
                    self.end_with_error(slot, err);
                    continue;
                }
            };
            let Some(active) = self.slots[slot].as_mut() else {
                continue;
            };
            let before = active.seq.completion_tokens();
            let step = match active.seq.advance(n, logits.as_deref()) {
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
mod tests {
    use super::*;
    use ferrolm_engine::sequence::SlotOutput;
    use ferrolm_engine::SamplerParams;
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    /// The default model's tokenizer (the model is fetched by `scripts/test` before the tests).
    fn tokenizer() -> Tokenizer {
        let home = std::env::var_os("FERROLM_HOME")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferrolm")
            });
        let path = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
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
    }

    const TOKEN: usize = 100;

    impl StepForward for Fake {
        fn n_slots(&self) -> usize {
            2
        }
        fn n_ctx(&self) -> usize {
            64
        }
        fn clear(&mut self, _slot: usize) {}
        fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
            let mut steps = self.steps.lock().unwrap();
            steps.push(inputs.iter().map(|i| (i.slot, i.ids.len())).collect());
            let step = steps.len();
            drop(steps);
            // Slow enough for requests to arrive while others run.
            std::thread::sleep(Duration::from_millis(2));
            if self.panic_at == Some(step) {
                panic!("a kernel bug");
            }
            if self.fail_at == Some(step) {
                let e = Arc::new(ModelError::Invalid("injected failure".into()));
                return vec![Err(e); inputs.len()];
            }
            inputs
                .iter()
                .map(|i| {
                    Ok(i.logits.then(|| {
                        let mut l = vec![0.0; self.n_vocab];
                        l[TOKEN] = 10.0;
                        l
                    }))
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
        let tok = tokenizer();
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            deadline: Mutex::new(None),
            metrics: Arc::new(Metrics::new(2)),
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
                let mut fake = fake;
                Scheduler {
                    tokenizer: tok,
                    experts: None,
                    slots: vec![None, None],
                    rx,
                    shared,
                    chunk,
                    n_ctx: 64,
                }
                .run(&mut fake)
            });
            body(&handle);
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

    impl StepForward for Dies {
        fn n_slots(&self) -> usize {
            1
        }
        fn n_ctx(&self) -> usize {
            64
        }
        fn clear(&mut self, _slot: usize) {
            panic!("a bug outside the forward pass");
        }
        fn forward(&mut self, _inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
            Vec::new()
        }
    }

    #[test]
    fn the_handle_reports_a_scheduler_thread_that_died() {
        let tok: &'static Tokenizer = Box::leak(Box::new(tokenizer()));
        let (h, rx, shared) = handle(4);
        let thread = std::thread::spawn(move || {
            Scheduler {
                tokenizer: tok,
                experts: None,
                slots: vec![None],
                rx,
                shared,
                chunk: 16,
                n_ctx: 64,
            }
            .run(&mut Dies)
        });
        assert_eq!(h.state(), SchedulerState::Running);
        let (job, _events) = job(4, 1);
        h.submit(job, h.reserve().unwrap()).unwrap();
        assert!(thread.join().is_err(), "the thread panicked");
        assert_eq!(h.state(), SchedulerState::Stopped);
        assert!(h.reserve().is_err());
    }
}
