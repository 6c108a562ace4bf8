//! What the parity tests share: golden data from `scripts/parity_golden.py` and
//! `scripts/synthetic_golden.py`, KL divergence and top-1 agreement against it, and SHA-256.
#![allow(dead_code)] // each test binary uses a part

use std::path::PathBuf;

/// Golden data of one model.
pub struct Golden {
    /// Per prompt: its ids and llama.cpp's greedy continuation.
    pub cases: Vec<(Vec<u32>, Vec<u32>)>,
    /// Logits kept per position.
    pub k: usize,
    /// Per position: f32 log-sum-exp, then `k` x (u32 id, f32 logit), best first.
    pub topk: Vec<u8>,
    /// The whole JSON file.
    pub meta: serde_json::Value,
}

/// Reads `tests/golden/NAME.{json,topk}`.
pub fn golden(name: &str) -> Golden {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.json"))).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let cases = meta["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (ids(&c["ids"]), ids(&c["greedy"])))
        .collect();
    Golden {
        cases,
        k: meta["k"].as_u64().unwrap() as usize,
        topk: std::fs::read(dir.join(format!("{name}.topk"))).unwrap(),
        meta,
    }
}

/// KL(reference || ours) from the reference's top-k (exact probabilities, from its log-sum-exp)
/// and our full row; the reference's remaining mass is compared as one bucket, which makes this a
/// lower bound of the full KL that is tight when the top-k hold nearly all the mass.
pub fn kl_and_top1(reference: &[u8], k: usize, ours: &[f32]) -> (f64, bool) {
    let f = |o: usize| f32::from_le_bytes(reference[o..o + 4].try_into().unwrap());
    let lse_ref = f64::from(f(0));
    let max = ours.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let lse_ours = f64::from(max)
        + ours
            .iter()
            .map(|&x| (f64::from(x) - f64::from(max)).exp())
            .sum::<f64>()
            .ln();
    let (mut kl, mut p_top, mut q_top) = (0.0, 0.0, 0.0);
    let mut ref_best = 0;
    for i in 0..k {
        let o = 4 + i * 8;
        let id = u32::from_le_bytes(reference[o..o + 4].try_into().unwrap()) as usize;
        if i == 0 {
            ref_best = id;
        }
        let lp = f64::from(f(o + 4)) - lse_ref;
        let lq = f64::from(ours[id]) - lse_ours;
        kl += lp.exp() * (lp - lq);
        p_top += lp.exp();
        q_top += lq.exp();
    }
    let (p_tail, q_tail) = ((1.0 - p_top).max(0.0), (1.0 - q_top).max(1e-30));
    if p_tail > 0.0 {
        kl += p_tail * (p_tail / q_tail).ln();
    }
    (kl, argmax(ours) == ref_best)
}

/// Whether each of the reference's top `k` logits (a row as `kl_and_top1` reads it) has the same
/// f32 bits in `ours`: bit-level agreement, which the KL cannot show (the reference's
/// log-sum-exp is stored rounded to f32, which alone gives KLs up to about 1e-5).
#[allow(dead_code)] // not every test binary that includes this module compares bits
pub fn same_top_logits(reference: &[u8], k: usize, ours: &[f32]) -> bool {
    (0..k).all(|i| {
        let o = 4 + i * 8;
        let id = u32::from_le_bytes(reference[o..o + 4].try_into().unwrap()) as usize;
        let want = f32::from_le_bytes(reference[o + 4..o + 8].try_into().unwrap());
        ours[id].to_bits() == want.to_bits()
    })
}

/// Whether our pick is within `tolerance` of the reference's best logit (MODELS.md: random
/// weights give near-ties), judged by the reference's own logits; a pick outside the
/// reference's top-k disagrees.
pub fn top1_within(reference: &[u8], k: usize, ours: &[f32], tolerance: f32) -> bool {
    let f = |o: usize| f32::from_le_bytes(reference[o..o + 4].try_into().unwrap());
    let pick = argmax(ours);
    let best = f(8);
    (0..k).any(|i| {
        let o = 4 + i * 8;
        u32::from_le_bytes(reference[o..o + 4].try_into().unwrap()) as usize == pick
            && f(o + 4) >= best - tolerance
    })
}

/// The first index of the largest value.
pub fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > row[b] { i } else { b })
}

/// SHA-256 of `data`, as lowercase hex (FIPS 180-4).
pub fn sha256_hex(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks(64) {
        let mut w = [0u32; 64];
        for (i, c) in block.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes(c.try_into().unwrap());
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}
