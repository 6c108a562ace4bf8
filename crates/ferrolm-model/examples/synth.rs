//! Writes `SyntheticSpec::small(ARCH)` to a file (what `ferrolm synth --arch ARCH` writes), for
//! scripts/synthetic_golden.py --ferrolm example.
//!
//! usage: cargo run --release -p ferrolm-model --example synth -- ARCH OUT.gguf

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let spec = ferrolm_model::synthetic::SyntheticSpec::small(&args[1]);
    ferrolm_model::synthetic::write(&spec, &args[2]).expect("write");
}
