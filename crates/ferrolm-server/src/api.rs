//! The OpenAI request bodies, their validation, and the answers' JSON.

use ferrolm_engine::constraint::{Constraint, Grammar};

use crate::tools::{ToolCall, ToolFormat};
use ferrolm_engine::sequence::SequenceParams;
use ferrolm_engine::{FinishReason, SamplerParams};
use ferrolm_tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use axum::http::StatusCode;

/// `stop`: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A message's `content`: text, or parts of which we read the text ones.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's earlier calls: `{"id", "type": "function", "function": {"name",
    /// "arguments": "<JSON text>"}}`.
    #[serde(default)]
    pub tool_calls: Vec<Value>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// `response_format`: `text`, `json_object`, or `json_schema` with its schema.
#[derive(Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
}

#[derive(Deserialize)]
pub struct JsonSchemaFormat {
    pub schema: Option<Value>,
}

#[derive(Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// What both endpoints share.
#[derive(Deserialize, Default)]
pub struct Common {
    /// Optional: one model is served.
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub logprobs: Option<Value>,
    /// llama.cpp's extension: keep generating past end-of-generation tokens.
    pub ignore_eos: Option<bool>,
    /// Structured output: JSON, or JSON valid against a schema.
    pub response_format: Option<ResponseFormat>,
    /// An extension (as vLLM's and llama.cpp's servers have): a grammar, in Lark syntax.
    pub grammar: Option<String>,
}

/// The grammar a request's output must follow, from `response_format` or `grammar`.
pub fn grammar_of(common: &Common) -> Result<Option<Grammar>, ApiError> {
    let format = match &common.response_format {
        None => None,
        Some(f) => match f.kind.as_str() {
            "text" => None,
            "json_object" => Some(Grammar::JsonObject),
            "json_schema" => {
                let schema = f
                    .json_schema
                    .as_ref()
                    .and_then(|j| j.schema.clone())
                    .ok_or_else(|| {
                        ApiError::param(
                            "response_format",
                            "`response_format.json_schema.schema` is required for type `json_schema`",
                        )
                    })?;
                Some(Grammar::JsonSchema(schema))
            }
            other => {
                return Err(ApiError::param(
                    "response_format",
                    format!(
                    "unknown `response_format.type` {other:?} (text, json_object or json_schema)"
                ),
                ))
            }
        },
    };
    match (&common.grammar, format) {
        (None, format) => Ok(format),
        (Some(_), Some(_)) => Err(ApiError::param(
            "grammar",
            "give either `grammar` or a JSON `response_format`, not both",
        )),
        (Some(g), None) if g.contains("::=") => Err(ApiError::param(
            "grammar",
            "GBNF grammars are not supported: give the grammar in Lark syntax (`rule: ...`)",
        )),
        (Some(g), None) => Ok(Some(Grammar::Lark(g.clone()))),
    }
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"`, or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// A completion prompt: text, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

/// Which endpoint, for the shape of the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// A validated request, ready to queue.
pub struct Prepared {
    pub endpoint: Endpoint,
    /// The grammar its output follows, compiled.
    pub constraint: Option<Constraint>,
    /// How to read tool calls out of the answer, when tools were given: the format and
    /// whether several calls may be kept.
    pub tools: Option<(ToolFormat, bool)>,
    pub prompt: Vec<u32>,
    pub params: SequenceParams,
    pub stream: bool,
    pub include_usage: bool,
}

/// Parses a body: 400 for malformed JSON and for missing or wrongly typed fields.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => {
                ApiError::invalid(format!("the body is not valid JSON: {e}"))
                    .with_code("invalid_json")
            }
            Category::Data => ApiError::invalid(format!("invalid request: {e}")),
        }
    })
}

/// The roles a message may have.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Stop strings a request may give, and the longest each may be (in bytes): the text held
/// back while a stop string may be starting grows with the longest one.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 512;

/// The messages as the chat template wants them.
pub fn chat_messages(
    messages: &[Message],
    template_renders_tools: bool,
) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::param(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::param(
                                    "messages",
                                    format!("messages[{i}]: content parts of type {kind:?} are not supported (text only)"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            // The template writes the role between its own markers: only the known roles.
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::param(
                    "messages",
                    format!(
                        "messages[{i}]: unknown role {:?} (one of {})",
                        m.role,
                        ROLES.join(", ")
                    ),
                ));
            }
            let calls = m
                .tool_calls
                .iter()
                .map(|c| template_call(i, c))
                .collect::<Result<Vec<_>, _>>()?;
            let mut message = ChatMessage::new(m.role.clone(), content);
            if template_renders_tools {
                message.tool_calls = calls;
            } else if !calls.is_empty() {
                // The template would drop them: they become the text the model was taught.
                let text = crate::tools::render_calls(&calls);
                message.content = if message.content.is_empty() {
                    text
                } else {
                    format!("{}\n{text}", message.content)
                };
            }
            message.tool_call_id = m.tool_call_id.clone();
            message.name = m.name.clone();
            Ok(message)
        })
        .collect()
}

/// A call as templates read it: its arguments an object, not JSON text.
fn template_call(i: usize, call: &Value) -> Result<Value, ApiError> {
    let bad = |what: &str| ApiError::param("messages", format!("messages[{i}].tool_calls: {what}"));
    let f = call
        .get("function")
        .ok_or_else(|| bad("each call needs a `function`"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("each call needs a `function.name`"))?;
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| json!(s)),
        Some(v) => v.clone(),
        None => json!({}),
    };
    Ok(json!({
        "id": call.get("id"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

/// What a request's tools ask of the answer.
pub struct ToolPlan {
    /// The tools, for the template (or the server's description of them).
    pub tools: Vec<Value>,
    pub format: ToolFormat,
    pub parallel: bool,
    /// With `tool_choice` `required` or a named function: the call's grammar.
    pub grammar: Option<Grammar>,
}

/// Most tools one request may give.
const MAX_TOOLS: usize = 128;

/// The tools of a chat request and what `tool_choice` asks; None without tools or with
/// `tool_choice: "none"`.
pub fn tool_plan(
    req: &ChatRequest,
    template_source: &str,
    control: crate::tool_grammar::ControlTokens<'_>,
) -> Result<Option<ToolPlan>, ApiError> {
    let tools = match &req.tools {
        None => return Ok(None),
        Some(t) if t.is_empty() => return Ok(None),
        Some(t) => t,
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::param(
            "tools",
            format!("at most {MAX_TOOLS} tools"),
        ));
    }
    let mut names = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|_| t.get("type").and_then(Value::as_str) == Some("function"));
        match name {
            Some(n) if !n.is_empty() => names.push(n),
            _ => {
                return Err(ApiError::param(
                    "tools",
                    format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                ))
            }
        }
    }
    let format = ToolFormat::of_template(template_source);
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let choice = req.tool_choice.clone().unwrap_or(json!("auto"));
    let required: Option<Vec<&Value>> = match &choice {
        Value::String(c) if c == "none" => return Ok(None),
        Value::String(c) if c == "auto" => None,
        Value::String(c) if c == "required" => Some(tools.iter().collect()),
        Value::Object(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::param(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let i = names.iter().position(|n| *n == name).ok_or_else(|| {
                ApiError::param(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not among the tools"),
                )
            })?;
            Some(vec![&tools[i]])
        }
        other => {
            return Err(ApiError::param(
                "tool_choice",
                format!("`tool_choice` must be \"auto\", \"none\", \"required\" or a named function, not {other}"),
            ))
        }
    };
    let grammar =
        required.map(|r| crate::tool_grammar::required_call(format, &r, parallel, control));
    Ok(Some(ToolPlan {
        tools: tools.clone(),
        format,
        parallel,
        grammar,
    }))
}

fn seed_from_clock() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
}

/// 404 unless `model` is absent or the served model's name.
pub fn check_model(model: &Option<String>, served: &str) -> Result<(), ApiError> {
    let Some(model) = model else {
        return Ok(());
    };
    if model == served {
        return Ok(());
    }
    Err(ApiError {
        param: Some("model".into()),
        ..ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{model}` does not exist; this server serves `{served}`"),
        )
    }
    .with_code("model_not_found"))
}

/// Checks the common fields against the served model and context; `prompt` is tokenized.
pub fn prepare(
    common: &Common,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    model_name: &str,
    n_ctx: usize,
) -> Result<Prepared, ApiError> {
    check_model(&common.model, model_name)?;
    if let Some(n) = common.n {
        if n != 1 {
            return Err(ApiError::param("n", "only `n` = 1 is supported"));
        }
    }
    if common
        .logprobs
        .as_ref()
        .is_some_and(|v| !v.is_null() && *v != json!(false))
    {
        return Err(ApiError::param("logprobs", "`logprobs` is not supported"));
    }
    if prompt.is_empty() {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    }
    if prompt.len() >= n_ctx {
        return Err(ApiError::param(
            "messages",
            format!(
                "the prompt has {} tokens but the context holds {n_ctx} (with room for at least one generated token)",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let (field, requested) = match (common.max_completion_tokens, common.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let room = n_ctx - prompt.len();
    let max_tokens = match requested {
        None if endpoint == Endpoint::Completion => 16.min(room),
        None => room,
        Some(m) if m < 1 => {
            return Err(ApiError::param(
                field,
                format!("`{field}` must be at least 1, got {m}"),
            ))
        }
        Some(m) if m as u64 > n_ctx as u64 => {
            return Err(ApiError::param(
                field,
                format!("`{field}` is {m} but the context holds {n_ctx} tokens"),
            ))
        }
        Some(m) => m as usize,
    };
    let mut sampler = SamplerParams::default();
    if let Some(t) = common.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::param(
                "temperature",
                "`temperature` must be between 0 and 2",
            ));
        }
        sampler.temperature = t;
    }
    if let Some(p) = common.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::param("top_p", "`top_p` must be in (0, 1]"));
        }
        sampler.top_p = p;
    }
    if let Some(k) = common.top_k {
        if k < 0 {
            return Err(ApiError::param("top_k", "`top_k` must be 0 (off) or more"));
        }
        sampler.top_k = k as usize;
    }
    if let Some(p) = common.min_p {
        if !(0.0..=1.0).contains(&p) {
            return Err(ApiError::param("min_p", "`min_p` must be in [0, 1]"));
        }
        sampler.min_p = p;
    }
    for (name, v) in [
        ("frequency_penalty", common.frequency_penalty),
        ("presence_penalty", common.presence_penalty),
    ] {
        if v.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
            return Err(ApiError::param(
                name,
                format!("`{name}` must be between -2 and 2"),
            ));
        }
    }
    sampler.frequency_penalty = common.frequency_penalty.unwrap_or(0.0);
    sampler.presence_penalty = common.presence_penalty.unwrap_or(0.0);
    if let Some(r) = common.repeat_penalty {
        if !(r > 0.0 && r.is_finite()) {
            return Err(ApiError::param(
                "repeat_penalty",
                "`repeat_penalty` must be positive",
            ));
        }
        sampler.repeat_penalty = r;
    }
    sampler.seed = common.seed.map_or_else(seed_from_clock, |s| s as u64);
    let stop = match &common.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::param(
            "stop",
            format!("at most {MAX_STOPS} stop strings"),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::param(
            "stop",
            format!(
                "a stop string is {} bytes long; at most {MAX_STOP_BYTES}",
                long.len()
            ),
        ));
    }
    let stream = common.stream.unwrap_or(false);
    Ok(Prepared {
        endpoint,
        constraint: None,
        tools: None,
        prompt,
        params: SequenceParams {
            max_tokens,
            sampler,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            stop_at_eog: !common.ignore_eos.unwrap_or(false),
        },
        stream,
        include_usage: stream
            && common
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
    })
}

pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// Identity of one answer: id, creation time, model.
pub struct Answer {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl Answer {
    /// The whole answer, not streamed.
    pub fn full(
        &self,
        text: &str,
        finish: FinishReason,
        prompt: usize,
        completion: usize,
    ) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": null,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish_reason(finish),
                }],
                "usage": usage(prompt, completion),
            }),
            Endpoint::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": null,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish_reason(finish),
                }],
                "usage": usage(prompt, completion),
            }),
        }
    }

    /// The whole chat answer when tools were given: the text outside the calls (null when
    /// there is none) and the calls; `finish_reason` `tool_calls` when there are any.
    pub fn full_with_tools(
        &self,
        content: &str,
        calls: &[ToolCall],
        finish: FinishReason,
        prompt: usize,
        completion: usize,
    ) -> Value {
        let mut v = self.full(content, finish, prompt, completion);
        let message = &mut v["choices"][0]["message"];
        if !calls.is_empty() {
            message["tool_calls"] = self.tool_calls_json(calls, false);
            v["choices"][0]["finish_reason"] = json!("tool_calls");
            if content.is_empty() {
                v["choices"][0]["message"]["content"] = Value::Null;
            }
        }
        v
    }

    /// `tool_calls` as OpenAI writes them (with `index` in streamed deltas); ids derive from
    /// the answer's id.
    pub fn tool_calls_json(&self, calls: &[ToolCall], indexed: bool) -> Value {
        Value::Array(
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut call = json!({
                        "id": format!("call_{}_{i}", self.id),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments.to_string()},
                    });
                    if indexed {
                        call["index"] = json!(i);
                    }
                    call
                })
                .collect(),
        )
    }

    /// One streamed chunk: `text` (chat: the delta's content; `first` adds the role), and the
    /// finish reason on the last one.
    pub fn chunk(&self, text: Option<&str>, first: bool, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(finish_reason);
        match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "system_fingerprint": null,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
            Endpoint::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": null,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            }),
        }
    }

    /// The usage chunk (`stream_options.include_usage`): no choices.
    pub fn usage_chunk(&self, prompt: usize, completion: usize) -> Value {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [],
            "usage": usage(prompt, completion),
        })
    }
}
