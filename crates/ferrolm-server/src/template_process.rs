//! Chat templates rendered in child processes. A template is code that comes with the model
//! file, and minijinja bounds its instructions (fuel) and what it writes, but not the size of
//! the values it builds: `{% set s = s ~ s %}` thirty times asks for gigabytes in thirty
//! instructions, and an allocation that fails aborts a Rust process. Nor does fuel bound time,
//! since one instruction may copy a long string. So the server renders in workers, the same
//! program re-executed with [`WORKER_ARG`], each under an address-space limit and a deadline:
//! a template that breaks either ends its worker, and the request (or the check at load) gets
//! an error that says which bound it broke. Workers stay up between renders, so a rendering
//! costs a round trip through two pipes rather than a process start.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use ferrolm_tokenizer::{ChatMessage, ChatTemplate, TemplateLimits, TokenizerError};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The argument that makes the server's program a template worker (`ferrolm __template-worker`).
pub const WORKER_ARG: &str = "__template-worker";

/// What a worker is started with: its first line on stdin.
#[derive(Serialize, Deserialize)]
struct Setup {
    source: String,
    bos: String,
    eos: String,
    fuel: u64,
    max_output_bytes: usize,
    /// Bytes of address space the worker may add to what it holds at start.
    memory_bytes: u64,
}

/// One rendering asked of a worker: a line on its stdin, as the worker reads it...
#[derive(Deserialize)]
struct RenderRequest {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    tools: Option<Value>,
}

/// ... and as the server writes it, without copying the conversation.
#[derive(Serialize)]
struct RenderRequestRef<'a> {
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    tools: Option<&'a Value>,
}

/// A worker's answer: a line on its stdout.
#[derive(Serialize, Deserialize)]
enum Reply {
    Text(String),
    Error(String),
}

/// The bounds of rendering in workers.
#[derive(Clone, Copy, Debug)]
pub struct ProcessLimits {
    /// Memory one worker may use beyond what it holds at start (its address space, so
    /// allocations count when reserved, not when touched).
    pub memory_bytes: u64,
    /// How long one rendering may take before its worker is killed.
    pub deadline: Duration,
    /// Workers alive at once (renderings beyond that wait for one).
    pub workers: usize,
}

impl ProcessLimits {
    /// 256 MiB plus 16 times the output bound (the messages arrive as JSON, are parsed, become
    /// the template's values, and the output goes back as JSON), ten seconds (a real template
    /// renders in well under a millisecond), four workers.
    pub fn for_output(limits: TemplateLimits) -> ProcessLimits {
        ProcessLimits {
            memory_bytes: (256u64 << 20).saturating_add((limits.max_output_bytes as u64) * 16),
            deadline: Duration::from_secs(10),
            workers: 4,
        }
    }
}

/// A pool of template workers for one template.
pub struct TemplateProcesses {
    program: PathBuf,
    setup: String,
    limits: ProcessLimits,
    pool: Mutex<Pool>,
    returned: Condvar,
}

#[derive(Default)]
struct Pool {
    idle: Vec<Worker>,
    /// Workers alive, idle or rendering.
    alive: usize,
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    /// Bytes read past the last reply.
    pending: Vec<u8>,
}

impl TemplateProcesses {
    /// Workers for `template`, started as `program __template-worker` when first needed.
    pub fn new(
        program: PathBuf,
        template: &ChatTemplate,
        limits: ProcessLimits,
    ) -> TemplateProcesses {
        let (bos, eos) = template.special_texts();
        let setup = Setup {
            source: template.source().to_string(),
            bos: bos.to_string(),
            eos: eos.to_string(),
            fuel: template.limits().fuel,
            max_output_bytes: template.limits().max_output_bytes,
            memory_bytes: limits.memory_bytes,
        };
        TemplateProcesses {
            program,
            setup: serde_json::to_string(&setup).expect("a setup serializes"),
            limits,
            pool: Mutex::new(Pool::default()),
            returned: Condvar::new(),
        }
    }

    /// Renders a conversation in a worker; a worker that breaks a bound is ended and the
    /// error says which bound (the next rendering starts a fresh one).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<String, TokenizerError> {
        let request = RenderRequestRef {
            messages,
            add_generation_prompt,
            tools,
        };
        let mut line = serde_json::to_vec(&request)
            .map_err(|e| TokenizerError::Template(format!("the messages cannot be sent: {e}")))?;
        line.push(b'\n');
        let mut retried = false;
        let reply = loop {
            let mut worker = self.take()?;
            let started = Instant::now();
            match worker.ask(&line, started + self.limits.deadline) {
                Ok(reply) => {
                    self.give_back(Some(worker));
                    break reply;
                }
                // An idle worker that has gone (killed from outside): once more, on a new one.
                Err(Failure::Unsent(_)) if !retried => {
                    worker.kill();
                    self.give_back(None);
                    retried = true;
                }
                Err(failure) => {
                    let why = worker.end(failure, &self.limits, started.elapsed());
                    self.give_back(None);
                    return Err(TokenizerError::Template(why));
                }
            }
        };
        match serde_json::from_slice::<Reply>(&reply) {
            Ok(Reply::Text(text)) => Ok(text),
            Ok(Reply::Error(e)) => Err(TokenizerError::Template(e)),
            Err(e) => Err(TokenizerError::Template(format!(
                "the template worker answered something unreadable: {e}"
            ))),
        }
    }

    /// The process ids of the idle workers (for tests).
    #[doc(hidden)]
    pub fn idle_worker_ids(&self) -> Vec<u32> {
        let pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        pool.idle.iter().map(|w| w.child.id()).collect()
    }

    /// An idle worker, a new one if fewer than the limit are alive, else the next one given back.
    fn take(&self) -> Result<Worker, TokenizerError> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(w) = pool.idle.pop() {
                return Ok(w);
            }
            if pool.alive < self.limits.workers.max(1) {
                pool.alive += 1;
                drop(pool);
                return self.spawn().inspect_err(|_| self.give_back(None));
            }
            pool = self.returned.wait(pool).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// A worker back into the pool, or None for one that has ended.
    fn give_back(&self, worker: Option<Worker>) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        match worker {
            Some(w) => pool.idle.push(w),
            None => pool.alive -= 1,
        }
        self.returned.notify_one();
    }

    fn spawn(&self) -> Result<Worker, TokenizerError> {
        let failed = |e: std::io::Error| {
            TokenizerError::Template(format!(
                "cannot start a template worker ({} {WORKER_ARG}): {e}",
                self.program.display()
            ))
        };
        let mut child = Command::new(&self.program)
            .arg(WORKER_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(failed)?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(failed(std::io::Error::other("no pipes")));
        };
        let sent = stdin
            .write_all(self.setup.as_bytes())
            .and_then(|()| stdin.write_all(b"\n"))
            .and_then(|()| stdin.flush());
        if let Err(e) = sent {
            let _ = child.kill();
            let _ = child.wait();
            return Err(failed(e));
        }
        Ok(Worker {
            child,
            stdin,
            stdout,
            pending: Vec::new(),
        })
    }
}

impl Drop for TemplateProcesses {
    fn drop(&mut self) {
        let pool = self.pool.get_mut().unwrap_or_else(|p| p.into_inner());
        for mut w in pool.idle.drain(..) {
            w.kill();
        }
    }
}

/// Why a worker gave no reply.
enum Failure {
    /// The request could not be written: the worker had already ended.
    Unsent(std::io::Error),
    TimedOut,
    Io(std::io::Error),
}

impl Worker {
    /// Sends one request line and reads the reply line, by `deadline`.
    fn ask(&mut self, line: &[u8], deadline: Instant) -> Result<Vec<u8>, Failure> {
        self.stdin
            .write_all(line)
            .and_then(|()| self.stdin.flush())
            .map_err(Failure::Unsent)?;
        let mut chunk = [0u8; 64 << 10];
        loop {
            if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let reply = self.pending[..end].to_vec();
                self.pending.drain(..=end);
                return Ok(reply);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !readable_within(&self.stdout, left).map_err(Failure::Io)? {
                return Err(Failure::TimedOut);
            }
            match self.stdout.read(&mut chunk) {
                Ok(0) => {
                    return Err(Failure::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the worker closed its output",
                    )))
                }
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Failure::Io(e)),
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the worker and says why it failed, in the template's terms.
    fn end(mut self, failure: Failure, limits: &ProcessLimits, took: Duration) -> String {
        let _ = self.child.kill();
        let status = self.child.wait();
        let mut stderr = String::new();
        if let Some(pipe) = self.child.stderr.take() {
            let _ = pipe.take(4096).read_to_string(&mut stderr);
        }
        let last_words = stderr.lines().last().unwrap_or("").trim().to_string();
        let mib = limits.memory_bytes >> 20;
        match failure {
            Failure::TimedOut => format!(
                "rendering took longer than {:.1} s (the template runs too long)",
                limits.deadline.as_secs_f64()
            ),
            _ if last_words.contains("memory allocation") => format!(
                "rendering needed more than {mib} MiB of memory (the template builds too large \
                 a value: {last_words})"
            ),
            Failure::Io(e) | Failure::Unsent(e) => {
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                format!(
                    "the template worker ended after {:.1} s ({status}; {e}{}{last_words}): \
                     the template may need more than {mib} MiB of memory or recurse too deep",
                    took.as_secs_f64(),
                    if last_words.is_empty() { "" } else { "; " }
                )
            }
        }
    }
}

/// Whether `pipe` has bytes (or its end) to read within `wait`.
#[cfg(unix)]
fn readable_within(pipe: &ChildStdout, wait: Duration) -> std::io::Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = Timespec {
        tv_sec: wait.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    let mut fds = [PollFd::new(pipe, PollFlags::IN)];
    match poll(&mut fds, Some(&timeout)) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Without poll, a read waits for the worker (the deadline is not enforced).
#[cfg(not(unix))]
fn readable_within(_pipe: &ChildStdout, _wait: Duration) -> std::io::Result<bool> {
    Ok(true)
}

/// A worker's life: `PROGRAM __template-worker` calls this and exits with what it returns.
/// It reads its setup, limits its own address space, then answers one rendering per line.
pub fn run_worker() -> ExitCode {
    end_with_the_server();
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut line = String::new();
    if input.read_line(&mut line).is_err() {
        return ExitCode::FAILURE;
    }
    let Ok(setup) = serde_json::from_str::<Setup>(&line) else {
        eprintln!("ferrolm: the template worker's setup is unreadable");
        return ExitCode::FAILURE;
    };
    if let Err(e) = limit_memory(setup.memory_bytes) {
        eprintln!("ferrolm: the template worker cannot limit its memory: {e}");
        return ExitCode::FAILURE;
    }
    let template = ChatTemplate::new(&setup.source, &setup.bos, &setup.eos).map(|t| {
        t.with_limits(TemplateLimits {
            fuel: setup.fuel,
            max_output_bytes: setup.max_output_bytes,
        })
    });
    let mut output = std::io::stdout().lock();
    loop {
        line.clear();
        match input.read_line(&mut line) {
            Ok(0) | Err(_) => return ExitCode::SUCCESS, // the server has gone
            Ok(_) => {}
        }
        let reply = match (&template, serde_json::from_str::<RenderRequest>(&line)) {
            (Err(e), _) => Reply::Error(message(e)),
            (_, Err(e)) => Reply::Error(format!("the request to the worker is unreadable: {e}")),
            (Ok(t), Ok(r)) => {
                match t.render(&r.messages, r.add_generation_prompt, r.tools.as_ref()) {
                    Ok(text) => Reply::Text(text),
                    Err(e) => Reply::Error(message(&e)),
                }
            }
        };
        let sent = serde_json::to_writer(&mut output, &reply)
            .map_err(std::io::Error::from)
            .and_then(|()| output.write_all(b"\n"))
            .and_then(|()| output.flush());
        if sent.is_err() {
            return ExitCode::SUCCESS;
        }
    }
}

/// An error's message, for the server to wrap as its own.
fn message(e: &TokenizerError) -> String {
    match e {
        TokenizerError::Template(m) => m.clone(),
        other => other.to_string(),
    }
}

/// A worker mid-rendering when the server goes would run on alone: a thread ends it once it
/// has another parent. (Not `PR_SET_PDEATHSIG`, which fires when the thread that started the
/// worker ends, and the server's rendering threads come and go.)
fn end_with_the_server() {
    #[cfg(unix)]
    {
        let parent = std::os::unix::process::parent_id();
        let _ = std::thread::Builder::new()
            .name("parent-watch".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(500));
                if std::os::unix::process::parent_id() != parent {
                    std::process::exit(1);
                }
            });
    }
}

/// Caps this process's address space at what it holds now plus `extra` bytes.
#[cfg(unix)]
fn limit_memory(extra: u64) -> std::io::Result<()> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let held = address_space_bytes().unwrap_or(1 << 30);
    // Never above a limit the process already has (raising it is not allowed).
    let already = getrlimit(Resource::As).maximum.unwrap_or(u64::MAX);
    let cap = held.saturating_add(extra).min(already);
    setrlimit(
        Resource::As,
        Rlimit {
            current: Some(cap),
            maximum: Some(cap),
        },
    )?;
    Ok(())
}

#[cfg(not(unix))]
fn limit_memory(_extra: u64) -> std::io::Result<()> {
    Ok(())
}

/// This process's address space (`VmSize`), where /proc says it.
#[cfg(unix)]
fn address_space_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}
