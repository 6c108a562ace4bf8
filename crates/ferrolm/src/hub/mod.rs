//! Models from the Hugging Face Hub: `hf:ORG/REPO[:QUANT|/FILE.gguf]`, through the Hub's HTTP
//! API with the `hf-hub` crate, into the Hub's standard cache (shared with its other tools).
//!
//! hf-hub finds the endpoint (`HF_ENDPOINT`), the cache (`HF_HOME`, default
//! `~/.cache/huggingface`) and the token file the Hub's tools write (`$HF_HOME/token`), lists a
//! repo, follows redirects, names blobs by their ETag, downloads into a `.part` file renamed when
//! complete and resumes a cut download with a Range request. Around it, here: `HF_TOKEN`,
//! `HF_TOKEN_PATH`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and the cache as a fallback when the Hub
//! cannot be reached, the choice of file, the sha256 check against the Hub's LFS metadata
//! (hf-hub does none), and errors that name the repo and what went wrong.

mod progress;
mod reference;

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo};
use sha2::{Digest, Sha256};

pub use reference::HubRef;
use reference::{candidates, choose};

/// Retries of a download cut short (each resumes where the last one stopped).
const RETRIES: usize = 3;

/// Whether `model` is an `hf:` reference.
pub fn is_reference(model: &str) -> bool {
    model.starts_with("hf:")
}

/// A file of a repo as the Hub lists it.
#[derive(Clone, Debug)]
struct RemoteFile {
    path: String,
    /// The sha256 of its content, for files stored with LFS.
    sha256: Option<String>,
}

/// The Hub client and what it was built from.
struct Hub {
    api: Api,
    cache: Cache,
    endpoint: String,
    has_token: bool,
}

impl Hub {
    fn from_env() -> Result<Hub> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let mut builder = ApiBuilder::from_env()
            .with_progress(false)
            .with_retries(RETRIES);
        if let Some(endpoint) = env("HF_ENDPOINT") {
            // `https://host/` and `https://host` are the same endpoint.
            builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
        }
        let mut cache = Cache::from_env();
        if let Some(dir) = env("HF_HUB_CACHE") {
            cache = Cache::new(PathBuf::from(&dir));
            builder = builder.with_cache_dir(PathBuf::from(dir));
        }
        // HF_TOKEN wins over the token file, as with the Hub's own tools.
        let token = env("HF_TOKEN")
            .map(|t| t.trim().to_string())
            .or_else(cache_token);
        let has_token = token.is_some();
        builder = builder.with_token(token);
        let endpoint = env("HF_ENDPOINT").unwrap_or_else(|| "the Hugging Face Hub".into());
        Ok(Hub {
            api: builder.build().context("setting up the Hub client")?,
            cache,
            endpoint,
            has_token,
        })
    }

    /// An error of the Hub's answer to `what`, naming the repo and what to do.
    fn explain(&self, repo: &str, what: &str, e: ureq::Error) -> anyhow::Error {
        match e {
            ureq::Error::Status(code, resp) => {
                let error_code = resp.header("x-error-code").unwrap_or("").to_string();
                let hint = "set HF_TOKEN, or log in with the Hub's tools (token file \
                            $HF_HOME/token)";
                match (code, error_code.as_str()) {
                    (_, "GatedRepo") => anyhow!(
                        "hf:{repo} is gated (HTTP {code}): accept its terms on the Hub, then {hint}"
                    ),
                    (404, _) | (_, "RepoNotFound") => anyhow!(
                        "hf:{repo}: no such repo at {} (HTTP {code}); a private repo needs a \
                         token: {hint}",
                        self.endpoint
                    ),
                    (401 | 403, _) if !self.has_token => anyhow!(
                        "hf:{repo}: {what}: HTTP {code} without a token: the repo is private or \
                         gated; {hint}"
                    ),
                    (401 | 403, _) => anyhow!(
                        "hf:{repo}: {what}: HTTP {code}: the Hub refused the token (HF_TOKEN or \
                         the token file)"
                    ),
                    (code, _) => anyhow!("hf:{repo}: {what}: HTTP {code}"),
                }
            }
            ureq::Error::Transport(t) => {
                anyhow!("hf:{repo}: {what}: cannot reach {}: {t}", self.endpoint)
            }
        }
    }

    fn explain_api(&self, repo: &str, what: &str, e: ApiError) -> anyhow::Error {
        match e {
            ApiError::RequestError(e) => self.explain(repo, what, *e),
            ApiError::TooManyRetries(e) => self
                .explain_api(repo, what, *e)
                .context(format!("gave up after {RETRIES} retries")),
            e => anyhow!("hf:{repo}: {what}: {e}"),
        }
    }

    /// The repo's files, from the Hub.
    fn list(&self, repo: &str) -> Result<Vec<RemoteFile>, Box<ureq::Error>> {
        let text = self
            .api
            .model(repo.to_string())
            .info_request()
            .query("blobs", "true")
            .call()
            .map_err(Box::new)?
            .into_string()
            .unwrap_or_default();
        // An answer that is not the listing lists nothing: "no GGUF file" follows.
        let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let files = json["siblings"]
            .as_array()
            .map(|s| s.as_slice())
            .unwrap_or_default()
            .iter()
            .filter_map(|f| {
                Some(RemoteFile {
                    path: safe_path(f["rfilename"].as_str()?)?.to_string(),
                    sha256: f["lfs"]["sha256"].as_str().map(str::to_ascii_lowercase),
                })
            })
            .collect();
        Ok(files)
    }

    /// The files of the repo's snapshot in the cache, for when the Hub cannot be reached.
    fn cached(&self, repo: &str) -> Option<(PathBuf, Vec<RemoteFile>)> {
        let dir = self
            .cache
            .path()
            .join(Repo::model(repo.to_string()).folder_name());
        let commit = std::fs::read_to_string(dir.join("refs").join("main")).ok()?;
        let snapshot = dir.join("snapshots").join(commit.trim());
        let mut files = Vec::new();
        walk(&snapshot, &snapshot, &mut files);
        Some((snapshot, files))
    }

    /// The local path of `file` of `repo`: from the cache when it holds the content the Hub
    /// lists, downloaded otherwise; checked against the LFS sha256 either way.
    fn fetch(&self, repo: &str, file: &RemoteFile) -> Result<PathBuf> {
        let cached = self
            .cache
            .repo(Repo::model(repo.to_string()))
            .get(&file.path);
        if let Some(path) = cached {
            match &file.sha256 {
                // The cache names LFS blobs by their sha256 (the Hub's ETag for them).
                Some(sha) if blob_name(&path).as_deref() == Some(sha.as_str()) => return Ok(path),
                Some(sha) if sha256_of(&path)? == *sha => return Ok(path),
                Some(_) => {} // another version of the file: download the listed one
                None => return Ok(path),
            }
        }
        let path = self
            .api
            .model(repo.to_string())
            .download_with_progress(&file.path, progress::DownloadProgress::new(&file.path))
            .map_err(|e| self.explain_api(repo, &format!("downloading {}", file.path), e))?;
        if let Some(sha) = &file.sha256 {
            let got = sha256_of(&path)?;
            if got != *sha {
                // hf-hub has already moved it under its final name: take it out again.
                if let Ok(blob) = std::fs::canonicalize(&path) {
                    let _ = std::fs::remove_file(blob);
                }
                let _ = std::fs::remove_file(&path);
                bail!(
                    "hf:{repo}: {} downloaded with sha256 {got}, but the Hub lists {sha}; the \
                     download was removed, try again",
                    file.path
                );
            }
        }
        Ok(path)
    }
}

/// A repo path from the listing, if it stays inside the repo: the cache joins it to its own
/// folders, so `..`, absolute paths and backslashes from a hostile server are dropped.
fn safe_path(path: &str) -> Option<&str> {
    let inside = !path.is_empty()
        && !path.starts_with('/')
        && !path.contains('\\')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    inside.then_some(path)
}

/// The token file the Hub's tools write: `$HF_TOKEN_PATH`, else `$HF_HOME/token` (default
/// `~/.cache/huggingface/token`).
fn cache_token() -> Option<String> {
    let path = std::env::var_os("HF_TOKEN_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|| Cache::from_env().token_path());
    let token = std::fs::read_to_string(path).ok()?;
    Some(token.trim().to_string()).filter(|t| !t.is_empty())
}

/// Every file under `dir`, as paths relative to `root` with `/` between parts.
fn walk(root: &Path, dir: &Path, out: &mut Vec<RemoteFile>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            walk(root, &path, out);
        } else if let Ok(rel) = path.strip_prefix(root) {
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push(RemoteFile {
                path: parts.join("/"),
                sha256: None,
            });
        }
    }
}

/// The file name of the blob a cache pointer links to.
fn blob_name(pointer: &Path) -> Option<String> {
    let blob = std::fs::canonicalize(pointer).ok()?;
    Some(blob.file_name()?.to_str()?.to_ascii_lowercase())
}

/// The sha256 of a file's content, in lowercase hex.
fn sha256_of(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The local path of the model `reference` names (of a shard set, its first shard), downloaded
/// into the Hub's cache if it is not there yet.
pub fn resolve(reference: &str) -> Result<PathBuf> {
    let r = HubRef::parse(reference)?;
    let hub = Hub::from_env()?;
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v == "true");
    let listing = if offline {
        Err(anyhow!("HF_HUB_OFFLINE is set"))
    } else {
        match hub.list(&r.repo) {
            Ok(files) => Ok(files),
            Err(e) if matches!(*e, ureq::Error::Transport(_)) => {
                Err(hub.explain(&r.repo, "listing files", *e))
            }
            Err(e) => return Err(hub.explain(&r.repo, "listing files", *e)),
        }
    };
    match listing {
        Ok(files) => {
            let names: Vec<String> = files.iter().map(|f| f.path.clone()).collect();
            let chosen = choose(&r.repo, &candidates(&names), &r.pick)?;
            let mut first = None;
            for name in &chosen.files {
                let file = files
                    .iter()
                    .find(|f| f.path == *name)
                    .expect("chosen among the listed files");
                let path = hub.fetch(&r.repo, file)?;
                first.get_or_insert(path);
            }
            Ok(first.expect("a candidate has at least one file"))
        }
        // Without the Hub, a model cached before still runs.
        Err(why) => {
            let Some((snapshot, files)) = hub.cached(&r.repo) else {
                bail!("{why:#}; and hf:{} is not in the cache", r.repo);
            };
            let names: Vec<String> = files.into_iter().map(|f| f.path).collect();
            let chosen = choose(&r.repo, &candidates(&names), &r.pick)
                .with_context(|| format!("{why:#}; looking in the cache instead"))?;
            eprintln!("ferrolm: {why:#}; using the cached copy");
            Ok(snapshot.join(chosen.name()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::safe_path;

    #[test]
    fn listed_paths_must_stay_inside_the_repo() {
        assert_eq!(
            safe_path("Q4_K_M/m-00001-of-00002.gguf"),
            Some("Q4_K_M/m-00001-of-00002.gguf")
        );
        for bad in [
            "../x.gguf",
            "a/../../x.gguf",
            "/etc/x.gguf",
            "a\\..\\x.gguf",
            "a//b.gguf",
            "./a.gguf",
            "",
        ] {
            assert_eq!(safe_path(bad), None, "{bad}");
        }
    }
}
