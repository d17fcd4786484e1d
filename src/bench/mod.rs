//! `fp8-moe bench ...`: benchmarks timed with CUDA events (device work) or the host clock
//! (host-side API costs), after warm-up, reported as medians beside their yardsticks.

pub mod cublaslt;
pub mod fp8_cast;
pub mod gemm;
pub mod graph;
pub mod graphed;

use std::fmt::Write as _;

use cuda_graph::{Event, Stream};

/// A seeded xorshift64 stream: deterministic benchmark data that differs per seed.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// Boxed error of the benchmarks: driver errors and failed result checks alike.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Median over `reps` runs of `body`, in milliseconds between CUDA events recorded around it
/// on `stream`, after `warmup` untimed runs.
pub fn event_median_ms(
    stream: &Stream,
    warmup: usize,
    reps: usize,
    body: impl FnMut() -> BenchResult<()>,
) -> BenchResult<f64> {
    Ok(timed_medians(stream, warmup, reps, body)?.gpu_ms)
}

/// Medians of one benchmark body: the time the stream took ([`event_median_ms`]) and the host
/// time the body took to enqueue its work. When the two are close the body is bound by the
/// host (launch overhead); when the host time is well below, by the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Median milliseconds between events recorded on the stream before and after the body.
    pub gpu_ms: f64,
    /// Median milliseconds of host wall time the body took.
    pub host_ms: f64,
}

/// Runs `body` `warmup` times, then `reps` times between two events on `stream` (waiting
/// after each), and returns the medians of the event times and of the host time per call.
pub fn timed_medians(
    stream: &Stream,
    warmup: usize,
    reps: usize,
    mut body: impl FnMut() -> BenchResult<()>,
) -> BenchResult<Timing> {
    let (start, end) = (Event::new(stream.context())?, Event::new(stream.context())?);
    for _ in 0..warmup {
        body()?;
    }
    stream.synchronize()?;
    let mut gpu = Vec::with_capacity(reps);
    let mut host = Vec::with_capacity(reps);
    for _ in 0..reps {
        start.record(stream)?;
        let t0 = std::time::Instant::now();
        body()?;
        host.push(t0.elapsed().as_secs_f64() * 1e3);
        end.record(stream)?;
        end.synchronize()?;
        gpu.push(f64::from(Event::elapsed_ms(&start, &end)?));
    }
    Ok(Timing {
        gpu_ms: median(&mut gpu),
        host_ms: median(&mut host),
    })
}

/// The median of `samples` (the mean of the middle two for an even count); NaN when empty.
pub fn median(samples: &mut [f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    }
}

/// One row of a benchmark table: a figure, its unit, and the yardstick it is judged by.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The median.
    pub value: f64,
    /// Unit of `value`.
    pub unit: &'static str,
    /// The comparison figure, in words (measured in the same run where possible).
    pub yardstick: String,
    /// Whether the target is met, if there is one.
    pub pass: Option<bool>,
}

/// Renders rows as an aligned text table.
pub fn table(title: &str, rows: &[Row]) -> String {
    let mut s = format!("{title}\n");
    let w = rows.iter().map(|r| r.name.len()).max().unwrap_or(0);
    for r in rows {
        let verdict = match r.pass {
            Some(true) => "  [pass]",
            Some(false) => "  [MISS]",
            None => "",
        };
        let _ = writeln!(
            s,
            "  {:<w$}  {:>10.3} {:<6}  {}{verdict}",
            r.name, r.value, r.unit, r.yardstick
        );
    }
    s
}

/// Renders rows as a JSON object `{"bench": name, "rows": [...]}` (no dependency needed for
/// this flat shape).
pub fn json(bench: &str, rows: &[Row]) -> String {
    let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let mut s = format!("{{\"bench\":\"{}\",\"rows\":[", esc(bench));
    for (i, r) in rows.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let value = if r.value.is_finite() {
            format!("{}", r.value)
        } else {
            "null".into()
        };
        let pass = r.pass.map_or("null".into(), |p| p.to_string());
        let _ = write!(
            s,
            "{{\"name\":\"{}\",\"value\":{value},\"unit\":\"{}\",\"yardstick\":\"{}\",\"pass\":{pass}}}",
            esc(&r.name),
            esc(r.unit),
            esc(&r.yardstick)
        );
    }
    s.push_str("]}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn json_escapes_and_marks_missing_values() {
        let rows = [Row {
            name: "a \"b\"".into(),
            value: f64::NAN,
            unit: "us",
            yardstick: "x".into(),
            pass: Some(false),
        }];
        assert_eq!(
            json("g", &rows),
            "{\"bench\":\"g\",\"rows\":[{\"name\":\"a \\\"b\\\"\",\"value\":null,\"unit\":\"us\",\"yardstick\":\"x\",\"pass\":false}]}\n"
        );
    }
}
