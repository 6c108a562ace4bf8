//! Element-wise and row operations, with llama.cpp's arithmetic (f64 sums where ggml uses them).

use crate::plan::{Rope, RopeLayout, YarnRamp};

/// Rows whose sums of squares are taken side by side: each row's f64 sum is one sequential
/// chain (ggml's order, so its rounding), and several independent chains hide the latency of
/// each add.
const SIDE_BY_SIDE: usize = 4;

/// `1 / sqrt(mean square + eps)` of each `d`-wide row of `x`, the sums as ggml's: in f64,
/// element by element in order.
fn inverse_rms<const R: usize>(x: &[f32], d: usize, eps: f32) -> [f32; R] {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &x[r * d..(r + 1) * d]);
    let mut sums = [0f64; R];
    #[allow(clippy::needless_range_loop)] // element i of every row in one step
    for i in 0..d {
        for r in 0..R {
            let v = rows[r][i];
            sums[r] += f64::from(v * v);
        }
    }
    sums.map(|sum| 1.0 / ((sum / d as f64) as f32 + eps).sqrt())
}

/// The scales of the `d`-wide rows of `x`, [`SIDE_BY_SIDE`] rows at a time.
fn row_scales(x: &[f32], d: usize, eps: f32) -> Vec<f32> {
    let n = x.len() / d;
    let mut scales = Vec::with_capacity(n);
    let whole = n / SIDE_BY_SIDE * SIDE_BY_SIDE;
    for rows in x[..whole * d].chunks_exact(SIDE_BY_SIDE * d) {
        scales.extend(inverse_rms::<SIDE_BY_SIDE>(rows, d, eps));
    }
    for row in x[whole * d..].chunks_exact(d) {
        scales.extend(inverse_rms::<1>(row, d, eps));
    }
    scales
}

/// `out = (x / rms(x)) * w` for every `d`-wide row of `x` into the rows of `out`, rounding as
/// ggml does: the mean square summed in f64, the scale in f32, then a separate multiply by the
/// weight.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32], d: usize) {
    let scales = row_scales(x, d, eps);
    for ((o, x), scale) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(scales) {
        for ((o, &v), &g) in o.iter_mut().zip(x).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// [`rms_norm_rows`] in place.
pub fn rms_norm_rows_in_place(x: &mut [f32], w: &[f32], eps: f32, d: usize) {
    let scales = row_scales(x, d, eps);
    for (row, scale) in x.chunks_exact_mut(d).zip(scales) {
        for (v, &g) in row.iter_mut().zip(w) {
            *v = (*v * scale) * g;
        }
    }
}

/// [`rms_norm_rows`] of one row, in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let d = x.len();
    rms_norm_rows_in_place(x, w, eps, d);
}

/// The cosines and sines of one position, for the pairs RoPE rotates.
pub struct RopeAngles {
    cos_sin: Vec<(f32, f32)>,
}

impl RopeAngles {
    /// Angles for position `pos`, computed as ggml does (the angle multiplied up pair by pair
    /// in f32, divided by the pair's frequency factor, cosine and sine then multiplied by the
    /// attention factor), so that positions far into the context round the same way.
    pub fn new(rope: &Rope, freq_factors: Option<&[f32]>, pos: usize) -> RopeAngles {
        let theta_scale = rope.freq_base.powf(-2.0 / rope.n_dims as f32);
        let mut theta = pos as f32;
        let yarn = YarnRamp::of(rope);
        let cos_sin = (0..rope.n_dims / 2)
            .map(|i| {
                let ff = freq_factors.map_or(1.0, |f| f[i]);
                let extrap = theta / ff;
                let interp = rope.freq_scale * extrap;
                theta *= theta_scale;
                match &yarn {
                    None => (
                        interp.cos() * rope.attn_factor,
                        interp.sin() * rope.attn_factor,
                    ),
                    Some(r) => {
                        let mix = r.ramp(i) * r.ext_factor;
                        let angle = interp.mul_add(1.0 - mix, extrap * mix);
                        (angle.cos() * r.mscale, angle.sin() * r.mscale)
                    }
                }
            })
            .collect();
        RopeAngles { cos_sin }
    }

    /// Rotates one head in place.
    pub fn apply(&self, layout: RopeLayout, head: &mut [f32]) {
        let neox = matches!(layout, RopeLayout::Neox);
        ferrolm_quant::ggml_vec::rope_rotate(head, &self.cos_sin, neox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_makes_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let mut out = [0.0; 4];
        rms_norm_rows(&x, &[1.0; 4], 0.0, &mut out, 4);
        let ms: f32 = out.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        assert!((out[1] / out[0] + 4.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn rows_side_by_side_norm_as_one_row_at_a_time() {
        // 7 rows: one group of SIDE_BY_SIDE and a tail of 3, against the plain sequential sum.
        let d = 37;
        let x: Vec<f32> = (0..7 * d)
            .map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / 50.0).collect();
        let eps = 1e-6;
        let mut out = vec![0.0; x.len()];
        rms_norm_rows(&x, &w, eps, &mut out, d);
        let mut in_place = x.clone();
        rms_norm_rows_in_place(&mut in_place, &w, eps, d);
        for (t, row) in x.chunks(d).enumerate() {
            let sum: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
            let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
            for i in 0..d {
                let want = (row[i] * scale) * w[i];
                assert_eq!(out[t * d + i].to_bits(), want.to_bits(), "row {t}, {i}");
                assert_eq!(
                    in_place[t * d + i].to_bits(),
                    want.to_bits(),
                    "row {t}, {i}"
                );
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_by_position_angle() {
        let rope = Rope {
            layout: RopeLayout::Normal,
            n_dims: 4,
            freq_base: 10000.0,
            freq_scale: 1.0,
            freq_factors: false,
            long_rope: None,
            attn_factor: 1.0,
            yarn: None,
        };
        let a = RopeAngles::new(&rope, None, 3);
        let mut h = [1.0, 0.0, 1.0, 0.0, 7.0];
        a.apply(RopeLayout::Normal, &mut h);
        assert!((h[0] - 3f32.cos()).abs() < 1e-6 && (h[1] - 3f32.sin()).abs() < 1e-6);
        let theta1 = 3.0 * 10000f32.powf(-0.5);
        assert!((h[2] - theta1.cos()).abs() < 1e-6);
        assert_eq!(h[4], 7.0, "dimensions past n_dims pass through");
        let mut n = [1.0, 1.0, 0.0, 0.0];
        a.apply(RopeLayout::Neox, &mut n);
        assert!((n[0] - 3f32.cos()).abs() < 1e-6 && (n[2] - 3f32.sin()).abs() < 1e-6);

        // Frequency factors divide each pair's angle; the attention factor scales the result.
        let scaled = Rope {
            attn_factor: 1.5,
            ..rope
        };
        let a = RopeAngles::new(&scaled, Some(&[2.0, 4.0]), 3);
        let mut h = [1.0, 0.0, 1.0, 0.0];
        a.apply(RopeLayout::Normal, &mut h);
        assert!((h[0] - 1.5 * 1.5f32.cos()).abs() < 1e-6);
        assert!((h[1] - 1.5 * 1.5f32.sin()).abs() < 1e-6);
        assert!((h[2] - 1.5 * (theta1 / 4.0).cos()).abs() < 1e-6);
    }

    #[test]
    fn long_rope_follows_llama_cpp_padded_context() {
        let lr = crate::plan::LongRope {
            original_context: 1024,
        };
        assert!(!lr.uses_long(1024));
        assert!(!lr.uses_long(1000));
        assert!(lr.uses_long(1025));
        assert!(lr.uses_long(2048));
        let odd = crate::plan::LongRope {
            original_context: 1000,
        };
        // llama.cpp pads 1000 to 1024 > 1000.
        assert!(odd.uses_long(1000));
        assert!(!odd.uses_long(768));
    }
}
