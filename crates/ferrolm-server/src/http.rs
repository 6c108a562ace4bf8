//! The HTTP layer: routes, validation, queueing, and answers streamed from the scheduler's
//! channel. It never touches the model.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferrolm_engine::constraint::{Constraint, Constraints, Grammar};
use ferrolm_tokenizer::{ChatMessage, Tokenizer};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{self, Answer, Endpoint, Prepared};
use crate::connection::{self, ConnectionLimits};
use crate::error::ApiError;
use crate::guard::{self, AllowedHosts};
use crate::metrics::Metrics;
use crate::scheduler::{Event, Job, SchedulerHandle, SchedulerState, Ticket};
use crate::tools::CallSplitter;
use crate::ServerConfig;
use ferrolm_engine::FinishReason;

/// What every handler sees.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<ServerConfig>,
    pub allowed_hosts: Arc<AllowedHosts>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<Arc<crate::template::ServedTemplate>>,
    pub scheduler: SchedulerHandle,
    pub metrics: Arc<Metrics>,
    /// Built at the first request with a grammar (it indexes the whole vocabulary).
    pub constraints: Arc<OnceLock<Result<Constraints, String>>>,
}

/// `grammar` compiled (400 about `param` if it does not compile).
fn compile(state: &AppState, grammar: &Grammar, param: &str) -> Result<Constraint, ApiError> {
    let constraints = state
        .constraints
        .get_or_init(|| Constraints::new(state.tokenizer.clone()))
        .as_ref()
        .map_err(|e| ApiError::internal(format!("constrained decoding is unavailable: {e}")))?;
    constraints
        .compile(grammar)
        .map_err(|e| ApiError::param(param, format!("the {param} cannot be compiled: {e}")))
}

/// The compiled grammar of a request, if it gives one (400 naming the problem otherwise).
fn constraint_of(state: &AppState, common: &api::Common) -> Result<Option<Constraint>, ApiError> {
    let Some(grammar) = api::grammar_of(common)? else {
        return Ok(None);
    };
    let param = if common.grammar.is_some() {
        "grammar"
    } else {
        "response_format"
    };
    compile(state, &grammar, param).map(Some)
}

/// Token counts a generation reports to the request log, filled when it ends.
#[derive(Clone, Default)]
pub struct Usage(Arc<Mutex<Option<(usize, usize)>>>);

impl Usage {
    pub fn set(&self, prompt: usize, completion: usize) {
        if let Ok(mut u) = self.0.lock() {
            *u = Some((prompt, completion));
        }
    }
}

/// Binds, serves until a signal, then shuts down: requests in flight run on for at most the
/// grace period, and then every connection is closed.
pub async fn run(state: AppState) -> std::io::Result<()> {
    let config = state.config.clone();
    let listener = tokio::net::TcpListener::bind(config.addr).await?;
    let addr = listener.local_addr()?;
    eprintln!(
        "ferrolm: serving {} on http://{addr} ({} slots of {} tokens, queue {})",
        config.model_name, config.parallel, config.n_ctx, config.max_queue
    );
    if config.addr.ip().is_unspecified() && config.allowed_hosts.is_empty() {
        eprintln!(
            "ferrolm: note: requests must name localhost, 127.0.0.1 or [::1] in their Host \
             header (DNS-rebinding guard); add this machine's names with --allowed-host"
        );
    }
    let scheduler = state.scheduler.clone();
    let limits = ConnectionLimits {
        max_connections: config.max_connections,
        header_timeout: config.header_timeout,
        idle_timeout: config.idle_timeout,
    };
    let grace = config.shutdown_grace;
    connection::serve(
        listener,
        router(state),
        limits,
        shutdown_signal(),
        grace,
        move || {
            eprintln!(
                "ferrolm: shutting down: finishing requests in flight (at most {:.0} s)",
                grace.as_secs_f64()
            );
            scheduler.shut_down_after(grace);
        },
    )
    .await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn router(state: AppState) -> Router {
    // Route layers run last-added first: the key, then the body.
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            guard::read_json_body,
        ))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::check_host,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), log_request))
        .with_state(state)
}

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no route {method} {}", uri.path()),
    )
    .with_code("not_found")
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("method {method} is not allowed on {}", uri.path()),
    )
    .with_code("method_not_allowed")
}

/// `Authorization: Bearer KEY` on every `/v1` route when `--api-key` is set.
async fn require_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        // OpenAI's clients send `Authorization: Bearer KEY`; Anthropic's, `x-api-key: KEY`.
        let headers = request.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        let ok = given.is_some_and(|g| {
            g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0, |a, (x, y)| a | (x ^ y)) == 0
        });
        if !ok {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or wrong API key: send `Authorization: Bearer <key>`",
            )
            .with_code("invalid_api_key")
            .into_response();
        }
    }
    next.run(request).await
}

/// The path as a metrics label: known routes as they are, anything else as `other`.
fn path_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/messages" => "/v1/messages",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

/// Logs one line per request when its answer has been sent, or when the client went away
/// before it (status 499, as nginx writes it): method, path, status, tokens, duration.
async fn log_request(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let usage = Usage::default();
    let mut guard = LogOnDrop {
        method: request.method().clone(),
        path: request.uri().path().to_string(),
        status: None,
        usage: usage.clone(),
        start: Instant::now(),
        metrics: state.metrics.clone(),
    };
    request.extensions_mut().insert(usage);
    // Dropped here (the client went away while the answer was computed), the guard logs 499.
    let response = next.run(request).await;
    let status = response.status().as_u16();
    guard.status = Some(status);
    state.metrics.request(path_label(&guard.path), status);
    let (mut parts, body) = response.into_parts();
    if let Some(n) = body.size_hint().exact() {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    let stream = body.into_data_stream().map(move |chunk| {
        let _ = &guard;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

struct LogOnDrop {
    method: Method,
    path: String,
    status: Option<u16>,
    usage: Usage,
    start: Instant,
    metrics: Arc<Metrics>,
}

impl Drop for LogOnDrop {
    fn drop(&mut self) {
        let status = self.status.unwrap_or_else(|| {
            self.metrics.request(path_label(&self.path), 499);
            499
        });
        let tokens = match self.usage.0.lock().ok().and_then(|u| *u) {
            Some((p, c)) => format!(" prompt={p} completion={c}"),
            None => String::new(),
        };
        eprintln!(
            "ferrolm: {} {} {status}{tokens} {:.3}s",
            self.method,
            self.path,
            self.start.elapsed().as_secs_f64()
        );
    }
}

/// 200 while the scheduler takes requests; 503 while it shuts down or after it has ended.
async fn health(State(state): State<AppState>) -> Response {
    let (status, code, scheduler) = match state.scheduler.state() {
        SchedulerState::Running => ("ok", StatusCode::OK, "running"),
        SchedulerState::ShuttingDown => (
            "shutting_down",
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
        ),
        SchedulerState::Stopped => ("error", StatusCode::SERVICE_UNAVAILABLE, "stopped"),
    };
    (
        code,
        Json(json!({
            "status": status,
            "scheduler": scheduler,
            "slots": state.config.parallel,
            "active_slots": state.metrics.active_slots.load(Relaxed),
            "queue_depth": state.metrics.queue_depth.load(Relaxed),
        })),
    )
        .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        state.metrics.render(),
    )
        .into_response()
}

fn model_object(name: &str) -> serde_json::Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "ferrolm"})
}

async fn models(State(state): State<AppState>) -> Response {
    Json(json!({"object": "list", "data": [model_object(&state.config.model_name)]}))
        .into_response()
}

async fn model(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id == state.config.model_name {
        Json(model_object(&id)).into_response()
    } else {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{id}` does not exist"),
        )
        .with_code("model_not_found")
        .into_response()
    }
}

/// The body, or the error for a body that could not be read (413 over the size limit).
pub fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            guard::too_large()
        } else {
            ApiError::new(status, "invalid_request_error", r.body_text())
        }
    })
}

async fn chat(
    State(state): State<AppState>,
    axum::Extension(usage): axum::Extension<Usage>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    prepare_then_answer(state, usage, answer, move |state| {
        let body = body_bytes(body)?;
        let req: api::ChatRequest = api::parse(&body)?;
        prepare_chat(state, req)
    })
    .await
}

/// A chat request validated, rendered, tokenized, its grammar compiled.
pub fn prepare_chat(state: &AppState, req: api::ChatRequest) -> Result<Prepared, ApiError> {
    api::check_model(&req.common.model, &state.config.model_name)?;
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::invalid("the model has no usable chat template; use /v1/completions")
    })?;
    let tokenizer = &state.tokenizer;
    let control = |text: &str| {
        tokenizer
            .token_id(text)
            .filter(|&id| tokenizer.is_special(id))
    };
    let plan = api::tool_plan(&req, template.source(), &control)?;
    let templated = template.renders_tools();
    let mut messages = api::chat_messages(&req.messages, templated)?;
    let tools = plan.as_ref().map(|t| Value::Array(t.tools.clone()));
    if let (Some(plan), false) = (&plan, templated) {
        // The template has no place for tools: describe them in the system message.
        let description = crate::tools::describe(&plan.tools);
        match messages.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{description}", m.content),
            _ => messages.insert(0, ChatMessage::new("system", description)),
        }
    }
    let tools = tools.filter(|_| templated);
    let ids = template
        .render_ids(&state.tokenizer, &messages, true, tools.as_ref())
        .map_err(|e| ApiError::param("messages", format!("the chat template failed: {e}")))?;
    let mut p = api::prepare(
        &req.common,
        Endpoint::Chat,
        ids,
        &state.config.model_name,
        state.config.n_ctx,
    )?;
    p.constraint = constraint_of(state, &req.common)?;
    if let Some(plan) = plan {
        if let Some(grammar) = &plan.grammar {
            if p.constraint.is_some() {
                return Err(ApiError::param(
                    "tool_choice",
                    "a required tool call and a `response_format` cannot both constrain the answer",
                ));
            }
            p.constraint = Some(compile(state, grammar, "tools")?);
        }
        p.tools = Some((plan.format, plan.parallel));
    }
    Ok(p)
}

async fn completions(
    State(state): State<AppState>,
    axum::Extension(usage): axum::Extension<Usage>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    prepare_then_answer(state, usage, answer, move |state| {
        let body = body_bytes(body)?;
        let req: api::CompletionRequest = api::parse(&body)?;
        api::check_model(&req.common.model, &state.config.model_name)?;
        if req.echo == Some(true) {
            return Err(ApiError::param("echo", "`echo` is not supported"));
        }
        if req.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::param(
                "best_of",
                "only `best_of` = 1 is supported",
            ));
        }
        let ids = match &req.prompt {
            api::Prompt::Text(t) => state.tokenizer.encode_prompt(t),
            api::Prompt::Texts(v) if v.len() == 1 => state.tokenizer.encode_prompt(&v[0]),
            api::Prompt::Texts(_) => {
                return Err(ApiError::param(
                    "prompt",
                    "only one prompt per request is supported",
                ))
            }
            api::Prompt::Ids(ids) => {
                let n_vocab = state.tokenizer.vocab_size();
                if let Some(id) = ids.iter().find(|&&id| id as usize >= n_vocab) {
                    return Err(ApiError::param(
                        "prompt",
                        format!("token id {id} is outside the vocabulary of {n_vocab}"),
                    ));
                }
                ids.clone()
            }
        };
        let mut p = api::prepare(
            &req.common,
            Endpoint::Completion,
            ids,
            &state.config.model_name,
            state.config.n_ctx,
        )?;
        p.constraint = constraint_of(state, &req.common)?;
        Ok(p)
    })
    .await
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Queues a prepared request and answers it: one JSON object, or an SSE stream.
/// Takes a place in the queue first (a full queue is 503 before any work), then runs
/// `prepare` (parsing, the template, tokenization: slow on a large body) off the async
/// workers, then answers the request it prepared, or with its error.
pub async fn prepare_then_answer<A, F>(
    state: AppState,
    usage: Usage,
    answer: A,
    prepare: impl FnOnce(&AppState) -> Result<Prepared, ApiError> + Send + 'static,
) -> Response
where
    A: FnOnce(AppState, Prepared, Usage, Ticket) -> F,
    F: std::future::Future<Output = Response>,
{
    let ticket = match state.scheduler.reserve() {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let st = state.clone();
    let prepared = tokio::task::spawn_blocking(move || prepare(&st))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::internal(format!(
                "preparing the request failed: {e}"
            )))
        });
    match prepared {
        Ok(p) => answer(state, p, usage, ticket).await,
        Err(e) => e.into_response(),
    }
}

/// Queues a prepared request (its prompt, parameters and grammar move into the job); the
/// channel its events arrive on.
pub fn queue(
    state: &AppState,
    p: &mut Prepared,
    ticket: Ticket,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt: std::mem::take(&mut p.prompt),
        params: p.params.clone(),
        constraint: p.constraint.take(),
        special_text: p.tools.is_some_and(|(f, _)| f.needs_special_text()),
        events: tx,
        arrived: Instant::now(),
    };
    state.scheduler.submit(job, ticket)?;
    Ok(rx)
}

/// The whole text of an answer, how it finished, and its token counts.
pub async fn collect(
    rx: &mut mpsc::UnboundedReceiver<Event>,
) -> Result<(String, FinishReason, usize, usize), ApiError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            }) => return Ok((text, finish, prompt_tokens, completion_tokens)),
            Some(Event::Error(e)) => return Err(e),
            None => return Err(ApiError::internal("the scheduler dropped the request")),
        }
    }
}

/// A fresh id's number and the time, for an answer's id and `created`.
pub fn new_id() -> (u64, u64) {
    let n = NEXT_ID.fetch_add(1, Relaxed);
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    (n, created)
}

async fn answer(state: AppState, mut p: Prepared, usage: Usage, ticket: Ticket) -> Response {
    let (n, created) = new_id();
    let answer = Answer {
        id: match p.endpoint {
            Endpoint::Chat => format!("chatcmpl-{created:x}{n:06}"),
            Endpoint::Completion => format!("cmpl-{created:x}{n:06}"),
        },
        created,
        model: state.config.model_name.clone(),
        endpoint: p.endpoint,
    };
    let mut rx = match queue(&state, &mut p, ticket) {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    if !p.stream {
        let (text, finish, prompt_tokens, completion_tokens) = match collect(&mut rx).await {
            Ok(done) => done,
            Err(e) => return e.into_response(),
        };
        usage.set(prompt_tokens, completion_tokens);
        let Some((format, parallel)) = p.tools else {
            return Json(answer.full(&text, finish, prompt_tokens, completion_tokens))
                .into_response();
        };
        let mut splitter = CallSplitter::new(format, parallel);
        let mut content = splitter.push(&text);
        let (rest, calls) = splitter.finish();
        content.push_str(&rest);
        return Json(answer.full_with_tools(
            content.trim(),
            &calls,
            finish,
            prompt_tokens,
            completion_tokens,
        ))
        .into_response();
    }
    // Wait for the first event, so that an error before any text is an HTTP status.
    let first = match rx.recv().await {
        Some(Event::Error(e)) => return e.into_response(),
        Some(e) => e,
        None => return ApiError::internal("the scheduler dropped the request").into_response(),
    };
    let include_usage = p.include_usage;
    // With tools, text that may be a call is held back and parsed at the end.
    let mut splitter = p
        .tools
        .map(|(format, parallel)| CallSplitter::new(format, parallel));
    let mut pending = Some(first);
    let mut role_sent = false;
    let mut ended = false;
    let stream = futures_util::stream::poll_fn(move |cx| {
        if ended {
            return std::task::Poll::Ready(None);
        }
        let event = match pending.take() {
            Some(e) => Some(e),
            None => match rx.poll_recv(cx) {
                std::task::Poll::Ready(e) => e,
                std::task::Poll::Pending => return std::task::Poll::Pending,
            },
        };
        let mut out = String::new();
        let mut data = |v: serde_json::Value| {
            out.push_str("data: ");
            out.push_str(&v.to_string());
            out.push_str("\n\n");
        };
        match event {
            Some(Event::Text(t)) => {
                let t = crate::tools::pass(&mut splitter, t);
                if !t.is_empty() || answer.endpoint == Endpoint::Completion {
                    data(answer.chunk(Some(&t), !role_sent, None));
                    role_sent = true;
                }
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            }) => {
                usage.set(prompt_tokens, completion_tokens);
                let (rest, calls) = splitter
                    .take()
                    .map(CallSplitter::finish)
                    .unwrap_or_default();
                if answer.endpoint == Endpoint::Chat && (!role_sent || !rest.is_empty()) {
                    data(answer.chunk(Some(&rest), !role_sent, None));
                }
                let mut last = answer.chunk(None, false, Some(finish));
                if !calls.is_empty() {
                    let mut delta = answer.chunk(None, false, None);
                    delta["choices"][0]["delta"]["tool_calls"] =
                        answer.tool_calls_json(&calls, true);
                    data(delta);
                    last["choices"][0]["finish_reason"] = json!("tool_calls");
                }
                data(last);
                if include_usage {
                    data(answer.usage_chunk(prompt_tokens, completion_tokens));
                }
                out.push_str("data: [DONE]\n\n");
                ended = true;
            }
            Some(Event::Error(e)) => {
                data(e.body());
                out.push_str("data: [DONE]\n\n");
                ended = true;
            }
            None => {
                data(ApiError::internal("the scheduler dropped the request").body());
                ended = true;
            }
        }
        std::task::Poll::Ready(Some(Ok::<_, Infallible>(Bytes::from(out))))
    });
    sse(Body::from_stream(stream))
}

/// A server-sent-events answer.
pub fn sse(body: Body) -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response()
}
