//! Safe CUDA graphs for Rust.
//!
//! This crate sits on [`cuda_graph_sys`], which loads the CUDA driver at run time, so
//! programs built with it start on machines without a GPU and report a clear error there.
//!
//! * [`driver`]: initialisation, the driver version, devices and the graph features the
//!   installed driver supports.
//! * [`Error`]: every failure, carrying the driver call, its result code, name and message.
//!
//! ```no_run
//! use cuda_graph::driver::{self, Device, Feature};
//! let version = driver::driver_version()?;
//! let dev = Device::get(0)?;
//! println!("{} on CUDA {version}", dev.name()?);
//! if dev.supports(Feature::ConditionalIfWhile)? {
//!     println!("conditional nodes available");
//! }
//! # Ok::<(), cuda_graph::Error>(())
//! ```

#[macro_use]
mod error;
pub mod driver;

pub use cuda_graph_sys as sys;
pub use error::{Error, Result};
