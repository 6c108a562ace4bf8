//! The request parsing and validation that a fuzz target drives (`fuzz/`): every path from
//! body bytes to a prepared request that needs no model. Not a stable interface.

use serde_json::Value;

use crate::api;

/// Parses `body` as each endpoint's request and runs the validation that follows parsing.
/// Any input must give `Ok` or an error, never a panic.
pub fn parse_request(body: &[u8]) {
    if let Ok(req) = api::parse::<api::ChatRequest>(body) {
        let _ = api::grammar_of(&req.common);
        for template in [
            "",
            "<tool_call>",
            "[TOOL_CALLS]",
            "[TOOL_CALLS][ARGS]",
            "<|python_tag|>",
            "<|channel|>",
        ] {
            let _ = api::tool_plan(&req, template, &|_| None);
        }
        let _ = api::chat_messages(&req.messages, true);
        let _ = api::chat_messages(&req.messages, false);
        let _ = api::prepare(&req.common, api::Endpoint::Chat, vec![1; 8], "m", 64);
    }
    if let Ok(req) = api::parse::<api::CompletionRequest>(body) {
        let _ = api::prepare(&req.common, api::Endpoint::Completion, vec![1; 8], "m", 64);
    }
    let _ = crate::anthropic::parse_request(body);
    let text = String::from_utf8_lossy(body);
    use crate::tools::ToolFormat;
    const FORMATS: [ToolFormat; 5] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::MistralArgs,
        ToolFormat::GptOss,
    ];
    for format in FORMATS {
        let _ = crate::tools::parse(format, &text);
    }
    if let Ok(Value::Array(tools)) = serde_json::from_slice::<Value>(body) {
        let refs: Vec<&Value> = tools.iter().collect();
        for format in FORMATS {
            let _ = crate::tool_grammar::required_call(format, &refs, true, &|_| Some(7));
        }
        let _ = crate::tools::describe(&tools);
    }
}

#[cfg(test)]
mod tests {
    /// The fuzz target's seeds, and every prefix of each (truncated bodies), parse or fail
    /// cleanly: CI runs what the fuzzer starts from.
    #[test]
    fn the_fuzz_seeds_and_their_prefixes_never_panic() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fuzz/corpus/request_parser"
        );
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            for end in 0..=bytes.len() {
                super::parse_request(&bytes[..end]);
            }
            n += 1;
        }
        assert!(n >= 3, "{n} seeds in {dir}");
    }
}
