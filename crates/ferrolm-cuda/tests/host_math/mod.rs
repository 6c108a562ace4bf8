//! The kernels' arithmetic as plain host functions, for the emulations of the launch lists
//! (`emulated_step.rs`, `emulated_batches.rs`): the RMS norm, RoPE, attention over a cache,
//! the expert routing, and the comparisons of logits.
// (each test crate uses a part)
#![allow(dead_code)]

/// `x / rms(x) * w` (the sum of squares in f64, as the CPU sums it; `w` none: 1).
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let scale = 1.0 / ((sum / x.len() as f64) as f32 + eps).sqrt();
    match w {
        Some(w) => x.iter().zip(w).map(|(&x, &w)| (x * scale) * w).collect(),
        None => x.iter().map(|&x| x * scale).collect(),
    }
}

/// A logit through the final soft cap (`cap` 0: none; `inv_cap` = 1 / cap as the CPU rounds
/// it) and the logit scale (times `inv_scale`), as adjust_logits computes it.
pub fn adjust_logit(v: f32, [inv_cap, cap, inv_scale]: [f32; 3]) -> f32 {
    let v = if cap > 0.0 {
        (v * inv_cap).tanh() * cap
    } else {
        v
    };
    v * inv_scale
}

/// `silu(g) * u`.
pub fn swiglu(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// The gated activation of kernel family `act` (`swiglu`, `geglu`, `swiglu_oai`) over `g`
/// and `u`.
pub fn gated(act: &str, g: &[f32], u: &[f32]) -> Vec<f32> {
    match act {
        "swiglu" => g.iter().zip(u).map(|(&g, &u)| swiglu(g, u)).collect(),
        "swiglu_oai" => g.iter().zip(u).map(|(&g, &u)| swiglu_oai(g, u)).collect(),
        "geglu" => {
            let mut out = vec![0f32; g.len()];
            ferrolm_quant::ggml_vec::geglu(g, u, &mut out);
            out
        }
        other => panic!("no activation {other}"),
    }
}

/// A RoPE rotation as the kernels compute it: pair i's angle is the position times
/// theta_scale i times (multiplied up pair by pair), over the frequency factor; YaRN's ramp
/// mixes it with the scaled angle, and the cosines and sines are multiplied by the magnitude
/// (`scaling`: mscale, ext_factor, low, high).
pub struct Rope {
    pub p: usize,
    pub n_dims: usize,
    pub neox: bool,
    pub theta_scale: f32,
    pub freq_scale: f32,
    pub ff: Option<Vec<f32>>,
    pub scaling: [f32; 4],
}

impl Rope {
    pub fn rotate(&self, head: &mut [f32]) {
        let half = self.n_dims / 2;
        let mut theta = self.p as f32;
        for i in 0..half {
            let extrap = self.ff.as_ref().map_or(theta, |f| theta / f[i]);
            let [mscale, ext, low, high] = self.scaling;
            let interp = self.freq_scale * extrap;
            let angle = if ext == 0.0 {
                interp
            } else {
                let y = (i as f32 - low) / (high - low).max(0.001);
                let mix = (1.0 - y.clamp(0.0, 1.0)) * ext;
                interp.mul_add(1.0 - mix, extrap * mix)
            };
            let (s, c) = angle.sin_cos();
            let (s, c) = (s * mscale, c * mscale);
            let (i0, i1) = if self.neox {
                (i, i + half)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (x0, x1) = (head[i0], head[i1]);
            head[i0] = x0.mul_add(c, -(x1 * s));
            head[i1] = x0.mul_add(s, x1 * c);
            theta *= self.theta_scale;
        }
    }
}

/// One query head (`q`, already f16-rounded as the kernels stage it) over cache positions
/// `lo..hi` of `keys` and `values` (each position's row `hd` values from `offset` on): plain
/// softmax attention, the scaled scores soft-capped where `cap > 0`, a sink's logit (gpt-oss)
/// one more column of the softmax.
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    row: usize,
    offset: usize,
    (lo, hi): (usize, usize),
    (scale, cap, sink): (f32, f32, Option<f32>),
) -> Vec<f32> {
    let hd = q.len();
    let at = |t: usize, i: usize| t * row + offset + i;
    let scores: Vec<f32> = (lo..hi)
        .map(|t| {
            let s = (0..hd).map(|i| q[i] * keys[at(t, i)]).sum::<f32>() * scale;
            if cap > 0.0 {
                (s * (1.0 / cap)).tanh() * cap
            } else {
                s
            }
        })
        .collect();
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let e: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
    // A sink (gpt-oss): one more column of the softmax, with no value.
    let sum: f32 = e.iter().sum::<f32>() + sink.map_or(0.0, |s| (s - max).exp());
    let mut out = vec![0f32; hd];
    for (j, t) in (lo..hi).enumerate() {
        for (i, o) in out.iter_mut().enumerate() {
            *o += e[j] / sum * values[at(t, i)];
        }
    }
    out
}

/// How `moe_route` chooses: gating (0 softmax, 1 sigmoid, 2 the logits, softmaxed after the
/// top-k), groups (count, used; 0: none), whether the weights are renormalized, their scale.
pub struct Routing {
    pub k: usize,
    pub gating: usize,
    pub groups: (usize, usize),
    pub norm: bool,
    pub scale: f32,
}

/// What the routing decides on: the probabilities, the selection scores (the bias added,
/// the experts of the groups left out masked) and, with groups, the gap between the last
/// group kept and the next.
struct Selection {
    p: Vec<f32>,
    sel: Vec<f32>,
    group_gap: Option<f32>,
}

fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = x
        .iter_mut()
        .map(|v| {
            *v = (*v - max).exp();
            f64::from(*v)
        })
        .sum();
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The indices of `v`, largest value first (ties: the lower index, as a stable sort).
fn descending(v: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&x, &y| v[y].total_cmp(&v[x]));
    order
}

impl Routing {
    fn select(&self, logits: &[f32], bias: Option<&[f32]>) -> Selection {
        let mut p = logits.to_vec();
        match self.gating {
            0 => softmax(&mut p),
            1 => p.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
            _ => {}
        }
        let mut sel = p.clone();
        if let Some(b) = bias {
            sel.iter_mut().zip(b).for_each(|(s, b)| *s += b);
        }
        let (n_group, n_used) = self.groups;
        let mut group_gap = None;
        if let Some(per) = logits.len().checked_div(n_group) {
            let scores: Vec<f32> = sel
                .chunks(per)
                .map(|g| {
                    descending(g)
                        .iter()
                        .take(2)
                        .map(|&i| f64::from(g[i]))
                        .sum::<f64>() as f32
                })
                .collect();
            let order = descending(&scores);
            group_gap = Some(scores[order[n_used - 1]] - scores[order[n_used]]);
            for &dropped in &order[n_used..] {
                sel[dropped * per..(dropped + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
        Selection { p, sel, group_gap }
    }

    /// How much the router logits could move before the choice changes, roughly: the gap
    /// between the k-th expert and the next (and between the last group kept and the next),
    /// in logits (a selection score moves at most a quarter as much as its logit under a
    /// softmax or a sigmoid, a group's score of two at most half).
    pub fn margin(&self, logits: &[f32], bias: Option<&[f32]>) -> f32 {
        let s = self.select(logits, bias);
        let slope = if self.gating == 2 { 1.0 } else { 0.25 };
        let kept: Vec<usize> = (0..logits.len())
            .filter(|&e| s.sel[e] > f32::NEG_INFINITY)
            .collect();
        let expert_gap = if self.k >= kept.len() {
            // (every expert kept runs: no choice to change)
            f32::INFINITY
        } else if bias.is_none() {
            // (the scores' order is the logits')
            let order = descending(&kept.iter().map(|&e| logits[e]).collect::<Vec<_>>());
            logits[kept[order[self.k - 1]]] - logits[kept[order[self.k]]]
        } else {
            let order = descending(&s.sel);
            (s.sel[order[self.k - 1]] - s.sel[order[self.k]]) / slope
        };
        s.group_gap
            .map_or(expert_gap, |g| expert_gap.min(g / (2.0 * slope)))
    }

    /// One token's experts and weights from its router logits (and selection bias): the
    /// CPU's routing (routing.rs), written out again.
    pub fn route(&self, logits: &[f32], bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
        let Selection { p, sel, .. } = self.select(logits, bias);
        let ids: Vec<usize> = descending(&sel)[..self.k].to_vec();
        let mut w: Vec<f32> = ids.iter().map(|&e| p[e]).collect();
        if self.gating == 2 {
            softmax(&mut w);
        }
        if self.norm {
            let sum = (w.iter().map(|&v| f64::from(v)).sum::<f64>() as f32).max(6.103_515_6e-5);
            w.iter_mut().for_each(|v| *v /= sum);
        }
        if self.scale != 1.0 {
            w.iter_mut().for_each(|v| *v *= self.scale);
        }
        (ids.iter().map(|&e| e as u32).collect(), w)
    }
}

/// The mean over rows of `n_vocab` logits of KL(softmax(a) || softmax(b)).
pub fn mean_kl(a: &[f32], b: &[f32], n_vocab: usize) -> f64 {
    let log_softmax = |r: &[f32]| {
        let max = r.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let lse = r.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
        r.iter().map(|&v| v as f64 - lse).collect::<Vec<f64>>()
    };
    let rows = a.len() / n_vocab;
    (0..rows)
        .map(|i| {
            let (p, q) = (
                log_softmax(&a[i * n_vocab..][..n_vocab]),
                log_softmax(&b[i * n_vocab..][..n_vocab]),
            );
            p.iter()
                .zip(&q)
                .map(|(p, q)| p.exp() * (p - q))
                .sum::<f64>()
        })
        .sum::<f64>()
        / rows as f64
}

/// Mean absolute difference of the logits over their mean magnitude.
pub fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).sum();
    let size: f64 = a.iter().map(|x| f64::from(x.abs())).sum();
    diff / size
}

/// The index of the largest value (the first such).
pub fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

/// gpt-oss's clamped SwiGLU (alpha 1.702, limit 7), as the CPU computes it.
pub fn swiglu_oai(g: f32, u: f32) -> f32 {
    let x = g.min(7.0);
    let y = u.clamp(-7.0, 7.0);
    x / (1.0 + (1.702 * -x).exp()) * (y + 1.0)
}

/// A gated delta-net layer's shape as its kernels take it.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    /// Key heads, value heads, the head size.
    pub hk: usize,
    /// See `hk`.
    pub hv: usize,
    /// See `hk`.
    pub s: usize,
    /// Value head `h` reads key head `h % hk` instead of `h / (hv / hk)`.
    pub tiled: bool,
}

impl DeltaShape {
    fn ratio(&self) -> usize {
        self.hv / self.hk
    }

    /// Channels of the convolution.
    pub fn channels(&self) -> usize {
        (2 * self.hk + self.hv) * self.s
    }

    /// Where channel `c` is in a projection's row: contiguous, or in the fused `ssm_in`
    /// layout (per key head its query, key, value heads, their gates).
    pub fn conv_source(&self, c: usize, fused: bool) -> usize {
        let (s, key_dim, vw) = (self.s, self.hk * self.s, self.ratio() * self.s);
        let group = 2 * s + 2 * vw;
        if !fused {
            c
        } else if c < key_dim {
            c / s * group + c % s
        } else if c < 2 * key_dim {
            (c - key_dim) / s * group + s + (c - key_dim) % s
        } else {
            let j = c - 2 * key_dim;
            j / vw * group + 2 * s + j % vw
        }
    }

    /// Output gate `i` (value-head order) in a fused `ssm_in` row.
    pub fn fused_z(&self, row: &[f32], i: usize) -> f32 {
        let (s, vw) = (self.s, self.ratio() * self.s);
        row[i / vw * (2 * s + 2 * vw) + 2 * s + vw + i % vw]
    }

    /// Value head `vh`'s rate and decay input in a fused `ssm_ba` row.
    pub fn fused_gates(&self, row: &[f32], vh: usize) -> (f32, f32) {
        let r = self.ratio();
        (
            row[vh / r * 2 * r + vh % r],
            row[vh / r * 2 * r + r + vh % r],
        )
    }
}

/// One token of the causal convolution: `x` (each channel's input), `state` the channels'
/// `taps - 1` older inputs (oldest first, channel-minor), moved on by one; SiLU of the sums.
pub fn delta_conv(state: &mut Vec<f32>, w: &[f32], x: &[f32], taps: usize) -> Vec<f32> {
    let channels = x.len();
    let sums: Vec<f32> = (0..channels)
        .map(|c| {
            let mut acc = 0f32;
            for i in 0..taps - 1 {
                acc += state[i * channels + c] * w[c * taps + i];
            }
            acc + x[c] * w[c * taps + taps - 1]
        })
        .collect();
    if taps > 1 {
        state.drain(..channels);
        state.extend_from_slice(x);
    }
    sums.iter().map(|&v| v / (1.0 + (-v).exp())).collect()
}

/// `x / |x|` as the delta-net takes it: an RMS norm with epsilon `eps / len`, then a scale by
/// `1 / sqrt(len)`.
pub fn l2_normalized(x: &[f32], eps: f32) -> Vec<f32> {
    let s = x.len();
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let scale = 1.0 / ((sum / s as f64) as f32 + eps / s as f32).sqrt();
    let post = 1.0 / (s as f32).sqrt();
    x.iter().map(|v| (v * scale) * post).collect()
}

/// `beta = sigmoid(b)` and the log-decay `softplus(a + dt_bias) * ssm_a` of a value head.
pub fn rate_and_log_decay(b: f32, a: f32, dt_bias: f32, ssm_a: f32) -> (f32, f32) {
    let x = a + dt_bias;
    let softplus = if x > 20.0 { x } else { (1.0 + x.exp()).ln() };
    (1.0 / (1.0 + (-b).exp()), softplus * ssm_a)
}

/// One token of the delta rule over every value head, in place on `state` (`hv` squares of
/// `s`, key-major): `conv` the convolution's output, `b`, `a` and `z` per value head (and
/// value dimension), the vectors of the layer; returns the gated-normed read-out.
#[allow(clippy::too_many_arguments)] // the kernel's arguments, named
pub fn delta_rule(
    shape: DeltaShape,
    state: &mut [f32],
    conv: &[f32],
    (b, a, z): (&[f32], &[f32], &[f32]),
    (dt_bias, ssm_a, norm): (&[f32], &[f32], &[f32]),
    eps: f32,
) -> Vec<f32> {
    let DeltaShape { hk, hv, s, tiled } = shape;
    let ratio = hv / hk;
    let l2 = |x: &[f32]| l2_normalized(x, eps);
    let key_dim = hk * s;
    let mut out = vec![0f32; hv * s];
    for vh in 0..hv {
        let kh = if tiled { vh % hk } else { vh / ratio };
        let q = l2(&conv[kh * s..(kh + 1) * s]);
        let k = l2(&conv[key_dim + kh * s..key_dim + (kh + 1) * s]);
        let v = &conv[2 * key_dim + vh * s..2 * key_dim + (vh + 1) * s];
        let (beta, log_decay) = rate_and_log_decay(b[vh], a[vh], dt_bias[vh], ssm_a[vh]);
        let decay = log_decay.exp();
        let st = &mut state[vh * s * s..(vh + 1) * s * s];
        st.iter_mut().for_each(|x| *x *= decay);
        let o = &mut out[vh * s..(vh + 1) * s];
        for j in 0..s {
            let sk: f32 = (0..s).map(|i| k[i] * st[i * s + j]).sum();
            let u = (v[j] - sk) * beta;
            for i in 0..s {
                st[i * s + j] += k[i] * u;
            }
            o[j] = (0..s).map(|i| q[i] * st[i * s + j]).sum::<f32>() / (s as f32).sqrt();
        }
        let normed = rms_norm(o, Some(norm), eps);
        for j in 0..s {
            let zv = z[vh * s + j];
            o[j] = normed[j] * (zv / (1.0 + (-zv).exp()));
        }
    }
    out
}
