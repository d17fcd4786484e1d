//! `fp8-moe`: the workspace's command-line front end.
//!
//! * `fp8-moe info`: the driver, each device, and which graph features they support.
//! * `fp8-moe bench graph [--json PATH]`: launch, replay, capture and update costs.
//!
//! Errors print one line to stderr and exit non-zero; there is never a backtrace.

mod bench;
mod info;

use std::process::ExitCode;

const USAGE: &str = "usage: fp8-moe <command>

commands:
  info                          driver version, devices, graph features of this driver
  bench graph [--json PATH]     launch, replay, capture and update costs (JSON default:
                                bench-graph.json)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("info") if args.len() == 1 => info::run(&mut std::io::stdout().lock()),
        Some("bench") if args.get(1).map(String::as_str) == Some("graph") => {
            let json = match &args[2..] {
                [] => Some("bench-graph.json".to_owned()),
                [flag, path] if flag == "--json" => Some(path.clone()),
                _ => None,
            };
            let Some(json) = json else {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            };
            run_bench(&json)
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

fn run_bench(json_path: &str) -> Result<(), info::CliError> {
    let rows = bench::graph::run().map_err(|e| info::CliError::Other(e.to_string()))?;
    print!(
        "{}",
        bench::table(
            "bench graph: chain of 1000 x add 1.0 to 1024 floats (4 x 256)",
            &rows
        )
    );
    std::fs::write(json_path, bench::json("graph", &rows))?;
    println!("wrote {json_path}");
    Ok(())
}
