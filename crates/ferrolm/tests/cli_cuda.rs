//! `--device` on a machine without CUDA (CI): asking for CUDA is a clear one-line error that
//! names what is missing; the default is the CPU, and loads no CUDA library in a way that fails.

use std::path::PathBuf;
use std::process::Command;

use ferrolm_gguf::TensorType;
use ferrolm_model::synthetic::{self, SyntheticSpec};

/// A one-layer llama of Q8_0 matrices (a model the CUDA path serves).
fn model_file(name: &str) -> PathBuf {
    model_file_with(name, |_| {})
}

fn model_file_with(name: &str, edit: impl FnOnce(&mut SyntheticSpec)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrolm-cli-cuda-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = SyntheticSpec::small("llama");
    s.n_layer = 1;
    s.n_ctx = 64;
    s.types = Vec::new();
    s.default_type = TensorType::Q8_0;
    edit(&mut s);
    let path = dir.join("m.gguf");
    synthetic::write(&s, &path).unwrap();
    path
}

fn ferrolm(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap()
}

fn no_cuda_here() -> bool {
    ferrolm_cuda::device_count().map_or(true, |n| n == 0)
}

#[test]
fn asking_for_cuda_without_it_is_a_clear_error() {
    if !no_cuda_here() {
        eprintln!("skipped: this machine has a CUDA device");
        return;
    }
    let m = model_file("explicit");
    let m = m.to_str().unwrap();
    for args in [
        vec![
            "bench", "-m", m, "--device", "cuda", "-p", "4", "-n", "4", "-r", "1",
        ],
        vec![
            "logits",
            "-m",
            m,
            "--device",
            "cuda:1",
            "--ids",
            "1,2",
            "-o",
            "/dev/null",
        ],
        vec!["run", "-m", m, "--device", "cuda", "-n", "2", "hi"],
        vec!["chat", "-m", m, "--device", "cuda"],
        vec!["serve", "-m", m, "--device", "cuda:0", "--port", "1"],
        vec!["cuda-check", "-m", m, "-p", "4", "-n", "2"],
    ] {
        let out = ferrolm(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains("CUDA is not available"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn the_default_device_is_the_cpu_without_cuda() {
    if !no_cuda_here() {
        eprintln!("skipped: this machine has a CUDA device");
        return;
    }
    let m = model_file("default");
    let out = ferrolm(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "4",
        "-n",
        "4",
        "-r",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("| CPU |"));
    let out = ferrolm(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--device",
        "cpu",
        "-p",
        "4",
        "-n",
        "0",
        "-r",
        "1",
    ]);
    assert!(out.status.success());
}

#[test]
fn a_bad_device_name_is_an_error() {
    let m = model_file("bad");
    let out = ferrolm(&["bench", "-m", m.to_str().unwrap(), "--device", "tpu"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cpu, cuda or cuda:N"));
}

#[test]
fn a_model_the_cuda_path_declines_runs_on_the_cpu_naming_the_field() {
    // Gemma 2 with heads of 48 dimensions: the CUDA kernels take multiples of 32.
    let m = model_file_with("declined", |s| {
        let mut g = SyntheticSpec::small("gemma2");
        g.n_layer = 1;
        g.n_ctx = 64;
        *s = g;
    });
    let out = ferrolm(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--device",
        "cuda",
        "-p",
        "4",
        "-n",
        "4",
        "-r",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("the CUDA path does not serve") && err.contains("; running on the CPU"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("| CPU |"));
}
