//! `ferrolm serve`: the OpenAI-compatible HTTP server.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use super::common::{context_size, load_any_device, open_backend, ModelArgs};
use crate::models;
use ferrolm_engine::Backend;
use ferrolm_model::Model;
use ferrolm_server::{BackendSource, ServerConfig};

/// Flags of `ferrolm serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together (each with its own KV cache).
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Context size of each sequence (0: the model's, at most 4096).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: usize,
    /// Require `Authorization: Bearer KEY` on every /v1 route (visible in `ps`: prefer
    /// --api-key-file or FERROLM_API_KEY).
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line).
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Requests that may wait for a free slot; beyond that the server answers 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Prompt tokens a sequence evaluates per step while others decode.
    #[arg(long, default_value_t = 128)]
    pub prefill_chunk: usize,
    /// Largest request body, in bytes (413 beyond).
    #[arg(long, default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// The model's name in the API (default: the known model's name, or the file's stem).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Seconds requests in flight may run on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace: f64,
    /// Seconds a client may take to send a request's headers.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a client may take to send a request's whole body (408 beyond).
    #[arg(long, default_value_t = 60.0)]
    pub body_timeout: f64,
    /// Seconds a connection may stay open with no request in flight.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// Connections open at once; more wait until one closes.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// A `Host` name to answer besides localhost, 127.0.0.1, [::1] and --host (repeatable;
    /// `*`: any, which lets any web page's scripts reach the server).
    #[arg(long = "allowed-host", value_name = "NAME")]
    pub allowed_hosts: Vec<String>,
    /// A Jinja chat template file to use instead of the model's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
}

/// Seconds from a flag, within (0, 1 hour] (the grace may be 0).
fn seconds(flag: &str, value: f64, zero_ok: bool) -> Result<Duration> {
    let low_ok = if zero_ok { value >= 0.0 } else { value > 0.0 };
    if !(low_ok && value <= 3600.0) {
        bail!(
            "--{flag} must be a number of seconds {} 3600, got {value}",
            if zero_ok {
                "from 0 to"
            } else {
                "above 0 and at most"
            }
        );
    }
    Ok(Duration::from_secs_f64(value))
}

/// The API key: --api-key, else --api-key-file's first line, else FERROLM_API_KEY.
fn api_key(args: &ServeArgs) -> Result<Option<String>> {
    let key = match (&args.api_key, &args.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --api-key-file {}", path.display()))?;
            let key = text.lines().next().unwrap_or("").trim().to_string();
            if key.is_empty() {
                bail!("--api-key-file {}: the file holds no key", path.display());
            }
            Some(key)
        }
        (None, None) => std::env::var("FERROLM_API_KEY").ok(),
    };
    Ok(key.filter(|k| !k.is_empty()))
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.parallel == 0 || args.parallel > 256 {
        bail!("--parallel must be between 1 and 256");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let shutdown_grace = seconds("shutdown-grace", args.shutdown_grace, true)?;
    let header_timeout = seconds("header-timeout", args.header_timeout, false)?;
    let body_timeout = seconds("body-timeout", args.body_timeout, false)?;
    let idle_timeout = seconds("idle-timeout", args.idle_timeout, false)?;
    if !(1..=1_000_000).contains(&args.max_queue) {
        bail!(
            "--max-queue must be between 1 and 1000000, got {}",
            args.max_queue
        );
    }
    if !(1..=65_536).contains(&args.max_connections) {
        bail!(
            "--max-connections must be between 1 and 65536, got {}",
            args.max_connections
        );
    }
    if !(1024..=1 << 30).contains(&args.max_body_bytes) {
        bail!(
            "--max-body-bytes must be between 1024 and 1073741824, got {}",
            args.max_body_bytes
        );
    }
    if args.ctx_size > 1 << 20 {
        bail!("--ctx-size must be at most 1048576, got {}", args.ctx_size);
    }
    let api_key = api_key(&args)?;
    let chat_template = match &args.chat_template {
        Some(path) => Some((
            path.display().to_string(),
            std::fs::read_to_string(path)
                .with_context(|| format!("reading --chat-template {}", path.display()))?,
        )),
        None => None,
    };
    let model_name = match (&args.model_name, &args.model.model) {
        (Some(n), _) => n.clone(),
        (None, None) => models::DEFAULT_MODEL.to_string(),
        (None, Some(m)) if !Path::new(m).exists() => m.clone(),
        (None, Some(m)) => Path::new(m)
            .file_stem()
            .map_or_else(|| m.clone(), |s| s.to_string_lossy().into_owned()),
    };
    let (model, tokenizer) = load_any_device(&args.model)?;
    let n_ctx = context_size(&model, args.ctx_size);
    let config = ServerConfig {
        addr: SocketAddr::new(args.host, args.port),
        model_name,
        parallel: args.parallel,
        n_ctx,
        max_queue: args.max_queue,
        prefill_chunk: args.prefill_chunk,
        api_key,
        max_body_bytes: args.max_body_bytes,
        shutdown_grace,
        header_timeout,
        body_timeout,
        idle_timeout,
        max_connections: args.max_connections,
        allowed_hosts: args.allowed_hosts,
        chat_template,
        // Templates render in copies of this program, under memory and time bounds.
        template_worker: Some(
            std::env::current_exe().context("finding this program, to run template workers")?,
        ),
    };
    let addr = config.addr;
    let source = Source {
        model,
        args: args.model,
    };
    ferrolm_server::serve(source, tokenizer, config).with_context(|| format!("serving on {addr}"))
}

/// The model and the flags that say where it runs: the server opens it on its own thread.
struct Source {
    model: Model,
    args: ModelArgs,
}

impl BackendSource for Source {
    fn open(&self, slots: usize, n_ctx: usize) -> Result<Box<dyn Backend + '_>, String> {
        open_backend(&self.args, &self.model, n_ctx, slots).map_err(|e| format!("{e:#}"))
    }
}
