//! `fp8-moe`: the workspace's command-line front end.
//!
//! * `fp8-moe info`: the driver, each device, and which graph features they support.
//! * `fp8-moe bench graph [--json PATH]`: launch, replay, capture and update costs.
//! * `fp8-moe bench fp8-cast [--json PATH]`: FP8 quantize and cast-transpose bandwidth.
//! * `fp8-moe bench gemm [--json PATH]`: FP8 GEMM and grouped GEMM against cuBLASLt.
//! * `fp8-moe bench graphed [--json PATH]`: eager against graphed step time of the FP8 MLP
//!   stack and the FP8 MoE layer (eager, breaking-layer, full-layer).
//!
//! Errors print one line to stderr and exit non-zero; there is never a backtrace.

mod bench;
mod info;

use std::process::ExitCode;

const USAGE: &str = "usage: fp8-moe <command>

commands:
  info                          driver version, devices, graph features of this driver
  bench graph [--json PATH]     launch, replay, capture and update costs (JSON default:
                                bench-graph.json)
  bench fp8-cast [--json PATH]  FP8 quantize and cast-transpose bandwidth against a device
                                copy (JSON default: bench-fp8-cast.json)
  bench gemm [--json PATH]      FP8 GEMM and MoE grouped GEMM against cuBLASLt (loaded at
                                run time) (JSON default: bench-gemm.json)
  bench graphed [--json PATH]   eager vs graphed step time: FP8 MLP stack at 64 and 8192
                                tokens, FP8 MoE layer eager vs breaking-layer vs
                                full-layer (JSON default: bench-graphed.json)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("info") if args.len() == 1 => info::run(&mut std::io::stdout().lock()),
        Some("bench") if args.len() >= 2 => {
            let Some(bench) = Bench::parse(&args[1]) else {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            };
            let json = match &args[2..] {
                [] => Some(format!("bench-{}.json", args[1])),
                [flag, path] if flag == "--json" => Some(path.clone()),
                _ => None,
            };
            let Some(json) = json else {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            };
            run_bench(bench, &json)
        }
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fp8-moe: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The benchmarks `bench` runs.
#[derive(Debug, Clone, Copy)]
enum Bench {
    Graph,
    Fp8Cast,
    Gemm,
    Graphed,
}

impl Bench {
    fn parse(name: &str) -> Option<Bench> {
        match name {
            "graph" => Some(Bench::Graph),
            "fp8-cast" => Some(Bench::Fp8Cast),
            "gemm" => Some(Bench::Gemm),
            "graphed" => Some(Bench::Graphed),
            _ => None,
        }
    }
}

fn run_bench(bench: Bench, json_path: &str) -> Result<(), info::CliError> {
    let (name, title, rows) = match bench {
        Bench::Graph => (
            "graph",
            "bench graph: chain of 1000 x add 1.0 to 1024 floats (4 x 256)",
            bench::graph::run(),
        ),
        Bench::Fp8Cast => (
            "fp8-cast",
            "bench fp8-cast: memory-bound FP8 kernels against a device copy",
            bench::fp8_cast::run(),
        ),
        Bench::Gemm => (
            "gemm",
            "bench gemm: FP8 GEMM (M x N x K) against cuBLASLt in the same run",
            bench::gemm::run(),
        ),
        Bench::Graphed => (
            "graphed",
            "bench graphed: eager vs graphed step time (FP8 MLP stack, FP8 MoE layer)",
            bench::graphed::run(),
        ),
    };
    let rows = rows.map_err(|e| info::CliError::Other(e.to_string()))?;
    print!("{}", bench::table(title, &rows));
    std::fs::write(json_path, bench::json(name, &rows))?;
    println!("wrote {json_path}");
    Ok(())
}
