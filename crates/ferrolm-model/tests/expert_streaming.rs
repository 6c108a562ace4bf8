//! Streamed experts (read from the file into a bounded cache) give the resident experts'
//! logits bit for bit, whatever the cache evicts; the cache's counters add up.

use std::path::PathBuf;

use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{ExpertMode, LoadOptions, Logits, Model, ModelError};

/// A file written to disk (so that a streamed model reads it with pread), removed when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A Qwen3-MoE file of 16 experts (top-2) in 4 layers.
fn moe_file(tag: &str) -> TempFile {
    let mut spec = SyntheticSpec::small("qwen3moe");
    spec.n_expert = 16;
    write_spec(&spec, tag)
}

fn write_spec(spec: &SyntheticSpec, tag: &str) -> TempFile {
    let path = std::env::temp_dir().join(format!(
        "ferrolm-expert-streaming-{tag}-{}.gguf",
        std::process::id()
    ));
    synthetic::write(spec, &path).unwrap();
    TempFile(path)
}

fn load(path: &PathBuf, experts: ExpertMode, threads: usize) -> Model {
    let options = LoadOptions {
        threads,
        experts,
        ..Default::default()
    };
    Model::load_with(path, &options).unwrap()
}

/// The smallest cache the file allows, read from the error a one-byte cache gets.
fn minimum_cache(path: &PathBuf, top_k: usize) -> (usize, usize) {
    let e = Model::load_with(
        path,
        &LoadOptions {
            threads: 1,
            experts: ExpertMode::Streamed { cache_bytes: 1 },
            ..Default::default()
        },
    )
    .err()
    .expect("a one-byte cache is refused");
    let message = e.to_string();
    match e {
        ModelError::ExpertCacheTooSmall {
            needed,
            given,
            experts_per_token,
            expert_bytes,
        } => {
            assert_eq!(given, 1);
            assert_eq!(experts_per_token, top_k);
            assert_eq!(needed, top_k * expert_bytes);
            assert!(
                message.contains(&needed.to_string()) && message.contains("1 bytes"),
                "{message}"
            );
            (needed, expert_bytes)
        }
        other => panic!("expected ExpertCacheTooSmall, got {other}"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + seed * 104_729) % 900)
        .collect()
}

/// Everything a model computes on a fixed workload: a batched prefill (every position's
/// logits), decode steps one token at a time, and three sequences in one `eval_many` pass
/// (prompts, then one step each).
fn workload(m: &Model) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    let mut s = m.session(256);
    out.push(bits(&s.eval(&prompt(1, 40), Logits::All).unwrap()));
    for t in [5u32, 77, 301, 12, 640] {
        out.push(bits(&s.eval(&[t], Logits::Last).unwrap()));
    }
    let mut sessions: Vec<_> = (0..3).map(|_| m.session(256)).collect();
    let prompts = [prompt(2, 9), prompt(3, 23), prompt(4, 1)];
    let [a, b, c] = &mut sessions[..] else {
        unreachable!()
    };
    let mut items = vec![
        (a, &prompts[0][..], Logits::All),
        (b, &prompts[1][..], Logits::Last),
        (c, &prompts[2][..], Logits::All),
    ];
    for r in m.eval_many(&mut items) {
        out.push(bits(&r.unwrap()));
    }
    let next = [[8u32], [9], [10]];
    let mut items: Vec<_> = items
        .into_iter()
        .zip(&next)
        .map(|((s, _, _), n)| (s, &n[..], Logits::Last))
        .collect();
    for r in m.eval_many(&mut items) {
        out.push(bits(&r.unwrap()));
    }
    out
}

#[test]
fn streamed_experts_match_resident_bit_for_bit_with_constant_eviction() {
    let file = moe_file("tiny");
    let (minimum, expert_bytes) = minimum_cache(&file.0, 2);
    let resident = load(&file.0, ExpertMode::Resident, 2);
    assert!(resident.expert_cache_stats().is_none());
    let expected = workload(&resident);

    // Room for exactly one token's two experts: nearly every use reads from the file.
    let streamed = load(
        &file.0,
        ExpertMode::Streamed {
            cache_bytes: minimum,
        },
        2,
    );
    let got = workload(&streamed);
    assert_eq!(got.len(), expected.len());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert!(!g.is_empty());
        assert!(g == e, "output {i} differs between streamed and resident");
    }
    assert_eq!(streamed.expert_counts(), resident.expert_counts());

    let st = streamed.expert_cache_stats().expect("streamed");
    assert_eq!(st.slots, 2);
    assert_eq!(st.slot_bytes, expert_bytes);
    assert!(!st.automatic);
    // Two slots for four layers: an expert is gone by the time its layer comes again.
    assert!(
        st.misses as f64 > 0.5 * (st.hits + st.misses) as f64,
        "{st:?}"
    );
    // Each miss reads one expert's three matrices (the slot rounds them up to 64 bytes).
    assert!(st.bytes_read <= st.misses * expert_bytes as u64);
    assert!(st.bytes_read > st.misses * (expert_bytes as u64 - 3 * 64));
}

#[test]
fn a_cache_of_every_expert_reads_each_once_then_hits() {
    let file = moe_file("big");
    let resident = load(&file.0, ExpertMode::Resident, 1);
    let expected = workload(&resident);
    let streamed = load(
        &file.0,
        ExpertMode::Streamed {
            cache_bytes: 1 << 30,
        },
        1,
    );
    assert_eq!(workload(&streamed), expected);
    assert_eq!(streamed.expert_counts(), resident.expert_counts());
    let st = streamed.expert_cache_stats().unwrap();
    // The cache holds all 4 x 16 experts: never more slots than experts.
    assert_eq!(st.slots, 64);
    let distinct = streamed
        .expert_counts()
        .iter()
        .flatten()
        .filter(|&&c| c > 0)
        .count() as u64;
    assert_eq!(st.misses, distinct, "{st:?}");
    assert!(st.hits > st.misses, "{st:?}");
    assert!(st.hit_rate() > 0.5);
    assert!(st.bytes_read <= st.expert_bytes);
}

/// The other MoE layouts: Qwen2-MoE (its shared expert stays mapped with the dense part),
/// Mixtral-style llama, dots1 (a leading dense layer, sigmoid routing with a selection bias,
/// grouped top-4), gpt-oss (MXFP4 experts with biases kept resident, top-k then softmax) and
/// qwen3next (gated delta-net layers beside attention, a shared expert),
/// each streamed through the smallest cache.
#[test]
fn other_moe_layouts_stream_bit_for_bit() {
    let mut mixtral = SyntheticSpec::small("llama");
    mixtral.n_expert = 4;
    mixtral.n_expert_used = 2;
    for (tag, spec) in [
        ("qwen2moe", SyntheticSpec::small("qwen2moe")),
        ("mixtral", mixtral),
        ("dots1", SyntheticSpec::small("dots1")),
        ("gpt-oss", SyntheticSpec::small("gpt-oss")),
        ("qwen3next", SyntheticSpec::small("qwen3next")),
    ] {
        let file = write_spec(&spec, tag);
        let (minimum, _) = minimum_cache(&file.0, spec.n_expert_used);
        let resident = load(&file.0, ExpertMode::Resident, 2);
        let streamed = load(
            &file.0,
            ExpertMode::Streamed {
                cache_bytes: minimum,
            },
            2,
        );
        assert!(workload(&streamed) == workload(&resident), "{tag}");
        assert_eq!(streamed.expert_counts(), resident.expert_counts(), "{tag}");
        assert!(streamed.expert_cache_stats().unwrap().misses > 0);
    }
}

/// A dense model has nothing to stream: any mode loads it resident.
#[test]
fn dense_models_ignore_the_expert_cache() {
    let bytes = synthetic::build(&SyntheticSpec::small("qwen3"))
        .unwrap()
        .to_bytes();
    let file = std::sync::Arc::new(ferrolm_gguf::GgufFile::from_bytes(bytes).unwrap());
    let m = Model::from_file_with(
        file,
        &LoadOptions {
            threads: 1,
            experts: ExpertMode::Streamed { cache_bytes: 1 },
            ..Default::default()
        },
    )
    .unwrap();
    assert!(m.expert_cache_stats().is_none());
}

/// Two threads running their own sessions on one streamed model at once, through a cache of two
/// slots: passes contend for the slots (a pass computing with a slot keeps it from being
/// overwritten, and reads into a buffer of its own when none is free), and each still gets the
/// resident logits bit for bit.
#[test]
fn concurrent_passes_through_a_tiny_cache_match_resident() {
    let file = moe_file("concurrent");
    let (minimum, _) = minimum_cache(&file.0, 2);
    let resident = load(&file.0, ExpertMode::Resident, 1);
    let run = |m: &Model, seed: u32| -> Vec<Vec<u32>> {
        let mut s = m.session(128);
        let mut out = vec![bits(&s.eval(&prompt(seed, 17), Logits::All).unwrap())];
        for t in 0..12 {
            out.push(bits(&s.eval(&[t * 31 + seed], Logits::Last).unwrap()));
        }
        out
    };
    let expected: Vec<_> = (1..=2).map(|seed| run(&resident, seed)).collect();
    let streamed = load(
        &file.0,
        ExpertMode::Streamed {
            cache_bytes: minimum,
        },
        1,
    );
    let got: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (1..=2)
            .map(|seed| {
                let m = &streamed;
                scope.spawn(move || run(m, seed))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        got == expected,
        "concurrent streamed passes differ from resident"
    );
    let st = streamed.expert_cache_stats().unwrap();
    assert!(st.misses > 0);
}

/// Experts computed for another executor (`HostExperts`, the CUDA backend's CPU tier) read a
/// streamed model's experts through its cache: a token's chosen experts and a batch's groups
/// give the resident model's bits, the cache reading the experts it does not hold.
#[test]
fn host_experts_of_a_streamed_model_give_the_resident_bits() {
    let file = moe_file("host");
    let (minimum, _) = minimum_cache(&file.0, 2);
    let resident = load(&file.0, ExpertMode::Resident, 2);
    let streamed = load(
        &file.0,
        ExpertMode::Streamed {
            cache_bytes: minimum,
        },
        2,
    );
    let layers = [0, 2, 3];
    let (want, got) = (
        resident.host_experts(&layers).unwrap(),
        streamed.host_experts(&layers).unwrap(),
    );
    let pool = ferrolm_threads::ThreadPool::new(2).unwrap();
    let d = want.d();
    let x: Vec<f32> = (0..6 * d)
        .map(|i| ((i * 31) % 23) as f32 / 8.0 - 1.4)
        .collect();
    for &l in &layers {
        // A token's chosen experts, one of them twice.
        let ids = [3u32, 11, 3, 15];
        let (mut a, mut b) = (vec![0f32; ids.len() * d], vec![1f32; ids.len() * d]);
        want.outputs(&pool, l, &ids, &x[..d], &mut a).unwrap();
        got.outputs(&pool, l, &ids, &x[..d], &mut b).unwrap();
        assert_eq!(bits(&a), bits(&b), "layer {l}: one token's experts");
        // Six rows in three groups.
        let groups = [(1u32, 0..2), (7, 2..5), (12, 5..6)];
        let (mut a, mut b) = (vec![0f32; 6 * d], vec![1f32; 6 * d]);
        want.grouped(&pool, l, &groups, &x, &mut a).unwrap();
        got.grouped(&pool, l, &groups, &x, &mut b).unwrap();
        assert_eq!(bits(&a), bits(&b), "layer {l}: a batch's groups");
    }
    let st = streamed.expert_cache_stats().unwrap();
    assert!(st.misses >= 6 && st.bytes_read > 0, "{st:?}");
}
