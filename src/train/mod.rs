//! The train job (`fp8-moe train`, [`job`]) and its host side: the corpus ([`data`]),
//! checkpoints ([`checkpoint`]) and the run's report ([`report`]).

pub mod checkpoint;
pub mod data;
pub mod job;
pub mod report;

/// Test helpers shared by the modules' tests.
#[cfg(test)]
pub(crate) mod test_util {
    use std::fs;
    use std::path::PathBuf;

    /// A fresh folder under the system's temp dir, removed on drop.
    pub(crate) struct TempDir(pub(crate) PathBuf);

    impl TempDir {
        /// A new empty folder whose name holds `tag`, the process and a counter.
        pub(crate) fn new(tag: &str) -> TempDir {
            use std::sync::atomic::{AtomicU64, Ordering};
            static N: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let dir = std::env::temp_dir().join(format!(
                "fp8-moe-train-{tag}-{}-{nanos}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        /// Writes `bytes` to `rel` inside the folder (making its parents).
        pub(crate) fn write(&self, rel: &str, bytes: &[u8]) {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, bytes).unwrap();
        }

        /// The entries of the folder, sorted.
        pub(crate) fn entries(&self) -> Vec<String> {
            let mut v: Vec<_> = fs::read_dir(&self.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}
