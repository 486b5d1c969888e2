//! Counters, gauges and histograms for `GET /metrics`, in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Seconds: a request's whole time, its wait in the queue, its first token.
const SECONDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Sequences decoded together in one step.
const ROWS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>, // per-bucket counts, sum, count
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)),
        }
    }

    /// Records one value.
    pub fn observe(&self, x: f64) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = self.bounds.iter().position(|&b| x <= b) {
            g.0[i] += 1;
        }
        g.1 += x;
        g.2 += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&g.0) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", g.2);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", g.1, g.2);
    }
}

/// Everything `/metrics` reports: ours (`gpt_*`), and the gauges an inference gateway reads
/// to route by load (the Kubernetes Gateway API Inference Extension's model-server
/// protocol) under vLLM's names: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
/// `vllm:kv_cache_usage_perc`.
#[derive(Debug)]
pub struct Metrics {
    /// The served model's name, the `model_name` label of the vLLM gauges.
    model_name: String,
    /// Positions the running batch can cache when full: `--max-batch` sequences of the
    /// whole context.
    kv_capacity: u64,
    /// Positions cached by the running sequences.
    pub cached_positions: AtomicU64,
    /// Finished requests by endpoint and HTTP status.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Requests waiting for a place in the batch.
    pub queue_length: AtomicU64,
    /// Sequences in the running batch.
    pub batch_size: AtomicU64,
    /// Open connections.
    pub connections: AtomicU64,
    /// Whole request time.
    pub latency: Histogram,
    /// Time to the first generated token.
    pub first_token: Histogram,
    /// Time spent queued.
    pub queue_wait: Histogram,
    /// Sequences per decoding step.
    pub step_batch: Histogram,
    /// Prompt tokens looked up in the prompt cache (all but each prompt's last).
    pub prompt_cache_queried: AtomicU64,
    /// Prompt tokens restored from the prompt cache.
    pub prompt_cache_hits: AtomicU64,
    /// Bytes of keys and values the prompt cache holds.
    pub prompt_cache_bytes: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new("", 0)
    }
}

impl Metrics {
    /// Metrics of a server of `model_name` whose full batch caches `kv_capacity` positions.
    pub fn new(model_name: &str, kv_capacity: u64) -> Self {
        Self {
            model_name: model_name.to_string(),
            kv_capacity,
            cached_positions: AtomicU64::new(0),
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            queue_length: AtomicU64::new(0),
            batch_size: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            latency: Histogram::new(&SECONDS),
            first_token: Histogram::new(&SECONDS),
            queue_wait: Histogram::new(&SECONDS),
            step_batch: Histogram::new(&ROWS),
            prompt_cache_queried: AtomicU64::new(0),
            prompt_cache_hits: AtomicU64::new(0),
            prompt_cache_bytes: AtomicU64::new(0),
        }
    }

    /// Counts a finished request.
    pub fn request(&self, endpoint: &str, status: u16) {
        let mut g = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *g.entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP gpt_requests_total Requests answered, by endpoint and HTTP status.\n# TYPE gpt_requests_total counter"
        );
        for ((endpoint, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "gpt_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let scalar = |out: &mut String, name: &str, kind: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        scalar(
            &mut out,
            "gpt_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            &self.prompt_tokens,
        );
        scalar(
            &mut out,
            "gpt_generated_tokens_total",
            "counter",
            "Tokens generated.",
            &self.generated_tokens,
        );
        scalar(
            &mut out,
            "gpt_queue_length",
            "gauge",
            "Requests waiting for a place in the running batch.",
            &self.queue_length,
        );
        scalar(
            &mut out,
            "gpt_batch_size",
            "gauge",
            "Sequences in the running batch.",
            &self.batch_size,
        );
        scalar(
            &mut out,
            "gpt_open_connections",
            "gauge",
            "Open HTTP connections.",
            &self.connections,
        );
        self.latency.write(
            &mut out,
            "gpt_request_duration_seconds",
            "Time from a request's arrival to its last byte.",
        );
        self.first_token.write(
            &mut out,
            "gpt_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
        );
        self.queue_wait.write(
            &mut out,
            "gpt_queue_wait_seconds",
            "Time a request waited for a place in the batch.",
        );
        self.step_batch.write(
            &mut out,
            "gpt_step_batch_size",
            "Sequences decoded together in one step.",
        );
        scalar(
            &mut out,
            "gpt_cached_positions",
            "gauge",
            "Positions cached by the running sequences.",
            &self.cached_positions,
        );
        scalar(
            &mut out,
            "gpt_prompt_cache_queried_tokens_total",
            "counter",
            "Prompt tokens looked up in the prompt cache.",
            &self.prompt_cache_queried,
        );
        scalar(
            &mut out,
            "gpt_prompt_cache_hit_tokens_total",
            "counter",
            "Prompt tokens whose keys and values came from the prompt cache.",
            &self.prompt_cache_hits,
        );
        scalar(
            &mut out,
            "gpt_prompt_cache_bytes",
            "gauge",
            "Bytes of keys and values the prompt cache holds.",
            &self.prompt_cache_bytes,
        );
        // vLLM's gauges, as gateways read them (a label value escaped as Prometheus says).
        let model = self
            .model_name
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let cached = self.cached_positions.load(Ordering::Relaxed);
        let usage = match self.kv_capacity {
            0 => 0.0,
            c => (cached as f64 / c as f64).min(1.0),
        };
        for (name, help, value) in [
            (
                "vllm:num_requests_waiting",
                "Requests waiting for a place in the running batch.",
                self.queue_length.load(Ordering::Relaxed) as f64,
            ),
            (
                "vllm:num_requests_running",
                "Sequences in the running batch.",
                self.batch_size.load(Ordering::Relaxed) as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "Cached positions over what a full batch of whole contexts caches (1 = full).",
                usage,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} {value}"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        for x in [0.003, 0.02, 0.02, 200.0] {
            m.latency.observe(x);
        }
        m.request("completions", 200);
        m.request("completions", 200);
        let text = m.render();
        assert!(text.contains("gpt_request_duration_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("gpt_request_duration_seconds_bucket{le=\"0.025\"} 3\n"));
        assert!(text.contains("gpt_request_duration_seconds_bucket{le=\"120\"} 3\n"));
        assert!(text.contains("gpt_request_duration_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(text.contains("gpt_request_duration_seconds_count 4\n"));
        assert!(text.contains("gpt_requests_total{endpoint=\"completions\",status=\"200\"} 2\n"));
    }

    #[test]
    fn gateway_gauges_under_vllms_names() {
        let m = Metrics::new("tiny \"gpt\"", 400);
        m.queue_length.store(3, Ordering::Relaxed);
        m.batch_size.store(2, Ordering::Relaxed);
        m.cached_positions.store(100, Ordering::Relaxed);
        let text = m.render();
        let label = "{model_name=\"tiny \\\"gpt\\\"\"}";
        for (name, value) in [
            ("vllm:num_requests_waiting", "3"),
            ("vllm:num_requests_running", "2"),
            ("vllm:kv_cache_usage_perc", "0.25"),
        ] {
            let line = format!("{name}{label} {value}\n");
            assert!(text.contains(&line), "{line} in\n{text}");
            assert!(text.contains(&format!("# TYPE {name} gauge\n")));
        }
        assert!(text.contains("gpt_cached_positions 100\n"));
        // No capacity (no model): usage 0, never a division by zero.
        assert!(Metrics::default()
            .render()
            .contains("vllm:kv_cache_usage_perc{model_name=\"\"} 0\n"));
    }
}
