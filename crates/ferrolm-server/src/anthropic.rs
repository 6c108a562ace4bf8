//! Anthropic's Messages API (`POST /v1/messages`): the request is turned into the OpenAI chat
//! request the rest of the server knows (system, messages, tools), and the answer is written
//! in Anthropic's shape: content blocks (`text`, `tool_use`), `stop_reason`, and when streamed
//! the `message_start` ... `message_stop` events.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrolm_engine::FinishReason;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{self, ChatRequest, Common, Content, Message, Prepared, Stop};
use crate::error::ApiError;
use crate::http::{self, AppState, Usage};
use crate::scheduler::{Event, Ticket};
use crate::tools::{CallSplitter, ToolCall};

/// `system`: text, or text blocks.
#[derive(Deserialize)]
#[serde(untagged)]
enum System {
    Text(String),
    Blocks(Vec<Value>),
}

/// A message's `content`: text, or blocks (`text`, `tool_use`, `tool_result`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Blocks {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Deserialize)]
struct AnthropicMessage {
    role: String,
    content: Blocks,
}

/// `POST /v1/messages`.
#[derive(Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    max_tokens: i64,
    messages: Vec<AnthropicMessage>,
    system: Option<System>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    /// `[{"name", "description", "input_schema"}]`.
    tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}`.
    tool_choice: Option<Value>,
}

/// The text of blocks, or of a `tool_result`'s content.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn message(role: &str, text: String) -> Message {
    Message {
        role: role.to_string(),
        content: Some(Content::Text(text)),
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
    }
}

/// The OpenAI chat request the same conversation is.
fn to_chat(req: MessagesRequest) -> Result<ChatRequest, ApiError> {
    let mut messages = Vec::new();
    match req.system {
        None => {}
        Some(System::Text(t)) => messages.push(message("system", t)),
        Some(System::Blocks(b)) => messages.push(message("system", text_of(&Value::Array(b)))),
    }
    for (i, m) in req.messages.into_iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::param(
                "messages",
                format!(
                    "messages[{i}]: the role must be user or assistant, not {:?}",
                    m.role
                ),
            ));
        }
        let blocks = match m.content {
            Blocks::Text(t) => vec![json!({"type": "text", "text": t})],
            Blocks::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for b in &blocks {
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                Some("tool_use") => calls.push(json!({
                    "id": b.get("id"),
                    "type": "function",
                    "function": {
                        "name": b.get("name"),
                        "arguments": b.get("input").cloned().unwrap_or(json!({})).to_string(),
                    },
                })),
                Some("tool_result") => {
                    let mut result =
                        message("tool", text_of(b.get("content").unwrap_or(&json!(""))));
                    result.tool_call_id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .map(String::from);
                    messages.push(result);
                }
                other => {
                    return Err(ApiError::param(
                        "messages",
                        format!(
                            "messages[{i}]: content blocks of type {other:?} are not supported"
                        ),
                    ))
                }
            }
        }
        if !text.is_empty() || !calls.is_empty() {
            let mut m = message(&m.role, text);
            m.tool_calls = calls;
            messages.push(m);
        }
    }
    let tools = req.tools.map(|tools| {
        tools
            .into_iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
                }})
            })
            .collect()
    });
    let choice = req.tool_choice.as_ref();
    let parallel = !choice
        .and_then(|c| c.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let tool_choice = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None | Some("auto") => None,
        Some("any") => Some(json!("required")),
        Some("none") => Some(json!("none")),
        Some("tool") => Some(
            json!({"type": "function", "function": {"name": choice.and_then(|c| c.get("name"))}}),
        ),
        Some(other) => {
            return Err(ApiError::param(
                "tool_choice",
                format!("unknown `tool_choice.type` {other:?} (auto, any, tool or none)"),
            ))
        }
    };
    let common = Common {
        model: req.model,
        max_tokens: Some(req.max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.map(Stop::Many),
        stream: req.stream,
        ..Common::default()
    };
    Ok(ChatRequest {
        messages,
        tools,
        tool_choice,
        parallel_tool_calls: Some(parallel),
        common,
    })
}

/// A Messages body as the chat request it is (for the fuzz target).
pub fn parse_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let req: MessagesRequest = api::parse(body)?;
    to_chat(req)
}

/// `POST /v1/messages`.
pub async fn messages(
    State(state): State<AppState>,
    axum::Extension(usage): axum::Extension<Usage>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    http::prepare_then_answer(state, usage, answer, move |state| {
        let body = http::body_bytes(body)?;
        http::prepare_chat(state, parse_request(&body)?)
    })
    .await
}

fn stop_reason(finish: FinishReason, calls: &[ToolCall]) -> &'static str {
    match finish {
        _ if !calls.is_empty() => "tool_use",
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
    }
}

/// Content blocks: the text (if any), then each call as `tool_use`.
fn blocks(id: &str, text: &str, calls: &[ToolCall]) -> Vec<Value> {
    let mut out = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        out.push(json!({"type": "text", "text": text}));
    }
    for (i, c) in calls.iter().enumerate() {
        out.push(json!({"type": "tool_use", "id": format!("toolu_{id}_{i}"), "name": c.name, "input": c.arguments}));
    }
    out
}

/// One SSE event, named as Anthropic names them.
fn event(data: Value) -> String {
    let name = data["type"].as_str().unwrap_or("message").to_string();
    format!("event: {name}\ndata: {data}\n\n")
}

async fn answer(state: AppState, mut p: Prepared, usage: Usage, ticket: Ticket) -> Response {
    let (n, _) = http::new_id();
    let id = format!("msg_{n:08}");
    let model = state.config.model_name.clone();
    let prompt_tokens = p.prompt.len();
    let mut rx = match http::queue(&state, &mut p, ticket) {
        Ok(rx) => rx,
        Err(e) => return anthropic_error(e),
    };
    if !p.stream {
        let (text, finish, prompt, completion) = match http::collect(&mut rx).await {
            Ok(done) => done,
            Err(e) => return anthropic_error(e),
        };
        usage.set(prompt, completion);
        let (text, calls) = match p.tools {
            Some((format, parallel)) => {
                let mut splitter = CallSplitter::new(format, parallel);
                let mut before = splitter.push(&text);
                let (rest, calls) = splitter.finish();
                before.push_str(&rest);
                (before.trim().to_string(), calls)
            }
            None => (text, Vec::new()),
        };
        return Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks(&id, &text, &calls),
            "stop_reason": stop_reason(finish, &calls),
            "stop_sequence": null,
            "usage": {"input_tokens": prompt, "output_tokens": completion},
        }))
        .into_response();
    }
    // Streamed: a task turns the scheduler's events into Anthropic's; dropped with the client.
    let (tx, out) = mpsc::unbounded_channel::<String>();
    let start = event(json!({"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }}));
    let _ = tx.send(start);
    let tools = p.tools;
    tokio::spawn(async move {
        let send = |e: Value| tx.send(event(e)).is_ok();
        // With tools, text that may be a call is held back and parsed at the end.
        let mut splitter = tools.map(|(format, parallel)| CallSplitter::new(format, parallel));
        let mut text_open = false;
        let text_delta = |text: &str, open: &mut bool| {
            if !*open {
                *open = true;
                let block = json!({"type": "text", "text": ""});
                send(json!({"type": "content_block_start", "index": 0, "content_block": block}));
            }
            let delta = json!({"type": "text_delta", "text": text});
            send(json!({"type": "content_block_delta", "index": 0, "delta": delta}))
        };
        let (finish, completion) = loop {
            match rx.recv().await {
                Some(Event::Text(t)) => {
                    let t = crate::tools::pass(&mut splitter, t);
                    if !t.is_empty() && !text_delta(&t, &mut text_open) {
                        return; // the client went away: dropping `rx` cancels the request
                    }
                }
                Some(Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    usage.set(prompt_tokens, completion_tokens);
                    break (finish, completion_tokens);
                }
                Some(Event::Error(e)) => {
                    send(json!({"type": "error", "error": {"type": e.kind, "message": e.message}}));
                    return;
                }
                None => return,
            }
        };
        let (rest, calls) = splitter.map(CallSplitter::finish).unwrap_or_default();
        if !rest.is_empty() || (calls.is_empty() && !text_open) {
            text_delta(&rest, &mut text_open);
        }
        let mut index = 0;
        if text_open {
            send(json!({"type": "content_block_stop", "index": 0}));
            index = 1;
        }
        let uses = blocks(&id, "", &calls)
            .into_iter()
            .filter(|b| b["type"] == "tool_use");
        for (i, b) in uses.enumerate() {
            let at = index + i;
            let start = json!({"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}});
            let delta = json!({"type": "input_json_delta", "partial_json": b["input"].to_string()});
            send(json!({"type": "content_block_start", "index": at, "content_block": start}));
            send(json!({"type": "content_block_delta", "index": at, "delta": delta}));
            send(json!({"type": "content_block_stop", "index": at}));
        }
        send(json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(finish, &calls), "stop_sequence": null},
            "usage": {"output_tokens": completion},
        }));
        send(json!({"type": "message_stop"}));
    });
    let stream = futures_util::stream::unfold(out, |mut out| async move {
        out.recv()
            .await
            .map(|s| (Ok::<_, Infallible>(Bytes::from(s)), out))
    });
    http::sse(Body::from_stream(stream))
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
fn anthropic_error(e: ApiError) -> Response {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let mut response = (
        e.status,
        Json(json!({"type": "error", "error": {"type": kind, "message": e.message}})),
    )
        .into_response();
    if let Some(s) = e.retry_after {
        response
            .headers_mut()
            .insert(axum::http::header::RETRY_AFTER, s.into());
    }
    response
}
