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

/// Everything `/metrics` reports.
#[derive(Debug)]
pub struct Metrics {
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
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
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
        }
    }
}

impl Metrics {
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
}
