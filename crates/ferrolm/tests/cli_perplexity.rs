//! `ferrolm perplexity` against llama.cpp's figures on the packaged models and a committed text
//! (`scripts/perplexity_golden.py`), its KL-divergence mode, and its refusals.

use std::process::{Command, Output};

use support::ok;

mod support;

const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/perplexity.txt");

fn ferrolm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap()
}

fn golden() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/perplexity.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The `(PPL, uncertainty)` of a "Final estimate: PPL = X +/- Y" line.
fn estimate(stdout: &str) -> (f64, f64) {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Final estimate: PPL = "))
        .unwrap_or_else(|| panic!("no final estimate in {stdout}"));
    let (x, y) = line.split_once(" +/- ").unwrap();
    (x.parse().unwrap(), y.parse().unwrap())
}

/// The first number after the colon of the statistics line that starts with `name`.
fn statistic(out: &str, name: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name:?} in {out}"));
    let v = line.split(':').nth(1).unwrap().trim();
    v.split_whitespace().next().unwrap().parse().unwrap()
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!(
        ((got - want) / want).abs() < 1e-3,
        "{what}: {got} against llama.cpp's {want}"
    );
}

#[test]
fn smollm2_perplexity_is_llama_cpp_s() {
    let g = &golden()["models"]["smollm2"];
    let out = ok(ferrolm(&["perplexity", "-f", TEXT, "-c", "512", "-t", "2"]));
    let (ppl, unc) = estimate(&out);
    assert_close(ppl, g["ppl"].as_f64().unwrap(), "PPL");
    assert_close(unc, g["ppl_uncertainty"].as_f64().unwrap(), "uncertainty");
}

/// Gemma 3 270M with llama.cpp's default kernels (its Q4_K matrices repacked, its tiled K-quant
/// batches) and, with `--no-repack --no-tiled`, with both off.
#[test]
fn gemma3_perplexity_is_llama_cpp_s_with_and_without_repacking() {
    let gemma = &golden()["models"]["gemma3"];
    for (g, flags) in [
        (gemma, &[][..]),
        (&gemma["no_repack"], &["--no-repack", "--no-tiled"][..]),
    ] {
        let mut args = vec![
            "perplexity",
            "-m",
            "gemma3",
            "-f",
            TEXT,
            "-c",
            "256",
            "--chunks",
            "4",
            "-t",
            "2",
        ];
        args.extend(flags);
        let (ppl, unc) = estimate(&ok(ferrolm(&args)));
        assert_close(ppl, g["ppl"].as_f64().unwrap(), "PPL");
        assert_close(unc, g["ppl_uncertainty"].as_f64().unwrap(), "uncertainty");
    }
}

#[test]
fn kl_divergence_against_a_saved_base() {
    let dir = std::env::temp_dir().join(format!("ferrolm-kld-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("smollm2.kld");
    let base_s = base.to_str().unwrap();
    let g = &golden()["models"]["smollm2"];
    let out = ok(ferrolm(&[
        "perplexity",
        "-f",
        TEXT,
        "-c",
        "512",
        "--chunks",
        "2",
        "--kl-divergence-base",
        base_s,
    ]));
    estimate(&out);
    // The same model against its own saved distributions: no divergence, the same top tokens.
    let out = ok(ferrolm(&[
        "perplexity",
        "--kl-divergence-base",
        base_s,
        "--kl-divergence",
    ]));
    let field = |name: &str| statistic(&out, name);
    assert!(field("Mean    KLD").abs() < 1e-5, "{out}");
    assert!(field("Maximum KLD") < 1e-3, "{out}");
    assert_eq!(field("Same top p"), 100.0, "{out}");
    // Two chunks of llama.cpp's running value.
    assert_close(
        field("Mean PPL(base)"),
        g["running"][1].as_f64().unwrap(),
        "PPL(base)",
    );
    // Another vocabulary, and a truncated file, are refused by name.
    let e = String::from_utf8(
        ferrolm(&[
            "perplexity",
            "-m",
            "gemma3",
            "--kl-divergence-base",
            base_s,
            "--kl-divergence",
        ])
        .stderr,
    )
    .unwrap();
    assert!(e.contains("vocabulary of 49152"), "{e}");
    let bytes = std::fs::read(&base).unwrap();
    std::fs::write(&base, &bytes[..bytes.len() - 10]).unwrap();
    let e = String::from_utf8(
        ferrolm(&[
            "perplexity",
            "--kl-divergence-base",
            base_s,
            "--kl-divergence",
        ])
        .stderr,
    )
    .unwrap();
    assert!(e.contains("smollm2.kld") && e.contains("needs"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_text_too_short_for_the_context_is_refused() {
    let e = String::from_utf8(ferrolm(&["perplexity", "-f", TEXT, "-c", "2048"]).stderr).unwrap();
    assert!(
        e.contains("1711 tokens") && e.contains("at least 4096"),
        "{e}"
    );
}

/// SmolLM2 Q4_1 as the base, its Q8_0 (quantized by ferrolm from its F16 form, the bytes
/// llama-quantize writes) compared with it: llama.cpp's statistics on the same files.
#[test]
fn kl_divergence_of_a_requantized_model_is_llama_cpp_s() {
    let g = &golden()["kl_smollm2_q4_1_vs_q8_0"];
    let dir = std::env::temp_dir().join(format!("ferrolm-kld-q8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (f16, q8, base) = (path("f16.gguf"), path("q8_0.gguf"), path("base.kld"));
    ok(ferrolm(&[
        "quantize",
        "smollm2",
        &f16,
        "f16",
        "--allow-requantize",
    ]));
    ok(ferrolm(&["quantize", &f16, &q8, "q8_0"]));
    ok(ferrolm(&[
        "perplexity",
        "-f",
        TEXT,
        "-c",
        "512",
        "--chunks",
        "2",
        "--kl-divergence-base",
        &base,
    ]));
    let out = ok(ferrolm(&[
        "perplexity",
        "-m",
        &q8,
        "--kl-divergence-base",
        &base,
        "--kl-divergence",
    ]));
    let field = |name: &str| statistic(&out, name);
    let want = |k: &str| g[k].as_f64().unwrap();
    let kld = field("Mean    KLD");
    assert!(
        kld > 0.0 && ((kld - want("mean_kld")) / want("mean_kld")).abs() < 0.01,
        "{kld} vs {g}"
    );
    assert!(
        (field("Same top p") / 100.0 - want("same_top")).abs() < 0.005,
        "{out} vs {g}"
    );
    assert_close(field("Mean PPL(Q)"), want("ppl"), "PPL(Q)");
    assert_close(field("Mean PPL(base)"), want("ppl_base"), "PPL(base)");
    std::fs::remove_dir_all(&dir).unwrap();
}
