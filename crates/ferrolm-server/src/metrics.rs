//! Counters, gauges and histograms, written in Prometheus' text format at `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// A histogram with fixed upper bounds.
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

const LATENCY_S: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const BATCH: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

struct Histograms {
    ttft: Histogram,
    per_token: Histogram,
    batch: Histogram,
    requests: BTreeMap<(String, u16), u64>,
    /// Per layer, per expert: tokens routed to it (`Model::expert_counts`; empty when dense).
    experts: Vec<Vec<u64>>,
    /// The streamed-expert cache's counters (`None` when the experts are resident).
    expert_cache: Option<ferrolm_model::ExpertCacheStats>,
    /// Where the expert selections were served from (`None` without a GPU memory budget).
    expert_tiers: Option<ferrolm_engine::ExpertTierStats>,
}

/// Everything `/metrics` reports.
pub struct Metrics {
    slots: usize,
    pub queue_depth: AtomicUsize,
    pub active_slots: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub rejected_queue_full: AtomicU64,
    pub steps: AtomicU64,
    /// Requests whose prompt began with ids a slot's cache already held.
    pub prefix_hits: AtomicU64,
    /// Prompt ids those requests did not evaluate again.
    pub prefix_tokens_reused: AtomicU64,
    /// Times a request was paused to give its KV cache room to older ones.
    pub paused: AtomicU64,
    hist: Mutex<Histograms>,
}

impl Metrics {
    pub fn new(slots: usize) -> Metrics {
        Metrics {
            slots,
            queue_depth: AtomicUsize::new(0),
            active_slots: AtomicUsize::new(0),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            rejected_queue_full: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prefix_tokens_reused: AtomicU64::new(0),
            paused: AtomicU64::new(0),
            hist: Mutex::new(Histograms {
                ttft: Histogram::new(LATENCY_S),
                per_token: Histogram::new(LATENCY_S),
                batch: Histogram::new(BATCH),
                requests: BTreeMap::new(),
                experts: Vec::new(),
                expert_cache: None,
                expert_tiers: None,
            }),
        }
    }

    fn hist(&self) -> std::sync::MutexGuard<'_, Histograms> {
        self.hist.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn request(&self, path: &str, status: u16) {
        *self
            .hist()
            .requests
            .entry((path.to_string(), status))
            .or_default() += 1;
    }

    pub fn time_to_first_token(&self, s: f64) {
        self.hist().ttft.observe(s);
    }

    pub fn time_per_token(&self, s: f64) {
        self.hist().per_token.observe(s);
    }

    /// The model's expert activation counts so far (per layer, per expert).
    pub fn set_expert_counts(&self, counts: Vec<Vec<u64>>) {
        self.hist().experts = counts;
    }

    /// The streamed-expert cache's counters so far (`None`: experts resident).
    pub fn set_expert_cache(&self, stats: Option<ferrolm_model::ExpertCacheStats>) {
        self.hist().expert_cache = stats;
    }

    /// Where the backend's expert selections were served from under a GPU memory budget.
    pub fn set_expert_tiers(&self, stats: Option<ferrolm_engine::ExpertTierStats>) {
        self.hist().expert_tiers = stats;
    }

    pub fn batch_size(&self, n: usize) {
        self.steps.fetch_add(1, Relaxed);
        self.hist().batch.observe(n as f64);
    }

    /// The Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, kind: &str, help: &str, v: u64| {
            scalars(&mut out, &[(name, kind, help, v)]);
        };
        gauge(
            "ferrolm_slots",
            "gauge",
            "Sequences decoded together at most.",
            self.slots as u64,
        );
        gauge(
            "ferrolm_active_slots",
            "gauge",
            "Slots serving a request now.",
            self.active_slots.load(Relaxed) as u64,
        );
        gauge(
            "ferrolm_queue_depth",
            "gauge",
            "Requests waiting for a slot.",
            self.queue_depth.load(Relaxed) as u64,
        );
        gauge(
            "ferrolm_prompt_tokens_total",
            "counter",
            "Prompt tokens evaluated.",
            self.prompt_tokens.load(Relaxed),
        );
        gauge(
            "ferrolm_generated_tokens_total",
            "counter",
            "Tokens generated.",
            self.generated_tokens.load(Relaxed),
        );
        gauge(
            "ferrolm_requests_cancelled_total",
            "counter",
            "Requests whose client went away before the end.",
            self.cancelled.load(Relaxed),
        );
        gauge(
            "ferrolm_requests_failed_total",
            "counter",
            "Requests that failed in the engine.",
            self.failed.load(Relaxed),
        );
        gauge(
            "ferrolm_requests_rejected_total",
            "counter",
            "Requests refused because the queue was full.",
            self.rejected_queue_full.load(Relaxed),
        );
        gauge(
            "ferrolm_prefix_cache_hits_total",
            "counter",
            "Requests whose prompt started with ids already in a slot's cache.",
            self.prefix_hits.load(Relaxed),
        );
        gauge(
            "ferrolm_prefix_cache_tokens_total",
            "counter",
            "Prompt ids taken from a slot's cache instead of evaluated again.",
            self.prefix_tokens_reused.load(Relaxed),
        );
        gauge(
            "ferrolm_requests_paused_total",
            "counter",
            "Times a request was paused to give its KV cache room to older ones (it resumes).",
            self.paused.load(Relaxed),
        );
        gauge(
            "ferrolm_steps_total",
            "counter",
            "Scheduler steps run.",
            self.steps.load(Relaxed),
        );
        let h = self.hist();
        let _ = writeln!(
            out,
            "# HELP ferrolm_requests_total HTTP requests answered, by path and status.\n# TYPE ferrolm_requests_total counter"
        );
        for ((path, status), n) in &h.requests {
            let _ = writeln!(
                out,
                "ferrolm_requests_total{{path=\"{path}\",status=\"{status}\"}} {n}"
            );
        }
        if h.experts.iter().any(|l| !l.is_empty()) {
            let _ = writeln!(
                out,
                "# HELP ferrolm_expert_selections_total Tokens routed to each expert of each mixture-of-experts layer.\n# TYPE ferrolm_expert_selections_total counter"
            );
            for (layer, counts) in h.experts.iter().enumerate() {
                for (expert, n) in counts.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "ferrolm_expert_selections_total{{layer=\"{layer}\",expert=\"{expert}\"}} {n}"
                    );
                }
            }
        }
        if let Some(st) = &h.expert_cache {
            scalars(
                &mut out,
                &[
                    (
                        "ferrolm_expert_cache_bytes",
                        "gauge",
                        "Budget of the streamed-expert cache.",
                        st.cache_bytes as u64,
                    ),
                    (
                        "ferrolm_expert_cache_hits_total",
                        "counter",
                        "Expert uses served from the streamed-expert cache.",
                        st.hits,
                    ),
                    (
                        "ferrolm_expert_cache_misses_total",
                        "counter",
                        "Expert uses that read the expert from the file.",
                        st.misses,
                    ),
                    (
                        "ferrolm_expert_cache_read_bytes_total",
                        "counter",
                        "Bytes of expert weights read from the file.",
                        st.bytes_read,
                    ),
                ],
            );
        }
        if let Some(st) = &h.expert_tiers {
            scalars(
                &mut out,
                &[
                    (
                        "ferrolm_expert_device_bytes",
                        "gauge",
                        "Bytes of expert weights in device memory under the GPU memory budget.",
                        st.device_expert_bytes,
                    ),
                    (
                        "ferrolm_expert_host_bytes",
                        "gauge",
                        "Bytes of expert weights left in host memory under the GPU memory budget.",
                        st.host_expert_bytes,
                    ),
                    (
                        "ferrolm_expert_device_selections_total",
                        "counter",
                        "Expert selections served from device memory.",
                        st.device_selections,
                    ),
                    (
                        "ferrolm_expert_host_selections_total",
                        "counter",
                        "Expert selections that read rows in host memory.",
                        st.host_selections,
                    ),
                    (
                        "ferrolm_expert_cpu_selections_total",
                        "counter",
                        "Of the host-memory selections, those computed on the CPU.",
                        st.cpu_selections,
                    ),
                    (
                        "ferrolm_expert_host_read_bytes_total",
                        "counter",
                        "Bytes of host-memory expert rows the selections read.",
                        st.host_bytes,
                    ),
                ],
            );
        }
        h.batch.write(
            &mut out,
            "ferrolm_batch_size",
            "Sequences evaluated per scheduler step.",
        );
        h.ttft.write(
            &mut out,
            "ferrolm_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
        );
        h.per_token.write(
            &mut out,
            "ferrolm_time_per_output_token_seconds",
            "Between consecutive generated tokens of a request.",
        );
        out
    }
}

/// Scalar metrics (name, type, help, value), each with its HELP and TYPE lines.
fn scalars(out: &mut String, metrics: &[(&str, &str, &str, u64)]) {
    for (name, kind, help, v) in metrics {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_counts_are_counters_per_layer_and_expert_and_absent_when_dense() {
        let m = Metrics::new(1);
        assert!(!m.render().contains("ferrolm_expert_selections_total"));
        m.set_expert_counts(vec![vec![], vec![]]);
        assert!(!m.render().contains("ferrolm_expert_selections_total"));
        m.set_expert_counts(vec![vec![], vec![3, 0, 5]]);
        let text = m.render();
        assert!(text.contains("# TYPE ferrolm_expert_selections_total counter"));
        for line in [
            "ferrolm_expert_selections_total{layer=\"1\",expert=\"0\"} 3",
            "ferrolm_expert_selections_total{layer=\"1\",expert=\"1\"} 0",
            "ferrolm_expert_selections_total{layer=\"1\",expert=\"2\"} 5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        assert!(!text.contains("layer=\"0\""));
        assert!(!text.contains("ferrolm_expert_cache"));
        assert!(!text.contains("ferrolm_expert_host"));
    }

    #[test]
    fn expert_tier_counters_appear_under_a_budget() {
        let m = Metrics::new(1);
        m.set_expert_tiers(Some(ferrolm_engine::ExpertTierStats {
            device_expert_bytes: 3000,
            host_expert_bytes: 9000,
            device_selections: 4,
            host_selections: 12,
            cpu_selections: 5,
            host_bytes: 6000,
        }));
        let text = m.render();
        for line in [
            "ferrolm_expert_device_bytes 3000",
            "ferrolm_expert_host_bytes 9000",
            "ferrolm_expert_device_selections_total 4",
            "ferrolm_expert_host_selections_total 12",
            "ferrolm_expert_cpu_selections_total 5",
            "ferrolm_expert_host_read_bytes_total 6000",
            "# TYPE ferrolm_expert_host_selections_total counter",
            "# TYPE ferrolm_expert_host_bytes gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }

    #[test]
    fn expert_cache_counters_appear_when_streamed() {
        let m = Metrics::new(1);
        m.set_expert_cache(Some(ferrolm_model::ExpertCacheStats {
            cache_bytes: 1000,
            slots: 2,
            slot_bytes: 500,
            expert_bytes: 8000,
            automatic: false,
            hits: 7,
            misses: 11,
            bytes_read: 5500,
        }));
        let text = m.render();
        for line in [
            "ferrolm_expert_cache_bytes 1000",
            "ferrolm_expert_cache_hits_total 7",
            "ferrolm_expert_cache_misses_total 11",
            "ferrolm_expert_cache_read_bytes_total 5500",
            "# TYPE ferrolm_expert_cache_hits_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }
}
