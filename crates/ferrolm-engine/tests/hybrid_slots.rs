//! Server slots over a hybrid recurrent model (qwen3next): each slot's gated delta-net state
//! travels with its session, and a slot cleared for a new request starts from a clean state.

use ferrolm_engine::{Backend, CpuBackend, SlotInput, SlotOutput};
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model};

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 131)) % 900)
        .collect()
}

fn last_logits(out: &[SlotOutput], i: usize) -> Vec<f32> {
    out[i].as_ref().unwrap().clone()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-3)
}

#[test]
fn a_reused_slot_starts_clean_and_slots_keep_their_own_state() {
    let path =
        std::env::temp_dir().join(format!("ferrolm-hybrid-slots-{}.gguf", std::process::id()));
    synthetic::write(&SyntheticSpec::small("qwen3next"), &path).unwrap();
    let model = Model::load(&path, 1).unwrap();
    std::fs::remove_file(&path).ok();
    let (first, second, other) = (ids(60, 1), ids(35, 2), ids(20, 3));
    let alone = |p: &[u32]| model.session(256).eval(p, Logits::Last).unwrap();

    let mut forward = CpuBackend::new(&model, 2, 256);
    let out = forward.forward(&[
        SlotInput {
            slot: 0,
            ids: &first,
            want: Logits::Last,
        },
        SlotInput {
            slot: 1,
            ids: &other,
            want: Logits::Last,
        },
    ]);
    assert!(close(&last_logits(&out, 0), &alone(&first)));
    assert!(close(&last_logits(&out, 1), &alone(&other)));

    // Slot 0 is cleared and takes a new request while slot 1 goes on decoding: slot 0 sees
    // nothing of `first`, slot 1 continues its own state.
    forward.truncate(0, 0).unwrap();
    let out = forward.forward(&[
        SlotInput {
            slot: 0,
            ids: &second,
            want: Logits::Last,
        },
        SlotInput {
            slot: 1,
            ids: &[11],
            want: Logits::Last,
        },
    ]);
    assert!(close(&last_logits(&out, 0), &alone(&second)));
    let mut continued: Vec<u32> = other.clone();
    continued.push(11);
    assert!(close(&last_logits(&out, 1), &alone(&continued)));
    // Without the clear, slot 0's output would have continued `first`: a different result,
    // so the comparison above can fail.
    let mut carried = first.clone();
    carried.extend(&second);
    assert!(!close(&alone(&carried), &alone(&second)));
}
