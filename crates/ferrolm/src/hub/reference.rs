//! `hf:` model references and the choice of file(s) they name among a repo's files.

use anyhow::{bail, Result};

/// What an `hf:` reference names in its repo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pick {
    /// `hf:ORG/REPO`: the repo's one GGUF, or its Q4_K_M when it has several.
    Default,
    /// `hf:ORG/REPO:QUANT`: the file or shard set whose name carries QUANT (any case).
    Quant(String),
    /// `hf:ORG/REPO/FILE.gguf`: that file (and its other shards, if it is a first shard).
    File(String),
}

/// A parsed `hf:ORG/REPO[:QUANT|/FILE.gguf]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubRef {
    /// `ORG/REPO`.
    pub repo: String,
    /// Which file(s) of it.
    pub pick: Pick,
}

/// The quantization picked when a repo has several and the reference names none.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

impl HubRef {
    /// Parses a reference that starts with `hf:`.
    pub fn parse(reference: &str) -> Result<HubRef> {
        let Some(rest) = reference.strip_prefix("hf:") else {
            bail!("{reference:?} is not an hf: reference");
        };
        let usage = || {
            format!(
                "bad model reference {reference:?}: expected hf:ORG/REPO, hf:ORG/REPO:QUANT or \
                 hf:ORG/REPO/FILE.gguf"
            )
        };
        let (repo_and_file, quant) = match rest.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let mut parts = repo_and_file.splitn(3, '/');
        let (Some(org), Some(name)) = (parts.next(), parts.next()) else {
            bail!(usage());
        };
        let valid = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                && !s.starts_with('.')
        };
        if !valid(org) || !valid(name) {
            bail!(usage());
        }
        let repo = format!("{org}/{name}");
        let pick = match (parts.next(), quant) {
            (None, None) => Pick::Default,
            (None, Some(q)) if valid(q) => Pick::Quant(q.to_string()),
            (Some(file), None)
                if file.to_ascii_lowercase().ends_with(".gguf")
                    && !file.split('/').any(|c| c.is_empty() || c == "..") =>
            {
                Pick::File(file.to_string())
            }
            _ => bail!(usage()),
        };
        Ok(HubRef { repo, pick })
    }
}

/// A GGUF file in a repo, or a set of shards (the first one first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The repo paths of its files, in shard order.
    pub files: Vec<String>,
}

impl Candidate {
    /// The path shown for it: the file, or the first shard.
    pub fn name(&self) -> &str {
        &self.files[0]
    }

    /// Its quantization, as its name spells it (`Q4_K_M`, `F16`), if its name carries one.
    pub fn quant(&self) -> Option<String> {
        quant_of(self.name())
    }
}

/// `(prefix, no, count)` of a shard named `PREFIX-0000N-of-0000M.gguf` (no and count from 1).
pub fn shard_of(path: &str) -> Option<(&str, u32, u32)> {
    let stem = path.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    let (no, count) = (no.parse().ok()?, count.parse().ok()?);
    (no >= 1 && no <= count).then_some((prefix, no, count))
}

/// The repo's GGUF models: single files and complete shard sets (a set missing a shard is left
/// out), in the order of their names; projector files (`mmproj`) are not models.
pub fn candidates(paths: &[String]) -> Vec<Candidate> {
    let mut ggufs: Vec<&str> = paths
        .iter()
        .map(String::as_str)
        .filter(|p| p.to_ascii_lowercase().ends_with(".gguf"))
        .filter(|p| !p.to_ascii_lowercase().contains("mmproj"))
        .collect();
    ggufs.sort();
    let mut out = Vec::new();
    for p in &ggufs {
        match shard_of(p) {
            None => out.push(Candidate {
                files: vec![p.to_string()],
            }),
            Some((prefix, 1, count)) => {
                let files: Vec<String> = (1..=count)
                    .map(|k| format!("{prefix}-{k:05}-of-{count:05}.gguf"))
                    .collect();
                if files.iter().all(|f| ggufs.contains(&f.as_str())) {
                    out.push(Candidate { files });
                }
            }
            Some(_) => {} // a later shard: part of its first shard's set
        }
    }
    out
}

/// The quantization a file name carries: the last `-`/`.`-separated part of its name (less
/// `.gguf` and any shard suffix) that reads like one.
pub fn quant_of(path: &str) -> Option<String> {
    let base = path.rsplit('/').next().unwrap_or(path);
    let stem = match shard_of(base) {
        Some((prefix, _, _)) => prefix,
        None => base.strip_suffix(".gguf").unwrap_or(base),
    };
    stem.split(['-', '.'])
        .rfind(|part| looks_like_quant(part))
        .map(|q| q.to_string())
}

fn looks_like_quant(part: &str) -> bool {
    let up = part.to_ascii_uppercase();
    let digit_after = |prefix: &str| {
        up.strip_prefix(prefix)
            .and_then(|r| r.chars().next())
            .is_some_and(|c| c.is_ascii_digit())
    };
    ["F16", "BF16", "F32"].contains(&up.as_str())
        || digit_after("Q")
        || digit_after("IQ")
        || digit_after("TQ")
        || up.starts_with("MXFP4")
}

/// Whether `quant` appears in `path` (any case) as a whole part, not the start of a longer one
/// (`Q4_K` is not in `model-Q4_K_M.gguf`).
fn carries(path: &str, quant: &str) -> bool {
    let hay = path.to_ascii_lowercase();
    let needle = quant.to_ascii_lowercase();
    let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    hay.match_indices(&needle).any(|(i, _)| {
        !word(hay[..i].chars().next_back()) && !word(hay[i + needle.len()..].chars().next())
    })
}

/// The candidate `pick` names among `candidates` of `repo`, or an error saying what the repo has.
pub fn choose(repo: &str, candidates: &[Candidate], pick: &Pick) -> Result<Candidate> {
    if candidates.is_empty() {
        bail!("hf:{repo} has no GGUF file");
    }
    let listed = || {
        let quants: Vec<String> = candidates
            .iter()
            .map(|c| c.quant().unwrap_or_else(|| c.name().to_string()))
            .collect();
        quants.join(", ")
    };
    let one = |found: Vec<&Candidate>, what: &str| -> Result<Candidate> {
        match found.as_slice() {
            [c] => Ok((*c).clone()),
            [] => bail!("hf:{repo} has no GGUF {what}; it has: {}", listed()),
            many => {
                let names: Vec<&str> = many.iter().map(|c| c.name()).collect();
                bail!(
                    "hf:{repo} has several GGUFs {what}: {}; name one with hf:{repo}/FILE.gguf",
                    names.join(", ")
                )
            }
        }
    };
    match pick {
        Pick::Default if candidates.len() == 1 => Ok(candidates[0].clone()),
        Pick::Default => {
            let q4km: Vec<&Candidate> = candidates
                .iter()
                .filter(|c| carries(c.name(), DEFAULT_QUANT))
                .collect();
            if q4km.is_empty() {
                bail!(
                    "hf:{repo} has several GGUFs and no {DEFAULT_QUANT}; pick one with \
                     hf:{repo}:QUANT (it has: {})",
                    listed()
                );
            }
            one(q4km, &format!("of quantization {DEFAULT_QUANT}"))
        }
        Pick::Quant(q) => one(
            candidates.iter().filter(|c| carries(c.name(), q)).collect(),
            &format!("of quantization {q}"),
        ),
        Pick::File(f) => one(
            candidates.iter().filter(|c| c.name() == f).collect(),
            &format!("named {f} (or it is not a first shard)"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn references_parse_or_say_what_is_expected() {
        let r = HubRef::parse("hf:org/repo").unwrap();
        assert_eq!((r.repo.as_str(), r.pick), ("org/repo", Pick::Default));
        let r = HubRef::parse("hf:org/repo:q4_k_m").unwrap();
        assert_eq!(r.pick, Pick::Quant("q4_k_m".into()));
        let r = HubRef::parse("hf:org/repo/sub/model-Q8_0.gguf").unwrap();
        assert_eq!(r.pick, Pick::File("sub/model-Q8_0.gguf".into()));
        for bad in [
            "hf:org",
            "hf:/repo",
            "hf:org/repo:",
            "hf:org/repo/model.bin",
            "hf:org/repo/../x.gguf",
            "hf:org/re po",
            "hf:org/repo/x.gguf:Q4_0",
        ] {
            let e = HubRef::parse(bad).unwrap_err().to_string();
            assert!(e.contains("hf:ORG/REPO"), "{bad}: {e}");
        }
    }

    #[test]
    fn shards_group_and_incomplete_sets_are_left_out() {
        let c = candidates(&names(&[
            "README.md",
            "m-Q8_0.gguf",
            "m-Q4_K_M-00002-of-00002.gguf",
            "m-Q4_K_M-00001-of-00002.gguf",
            "m-F16-00001-of-00003.gguf",
            "m-F16-00003-of-00003.gguf",
            "mmproj-m-F16.gguf",
        ]));
        assert_eq!(c.len(), 2);
        assert_eq!(
            c[0].files,
            [
                "m-Q4_K_M-00001-of-00002.gguf",
                "m-Q4_K_M-00002-of-00002.gguf"
            ]
        );
        assert_eq!(c[0].quant().as_deref(), Some("Q4_K_M"));
        assert_eq!(c[1].files, ["m-Q8_0.gguf"]);
        assert_eq!(shard_of("a-00003-of-00002.gguf"), None);
    }

    #[test]
    fn the_pick_is_one_candidate_or_an_error_listing_what_there_is() {
        let c = candidates(&names(&[
            "Model-Q4_K_M.gguf",
            "Model-Q4_K_S.gguf",
            "Model-q8_0.gguf",
        ]));
        let pick = |p: Pick| choose("o/r", &c, &p).map(|c| c.name().to_string());
        assert_eq!(pick(Pick::Default).unwrap(), "Model-Q4_K_M.gguf");
        assert_eq!(pick(Pick::Quant("Q8_0".into())).unwrap(), "Model-q8_0.gguf");
        assert_eq!(
            pick(Pick::Quant("q4_k_s".into())).unwrap(),
            "Model-Q4_K_S.gguf"
        );
        let e = pick(Pick::Quant("Q4_K".into())).unwrap_err().to_string();
        assert!(e.contains("Q4_K_M, Q4_K_S, q8_0"), "{e}");
        let e = pick(Pick::File("x.gguf".into())).unwrap_err().to_string();
        assert!(e.contains("x.gguf"), "{e}");
        let none = choose("o/r", &[], &Pick::Default).unwrap_err().to_string();
        assert_eq!(none, "hf:o/r has no GGUF file");
        let two = candidates(&names(&["a-Q8_0.gguf", "a-F16.gguf"]));
        let e = choose("o/r", &two, &Pick::Default).unwrap_err().to_string();
        assert!(e.contains("no Q4_K_M") && e.contains("F16, Q8_0"), "{e}");
    }
}
