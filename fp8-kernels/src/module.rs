//! The crate's one fatbin, embedded at build time and loaded once per context.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cuda_graph::{Context, Kernel, Module, Result};

/// The fatbin of every kernel family (sm_90a and sm_89 SASS, compute_80 PTX), as built by
/// `build.rs` from `kernels/all.cu`.
pub static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8_kernels.fatbin"));

/// What is loaded for one context: the module, its kernels by name, and the SM count that
/// grid sizes are derived from.
struct Loaded {
    module: Module,
    sms: u32,
    kernels: Mutex<HashMap<String, Kernel>>,
}

/// Contexts by raw handle. Entries live for the process: they hold the (primary) context, so
/// a handle is never reused for another context while its entry exists.
fn cache() -> &'static Mutex<HashMap<usize, Arc<Loaded>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Loaded>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn loaded(ctx: &Arc<Context>) -> Result<Arc<Loaded>> {
    let key = ctx.as_raw() as usize;
    let mut map = cache().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = map.get(&key) {
        return Ok(l.clone());
    }
    let module = Module::from_image(ctx, FATBIN)?;
    let sms = ctx.device().multiprocessor_count()?.max(1) as u32;
    let l = Arc::new(Loaded {
        module,
        sms,
        kernels: Mutex::new(HashMap::new()),
    });
    map.insert(key, l.clone());
    Ok(l)
}

/// The crate's module in `ctx`, loaded on first use and cached for the process.
pub fn module(ctx: &Arc<Context>) -> Result<Module> {
    Ok(loaded(ctx)?.module.clone())
}

/// The kernel `name` of the crate's module in `ctx`, and the device's SM count.
pub(crate) fn kernel(ctx: &Arc<Context>, name: &str) -> Result<(Kernel, u32)> {
    let l = loaded(ctx)?;
    let mut kernels = l.kernels.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = kernels.get(name) {
        return Ok((k.clone(), l.sms));
    }
    let k = l.module.kernel(name)?;
    kernels.insert(name.to_owned(), k.clone());
    Ok((k, l.sms))
}
