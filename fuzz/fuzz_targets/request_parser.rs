//! Any body: parsing and validating it as an OpenAI chat or completion request or an
//! Anthropic Messages request, and reading tool calls out of it as model output, give a
//! request or an error, and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferrolm_server::fuzzing::parse_request(data);
});
