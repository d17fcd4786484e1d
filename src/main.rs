//! `fp8-moe`: the workspace's command-line front end.
//!
//! * `fp8-moe info`: the driver, each device, and which graph features they support.
//!
//! Errors print one line to stderr and exit non-zero; there is never a backtrace.

mod info;

use std::process::ExitCode;

const USAGE: &str = "usage: fp8-moe <command>

commands:
  info    driver version, devices, and the graph features this driver supports";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("info") if args.len() == 1 => info::run(&mut std::io::stdout().lock()),
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
