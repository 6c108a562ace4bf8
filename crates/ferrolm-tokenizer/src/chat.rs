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
}

impl ChatMessage {
    /// A message with this role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    warning: Option<String>,
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
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
            warning: None,
        })
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
        tmpl.render(ctx).map_err(template_error)
    }

    /// Set when the model had no template and ChatML is used instead; the CLI prints it.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
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
