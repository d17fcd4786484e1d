//! A watchdog for GPU tests that could hang (threads waiting on each other, a wait that never
//! returns): it aborts the whole process with a message naming the test unless it is dropped
//! in time. Aborting is the point: a hung test binary would stall the whole GPU suite.
#![allow(dead_code)] // each test file uses a different subset

use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::time::Duration;

/// Aborts the process if still alive `limit` after [`Watchdog::arm`]; dropping it disarms it.
pub struct Watchdog {
    _disarm: Sender<()>,
}

impl Watchdog {
    /// Arms a watchdog for `what`.
    pub fn arm(what: impl Into<String>, limit: Duration) -> Watchdog {
        let what = what.into();
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!("WATCHDOG: {what} still running after {limit:?}: it hangs; aborting");
                std::process::abort();
            }
        });
        Watchdog { _disarm: tx }
    }
}
