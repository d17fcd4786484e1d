//! Memory samples of a soak run: device memory in use (`cuMemGetInfo`, through
//! [`Context::memory_info`]) and the process's resident set (`/proc/self/statm`), and the
//! drift between the first and the last sample.

use cuda_graph::Context;
use serde::Serialize;

use crate::bench::BenchResult;

/// The most a soak may drift, device or host, in bytes (exclusive): 1 MiB.
pub const DRIFT_LIMIT: u64 = 1 << 20;

/// One sample, taken after the stream drained.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemSample {
    /// Replays of the measured phase done when it was taken.
    pub replays: u64,
    /// Seconds into the measured phase.
    pub seconds: f64,
    /// Device memory in use, `total - free` of `cuMemGetInfo` (every context on the device).
    pub device_used: u64,
    /// Resident set size of this process.
    pub rss: u64,
}

impl MemSample {
    /// Samples now (the caller synchronizes first, so nothing is in flight).
    pub fn take(ctx: &Context, replays: u64, seconds: f64) -> BenchResult<MemSample> {
        let (free, total) = ctx.memory_info()?;
        Ok(MemSample {
            replays,
            seconds,
            device_used: total.saturating_sub(free) as u64,
            rss: host_rss()?,
        })
    }
}

/// The resident set size in bytes from the text of `/proc/<pid>/statm` (its second field,
/// in pages of `page_size` bytes); `None` when the text has no such number.
pub fn rss_from_statm(statm: &str, page_size: u64) -> Option<u64> {
    statm
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?
        .checked_mul(page_size)
}

/// The system's page size (`sysconf(_SC_PAGESIZE)`), 4096 if it can not be read.
fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

/// This process's resident set size in bytes.
pub fn host_rss() -> BenchResult<u64> {
    let text = std::fs::read_to_string("/proc/self/statm")?;
    rss_from_statm(&text, page_size()).ok_or_else(|| {
        format!("cannot read the resident set from /proc/self/statm: {text:?}").into()
    })
}

/// How far memory moved over a run: `last - first` of the samples, and the largest
/// distance of any sample from the first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Drift {
    /// Device memory in use, last sample minus first, bytes.
    pub device: i64,
    /// Resident set, last sample minus first, bytes.
    pub rss: i64,
    /// The largest `|sample - first|` of device memory in use, bytes.
    pub device_max_excursion: u64,
    /// The largest `|sample - first|` of the resident set, bytes.
    pub rss_max_excursion: u64,
}

impl Drift {
    /// The drift of `samples` in order; zero with fewer than two.
    pub fn of(samples: &[MemSample]) -> Drift {
        let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
            return Drift::default();
        };
        let delta = |a: u64, b: u64| -> i64 {
            // Two's-complement difference, saturated: memory sizes fit i64 by far.
            i64::try_from(i128::from(b) - i128::from(a)).unwrap_or(i64::MAX)
        };
        Drift {
            device: delta(first.device_used, last.device_used),
            rss: delta(first.rss, last.rss),
            device_max_excursion: samples
                .iter()
                .map(|s| s.device_used.abs_diff(first.device_used))
                .max()
                .unwrap_or(0),
            rss_max_excursion: samples
                .iter()
                .map(|s| s.rss.abs_diff(first.rss))
                .max()
                .unwrap_or(0),
        }
    }

    /// Whether both drifts are under `limit` bytes in size.
    pub fn within(&self, limit: u64) -> bool {
        self.device.unsigned_abs() < limit && self.rss.unsigned_abs() < limit
    }
}

/// `bytes` as a signed size for people: `+0 B`, `-12.0 KiB`, `+2.0 MiB`.
pub fn signed_size(bytes: i64) -> String {
    let sign = if bytes < 0 { "-" } else { "+" };
    format!("{sign}{}", size(bytes.unsigned_abs()))
}

/// `bytes` for people: `512 B`, `12.0 KiB`, `2.0 MiB`, `1.50 GiB`.
pub fn size(bytes: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    let b = bytes as f64;
    if bytes < KIB {
        format!("{bytes} B")
    } else if bytes < MIB {
        format!("{:.1} KiB", b / KIB as f64)
    } else if bytes < GIB {
        format!("{:.1} MiB", b / MIB as f64)
    } else {
        format!("{:.2} GiB", b / GIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(device_used: u64, rss: u64) -> MemSample {
        MemSample {
            replays: 0,
            seconds: 0.0,
            device_used,
            rss,
        }
    }

    #[test]
    fn rss_is_the_second_statm_field_in_pages() {
        assert_eq!(
            rss_from_statm("1234 567 89 10 0 200 0\n", 4096),
            Some(567 * 4096)
        );
        assert_eq!(rss_from_statm("1 2", 65536), Some(2 * 65536));
        assert_eq!(rss_from_statm("", 4096), None);
        assert_eq!(rss_from_statm("1234", 4096), None);
        assert_eq!(rss_from_statm("1234 x 5", 4096), None);
        assert_eq!(rss_from_statm("1 -2 3", 4096), None);
        assert_eq!(rss_from_statm(&format!("1 {}", u64::MAX), 4096), None);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        let rss = host_rss().unwrap();
        assert!(rss > 0 && rss % page_size() == 0, "{rss}");
    }

    #[test]
    fn drift_is_last_minus_first_and_excursion_the_widest_swing() {
        let s = [
            sample(100 << 20, 50 << 20),
            sample(104 << 20, 49 << 20),
            sample(98 << 20, 51 << 20),
            sample(100 << 20, 50 << 20),
        ];
        let d = Drift::of(&s);
        assert_eq!(d.device, 0);
        assert_eq!(d.rss, 0);
        assert_eq!(d.device_max_excursion, 4 << 20);
        assert_eq!(d.rss_max_excursion, 1 << 20);
        assert!(d.within(DRIFT_LIMIT));

        let d = Drift::of(&[sample(10 << 20, 8 << 20), sample(12 << 20, 8 << 20)]);
        assert_eq!(d.device, 2 << 20);
        assert!(!d.within(DRIFT_LIMIT));
        let d = Drift::of(&[
            sample(10 << 20, 8 << 20),
            sample(10 << 20, (8 << 20) - 4096),
        ]);
        assert_eq!(d.rss, -4096);
        assert_eq!(d.rss_max_excursion, 4096);
        assert!(d.within(DRIFT_LIMIT));
        // Exactly the limit is over it.
        let d = Drift::of(&[sample(0, 0), sample(0, DRIFT_LIMIT)]);
        assert!(!d.within(DRIFT_LIMIT));
        let d = Drift::of(&[sample(DRIFT_LIMIT, 0), sample(0, 0)]);
        assert_eq!(d.device, -(DRIFT_LIMIT as i64));
        assert!(!d.within(DRIFT_LIMIT));
    }

    #[test]
    fn drift_of_fewer_than_two_samples_is_zero() {
        assert_eq!(Drift::of(&[]), Drift::default());
        assert_eq!(Drift::of(&[sample(5, 6)]), Drift::default());
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(12 << 10), "12.0 KiB");
        assert_eq!(size(2 << 20), "2.0 MiB");
        assert_eq!(size(3 << 29), "1.50 GiB");
        assert_eq!(signed_size(0), "+0 B");
        assert_eq!(signed_size(-(12 << 10)), "-12.0 KiB");
        assert_eq!(signed_size(2 << 20), "+2.0 MiB");
    }
}
