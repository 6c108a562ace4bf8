//! The default model's fetch: a failure says what failed and how to retry, and nothing partial
//! is left where a later run would take it for the model.

use std::process::Command;

#[test]
fn a_failed_fetch_names_the_failure_and_the_retry() {
    let home = std::env::temp_dir().join(format!("ferrolm-fetch-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    // No python3 on PATH: pip cannot run.
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["run", "hello"])
        .env("FERROLM_HOME", &home)
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("fetching model \"smollm2\" failed"),
        "{stderr}"
    );
    assert!(stderr.contains("ferrolm pull smollm2"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let models = home.join("models");
    let left: Vec<_> = std::fs::read_dir(&models)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&home);
}
