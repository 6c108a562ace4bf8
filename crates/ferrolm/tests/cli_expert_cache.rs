//! `--expert-cache`: a mixture-of-experts model with its experts streamed from the file gives
//! the same tokens and the same per-layer expert counts as with its experts mapped, and
//! reports its cache's counters; a cache too small for one token's experts is refused.

use std::process::{Command, Output};

fn ferrolm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> Output {
    let out = ferrolm(args);
    assert!(
        out.status.success(),
        "ferrolm {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

struct TempDir(std::path::PathBuf);

impl TempDir {
    /// A fresh directory `ferrolm-{tag}-{pid}` under the system's temporary directory.
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("ferrolm-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn streamed_and_resident_runs_agree_token_for_token_and_count_for_count() {
    let dir = TempDir::new("expert-cache");
    // 16 experts a layer of about 0.15 MB (gate, up and down of 256 x 256, mixed types): a
    // 1 MB cache holds 6 of the 48, so experts are evicted all the time.
    let model = dir.0.join("qwen3moe.gguf");
    let model = model.to_str().unwrap();
    ok(&[
        "synth",
        "--arch",
        "qwen3moe",
        "--layers",
        "3",
        "--experts",
        "16",
        "-o",
        model,
    ]);
    let run = |cache: &str| {
        let out = ok(&[
            "run",
            "-m",
            model,
            "-t",
            "2",
            "-n",
            "12",
            "--temp",
            "0",
            "--expert-stats",
            "--expert-cache",
            cache,
            "--json",
            "the quick brown fox jumps over the lazy dog",
        ]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (resident, resident_err) = run("0");
    let (streamed, streamed_err) = run("1");
    assert_eq!(resident["tokens"], streamed["tokens"]);
    assert_eq!(resident["expert_counts"], streamed["expert_counts"]);
    let counts = resident["expert_counts"].as_array().unwrap();
    assert_eq!(counts.len(), 3);
    assert!(resident.get("expert_cache").is_none());
    assert!(
        !resident_err.contains("streaming experts"),
        "{resident_err}"
    );

    let cache = &streamed["expert_cache"];
    let (hits, misses) = (
        cache["hits"].as_u64().unwrap(),
        cache["misses"].as_u64().unwrap(),
    );
    assert_eq!(cache["cache_bytes"].as_u64(), Some(1 << 20));
    assert!(misses > 0 && misses > hits, "{cache}");
    assert!(
        cache["bytes_read"].as_u64().unwrap() >= misses * 100_000,
        "{cache}"
    );
    assert!(
        streamed_err.contains("streaming experts") && streamed_err.contains("1 MB cache"),
        "{streamed_err}"
    );

    // Without --json: the per-layer lines, then the cache's line.
    let out = ok(&[
        "run",
        "-m",
        model,
        "-n",
        "2",
        "--temp",
        "0",
        "--expert-stats",
        "--expert-cache",
        "1",
        "hello",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("experts of layer").count(), 3, "{err}");
    assert!(err.contains("misses, hit rate"), "{err}");

    // Experts of 256 x 4096: two of them (one token's) need about 6.5 MB.
    let wide = dir.0.join("wide.gguf");
    let wide = wide.to_str().unwrap();
    ok(&[
        "synth", "--arch", "qwen3moe", "--layers", "1", "--ff", "4096", "-o", wide,
    ]);
    let out = ferrolm(&["run", "-m", wide, "-n", "1", "--expert-cache", "2", "hi"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("expert cache of 2097152 bytes cannot hold one token's experts"),
        "{err}"
    );
}

/// `ferrolm bench` with experts streamed: its own peak RSS stays within the cache, the dense
/// weights and an overhead, well under a run with the experts mapped (which touches all of
/// them), and it reports the cache's counters.
#[test]
fn bench_streamed_peak_rss_stays_within_cache_plus_dense_part() {
    let dir = TempDir::new("expert-bench");
    // 2 layers of 16 experts of 512 x 1024 in Q8_0: 51 MB of experts, 2 MB dense.
    let model = dir.0.join("moe.gguf");
    let model = model.to_str().unwrap();
    ok(&[
        "synth",
        "--arch",
        "qwen3moe",
        "--layers",
        "2",
        "--embd",
        "512",
        "--ff",
        "1024",
        "--experts",
        "16",
        "--experts-used",
        "8",
        "--type",
        "q8_0",
        "-o",
        model,
    ]);
    let bench = |cache: &str| -> serde_json::Value {
        let out = ok(&[
            "bench",
            "-m",
            model,
            "-p",
            "16",
            "-n",
            "4",
            "-r",
            "1",
            "-t",
            "2",
            "--expert-cache",
            cache,
            "--json",
        ]);
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let mb = |v: &serde_json::Value| v["peak_rss_bytes"].as_u64().unwrap() as f64 / 1048576.0;
    let streamed = bench("16");
    let resident = bench("0");
    let cache = &streamed["expert_cache"];
    let expert_mb = cache["expert_bytes"].as_u64().unwrap() as f64 / 1048576.0;
    assert!(expert_mb > 45.0, "{cache}");
    assert!(cache["misses"].as_u64().unwrap() > 0, "{cache}");
    assert!(resident.get("expert_cache").is_none());
    assert!(streamed["pp16"].as_f64().unwrap() > 0.0);
    assert_eq!(
        streamed["pp16_sd"].as_f64(),
        Some(0.0),
        "one repetition: no spread"
    );
    // The dense part is about 2 MB; 64 MB covers the binary, stacks, KV cache and activations.
    let (s, r) = (mb(&streamed), mb(&resident));
    assert!(s <= 16.0 + 2.0 + 64.0, "streamed peak RSS {s:.1} MB");
    assert!(
        r > s + 0.5 * expert_mb,
        "resident {r:.1} MB, streamed {s:.1} MB"
    );
}
