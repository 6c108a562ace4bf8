//! Any template source: compiling and rendering it (under small bounds) gives text or an
//! error, and never panics. This renders in-process: a template that builds a huge string in
//! a few steps (doubling it) without writing it is bounded by neither fuel nor the output
//! limit, and libFuzzer's memory limit reports such inputs; the server renders in worker
//! processes under a memory limit for that reason (ferrolm-server's `template_process`).
#![no_main]

use ferrolm_tokenizer::{ChatMessage, ChatTemplate, TemplateLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let source = String::from_utf8_lossy(data);
    let Ok(template) = ChatTemplate::new(&source, "<s>", "</s>") else {
        return;
    };
    let template = template.with_limits(TemplateLimits {
        fuel: 100_000,
        max_output_bytes: 1 << 16,
    });
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = vec![serde_json::json!({
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}},
    })];
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi <|im_start|>"),
        call,
        ChatMessage::new("tool", "21"),
    ];
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    let _ = template.check();
    let _ = template.render(&messages, true, Some(&tools));
});
