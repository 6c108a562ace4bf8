//! Tool calls: the request's tools rendered by the model's chat template (or described in a
//! system message when the template has no place for them), the model's output parsed back
//! into calls in the format that template teaches (the grammar of a required call is in
//! [`crate::tool_grammar`]).

use serde_json::{json, Value};

/// How a model writes a tool call, chosen from its chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; also what
    /// the server teaches a model whose template renders no tools.
    Hermes,
    /// Llama 3.x: a bare `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`, maybe).
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    Mistral,
    /// Mistral's newer form (templates that write `[ARGS]`): `[TOOL_CALLS]NAME[ARGS]{...}`,
    /// one marker per call.
    MistralArgs,
    /// gpt-oss (harmony): `to=functions.NAME ... <|message|>{...}<|call|>`.
    GptOss,
}

impl ToolFormat {
    /// The format a template's source teaches (Hermes when it names none).
    pub fn of_template(source: &str) -> ToolFormat {
        if source.contains("[TOOL_CALLS]") && source.contains("[ARGS]") {
            ToolFormat::MistralArgs
        } else if source.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if source.contains("<|channel|>") {
            ToolFormat::GptOss
        } else if source.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if source.contains("<|python_tag|>") || source.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    /// Whether the format's markers are control tokens, so the text must show them.
    pub fn needs_special_text(self) -> bool {
        matches!(
            self,
            ToolFormat::Mistral | ToolFormat::MistralArgs | ToolFormat::GptOss
        )
    }
}

/// One call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

/// A call's JSON (`{"name", "arguments" | "parameters"}`), its arguments an object (a string
/// holding JSON is parsed).
fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a) => a.clone(),
    };
    Some(ToolCall { name, arguments })
}

/// The JSON values written one after another at the start of `text` (Llama 3 separates
/// parallel calls with `;`); what follows the last one is ignored.
fn json_values(text: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match stream.next() {
            Some(Ok(v)) => out.push(v),
            _ => break,
        }
        rest = rest[stream.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    out
}

/// Splits a model's answer into its text and the calls it made.
pub fn parse(format: ToolFormat, text: &str) -> (String, Vec<ToolCall>) {
    match format {
        ToolFormat::Hermes => {
            let mut content = String::new();
            let mut calls = Vec::new();
            let mut rest = text;
            while let Some(start) = rest.find("<tool_call>") {
                content.push_str(&rest[..start]);
                let body = &rest[start + "<tool_call>".len()..];
                let (inside, after) = match body.find("</tool_call>") {
                    Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                    None => (body, ""),
                };
                match json_values(inside.trim()).first().and_then(call_of) {
                    Some(call) => calls.push(call),
                    None => content.push_str(&rest[start..rest.len() - after.len()]),
                }
                rest = after;
            }
            content.push_str(rest);
            (content.trim().to_string(), calls)
        }
        ToolFormat::Llama3 => {
            let body = text.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
            if !body.starts_with('{') {
                return (text.trim().to_string(), Vec::new());
            }
            let calls: Vec<ToolCall> = json_values(body).iter().filter_map(call_of).collect();
            if calls.is_empty() {
                (text.trim().to_string(), calls)
            } else {
                (String::new(), calls)
            }
        }
        ToolFormat::Mistral | ToolFormat::MistralArgs => {
            let Some(start) = text.find("[TOOL_CALLS]") else {
                return (text.trim().to_string(), Vec::new());
            };
            let mut calls = Vec::new();
            for segment in text[start..].split("[TOOL_CALLS]").skip(1) {
                if let Some((name, args)) = segment.split_once("[ARGS]") {
                    // The newer form: `[TOOL_CALLS]name[ARGS]{...}`, a marker per call.
                    if let Some(arguments) = json_values(args.trim()).into_iter().next() {
                        calls.push(ToolCall {
                            name: name.trim().to_string(),
                            arguments,
                        });
                    }
                    continue;
                }
                for v in json_values(segment) {
                    match &v {
                        Value::Array(items) => calls.extend(items.iter().filter_map(call_of)),
                        other => calls.extend(call_of(other)),
                    }
                }
            }
            (text[..start].trim().to_string(), calls)
        }
        ToolFormat::GptOss => {
            let mut calls = Vec::new();
            let mut rest = text;
            while let Some(at) = rest.find("to=functions.") {
                let after = &rest[at + "to=functions.".len()..];
                let name_end = after
                    .find(|c: char| c.is_whitespace() || c == '<')
                    .unwrap_or(after.len());
                let name = after[..name_end].to_string();
                let Some(msg) = after.find("<|message|>") else {
                    break;
                };
                let body = &after[msg + "<|message|>".len()..];
                let end = body.find("<|call|>").unwrap_or(body.len());
                if let Some(arguments) = json_values(body[..end].trim()).into_iter().next() {
                    calls.push(ToolCall { name, arguments });
                }
                rest = &body[end..];
            }
            let content = match text.rfind("<|channel|>final<|message|>") {
                Some(i) => {
                    let t = &text[i + "<|channel|>final<|message|>".len()..];
                    t.split("<|end|>").next().unwrap_or(t)
                }
                None if calls.is_empty() => text,
                None => "",
            };
            (content.trim().to_string(), calls)
        }
    }
}

/// Streams an answer's text while holding back what may be a tool call: text before a call's
/// marker goes out as it comes; from the marker on, the text is kept and parsed at the end.
pub struct CallSplitter {
    format: ToolFormat,
    parallel: bool,
    held: String,
    /// A call has begun: everything from here is parsed at the end.
    capturing: bool,
    /// Llama 3: whether the answer's start (a call is the whole answer) has been seen.
    decided: bool,
}

const PYTHON_TAG: &str = "<|python_tag|>";

impl CallSplitter {
    pub fn new(format: ToolFormat, parallel: bool) -> CallSplitter {
        CallSplitter {
            format,
            parallel,
            held: String::new(),
            // gpt-oss writes its answer in channels: all of it is parsed at the end.
            capturing: format == ToolFormat::GptOss,
            decided: false,
        }
    }

    /// The text that can go out now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.capturing {
            return String::new();
        }
        let marker = match self.format {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Mistral | ToolFormat::MistralArgs => "[TOOL_CALLS]",
            ToolFormat::GptOss => return String::new(),
            ToolFormat::Llama3 => {
                if self.decided {
                    return std::mem::take(&mut self.held);
                }
                let start = self.held.trim_start();
                if start.is_empty() || (PYTHON_TAG.starts_with(start) && start != PYTHON_TAG) {
                    return String::new(); // not yet known
                }
                self.decided = true;
                self.capturing = start.starts_with('{') || start.starts_with(PYTHON_TAG);
                return if self.capturing {
                    String::new()
                } else {
                    std::mem::take(&mut self.held)
                };
            }
        };
        if let Some(i) = self.held.find(marker) {
            self.capturing = true;
            let out = self.held[..i].to_string();
            self.held.drain(..i);
            return out;
        }
        // Hold back the longest end of the text that may begin the marker.
        let keep = (1..marker.len().min(self.held.len() + 1))
            .rev()
            .find(|&k| {
                let at = self.held.len() - k;
                self.held.is_char_boundary(at) && marker.starts_with(&self.held[at..])
            })
            .unwrap_or(0);
        let at = self.held.len() - keep;
        let out = self.held[..at].to_string();
        self.held.drain(..at);
        out
    }

    /// At the end: the text not yet sent (outside the calls), and the calls.
    pub fn finish(self) -> (String, Vec<ToolCall>) {
        if !self.capturing {
            return (self.held, Vec::new());
        }
        let (content, mut calls) = parse(self.format, &self.held);
        if !self.parallel {
            calls.truncate(1);
        }
        (content, calls)
    }
}

/// `text` through `splitter` when there is one (tools were given), as it is otherwise.
pub fn pass(splitter: &mut Option<CallSplitter>, text: String) -> String {
    match splitter {
        Some(s) => s.push(&text),
        None => text,
    }
}

/// The system text that teaches a model whose template renders no tools how to call them
/// (Hermes's format, which [`parse`] reads back).
pub fn describe(tools: &[Value]) -> String {
    let mut s = String::from(
        "You may call functions to help answer. To call one, reply with\n\
         <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>\n\
         The functions, as JSON schemas:\n",
    );
    for t in tools {
        s.push_str(&t.get("function").unwrap_or(t).to_string());
        s.push('\n');
    }
    s
}

/// The text a template without tools renders for an assistant's earlier calls.
pub fn render_calls(calls: &[Value]) -> String {
    calls
        .iter()
        .map(|c| {
            let f = c.get("function").unwrap_or(c);
            let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
            format!("<tool_call>\n{call}\n</tool_call>")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` through a splitter: what went out while streaming, what came at the
    /// end, and the calls.
    fn split(format: ToolFormat, pieces: &[&str]) -> (String, String, Vec<ToolCall>) {
        let mut s = CallSplitter::new(format, true);
        let streamed: String = pieces.iter().map(|p| s.push(p)).collect();
        let (rest, calls) = s.finish();
        (streamed, rest, calls)
    }

    #[test]
    fn text_before_a_call_streams_and_the_call_is_held_back() {
        let call = ToolCall {
            name: "f".into(),
            arguments: json!({}),
        };
        let (streamed, rest, calls) = split(
            ToolFormat::Hermes,
            &[
                "Let me ",
                "check.<tool",
                "_call>{\"name\": \"f\", ",
                "\"arguments\": {}}</tool_call>",
            ],
        );
        assert_eq!((streamed.as_str(), rest.as_str()), ("Let me check.", ""));
        assert_eq!(calls, vec![call.clone()]);
        // A marker's prefix that turns out to be text goes out after all.
        let (streamed, rest, calls) = split(ToolFormat::Hermes, &["a <to", "ol b", " <tool"]);
        assert_eq!((streamed.as_str(), rest.as_str()), ("a <tool b ", "<tool"));
        assert!(calls.is_empty());
        let (streamed, _, calls) = split(
            ToolFormat::Llama3,
            &[" <|python", "_tag|>{\"name\": \"f\", \"parameters\": {}}"],
        );
        assert_eq!((streamed.as_str(), calls), ("", vec![call]));
        let (streamed, rest, _) = split(ToolFormat::Llama3, &["  ", "Hello", " there"]);
        assert_eq!(streamed + &rest, "  Hello there");
    }

    #[test]
    fn each_format_is_chosen_from_its_template_and_parsed() {
        assert_eq!(
            ToolFormat::of_template("{{ '<tool_call>' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::of_template("[TOOL_CALLS] x"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::of_template("<|python_tag|>"),
            ToolFormat::Llama3
        );
        assert_eq!(ToolFormat::of_template("<|channel|>"), ToolFormat::GptOss);
        assert_eq!(ToolFormat::of_template("plain"), ToolFormat::Hermes);
        let want = |name: &str, n: i64| ToolCall {
            name: name.into(),
            arguments: json!({"n": n}),
        };
        let (text, calls) = parse(
            ToolFormat::Hermes,
            "Let me see.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 1}}\n</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": \"{\\\"n\\\": 2}\"}</tool_call>",
        );
        assert_eq!(
            (text.as_str(), calls),
            ("Let me see.", vec![want("f", 1), want("g", 2)])
        );
        let (text, calls) = parse(
            ToolFormat::Llama3,
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"n\": 1}}; {\"name\": \"g\", \"parameters\": {\"n\": 2}}",
        );
        assert_eq!(
            (text.as_str(), calls),
            ("", vec![want("f", 1), want("g", 2)])
        );
        let (_, calls) = parse(
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"n\": 1}}]",
        );
        assert_eq!(calls, vec![want("f", 1)]);
        let (_, calls) = parse(ToolFormat::Mistral, "[TOOL_CALLS]g[ARGS]{\"n\": 2}");
        assert_eq!(calls, vec![want("g", 2)]);
        let (text, calls) = parse(
            ToolFormat::MistralArgs,
            "Sure.[TOOL_CALLS]f[ARGS]{\"n\": 1}[TOOL_CALLS]g[ARGS]{\"n\": 2}",
        );
        assert_eq!(
            (text.as_str(), calls),
            ("Sure.", vec![want("f", 1), want("g", 2)])
        );
        assert_eq!(
            ToolFormat::of_template("[TOOL_CALLS]{{ name }}[ARGS]"),
            ToolFormat::MistralArgs
        );
        let (_, calls) = parse(
            ToolFormat::GptOss,
            "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"n\": 1}<|call|>",
        );
        assert_eq!(calls, vec![want("f", 1)]);
        // Text that only looks like a call stays text.
        let (text, calls) = parse(ToolFormat::Hermes, "<tool_call>not json</tool_call> ok");
        assert!(calls.is_empty() && text.contains("not json"), "{text}");
        let (text, calls) = parse(ToolFormat::Llama3, "{not a call}");
        assert!(calls.is_empty() && text == "{not a call}");
    }
}
