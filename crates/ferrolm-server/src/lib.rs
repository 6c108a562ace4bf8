//! `ferrolm serve`: an OpenAI-compatible HTTP server over ferrolm's engine.
//!
//! The HTTP layer ([`http`](crate)) only validates requests, queues them and streams answers
//! from a channel. One scheduler thread owns the model, the slots (one KV cache per sequence)
//! and the batching: at every step it admits waiting requests into free slots, evaluates a
//! prefill chunk or one decode token for every active slot, and hands each request its text.
//! A failed step sends its error to every request in it; a client that goes away frees its slot
//! at the next step. Nothing a request does can stop the process.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod anthropic;
mod api;
mod connection;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod guard;
mod http;
mod metrics;
mod scheduler;
mod template;
pub mod template_process;
mod tool_grammar;
mod tools;

pub use scheduler::BackendSource;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferrolm_tokenizer::Tokenizer;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Where to listen.
    pub addr: SocketAddr,
    /// The name clients use for the model (`model` in requests, `/v1/models`).
    pub model_name: String,
    /// Sequences decoded together (KV cache slots).
    pub parallel: usize,
    /// Positions of each slot's context.
    pub n_ctx: usize,
    /// Requests that may wait for a slot; beyond that, 503.
    pub max_queue: usize,
    /// Prompt tokens a slot evaluates per step while others decode.
    pub prefill_chunk: usize,
    /// When set, every `/v1` route needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// How long requests in flight may run on after SIGINT/SIGTERM before they are cancelled;
    /// every connection is closed soon after, whatever its client does.
    pub shutdown_grace: Duration,
    /// How long a client may take to send a request's headers.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's whole body (408 beyond).
    pub body_timeout: Duration,
    /// How long a connection may stay open with no request in flight.
    pub idle_timeout: Duration,
    /// Connections open at once; more wait until one closes.
    pub max_connections: usize,
    /// `Host` names answered besides the loopback ones and the address listened on (`*`: any).
    pub allowed_hosts: Vec<String>,
    /// A chat template that replaces the model file's (`--chat-template FILE`): its path and
    /// source.
    pub chat_template: Option<(String, String)>,
    /// The program to re-execute as `PROGRAM __template-worker`
    /// ([`template_process::WORKER_ARG`], which must call [`template_process::run_worker`]) so
    /// that chat templates render in child processes under memory and time bounds; None
    /// renders in this process, where a hostile template's values can exhaust its memory.
    pub template_worker: Option<std::path::PathBuf>,
}

/// Serves the backend `source` opens until SIGINT or SIGTERM, then finishes (or, after the
/// grace period, cancels) the requests in flight and returns. Errors are those of opening the
/// backend, binding the address or starting threads.
pub fn serve(
    source: impl BackendSource,
    tokenizer: Tokenizer,
    config: ServerConfig,
) -> std::io::Result<()> {
    let tokenizer = Arc::new(tokenizer);
    let metrics = Arc::new(metrics::Metrics::new(config.parallel));
    // The backend first: a device that cannot be used is then the one error reported.
    let (handle, join) = scheduler::start(
        Box::new(source),
        tokenizer.clone(),
        &config,
        metrics.clone(),
    )?;
    let template = match template::ServedTemplate::load(&tokenizer, &config) {
        Ok(t) => t,
        Err(e) => {
            handle.shut_down();
            let _ = join.join();
            return Err(e);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let allowed_hosts = guard::AllowedHosts::new(config.addr.ip(), &config.allowed_hosts);
    let result = runtime.block_on(http::run(http::AppState {
        allowed_hosts: Arc::new(allowed_hosts),
        config: Arc::new(config),
        tokenizer,
        template: template.map(Arc::new),
        scheduler: handle.clone(),
        metrics,
        constraints: Arc::default(),
    }));
    handle.shut_down();
    let _ = join.join();
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}
