//! Choosing the next token from logits: penalties, then top-k, top-p, min-p, temperature, then
//! a draw (or the maximum, when greedy), in llama.cpp's default order.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How to sample. The default is llama.cpp's: temperature 0.8, top-k 40, top-p 0.95,
/// min-p 0.05, no penalties.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// 0 or less: greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to p (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens by this (1: off).
    pub repeat_penalty: f32,
    /// Subtract from the logits of tokens that appeared (0: off).
    pub presence_penalty: f32,
    /// Subtract this times the count of each token that appeared (0: off).
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: usize,
    /// The seed of the draws.
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Default::default()
        }
    }
}

/// A sampler with its random state.
pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler whose draws are reproducible from `params.seed`.
    pub fn new(params: SamplerParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
        }
    }

    /// The next token given the logits and the tokens so far (for the penalties).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let penalize =
            p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let mut penalized;
        let logits = if penalize && !history.is_empty() {
            penalized = logits.to_vec();
            apply_penalties(
                &mut penalized,
                &history[history.len().saturating_sub(p.penalty_last_n)..],
                p,
            );
            &penalized[..]
        } else {
            logits
        };
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut c = std::mem::take(&mut self.candidates);
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        let id = self.pick(&mut c);
        self.candidates = c;
        id
    }

    /// Whether [`Sampler::sample_top`] gives what [`Sampler::sample`] would from the full
    /// logits when handed the `k` largest: no penalties (they change logits outside them), and
    /// greedy or a top-k of at most `k`.
    pub fn samples_from_top(&self, k: usize) -> bool {
        let p = &self.params;
        let penalize =
            p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        !penalize && (p.temperature <= 0.0 || (1..=k).contains(&p.top_k))
    }

    /// The next token from the largest logits only, as (id, logit) in any order: the same
    /// choice and the same draw as [`Sampler::sample`] over the full logits, where
    /// [`Sampler::samples_from_top`] says so for their count.
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> u32 {
        let mut c = std::mem::take(&mut self.candidates);
        c.clear();
        c.extend_from_slice(top);
        let id = if self.params.temperature <= 0.0 {
            c.iter().copied().min_by(by_logit).map_or(0, |x| x.0)
        } else {
            self.pick(&mut c)
        };
        self.candidates = c;
        id
    }

    /// Top-k, top-p, min-p and the temperature over the candidates `c`, then one draw.
    fn pick(&mut self, c: &mut Vec<(u32, f32)>) -> u32 {
        let p = &self.params;
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        // Probabilities at temperature 1 for top-p and min-p, as llama.cpp applies them before
        // the temperature.
        let probs = softmax(c.iter().map(|x| x.1), 1.0);
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        c.truncate(keep.max(1));
        let probs = softmax(c.iter().map(|x| x.1), p.temperature);
        let r: f32 = self.rng.random();
        let mut cum = 0.0;
        for (&(id, _), q) in c.iter().zip(&probs) {
            cum += q;
            if r < cum {
                return id;
            }
        }
        c.last().map_or(0, |x| x.0)
    }
}

/// The sampler's order of candidates: the larger logit first, then the lower id.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The `k` largest of `logits` as (id, logit), in the sampler's order (see [`Sampler`]).
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let k = k.min(c.len());
    if k > 0 && k < c.len() {
        c.select_nth_unstable_by(k - 1, by_logit);
    }
    c.truncate(k);
    c.sort_unstable_by(by_logit);
    c
}

/// The index of the largest logit (the first, on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(logits: impl Iterator<Item = f32> + Clone, temperature: f32) -> Vec<f32> {
    let max = logits.clone().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.map(|l| ((l - max) / temperature).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

fn apply_penalties(logits: &mut [f32], recent: &[u32], p: &SamplerParams) {
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &id in recent {
        *counts.entry(id).or_default() += 1;
    }
    for (&id, &n) in &counts {
        let Some(l) = logits.get_mut(id as usize) else {
            continue;
        };
        *l = if *l > 0.0 {
            *l / p.repeat_penalty
        } else {
            *l * p.repeat_penalty
        };
        *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.9, -1.0, 0.5, 2.0]
    }

    #[test]
    fn greedy_takes_the_maximum() {
        assert_eq!(
            Sampler::new(SamplerParams::greedy()).sample(&logits(), &[]),
            1
        );
    }

    #[test]
    fn seeds_reproduce_and_differ() {
        let params = |seed| SamplerParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..Default::default()
        };
        let draw = |seed| {
            let mut s = Sampler::new(params(seed));
            (0..50)
                .map(|_| s.sample(&logits(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        assert!(
            draw(7).iter().any(|&t| t != 1),
            "a hot sampler picks more than the maximum"
        );
    }

    #[test]
    fn top_k_one_and_min_p_keep_only_the_best() {
        let mut s = Sampler::new(SamplerParams {
            top_k: 1,
            temperature: 5.0,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&logits(), &[]) == 1));
        let mut s = Sampler::new(SamplerParams {
            top_k: 0,
            min_p: 0.95,
            temperature: 5.0,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&logits(), &[]) == 1));
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let mut s = Sampler::new(SamplerParams {
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            temperature: 1.0,
            ..Default::default()
        });
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits(), &[])).collect();
        assert!(picks.iter().all(|&t| t == 1 || t == 2), "{picks:?}");
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut s = Sampler::new(SamplerParams {
            repeat_penalty: 10.0,
            ..SamplerParams::greedy()
        });
        assert_eq!(s.sample(&logits(), &[1, 2]), 5);
        let mut s = Sampler::new(SamplerParams {
            presence_penalty: 0.2,
            ..SamplerParams::greedy()
        });
        assert_eq!(s.sample(&logits(), &[1]), 2);
        let mut s = Sampler::new(SamplerParams {
            frequency_penalty: 0.06,
            ..SamplerParams::greedy()
        });
        assert_eq!(s.sample(&logits(), &[1, 1]), 2);
        assert_eq!(s.sample(&logits(), &[1]), 1);
    }

    /// Sampling from the k largest logits alone gives the ids sampling from all of them gives,
    /// draw for draw, wherever `samples_from_top` says so (ties included).
    #[test]
    fn sampling_from_the_top_candidates_is_sampling_from_all() {
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(5);
        for case in 0..40 {
            let n = 300;
            let logits: Vec<f32> = (0..n)
                .map(|_| (rng.random::<f32>() * 8.0).round() / 2.0)
                .collect();
            let params = SamplerParams {
                temperature: [0.0, 0.7, 1.3][case % 3],
                top_k: [1, 5, 40][case % 3],
                top_p: [1.0, 0.9, 0.5][case % 3],
                min_p: [0.0, 0.05, 0.1][case % 3],
                seed: case as u64,
                ..Default::default()
            };
            let (mut all, mut top) = (Sampler::new(params.clone()), Sampler::new(params.clone()));
            assert!(top.samples_from_top(40));
            let mut shuffled = top_k(&logits, 40);
            shuffled.reverse();
            for _ in 0..20 {
                assert_eq!(
                    all.sample(&logits, &[]),
                    top.sample_top(&shuffled),
                    "case {case}"
                );
            }
        }
        let penalized = Sampler::new(SamplerParams {
            repeat_penalty: 1.1,
            ..Default::default()
        });
        assert!(!penalized.samples_from_top(40));
        assert!(!Sampler::new(SamplerParams {
            top_k: 0,
            ..Default::default()
        })
        .samples_from_top(40));
        assert!(!Sampler::new(SamplerParams {
            top_k: 41,
            ..Default::default()
        })
        .samples_from_top(40));
    }
}
