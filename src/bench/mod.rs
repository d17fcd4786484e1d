//! `fp8-moe bench ...`: benchmarks timed with CUDA events (device work) or the host clock
//! (host-side API costs), after warm-up, reported as medians beside their yardsticks.

pub mod cublaslt;
pub mod dist;
pub mod fp8_cast;
pub mod gemm;
pub mod graph;
pub mod graphed;
pub mod moe;
pub mod train;

use std::fmt::Write as _;
use std::io;

use cuda_graph::{Event, Stream};
use serde::Serialize;

pub use fp8_moe::rng::Rng;

/// Stream 0 of [`Rng`] of `seed`, as a closure: deterministic benchmark data that differs per
/// seed.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut rng = Rng::new(seed, 0);
    move || rng.next_u64()
}

/// Boxed error of the benchmarks: driver errors and failed result checks alike.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Buffers of `bytes` bytes each, zeroed on `stream` (a layer's saved buffers, defined
/// before anything reads them, as the graphed runtime leaves its own).
pub fn zeroed_saved(
    stream: &Stream,
    bytes: &[usize],
) -> cuda_graph::Result<Vec<cuda_graph::DeviceBuffer<u8>>> {
    bytes
        .iter()
        .map(|&n| {
            let b = cuda_graph::DeviceBuffer::<u8>::alloc(stream.context(), n)?;
            b.memset_bytes(stream, 0)?;
            Ok(b)
        })
        .collect()
}

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

/// The median (sorted in place); NaN when empty (the train job's, shared).
pub use fp8_moe::train::job::median;

/// One row of a benchmark table: a figure, its unit, and the yardstick it is judged by.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The median (`null` in JSON when it is not finite).
    #[serde(serialize_with = "finite_or_null")]
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

/// The JSON document of one benchmark run: `{"bench": name, "rows": [...]}`.
#[derive(Serialize)]
struct Report<'a> {
    bench: &'a str,
    rows: &'a [Row],
}

/// Writes rows as one line of JSON, `{"bench": name, "rows": [...]}`, to `out` and flushes it.
/// Each row is `{"name", "value", "unit", "yardstick", "pass"}`; a value that is not finite
/// and a missing verdict are `null`.
pub fn write_json(out: &mut impl io::Write, bench: &str, rows: &[Row]) -> io::Result<()> {
    serde_json::to_writer(&mut *out, &Report { bench, rows })?;
    out.write_all(b"\n")?;
    out.flush()
}

/// Serializes a figure as a JSON number, or `null` when it is NaN or infinite (JSON has
/// neither).
fn finite_or_null<S: serde::Serializer>(value: &f64, s: S) -> Result<S::Ok, S::Error> {
    if value.is_finite() {
        s.serialize_f64(*value)
    } else {
        s.serialize_none()
    }
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

    fn json(bench: &str, rows: &[Row]) -> String {
        let mut out = Vec::new();
        write_json(&mut out, bench, rows).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn json_escapes_and_marks_missing_values() {
        let rows = [Row {
            name: "a \"b\"\\".into(),
            value: f64::NAN,
            unit: "us",
            yardstick: "x\ny".into(),
            pass: Some(false),
        }];
        assert_eq!(
            json("g", &rows),
            "{\"bench\":\"g\",\"rows\":[{\"name\":\"a \\\"b\\\"\\\\\",\"value\":null,\"unit\":\"us\",\"yardstick\":\"x\\ny\",\"pass\":false}]}\n"
        );
        let rows = [Row {
            name: "inf".into(),
            value: f64::INFINITY,
            unit: "GB/s",
            yardstick: String::new(),
            pass: None,
        }];
        assert_eq!(
            json("h", &rows),
            "{\"bench\":\"h\",\"rows\":[{\"name\":\"inf\",\"value\":null,\"unit\":\"GB/s\",\"yardstick\":\"\",\"pass\":null}]}\n"
        );
    }

    #[test]
    fn written_json_parses_back() {
        let rows = [
            Row {
                name: "replay \"1000 nodes\"".into(),
                value: 12.5,
                unit: "us",
                yardstick: "eager launch: 3.2 ms".into(),
                pass: Some(true),
            },
            Row {
                name: "capture".into(),
                value: f64::NAN,
                unit: "ms",
                yardstick: "none\tyet".into(),
                pass: None,
            },
        ];
        let path = std::env::temp_dir().join(format!("fp8-moe-bench-{}.json", std::process::id()));
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        write_json(&mut file, "graph", &rows).unwrap();
        drop(file);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();

        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["bench"], "graph");
        let parsed = doc["rows"].as_array().unwrap();
        assert_eq!(parsed.len(), rows.len());
        for (p, r) in parsed.iter().zip(&rows) {
            let keys: Vec<&str> = p.as_object().unwrap().keys().map(String::as_str).collect();
            assert_eq!(keys.len(), 5, "{p}");
            assert_eq!(p["name"], r.name.as_str());
            assert_eq!(p["unit"], r.unit);
            assert_eq!(p["yardstick"], r.yardstick.as_str());
            assert_eq!(p["pass"].as_bool(), r.pass);
            if r.value.is_finite() {
                assert_eq!(p["value"].as_f64(), Some(r.value));
            } else {
                assert!(p["value"].is_null(), "{p}");
            }
        }
    }
}
