//! ferrolm as a library, on the default model (fetched by `scripts/test` before the tests):
//! `TokenStream` and `generate` give the same greedy text through the same backend, the text
//! `ferrolm run` prints; `bench --batch` reports every batch size asked for.

use std::path::PathBuf;
use std::process::Command;

use ferrolm::{
    generate, BackendOptions, Device, GenerateParams, LoadOptions, LoadedModel, SamplerParams,
};

fn default_model() -> PathBuf {
    std::env::var_os("FERROLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferrolm"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn a_stream_and_a_generation_give_the_text_run_prints() {
    let path = default_model();
    let model = LoadedModel::open(
        &path,
        &LoadOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let options = BackendOptions {
        device: Some(Device::Cpu),
        n_ctx: 256,
        ..Default::default()
    };
    let mut backend = model.backend(&options).unwrap();
    assert_eq!(backend.describe(), "CPU");
    let params = GenerateParams {
        max_tokens: 12,
        sampler: SamplerParams::greedy(),
        stop_at_eog: true,
    };
    let prompt = "The capital of France is";
    let streamed: Vec<String> = model
        .stream(backend.as_mut(), prompt, &params)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(streamed.len() > 1, "pieces, not one block: {streamed:?}");
    let streamed = streamed.concat();

    backend.truncate(0, 0).unwrap();
    let ids = model.tokenizer.encode_prompt(prompt);
    let whole = generate(backend.as_mut(), 0, &model.tokenizer, &ids, &params, |_| {
        true
    })
    .unwrap();
    assert_eq!(streamed, whole.text);

    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["run", "-m"])
        .arg(&path)
        .args([
            "--device", "cpu", "--temp", "0", "-n", "12", "-t", "1", "--json", prompt,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(run["text"].as_str().unwrap(), streamed);
}

#[test]
fn bench_batch_reports_every_batch_size_and_refuses_bad_ones() {
    let bench = |batch: &str| {
        Command::new(env!("CARGO_BIN_EXE_ferrolm"))
            .args(["bench", "-m"])
            .arg(default_model())
            .args([
                "--device", "cpu", "-t", "1", "-p", "4", "-n", "2", "-r", "1",
            ])
            .args(["--batch", batch, "--json"])
            .output()
            .unwrap()
    };
    let out = bench("1,3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for b in ["1", "3"] {
        for k in ["pp", "tg"] {
            let x = v["batch"][b][k].as_f64().unwrap_or(0.0);
            assert!(x > 0.0, "batch {b} {k}: {v}");
        }
    }
    assert_eq!(v["batch"].as_object().unwrap().len(), 2, "{v}");
    let bad = bench("0,2");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("each batch size is a number from 1 to 256")
    );
}
