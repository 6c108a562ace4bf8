//! Plain f32 loops of the model's own algorithms (the gated delta-net's chunked delta rule),
//! compiled for the widest vectors this CPU has. Each output element goes through the same
//! operations in the same order as the scalar loop (element-wise, no fused multiply-add, no
//! reordered sum), so every width gives the same bits.

/// `y += coeffs[r] * rows[r]` for `r` in order, `rows` holding `coeffs.len()` rows of
/// `y.len()` values one after another: the same as one `y[j] += c * x[j]` pass per row.
pub fn axpy_many(y: &mut [f32], coeffs: &[f32], rows: &[f32]) {
    assert!(
        rows.len() >= coeffs.len() * y.len(),
        "axpy_many: {} rows of {} need {} values, got {}",
        coeffs.len(),
        y.len(),
        coeffs.len() * y.len(),
        rows.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: avx512f was detected just above.
            #[allow(unsafe_code)]
            unsafe {
                x86::axpy_many_512(y, coeffs, rows)
            };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: avx2 was detected just above.
            #[allow(unsafe_code)]
            unsafe {
                x86::axpy_many_256(y, coeffs, rows)
            };
            return;
        }
    }
    axpy_many_body(y, coeffs, rows)
}

#[inline(always)]
fn axpy_many_body(y: &mut [f32], coeffs: &[f32], rows: &[f32]) {
    let w = y.len();
    for (&c, x) in coeffs.iter().zip(rows.chunks_exact(w)) {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y += c * x);
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    /// The scalar body compiled for AVX-512: 16 elements a step, the same operations.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_many_512(y: &mut [f32], coeffs: &[f32], rows: &[f32]) {
        super::axpy_many_body(y, coeffs, rows)
    }

    /// The scalar body compiled for AVX2: 8 elements a step, the same operations.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn axpy_many_256(y: &mut [f32], coeffs: &[f32], rows: &[f32]) {
        super::axpy_many_body(y, coeffs, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every width gives the bits of one plain `y[j] += c * x[j]` pass per row, for lengths
    /// with and without a tail.
    #[test]
    fn axpy_many_equals_one_pass_per_row() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for (w, n) in [(128, 64), (37, 5), (16, 1), (3, 4)] {
            let rows: Vec<f32> = (0..w * n).map(|_| next()).collect();
            let coeffs: Vec<f32> = (0..n).map(|_| next() * 3.0).collect();
            let start: Vec<f32> = (0..w).map(|_| next()).collect();
            let mut want = start.clone();
            for (r, &c) in coeffs.iter().enumerate() {
                for j in 0..w {
                    want[j] += c * rows[r * w + j];
                }
            }
            let mut got = start.clone();
            axpy_many(&mut got, &coeffs, &rows);
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "w {w} n {n}");
        }
    }
}
