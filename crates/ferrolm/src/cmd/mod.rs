//! One module per subcommand.

pub mod bench;
pub mod chat;
pub mod common;
pub mod cuda;
pub mod inspect;
pub mod logits;
pub mod perplexity;
pub mod quantize;
pub mod run;
pub mod serve;
pub mod synth;
pub mod synth_shape;
pub mod telemetry;
pub mod tokenize;
