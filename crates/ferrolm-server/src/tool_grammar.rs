//! The grammar of a required tool call (`tool_choice: "required"` or a named function), per
//! format: the call is written the way [`crate::tools::parse`] reads it back, and its
//! arguments are JSON valid against the tool's `parameters` schema (llguidance's `%json`).
//! A format's markers that are control tokens in the vocabulary (Mistral's `[TOOL_CALLS]`,
//! gpt-oss's `<|channel|>`) are named in the grammar by id (`<[id]>`), since no text produces
//! them; the same markers written as text where the vocabulary has no such token.

use serde_json::{json, Value};

use ferrolm_engine::constraint::Grammar;

use crate::tools::ToolFormat;

/// The id of a control token, by its text (None where the vocabulary has none).
pub type ControlTokens<'a> = &'a dyn Fn(&str) -> Option<u32>;

/// The grammar of a required call to one of `tools` (each `{"type": "function", "function":
/// {"name", "parameters"}}`); `parallel` allows several calls where the format has a way to
/// write them (gpt-oss ends its turn at a call, so one).
pub fn required_call(
    format: ToolFormat,
    tools: &[&Value],
    parallel: bool,
    control: ControlTokens<'_>,
) -> Grammar {
    let marker = |text: &str| match control(text) {
        Some(id) => format!("<[{id}]>"),
        None => literal(text),
    };
    let lark = match format {
        ToolFormat::Hermes => {
            let call = format!(
                "\"<tool_call>\\n\" {} \"\\n</tool_call>\"",
                json_call(tools, "arguments")
            );
            repeated(&call, Some("\"\\n\""), parallel)
        }
        ToolFormat::Llama3 => repeated(&json_call(tools, "parameters"), Some("\"; \""), parallel),
        ToolFormat::Mistral => {
            let mut calls = json!({
                "type": "array",
                "items": call_schemas(tools, "arguments"),
                "minItems": 1,
            });
            if !parallel {
                calls["maxItems"] = json!(1);
            }
            format!(
                "start: {} \" \"? %json {}\n",
                marker("[TOOL_CALLS]"),
                compact(calls)
            )
        }
        ToolFormat::MistralArgs => {
            let call = format!(
                "{} ({})",
                marker("[TOOL_CALLS]"),
                per_tool(tools, |name, params| format!(
                    "{} {} %json {}",
                    literal(name),
                    marker("[ARGS]"),
                    compact(params)
                ))
            );
            repeated(&call, None, parallel)
        }
        ToolFormat::GptOss => format!(
            "start: {} \"commentary to=functions.\" ({})\n",
            marker("<|channel|>"),
            per_tool(tools, |name, params| format!(
                "{} \" \" {} \"json\" {} %json {}",
                literal(name),
                marker("<|constrain|>"),
                marker("<|message|>"),
                compact(params)
            ))
        ),
    };
    Grammar::Lark(lark)
}

/// `start` as one `call`, or as calls one after another (separated by `sep`).
fn repeated(call: &str, sep: Option<&str>, parallel: bool) -> String {
    match (parallel, sep) {
        (false, _) => format!("start: {call}\n"),
        (true, Some(sep)) => format!("start: call ({sep} call)*\ncall: {call}\n"),
        (true, None) => format!("start: call+\ncall: {call}\n"),
    }
}

/// One JSON object `{"name": ..., args_key: {...}}` for any of `tools`.
fn json_call(tools: &[&Value], args_key: &str) -> String {
    format!("%json {}", compact(call_schemas(tools, args_key)))
}

/// The schema of a call object to any of `tools`, its arguments under `args_key`.
fn call_schemas(tools: &[&Value], args_key: &str) -> Value {
    let options: Vec<Value> = tools
        .iter()
        .map(|t| {
            let (name, params) = name_and_parameters(t);
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    json!({"anyOf": options})
}

/// `alternative(name, parameters)` for each tool, joined as Lark alternatives.
fn per_tool(tools: &[&Value], alternative: impl Fn(&str, Value) -> String) -> String {
    tools
        .iter()
        .map(|t| {
            let (name, params) = name_and_parameters(t);
            alternative(&name, params)
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

fn name_and_parameters(tool: &Value) -> (String, Value) {
    let f = tool.get("function").unwrap_or(tool);
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let params = f
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    (name, closed(params))
}

/// `schema` with every object that lists its `properties` but says nothing of others closed
/// to them (`additionalProperties: false`), as llama.cpp's grammars and OpenAI's strict mode
/// treat a tool's parameters: a function takes the arguments it names, and a model left free
/// to add keys can write them until it runs out of tokens. An explicit `additionalProperties`
/// (or a free-form object with no `properties`) is kept as written.
fn closed(mut schema: Value) -> Value {
    close_objects(&mut schema);
    schema
}

fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(o) => {
            if o.contains_key("properties") && !o.contains_key("additionalProperties") {
                o.insert("additionalProperties".into(), Value::Bool(false));
            }
            for (key, sub) in o.iter_mut() {
                // `const`, `enum`, `default` and `examples` hold values, not schemas.
                if !matches!(key.as_str(), "const" | "enum" | "default" | "examples") {
                    close_objects(sub);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// A schema written compactly (one line, `, ` and `: `), as the engine's JSON schemas are.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// `text` as a Lark string literal (Lark's strings are JSON's).
fn literal(text: &str) -> String {
    Value::from(text).to_string()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferrolm_engine::constraint::Constraints;
    use ferrolm_gguf::{Array, GgufFile, Metadata, Value as Meta};
    use ferrolm_tokenizer::Tokenizer;

    use super::*;
    use crate::tools::parse;

    /// The markers of Mistral's and gpt-oss's formats.
    const MARKERS: [&str; 6] = [
        "[TOOL_CALLS]",
        "[ARGS]",
        "<|channel|>",
        "<|constrain|>",
        "<|message|>",
        "<|call|>",
    ];

    /// The default model's vocabulary, with the markers added as control tokens when asked
    /// (as Mistral's and gpt-oss's vocabularies have them).
    fn tokenizer(with_markers: bool) -> Tokenizer {
        let file = GgufFile::open(crate::scheduler::tests::model_path()).unwrap();
        let mut meta = Metadata::default();
        for (k, v) in file.metadata().iter() {
            let v = match (k, v) {
                ("tokenizer.ggml.tokens", Meta::Array(Array::String(t))) if with_markers => {
                    let mut t = t.clone();
                    t.extend(MARKERS.map(String::from));
                    Meta::Array(Array::String(t))
                }
                ("tokenizer.ggml.token_type", Meta::Array(Array::I32(t))) if with_markers => {
                    let mut t = t.clone();
                    t.extend([3; MARKERS.len()]); // control
                    Meta::Array(Array::I32(t))
                }
                _ => v.clone(),
            };
            meta.insert(k, v).unwrap();
        }
        Tokenizer::from_metadata(&meta).unwrap()
    }

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "unit", "days"],
                "additionalProperties": false,
            }}}),
            json!({"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "local"]}},
                "required": ["zone"],
                "additionalProperties": false,
            }}}),
        ]
    }

    /// Whether `args` validate against the tool `name`'s parameters above.
    fn valid(name: &str, args: &Value) -> bool {
        let Some(o) = args.as_object() else {
            return false;
        };
        match name {
            "get_weather" => {
                o.len() == 3
                    && o["city"].as_str().is_some_and(|c| c.chars().count() <= 6)
                    && matches!(o["unit"].as_str(), Some("c" | "f"))
                    && o["days"].as_i64().is_some_and(|d| (1..=7).contains(&d))
            }
            "get_time" => o.len() == 1 && matches!(o["zone"].as_str(), Some("utc" | "local")),
            _ => false,
        }
    }

    /// Generates under `grammar` from random logits (the worst a model can do): the ids.
    fn generate(
        constraints: &Constraints,
        grammar: &Grammar,
        tok: &Tokenizer,
        seed: u64,
    ) -> Vec<u32> {
        let n_vocab = tok.vocab_size();
        let mut c = constraints.compile(grammar).unwrap();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut ids = Vec::new();
        for _ in 0..600 {
            if c.is_done().unwrap() {
                return ids;
            }
            let logits: Vec<f32> = (0..n_vocab)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32
                })
                .collect();
            let masked = c.mask(&logits).unwrap();
            let id = (0..n_vocab)
                .max_by(|&a, &b| masked[a].total_cmp(&masked[b]))
                .unwrap() as u32;
            if tok.eog_ids().contains(&id) {
                return ids; // allowed only where the grammar may end
            }
            c.accept(id).unwrap();
            ids.push(id);
        }
        panic!("no end after 600 tokens: {ids:?}");
    }

    #[test]
    fn required_calls_parse_back_with_valid_arguments_in_every_format() {
        let tools = tools();
        let refs: Vec<&Value> = tools.iter().collect();
        for with_markers in [true, false] {
            let tok = Arc::new(tokenizer(with_markers));
            let control = |text: &str| tok.token_id(text).filter(|&id| tok.is_special(id));
            assert_eq!(control("<|channel|>").is_some(), with_markers);
            let constraints = Constraints::new(tok.clone()).unwrap();
            for format in [
                ToolFormat::Hermes,
                ToolFormat::Llama3,
                ToolFormat::Mistral,
                ToolFormat::MistralArgs,
                ToolFormat::GptOss,
            ] {
                for (parallel, seed) in [(false, 1), (false, 2), (true, 3), (true, 4)] {
                    let grammar = required_call(format, &refs, parallel, &control);
                    let ids = generate(&constraints, &grammar, &tok, seed);
                    let text = tok.decode(&ids, true).unwrap();
                    let (_, calls) = parse(format, &text);
                    let case = format!("{format:?} markers={with_markers} parallel={parallel}");
                    assert!(!calls.is_empty(), "{case}: no call in {text:?}");
                    if !parallel || format == ToolFormat::GptOss {
                        assert_eq!(calls.len(), 1, "{case}: {text:?}");
                    }
                    for call in &calls {
                        assert!(valid(&call.name, &call.arguments), "{case}: {text:?}");
                    }
                    if with_markers && format.needs_special_text() {
                        // The marker is the control token, not text spelling it.
                        let first = if format == ToolFormat::GptOss {
                            "<|channel|>"
                        } else {
                            "[TOOL_CALLS]"
                        };
                        assert_eq!(ids.first().copied(), control(first), "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn objects_that_name_their_properties_are_closed_unless_they_say_otherwise() {
        let schema = json!({
            "type": "object",
            "properties": {
                "where": {"type": "object", "properties": {"city": {"type": "string"}}},
                "tags": {"type": "array", "items": {"properties": {"k": {}}}},
                "extra": {"type": "object"},
                "open": {"properties": {}, "additionalProperties": true},
                "fixed": {"const": {"properties": {}}},
            },
            "$defs": {"P": {"anyOf": [{"properties": {"x": {}}}]}},
        });
        let c = closed(schema);
        assert_eq!(c["additionalProperties"], json!(false));
        assert_eq!(
            c["properties"]["where"]["additionalProperties"],
            json!(false)
        );
        assert_eq!(
            c["properties"]["tags"]["items"]["additionalProperties"],
            json!(false)
        );
        assert_eq!(
            c["$defs"]["P"]["anyOf"][0]["additionalProperties"],
            json!(false)
        );
        assert!(c["properties"]["extra"]
            .get("additionalProperties")
            .is_none());
        assert_eq!(c["properties"]["open"]["additionalProperties"], json!(true));
        assert_eq!(
            c["properties"]["fixed"],
            json!({"const": {"properties": {}}})
        );
    }

    /// A tool whose schema leaves `additionalProperties` out still gets only its own keys.
    #[test]
    fn a_schema_that_does_not_close_its_object_gets_only_the_named_keys() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            }}}),
        ];
        let tok = Arc::new(tokenizer(false));
        let control = |_: &str| None;
        let constraints = Constraints::new(tok.clone()).unwrap();
        let grammar = required_call(ToolFormat::Hermes, &[&tools[0]], false, &control);
        for seed in 11..15 {
            let text = tok
                .decode(&generate(&constraints, &grammar, &tok, seed), true)
                .unwrap();
            let (_, calls) = parse(ToolFormat::Hermes, &text);
            assert_eq!(calls.len(), 1, "{text:?}");
            let args = calls[0].arguments.as_object().unwrap();
            assert!(args.keys().all(|k| k == "city" || k == "unit"), "{text:?}");
        }
    }

    #[test]
    fn a_named_function_is_the_only_one_called() {
        let tools = tools();
        let tok = Arc::new(tokenizer(true));
        let control = |text: &str| tok.token_id(text).filter(|&id| tok.is_special(id));
        let constraints = Constraints::new(tok.clone()).unwrap();
        for format in [
            ToolFormat::Mistral,
            ToolFormat::MistralArgs,
            ToolFormat::GptOss,
        ] {
            let grammar = required_call(format, &[&tools[1]], true, &control);
            for seed in 5..8 {
                let text = tok
                    .decode(&generate(&constraints, &grammar, &tok, seed), true)
                    .unwrap();
                let (_, calls) = parse(format, &text);
                assert!(!calls.is_empty(), "{format:?}: {text:?}");
                assert!(
                    calls.iter().all(|c| c.name == "get_time"),
                    "{format:?}: {text:?}"
                );
            }
        }
    }
}
