//! `fp8-moe info`: what the installed driver and devices offer.

use std::io::Write;

use cuda_graph::driver::{self, Device, Feature, HEADER_VERSION};

/// Errors of the CLI: the library's, or a failed write to stdout.
#[derive(Debug)]
pub enum CliError {
    /// From the CUDA layer.
    Cuda(cuda_graph::Error),
    /// Writing the report failed.
    Io(std::io::Error),
    /// Anything else, already described.
    Other(String),
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Cuda(e) => e.fmt(f),
            CliError::Io(e) => write!(f, "cannot write output: {e}"),
            CliError::Other(msg) => f.write_str(msg),
        }
    }
}

impl From<cuda_graph::Error> for CliError {
    fn from(e: cuda_graph::Error) -> Self {
        CliError::Cuda(e)
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::Io(e)
    }
}

/// Prints the report. Everything is queried before anything is printed, so a failure
/// leaves one error line and no half-written report.
pub fn run(out: &mut impl Write) -> Result<(), CliError> {
    let version = driver::driver_version()?;
    let count = Device::count()?;
    if count == 0 {
        return Err(cuda_graph::Error::NoDevice { ordinal: 0, count }.into());
    }
    let mut report = format!(
        "driver: CUDA {version} ({}), built against CUDA {HEADER_VERSION} headers\n",
        version.0
    );
    for ordinal in 0..count {
        let dev = Device::get(ordinal)?;
        let (major, minor) = dev.compute_capability()?;
        let gib = dev.total_memory()? as f64 / (1u64 << 30) as f64;
        report += &format!(
            "device {ordinal}: {}, compute capability {major}.{minor}, {} SMs, {gib:.1} GiB\n",
            dev.name()?,
            dev.multiprocessor_count()?,
        );
        report += "  graph features:\n";
        for feature in Feature::ALL {
            let needs = match feature.min_compute_capability() {
                Some((a, b)) => format!("driver >= {}, sm >= {a}.{b}", feature.min_driver()),
                None => format!("driver >= {}", feature.min_driver()),
            };
            let yes = if dev.supports(feature)? { "yes" } else { "no " };
            report += &format!("    {:<38} {yes}  ({needs})\n", feature.name());
        }
    }
    // Entries this driver lacks at the ABI the workspace asks for (a 12.x driver: the 13.0
    // ABIs): which older ABI stands in, or that the entry is missing (its features fail with
    // an error naming it when used).
    let d = cuda_graph::sys::driver().map_err(cuda_graph::Error::from)?;
    let fallbacks = d.fallbacks();
    let covered = |e: &cuda_graph::sys::LoadError| match e {
        cuda_graph::sys::LoadError::Missing { name, .. } => {
            fallbacks.iter().any(|f| f.name == *name)
        }
        _ => false,
    };
    let missing: Vec<_> = d
        .missing_entries()
        .into_iter()
        .filter(|e| !covered(e))
        .collect();
    if fallbacks.is_empty() && missing.is_empty() {
        report += "driver entry points: all resolved at the ABI the workspace asks for\n";
    } else {
        for f in &fallbacks {
            report += &format!("driver entry point fallback: {f}\n");
        }
        for m in &missing {
            report += &format!("driver entry point missing: {m}\n");
        }
    }
    out.write_all(report.as_bytes())?;
    Ok(())
}
