//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja, set up
//! the way Hugging Face transformers renders it (`trim_blocks`, `lstrip_blocks`,
//! `raise_exception`, `strftime_now`, a `tojson` like Python's `json.dumps`, and Python's
//! string and dict methods from minijinja-contrib's `pycompat`).

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{Tokenizer, TokenizerError};

/// Gemma's turn format (`<start_of_turn>user ... <end_of_turn>`, the assistant's role named
/// `model`, a system message folded into the first user turn), for Gemma vocabularies whose
/// file carries no template.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% if messages[0]['role'] == 'system' %}\
{% set sys = (messages[0]['content'] | trim) ~ '\n\n' %}{% set rest = messages[1:] %}\
{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}\
{% for m in rest %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n\
{{ (sys if loop.first else '') ~ (m['content'] | trim) }}<end_of_turn>\n{% endfor %}\
{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

/// The fallback for a model without a template: ChatML, as llama.cpp uses.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\\n' -}}\n{%- endif -%}";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text of the message.
    pub content: String,
    /// An assistant's tool calls, as templates read them: `{"type": "function", "id": ...,
    /// "function": {"name": ..., "arguments": {...}}}` with the arguments an object.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the name of the function that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with this role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

/// Bounds on one rendering. A template is code that comes with the file: without these, a
/// loop of loops never returns and a template that grows its output exhausts memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateLimits {
    /// Template instructions one rendering may execute (minijinja's fuel).
    pub fuel: u64,
    /// Bytes one rendering may write.
    pub max_output_bytes: usize,
}

impl Default for TemplateLimits {
    /// 20 million instructions (a long conversation with tools takes a few million) and 8 MiB.
    fn default() -> TemplateLimits {
        TemplateLimits {
            fuel: 20_000_000,
            max_output_bytes: 8 << 20,
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
    warning: Option<String>,
    limits: TemplateLimits,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("warning", &self.warning)
            .finish_non_exhaustive()
    }
}

const NAME: &str = "chat";

fn template_error(e: Error) -> TokenizerError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    TokenizerError::Template(msg)
}

impl ChatTemplate {
    /// The model's template, or the ChatML fallback (with a [`ChatTemplate::warning`] to show)
    /// when the model has none.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<ChatTemplate, TokenizerError> {
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
        let (bos, eos) = (text(tok.bos()), text(tok.eos()));
        match tok.chat_template() {
            Some(src) => ChatTemplate::new(src, &bos, &eos),
            // A Gemma vocabulary without a template (the packaged Gemma 3 270M file has none):
            // Gemma's own turn format, which llama.cpp also detects by these tokens.
            None if tok.token_id("<start_of_turn>").is_some()
                && tok.token_id("<end_of_turn>").is_some() =>
            {
                ChatTemplate::new(GEMMA_TEMPLATE, &bos, &eos)
            }
            None => {
                let mut t = ChatTemplate::new(CHATML_TEMPLATE, &bos, &eos)?;
                t.warning = Some(
                    "the model has no chat template (tokenizer.chat_template); using ChatML \
                     (<|im_start|>role\\ncontent<|im_end|>)"
                        .to_string(),
                );
                Ok(t)
            }
        }
    }

    /// Compiles a template; `bos` and `eos` are the texts of `bos_token` and `eos_token`.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(template_error)?;
        let limits = TemplateLimits::default();
        env.set_fuel(Some(limits.fuel));
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos: bos.to_string(),
            eos: eos.to_string(),
            warning: None,
            limits,
        })
    }

    /// The texts of `bos_token` and `eos_token`.
    pub fn special_texts(&self) -> (&str, &str) {
        (&self.bos, &self.eos)
    }

    /// The bounds each rendering runs under.
    pub fn limits(&self) -> TemplateLimits {
        self.limits
    }

    /// The template's Jinja source (a server picks the tool-call format it writes from it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template renders a `tools` list (else a server describes them itself).
    pub fn renders_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// The same template under other bounds.
    pub fn with_limits(mut self, limits: TemplateLimits) -> ChatTemplate {
        self.env.set_fuel(Some(limits.fuel));
        self.limits = limits;
        self
    }

    /// Renders the smallest conversation every template must accept (user, assistant, user,
    /// then the generation prompt): run once at load, so that a template that fails or runs
    /// past its bounds is refused before any request.
    pub fn check(&self) -> Result<(), TokenizerError> {
        self.render(&ChatTemplate::check_conversation(), true, None)
            .map(drop)
    }

    /// The conversation [`ChatTemplate::check`] renders (for a caller that renders elsewhere).
    pub fn check_conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("user", "Hello."),
            ChatMessage::new("assistant", "Hi. How can I help?"),
            ChatMessage::new("user", "Say hello."),
        ]
    }

    /// Renders a conversation. `tools` (a JSON array of tool schemas) is passed as `tools`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
            tools => tools.map(Value::from_serialize).unwrap_or(Value::from(())),
        };
        let mut out = BoundedOutput {
            bytes: Vec::new(),
            limit: self.limits.max_output_bytes,
            overflowed: false,
        };
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|_| TokenizerError::Template("the output is not UTF-8".into())),
            Err(_) if out.overflowed => Err(TokenizerError::Template(format!(
                "the output is larger than {} bytes",
                self.limits.max_output_bytes
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TokenizerError::Template(format!(
                "it ran out of fuel: more than {} instructions",
                self.limits.fuel
            ))),
            Err(e) => Err(template_error(e)),
        }
    }

    /// Renders a conversation and tokenizes it as the engine evaluates it, with every
    /// message's content as text: control-token text inside a message (a user typing
    /// `<|im_start|>system`) stays text, while the template's own markers are control tokens.
    ///
    /// The content reaches the template with each such span replaced by one private-use
    /// character (plane 16) that the rendering maps back, recording where it lands.
    pub fn render_ids(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.render_ids_with(tok, messages, add_generation_prompt, tools, |m, g, t| {
            self.render(m, g, t)
        })
    }

    /// [`ChatTemplate::render_ids`] with the rendering itself done by `render` (given the
    /// messages with their control-token texts hidden), e.g. in another process.
    pub fn render_ids_with(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        render: impl FnOnce(
            &[ChatMessage],
            bool,
            Option<&serde_json::Value>,
        ) -> Result<String, TokenizerError>,
    ) -> Result<Vec<u32>, TokenizerError> {
        // Every text the client wrote: contents, names, ids, calls' arguments, tools' schemas.
        let mut hidden = Vec::new();
        let mut hide = |text: &str| hide_spans(tok, text, &mut hidden);
        let mut escaped = Vec::with_capacity(messages.len());
        for m in messages {
            escaped.push(ChatMessage {
                role: m.role.clone(),
                content: hide(&m.content)?,
                tool_calls: (m.tool_calls.iter())
                    .map(|c| hide_in_json(c, &mut hide))
                    .collect::<Result<_, _>>()?,
                tool_call_id: m.tool_call_id.as_deref().map(&mut hide).transpose()?,
                name: m.name.as_deref().map(&mut hide).transpose()?,
            });
        }
        let tools = tools.map(|t| hide_in_json(t, &mut hide)).transpose()?;
        let rendered = render(&escaped, add_generation_prompt, tools.as_ref())?;
        let (text, literal) = restore_spans(&rendered, &hidden);
        Ok(tok.encode_prompt_with_literals(&text, &literal))
    }

    /// Set when the model had no template and ChatML is used instead; the CLI prints it.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }
}

/// The first private-use character of plane 16: placeholder `i` stands for `hidden[i]`.
const PLACEHOLDER_BASE: u32 = 0x10_0000;
/// Placeholders available to one rendering (plane 16's private-use characters).
const MAX_PLACEHOLDERS: usize = 0xFFFE;

fn is_placeholder(c: char) -> bool {
    (c as u32) >= PLACEHOLDER_BASE
}

/// `content` with every control-token text (and every plane-16 character, so that the mapping
/// back is unambiguous) replaced by a placeholder; the originals go to `hidden`.
fn hide_spans(
    tok: &Tokenizer,
    content: &str,
    hidden: &mut Vec<String>,
) -> Result<String, TokenizerError> {
    let mut spans = tok.control_token_spans(content);
    spans.extend(
        content
            .char_indices()
            .filter(|&(_, c)| is_placeholder(c))
            .map(|(i, c)| i..i + c.len_utf8()),
    );
    if spans.is_empty() {
        return Ok(content.to_string());
    }
    spans.sort_by_key(|r| r.start);
    let mut out = String::with_capacity(content.len());
    let mut at = 0;
    for r in spans {
        if r.start < at {
            continue; // inside the previous span
        }
        if hidden.len() >= MAX_PLACEHOLDERS {
            return Err(TokenizerError::Template(format!(
                "the messages hold more than {MAX_PLACEHOLDERS} special-token texts"
            )));
        }
        out.push_str(&content[at..r.start]);
        let index = u32::try_from(hidden.len()).unwrap_or(u32::MAX);
        out.push(char::from_u32(PLACEHOLDER_BASE + index).unwrap_or('\u{FFFD}'));
        hidden.push(content[r.clone()].to_string());
        at = r.end;
    }
    out.push_str(&content[at..]);
    Ok(out)
}

/// `value` with `hide` applied to every string in it, object keys included.
fn hide_in_json(
    value: &serde_json::Value,
    hide: &mut impl FnMut(&str) -> Result<String, TokenizerError>,
) -> Result<serde_json::Value, TokenizerError> {
    use serde_json::Value as J;
    Ok(match value {
        J::String(s) => J::String(hide(s)?),
        J::Array(items) => J::Array(
            items
                .iter()
                .map(|v| hide_in_json(v, hide))
                .collect::<Result<_, _>>()?,
        ),
        J::Object(o) => {
            let mut out = serde_json::Map::with_capacity(o.len());
            for (k, v) in o {
                out.insert(hide(k)?, hide_in_json(v, hide)?);
            }
            J::Object(out)
        }
        other => other.clone(),
    })
}

/// The rendered text with each placeholder replaced by what it hid, and where those land.
fn restore_spans(rendered: &str, hidden: &[String]) -> (String, Vec<std::ops::Range<usize>>) {
    if hidden.is_empty() {
        return (rendered.to_string(), Vec::new());
    }
    let mut text = String::with_capacity(rendered.len());
    let mut literal = Vec::new();
    for c in rendered.chars() {
        let original = is_placeholder(c)
            .then(|| hidden.get((c as u32 - PLACEHOLDER_BASE) as usize))
            .flatten();
        match original {
            Some(h) => {
                literal.push(text.len()..text.len() + h.len());
                text.push_str(h);
            }
            None => text.push(c),
        }
    }
    (text, literal)
}

/// A rendering's output, refusing to grow past `limit` bytes.
struct BoundedOutput {
    bytes: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC time, with the common `strftime` codes.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs)
}

pub(crate) fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    let (h, mi, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // civil date from days since 1970-01-01 (Howard Hinnant's algorithm)
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&d.to_string()),
                Some('m') => out.push_str(&m.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// sort_keys=sort_keys)`, so `", "` and `": "` separators and no HTML escaping.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent: Option<usize> = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let sort_keys: bool = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _ = kwargs.get::<Option<bool>>("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let mut out = String::new();
    write_py_json(&json, indent, sort_keys, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(
    v: &serde_json::Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&n.to_string()),
        J::String(s) => out.push_str(&serde_json::to_string(s).expect("string")),
        J::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(x, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(o) => {
            if o.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &serde_json::Value)> = o.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("string"));
                out.push_str(": ");
                write_py_json(x, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %A", 0),
            "1970-01-01 00:00:00 Thursday"
        );
        assert_eq!(
            strftime("%d %B %Y %a %b", 1_709_251_200),
            "01 March 2024 Fri Mar"
        );
    }

    #[test]
    fn chatml_fallback_renders() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, "", "").unwrap();
        let msgs = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            t.render(&msgs, true, None).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma_fallback_renders() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, "<bos>", "<eos>").unwrap();
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello."),
            ChatMessage::new("user", "Bye"),
        ];
        assert_eq!(
            t.render(&msgs, true, None).unwrap(),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n\
             Hello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn a_template_that_loops_too_long_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let start = std::time::Instant::now();
        let e = t.check().unwrap_err().to_string();
        assert!(e.contains("fuel"), "{e}");
        // 20 million instructions, not 10^10.
        assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
    }

    #[test]
    fn a_template_that_writes_too_much_is_cut_off() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
            "",
            "",
        )
        .unwrap()
        .with_limits(TemplateLimits {
            fuel: 1 << 40,
            max_output_bytes: 1 << 20,
        });
        let e = t.check().unwrap_err().to_string();
        assert!(e.contains("larger than 1048576 bytes"), "{e}");
        // Within the bound, the same template renders.
        let small = ChatTemplate::new("{{ 'x' * 1000 }}", "", "").unwrap();
        assert_eq!(small.render(&[], false, None).unwrap().len(), 1000);
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no way') }}", "", "").unwrap();
        let e = t.render(&[], false, None).unwrap_err().to_string();
        assert!(e.contains("no way"), "{e}");
    }

    #[test]
    fn tojson_like_python() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}",
            "",
            "",
        )
        .unwrap();
        let tools = serde_json::json!([{"name": "f<x>", "b": [1, 2.5, null], "a": {}}]);
        assert_eq!(
            t.render(&[], false, Some(&tools)).unwrap(),
            "[{\"name\": \"f<x>\", \"b\": [1, 2.5, null], \"a\": {}}]|{\n  \"name\": \"f<x>\",\n  \"b\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": {}\n}"
        );
    }
}
