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
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long)]
    pub api_key: Option<String>,
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
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.parallel == 0 || args.parallel > 256 {
        bail!("--parallel must be between 1 and 256");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if !(args.shutdown_grace >= 0.0 && args.shutdown_grace.is_finite()) {
        bail!("--shutdown-grace must be a number of seconds");
    }
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
        api_key: args.api_key.filter(|k| !k.is_empty()),
        max_body_bytes: args.max_body_bytes,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
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
