//! The train job's report folder and console output: the loss curve as SVG
//! ([`write_loss_svg`]), JSON documents ([`write_json`]), graph dumps as DOT and, when
//! Graphviz is installed, SVG ([`write_dot`]), a progress bar for the training loop
//! ([`TrainProgress`]) and the final comparison table ([`format_table`]).
//!
//! ```no_run
//! use std::path::Path;
//! use fp8_moe::train::report::{self, LossCurve};
//!
//! # fn main() -> Result<(), report::ReportError> {
//! let dir = Path::new("runs/a");
//! let mut train = LossCurve::new("train");
//! let mut valid = LossCurve::new("validation");
//! let mut progress = report::TrainProgress::new(100, true);
//! for step in 1..=100u64 {
//!     let loss = 5.5 / (step as f64).sqrt();
//!     train.push(step as f64, loss);
//!     if step % 20 == 0 {
//!         valid.push(step as f64, loss * 1.1);
//!     }
//!     progress.update(step, loss, 1.0e6, 12.5);
//! }
//! progress.finish();
//! report::write_loss_svg(&dir.join("loss.svg"), &[train, valid], "byte-level MoE, FP8")?;
//! report::write_json(&dir.join("summary.json"), &serde_json::json!({ "final_loss": 0.55 }))?;
//! let table = report::format_table(
//!     &["mode", "ms/step", "speed-up"],
//!     &[vec!["eager".into(), "41.20".into(), "1.00".into()]],
//! );
//! println!("{table}");
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::fs;
use std::io::{self, IsTerminal as _, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;

/// Why a report file could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReportError {
    /// Writing a file failed.
    #[error("cannot write {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// A value could not be serialized to JSON.
    #[error("cannot write {} as JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The serializer's error.
        source: serde_json::Error,
    },
    /// Drawing the plot failed.
    #[error("cannot draw the plot {}: {reason}", path.display())]
    Plot {
        /// The file.
        path: PathBuf,
        /// The plotting library's error.
        reason: String,
    },
}

/// One series of a loss plot: a label and `(step, loss)` points.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LossCurve {
    /// The legend's label ("train", "validation").
    pub label: String,
    /// `(step, loss)` in step order.
    pub points: Vec<(f64, f64)>,
}

impl LossCurve {
    /// An empty series labelled `label`.
    pub fn new(label: &str) -> LossCurve {
        LossCurve {
            label: label.to_owned(),
            points: Vec::new(),
        }
    }

    /// Appends a point.
    pub fn push(&mut self, step: f64, loss: f64) {
        self.points.push((step, loss));
    }
}

/// The series' colours, in order (the first is the training loss).
const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

/// Draws `curves` as lines on one chart (x: step, y: loss), with a legend, into the SVG file
/// `path`. Points whose step or loss is not finite (a diverged step) are left out; an empty
/// series is still listed in the legend.
pub fn write_loss_svg(path: &Path, curves: &[LossCurve], title: &str) -> Result<(), ReportError> {
    let plot_err = |e: &dyn fmt::Display| ReportError::Plot {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let finite: Vec<Vec<(f64, f64)>> = curves
        .iter()
        .map(|c| {
            c.points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect()
        })
        .collect();
    let (x, y) = bounds(finite.iter().flatten());

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(x.0..x.1, y.0..y.1)
            .map_err(|e| plot_err(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|x| {
                if x.fract() == 0.0 {
                    format!("{x:.0}")
                } else {
                    format!("{x}")
                }
            })
            .y_desc("loss")
            .draw()
            .map_err(|e| plot_err(&e))?;
        for (i, (curve, points)) in curves.iter().zip(finite).enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| plot_err(&e))?
                .label(curve.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        if !curves.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| plot_err(&e))?;
        }
        root.present().map_err(|e| plot_err(&e))?;
    }
    write_file(path, svg.as_bytes())
}

/// The axis ranges: the points' extent, with a margin on the loss axis, never empty.
fn bounds<'a>(points: impl Iterator<Item = &'a (f64, f64)>) -> ((f64, f64), (f64, f64)) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return ((0.0, 1.0), (0.0, 1.0));
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(y1.abs().max(1.0) * 1e-3);
    ((x0, x1), (y0 - pad, y1 + pad))
}

/// Writes `value` as pretty-printed JSON, with a final newline, to `path`.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), ReportError> {
    let mut text = serde_json::to_vec_pretty(value).map_err(|source| ReportError::Json {
        path: path.to_owned(),
        source,
    })?;
    text.push(b'\n');
    write_file(path, &text)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    fs::write(path, bytes).map_err(|source| ReportError::Io {
        path: path.to_owned(),
        source,
    })
}

/// What became of the SVG rendering of a DOT file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SvgRender {
    /// Graphviz wrote this SVG file.
    Rendered(PathBuf),
    /// No `dot` program on the `PATH`; only the DOT file was written.
    NoGraphviz,
    /// `dot` ran and failed (its message); only the DOT file is usable.
    Failed(String),
}

/// The files [`write_dot`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DotFiles {
    /// The DOT file.
    pub dot: PathBuf,
    /// The SVG rendering, or why there is none.
    pub svg: SvgRender,
}

/// Writes `dot_text` to `<dir>/<name>.dot` and, when Graphviz's `dot` is on the `PATH`,
/// renders it with `dot -Tsvg` to `<dir>/<name>.svg`. Only the DOT file's write is an
/// error; the rendering's outcome is reported in [`DotFiles::svg`] (a warning for the
/// caller to print).
pub fn write_dot(dir: &Path, name: &str, dot_text: &str) -> Result<DotFiles, ReportError> {
    let dot = dir.join(format!("{name}.dot"));
    write_file(&dot, dot_text.as_bytes())?;
    let svg_path = dir.join(format!("{name}.svg"));
    let svg = match Command::new("dot")
        .arg("-Tsvg")
        .arg(&dot)
        .arg("-o")
        .arg(&svg_path)
        .output()
    {
        Err(e) if e.kind() == io::ErrorKind::NotFound => SvgRender::NoGraphviz,
        Err(e) => SvgRender::Failed(format!("cannot run dot: {e}")),
        Ok(out) if out.status.success() => SvgRender::Rendered(svg_path),
        Ok(out) => SvgRender::Failed(format!(
            "dot -Tsvg {} failed ({}): {}",
            dot.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    };
    Ok(DotFiles { dot, svg })
}

/// Where progress goes.
enum Sink {
    /// An indicatif bar on a terminal.
    Bar(ProgressBar),
    /// One plain line every few steps (stdout is not a terminal, or a test's buffer).
    Lines(Box<dyn Write + Send>),
    /// Progress display disabled.
    Off,
}

/// Progress of the training loop on stdout: an indicatif bar (step, loss, tokens/s, ms per
/// step, ETA) when stdout is a terminal; when it is not (a log file), one plain line every
/// [`log_every`](Self::set_log_every) steps and at the last step, so logs show progress;
/// nothing when disabled.
pub struct TrainProgress {
    total: u64,
    sink: Sink,
    log_every: u64,
    start: Instant,
    /// The last update, and whether it was printed as a line.
    last: Option<(u64, String, bool)>,
}

impl fmt::Debug for TrainProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sink = match self.sink {
            Sink::Bar(_) => "bar",
            Sink::Lines(_) => "lines",
            Sink::Off => "off",
        };
        f.debug_struct("TrainProgress")
            .field("total", &self.total)
            .field("sink", &sink)
            .field("log_every", &self.log_every)
            .finish()
    }
}

impl TrainProgress {
    /// Progress of a run of `total_steps` steps; `enabled: false` shows nothing (messages
    /// given to [`println`](Self::println) are still printed).
    pub fn new(total_steps: u64, enabled: bool) -> TrainProgress {
        let sink = if !enabled {
            Sink::Off
        } else if io::stdout().is_terminal() {
            let bar =
                ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stdout());
            let style = ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} {msg} [{elapsed_precise}, eta {eta}]",
            )
            .expect("a valid template")
            .progress_chars("=> ");
            bar.set_style(style);
            Sink::Bar(bar)
        } else {
            Sink::Lines(Box::new(io::stdout()))
        };
        TrainProgress::with_sink(total_steps, sink)
    }

    fn with_sink(total: u64, sink: Sink) -> TrainProgress {
        TrainProgress {
            total,
            sink,
            log_every: (total / 20).max(1),
            start: Instant::now(),
            last: None,
        }
    }

    /// Prints a plain progress line every `every` steps (default: a twentieth of the run)
    /// when stdout is not a terminal.
    pub fn set_log_every(&mut self, every: u64) {
        self.log_every = every.max(1);
    }

    /// Reports step `step` (1-based) done, with its loss, the training throughput in tokens
    /// per second and the step's time in milliseconds.
    pub fn update(&mut self, step: u64, loss: f64, tokens_per_s: f64, step_ms: f64) {
        let stats = format!(
            "loss {loss:.4}  {}  {step_ms:.2} ms/step",
            format_rate(tokens_per_s)
        );
        let mut printed = false;
        match &mut self.sink {
            Sink::Bar(bar) => {
                bar.set_position(step);
                bar.set_message(stats.clone());
            }
            Sink::Lines(out) => {
                if step % self.log_every == 0 || step == self.total {
                    let line = plain_line(step, self.total, &stats, self.start.elapsed());
                    let _ = writeln!(out, "{line}");
                    let _ = out.flush();
                    printed = true;
                }
            }
            Sink::Off => {}
        }
        self.last = Some((step, stats, printed));
    }

    /// Prints a message line (above the bar when one is shown).
    pub fn println(&mut self, message: &str) {
        match &mut self.sink {
            Sink::Bar(bar) => bar.println(message),
            Sink::Lines(out) => {
                let _ = writeln!(out, "{message}");
                let _ = out.flush();
            }
            Sink::Off => println!("{message}"),
        }
    }

    /// Ends the display: the bar stays at its last state; in plain lines, the last update is
    /// printed if it was not.
    pub fn finish(&mut self) {
        match &mut self.sink {
            Sink::Bar(bar) => bar.finish(),
            Sink::Lines(out) => {
                if let Some((step, stats, false)) = &self.last {
                    let line = plain_line(*step, self.total, stats, self.start.elapsed());
                    let _ = writeln!(out, "{line}");
                    let _ = out.flush();
                }
            }
            Sink::Off => {}
        }
        if let Some(last) = &mut self.last {
            last.2 = true;
        }
    }
}

fn plain_line(step: u64, total: u64, stats: &str, elapsed: std::time::Duration) -> String {
    let secs = elapsed.as_secs();
    format!(
        "step {step}/{total}  {stats}  elapsed {}:{:02}:{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

fn format_rate(tokens_per_s: f64) -> String {
    if tokens_per_s >= 1e6 {
        format!("{:.2}M tok/s", tokens_per_s / 1e6)
    } else if tokens_per_s >= 1e3 {
        format!("{:.1}k tok/s", tokens_per_s / 1e3)
    } else {
        format!("{tokens_per_s:.0} tok/s")
    }
}

/// Renders a plain-text table: a header row, a rule, then the rows, columns separated by two
/// spaces. A column whose cells (other than empty ones) are all numbers (optionally ending in
/// `x` or `%`, as in `1.25x`) is right-aligned, header included; others are left-aligned.
/// Rows shorter than the header are padded with empty cells.
///
/// (The benchmarks' `bench::table` lives in the binary and prints its own fixed columns, so
/// the library keeps this small general one.)
///
/// ```
/// let t = fp8_moe::train::report::format_table(
///     &["mode", "ms/step"],
///     &[vec!["eager".into(), "41.2".into()], vec!["graph".into(), "9.75".into()]],
/// );
/// assert_eq!(t, "mode   ms/step\n-----  -------\neager     41.2\ngraph     9.75\n");
/// ```
pub fn format_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let cols = headers
        .len()
        .max(rows.iter().map(Vec::len).max().unwrap_or(0));
    fn cell(row: &[String], c: usize) -> &str {
        row.get(c).map_or("", String::as_str)
    }
    let width = |s: &str| s.chars().count();
    let mut widths = vec![0; cols];
    let mut numeric = vec![true; cols];
    for c in 0..cols {
        widths[c] = width(headers.get(c).copied().unwrap_or(""));
        for row in rows {
            let s = cell(row, c);
            widths[c] = widths[c].max(width(s));
            numeric[c] &= s.is_empty() || is_number(s);
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (c, s) in cells.enumerate() {
            if c > 0 {
                text.push_str("  ");
            }
            let pad = " ".repeat(widths[c] - width(s));
            if numeric[c] {
                text.push_str(&pad);
                text.push_str(s);
            } else {
                text.push_str(s);
                text.push_str(&pad);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut (0..cols).map(|c| headers.get(c).copied().unwrap_or("")));
    let rules: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    line(&mut rules.iter().map(String::as_str));
    for row in rows {
        line(&mut (0..cols).map(|c| cell(row, c)));
    }
    out
}

fn is_number(s: &str) -> bool {
    let s = s.trim();
    let s = s.strip_suffix(['x', '%']).unwrap_or(s);
    !s.is_empty() && s.parse::<f64>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use crate::train::test_util::TempDir;

    #[test]
    fn loss_svg_has_both_series_and_axis_labels() {
        let t = TempDir::new("svg");
        let mut train = LossCurve::new("train");
        let mut valid = LossCurve::new("validation <held-out>");
        for s in 1..=50 {
            train.push(f64::from(s), 5.5 / f64::from(s).sqrt());
        }
        train.push(51.0, f64::NAN);
        valid.push(10.0, 2.0);
        valid.push(50.0, 0.9);
        let path = t.0.join("loss.svg");
        write_loss_svg(&path, &[train, valid], "loss of run a").unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        // plotters writes each text element's content on a line of its own.
        let texts: Vec<&str> = svg
            .split("<text")
            .skip(1)
            .filter_map(|t| t.split_once('>')?.1.split_once("</text>"))
            .map(|(inner, _)| inner.trim())
            .collect();
        for text in [
            "train",
            "validation &lt;held-out&gt;",
            "loss of run a",
            "step",
            "loss",
            "50",
        ] {
            assert!(texts.contains(&text), "{text} missing from {texts:?}");
        }
        assert!(svg.matches("<polyline").count() >= 2);

        // Degenerate input still draws.
        write_loss_svg(&path, &[LossCurve::new("train")], "empty").unwrap();
        let one = LossCurve {
            label: "one".into(),
            points: vec![(3.0, 1.5)],
        };
        write_loss_svg(&path, &[one], "one point").unwrap();
        let e = write_loss_svg(&t.0.join("no/such/dir.svg"), &[], "x").unwrap_err();
        assert!(matches!(e, ReportError::Io { .. }), "{e}");
    }

    #[test]
    fn json_round_trips() {
        let t = TempDir::new("json");
        let path = t.0.join("summary.json");
        let curve = LossCurve {
            label: "train".into(),
            points: vec![(1.0, 5.25), (2.0, 4.5)],
        };
        write_json(&path, &curve).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(
            text.ends_with("}\n") && text.contains("\n  \"label\""),
            "{text}"
        );
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, serde_json::to_value(&curve).unwrap());
    }

    #[test]
    fn dot_is_written_and_svg_only_reported() {
        let t = TempDir::new("dot");
        let files = write_dot(&t.0, "graph", "digraph g { a -> b }").unwrap();
        assert_eq!(files.dot, t.0.join("graph.dot"));
        assert_eq!(
            fs::read_to_string(&files.dot).unwrap(),
            "digraph g { a -> b }"
        );
        match &files.svg {
            SvgRender::Rendered(svg) => assert!(fs::read_to_string(svg).unwrap().contains("<svg")),
            SvgRender::NoGraphviz => assert!(!t.0.join("graph.svg").exists()),
            SvgRender::Failed(why) => panic!("dot failed on a valid graph: {why}"),
        }
        let bad = write_dot(&t.0, "bad", "this is not dot {").unwrap();
        assert!(matches!(
            bad.svg,
            SvgRender::NoGraphviz | SvgRender::Failed(_)
        ));
        assert!(write_dot(&t.0.join("missing"), "g", "digraph {}").is_err());
    }

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn plain_progress_lines_every_n_steps_and_at_the_end() {
        let buf = Buffer::default();
        let mut p = TrainProgress::with_sink(10, Sink::Lines(Box::new(buf.clone())));
        p.set_log_every(4);
        for step in 1..=10 {
            p.update(step, 2.0 + step as f64, 1234.0, 7.5);
        }
        p.println("validation loss 1.5");
        p.finish();
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].starts_with("step 4/10  loss 6.0000  1.2k tok/s  7.50 ms/step"));
        assert!(lines[1].starts_with("step 8/10  loss 10.0000"));
        assert!(lines[2].starts_with("step 10/10  loss 12.0000"));
        assert_eq!(lines[3], "validation loss 1.5");

        // A run stopped early prints its last step at finish.
        let buf = Buffer::default();
        let mut p = TrainProgress::with_sink(100, Sink::Lines(Box::new(buf.clone())));
        p.update(7, 3.0, 2.5e6, 1.0);
        p.finish();
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.starts_with("step 7/100  loss 3.0000  2.50M tok/s"),
            "{text}"
        );
        let mut off = TrainProgress::new(5, false);
        off.update(1, 1.0, 1.0, 1.0);
        off.finish();
    }

    #[test]
    fn table_aligns_numbers_right_and_text_left() {
        let rows = vec![
            vec!["eager".into(), "41.20".into(), "1.00x".into(), "".into()],
            vec![
                "graph per layer".into(),
                "9.5".into(),
                "4.34x".into(),
                "ok".into(),
            ],
            vec!["full".into(), "n/a".into()],
        ];
        let t = format_table(&["mode", "ms", "speed-up", "note"], &rows);
        assert_eq!(
            t,
            "mode             ms     speed-up  note\n\
             ---------------  -----  --------  ----\n\
             eager            41.20     1.00x\n\
             graph per layer  9.5       4.34x  ok\n\
             full             n/a\n"
        );
        assert_eq!(format_table(&["a"], &[]), "a\n-\n");
    }
}
