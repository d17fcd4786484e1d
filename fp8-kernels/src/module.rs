//! The crate's one fatbin, embedded at build time and loaded once per context.

use std::sync::Arc;

use cuda_graph::{Context, Kernel, Module, Result};

/// The fatbin of every kernel family (sm_90a and sm_89 SASS, compute_80 PTX), as built by
/// `build.rs` from `kernels/all.cu`.
pub static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8_kernels.fatbin"));

/// The crate's module in `ctx`, loaded on first use and kept for the process
/// ([`Module::embedded`]).
pub fn module(ctx: &Arc<Context>) -> Result<Module> {
    Module::embedded(ctx, FATBIN)
}

/// The kernel `name` of the crate's module in `ctx`, and the device's SM count (grid sizes
/// derive from it).
pub(crate) fn kernel(ctx: &Arc<Context>, name: &str) -> Result<(Kernel, u32)> {
    let kernel = module(ctx)?.kernel(name)?;
    let sms = ctx.multiprocessor_count()?.max(1);
    Ok((kernel, sms))
}
