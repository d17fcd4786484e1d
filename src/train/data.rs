//! The train job's corpus: bytes read from text files, split into a training part and a
//! held-out validation part, and sampled into `(tokens, targets)` batches by a seeded,
//! resumable [`Sampler`].
//!
//! The model is byte-level: a token is one byte (`0..=255`, stored as `i32` for the device),
//! and a window of `seq_len + 1` bytes gives `seq_len` tokens and the `seq_len` targets that
//! follow each of them (the same window shifted by one).
//!
//! # Which files are read
//!
//! [`Corpus::from_path`] takes one file or a folder. A folder is walked recursively and its
//! files are read in sorted order of their paths relative to the folder (compared component
//! by component, so a folder's contents come right after its name sorts), which makes the
//! corpus the same on every machine. The walk:
//!
//! * skips every entry whose name starts with `.` (`.git`, `.toolchain`, `.bundle`, ...) and
//!   the folders named in [`SKIPPED_DIRS`] (`target`, ...);
//! * skips symbolic links (no cycles, nothing read from outside the folder);
//! * skips, and lists in [`Corpus::skipped`], files that are empty, larger than
//!   [`MAX_FILE_BYTES`], contain a NUL byte (binary) or are not valid UTF-8;
//! * with [`Corpus::from_path_with_extensions`], reads only the files whose extension is
//!   listed.
//!
//! Each file's bytes are followed by [`SEPARATOR`] (`"\n\n"`). A single file named directly
//! must pass the same text checks (else [`DataError::NotText`]) and may be up to
//! [`MAX_CORPUS_BYTES`], the limit on the whole corpus.
//!
//! [`Corpus::default_for_repo`] reads this repository's own sources and documents: the files
//! with an extension in [`REPO_EXTENSIONS`] under [`repo_root`].
//!
//! # Split and sampling
//!
//! [`Corpus::split`] holds out the last ~5% of the bytes, as whole windows of `seq_len + 1`
//! bytes (at least one), for validation; the rest is the training part. A [`Sampler`] draws
//! training windows at random offsets from a seeded generator; its [`SamplerState`] is
//! serializable and [`Sampler::from_state`] continues the exact same sequence, so a resumed
//! run sees the same batches as an uninterrupted one. Validation batches are a fixed set:
//! the held-out windows in order ([`Split::validation_batch`]).
//!
//! ```no_run
//! use fp8_moe::train::data::{Corpus, Sampler};
//!
//! # fn main() -> Result<(), fp8_moe::train::data::DataError> {
//! let seq_len = 128;
//! let split = Corpus::default_for_repo()?.split(seq_len)?;
//! let mut sampler = split.sampler(42)?;
//! let (mut tokens, mut targets) = (vec![0i32; 8 * seq_len], vec![0i32; 8 * seq_len]);
//! sampler.next_batch(split.train(), 8, &mut tokens, &mut targets)?;
//! // ... train; store `sampler.state()` in the checkpoint, and on resume:
//! let state = sampler.state();
//! let resumed = Sampler::from_state(&state, split.train().len(), seq_len)?;
//! # let _ = resumed;
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::fs;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::rng::Rng;

/// The bytes written after each file of the corpus.
pub const SEPARATOR: &[u8] = b"\n\n";

/// Files larger than this are skipped in a folder walk (generated or data files, not prose or
/// code).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// The largest corpus read (one file named directly, or a folder's files together).
pub const MAX_CORPUS_BYTES: u64 = 1 << 30;

/// Folder names skipped in a walk besides hidden ones (names starting with `.`): build
/// outputs and caches.
pub const SKIPPED_DIRS: &[&str] = &["target", "node_modules", "__pycache__"];

/// The extensions [`Corpus::default_for_repo`] reads: Rust, Markdown, CUDA sources and
/// headers, TOML, shell and Python scripts, plain text.
pub const REPO_EXTENSIONS: &[&str] = &["rs", "md", "cu", "cuh", "toml", "sh", "py", "txt"];

/// The fraction of the corpus held out for validation, as `1 / VALID_DIVISOR` (rounded down
/// to whole windows, at least one window).
pub const VALID_DIVISOR: usize = 20;

/// The [`Rng`] stream the sampler draws from (any fixed number; named so that other users of
/// the same seed draw unrelated values).
const SAMPLER_STREAM: u64 = 0xDA7A;

/// Why the corpus could not be read or sampled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The path named as the corpus does not exist.
    #[error("corpus path {} does not exist", path.display())]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// Reading a file or folder failed.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// A file named directly is not text.
    #[error("{} is not usable as text: {reason}", path.display())]
    NotText {
        /// The file.
        path: PathBuf,
        /// Why it was refused.
        reason: SkipReason,
    },
    /// A folder held no file that passed the filters.
    #[error(
        "no usable text under {}: {skipped} file(s) skipped (empty, binary, not UTF-8 or \
         larger than {MAX_FILE_BYTES} bytes){}",
        path.display(),
        match extensions {
            Some(e) => format!(", only extensions {e} read"),
            None => String::new(),
        }
    )]
    NoText {
        /// The folder.
        path: PathBuf,
        /// How many files were skipped as not text.
        skipped: usize,
        /// The extension filter, if one was applied (comma-separated).
        extensions: Option<String>,
    },
    /// The corpus is larger than [`MAX_CORPUS_BYTES`].
    #[error("corpus {} is too large: {len} bytes, at most {MAX_CORPUS_BYTES} are read", path.display())]
    TooLarge {
        /// The file or folder.
        path: PathBuf,
        /// Its size in bytes (so far, for a folder).
        len: u64,
    },
    /// The corpus (or its training part) is too short for one window of `seq_len + 1` bytes.
    #[error(
        "corpus too short: {len} bytes, sequence length {seq_len} needs at least {needed} \
         ({what})"
    )]
    TooShort {
        /// The bytes available.
        len: usize,
        /// The sequence length asked for.
        seq_len: usize,
        /// The bytes needed.
        needed: usize,
        /// What the bytes are needed for.
        what: &'static str,
    },
    /// A sequence length of zero.
    #[error("sequence length must be at least 1")]
    ZeroSeqLen,
    /// No repository root was found for [`Corpus::default_for_repo`].
    #[error(
        "cannot find the repository to read as the default corpus: no folder holding a \
         workspace Cargo.toml and src/ encloses {} and the build's {} is gone; run from inside \
         the repository or name a corpus path",
        cwd.display(),
        manifest_dir.display()
    )]
    NoRepoRoot {
        /// The current directory searched from.
        cwd: PathBuf,
        /// The workspace folder recorded at build time.
        manifest_dir: PathBuf,
    },
    /// A saved sampler state belongs to another corpus or sequence length.
    #[error(
        "sampler state was saved for a training part of {saved_len} bytes and sequence length \
         {saved_seq_len}, but this run has {len} bytes and sequence length {seq_len} (a \
         different corpus or configuration)"
    )]
    StateMismatch {
        /// The training part's length in the state.
        saved_len: usize,
        /// The sequence length in the state.
        saved_seq_len: usize,
        /// This run's training part length.
        len: usize,
        /// This run's sequence length.
        seq_len: usize,
    },
    /// Batch buffers of the wrong size, or training bytes other than the sampler's.
    #[error("{what}: {got} given, {expected} expected")]
    BatchShape {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length it needs.
        expected: usize,
    },
}

/// Why a file was left out of the corpus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum SkipReason {
    /// It holds no bytes.
    Empty,
    /// It is larger than the limit (its size in bytes).
    TooLarge(u64),
    /// It contains a NUL byte (a binary file).
    Binary,
    /// It is not valid UTF-8.
    NotUtf8,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::Empty => write!(f, "empty"),
            SkipReason::TooLarge(n) => write!(f, "{n} bytes, larger than the limit"),
            SkipReason::Binary => write!(f, "binary (contains a NUL byte)"),
            SkipReason::NotUtf8 => write!(f, "not valid UTF-8"),
        }
    }
}

/// One file read into the corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFile {
    /// Its path (the folder given joined with the relative path).
    pub path: PathBuf,
    /// Where its bytes start in [`Corpus::bytes`].
    pub offset: usize,
    /// Its length in bytes (without the separator).
    pub len: usize,
}

/// One file left out of the corpus, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Its path.
    pub path: PathBuf,
    /// Why it was left out.
    pub reason: SkipReason,
}

/// The corpus: the bytes of its files, each followed by [`SEPARATOR`].
#[derive(Clone)]
pub struct Corpus {
    bytes: Vec<u8>,
    files: Vec<SourceFile>,
    skipped: Vec<Skipped>,
}

impl fmt::Debug for Corpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Corpus")
            .field("len", &self.bytes.len())
            .field("files", &self.files.len())
            .field("skipped", &self.skipped.len())
            .finish()
    }
}

impl Corpus {
    /// Reads a file, or every text file under a folder (see the [module docs](self) for the
    /// rules).
    pub fn from_path(path: &Path) -> Result<Corpus, DataError> {
        Corpus::read(path, None)
    }

    /// As [`from_path`](Self::from_path), but a folder walk reads only files whose extension
    /// (after the last `.`, case-sensitive) is in `extensions`. A file named directly is read
    /// whatever its extension.
    pub fn from_path_with_extensions(
        path: &Path,
        extensions: &[&str],
    ) -> Result<Corpus, DataError> {
        Corpus::read(path, Some(extensions))
    }

    /// This repository's text: the files with an extension in [`REPO_EXTENSIONS`] under
    /// [`repo_root`].
    pub fn default_for_repo() -> Result<Corpus, DataError> {
        Corpus::from_path_with_extensions(&repo_root()?, REPO_EXTENSIONS)
    }

    /// A corpus of the given bytes (one unnamed "file", no separator added).
    pub fn from_bytes(bytes: Vec<u8>) -> Corpus {
        let len = bytes.len();
        Corpus {
            bytes,
            files: vec![SourceFile {
                path: PathBuf::new(),
                offset: 0,
                len,
            }],
            skipped: Vec::new(),
        }
    }

    /// All the bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The number of bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether there are no bytes (never true for a corpus read from a path).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The files read, in corpus order.
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }

    /// The files a folder walk left out as not text, in walk order.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// Splits off the last ~5% (`1 / VALID_DIVISOR`, rounded down to whole windows of
    /// `seq_len + 1` bytes, at least one window) for validation. Needs at least one window
    /// for each part.
    pub fn split(self, seq_len: usize) -> Result<Split, DataError> {
        if seq_len == 0 {
            return Err(DataError::ZeroSeqLen);
        }
        let window = seq_len + 1;
        let len = self.bytes.len();
        let needed = 2 * window;
        if len < needed {
            return Err(DataError::TooShort {
                len,
                seq_len,
                needed,
                what: "one training and one validation window of seq_len + 1 bytes",
            });
        }
        let windows = (len / VALID_DIVISOR / window).max(1);
        let valid_start = len - windows * window;
        Ok(Split {
            corpus: self,
            seq_len,
            valid: valid_start..len,
        })
    }

    fn read(path: &Path, extensions: Option<&[&str]>) -> Result<Corpus, DataError> {
        let meta = match fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(DataError::NotFound {
                    path: path.to_owned(),
                });
            }
            Err(source) => {
                return Err(DataError::Io {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let mut corpus = Corpus {
            bytes: Vec::new(),
            files: Vec::new(),
            skipped: Vec::new(),
        };
        if !meta.is_dir() {
            if meta.len() > MAX_CORPUS_BYTES {
                return Err(DataError::TooLarge {
                    path: path.to_owned(),
                    len: meta.len(),
                });
            }
            let bytes = read_file(path)?;
            if let Err(reason) = check_text(&bytes) {
                return Err(DataError::NotText {
                    path: path.to_owned(),
                    reason,
                });
            }
            corpus.push(path.to_owned(), &bytes);
            return Ok(corpus);
        }
        let mut relative = Vec::new();
        walk(path, Path::new(""), extensions, &mut relative)?;
        relative.sort();
        for rel in relative {
            let full = path.join(&rel);
            let size = fs::metadata(&full)
                .map_err(|source| DataError::Io {
                    path: full.clone(),
                    source,
                })?
                .len();
            if size > MAX_FILE_BYTES {
                corpus.skip(full, SkipReason::TooLarge(size));
                continue;
            }
            let bytes = read_file(&full)?;
            match check_text(&bytes) {
                Ok(()) => corpus.push(full, &bytes),
                Err(reason) => corpus.skip(full, reason),
            }
            if corpus.bytes.len() as u64 > MAX_CORPUS_BYTES {
                return Err(DataError::TooLarge {
                    path: path.to_owned(),
                    len: corpus.bytes.len() as u64,
                });
            }
        }
        if corpus.files.is_empty() {
            return Err(DataError::NoText {
                path: path.to_owned(),
                skipped: corpus.skipped.len(),
                extensions: extensions.map(|e| e.join(",")),
            });
        }
        Ok(corpus)
    }

    fn push(&mut self, path: PathBuf, bytes: &[u8]) {
        self.files.push(SourceFile {
            path,
            offset: self.bytes.len(),
            len: bytes.len(),
        });
        self.bytes.extend_from_slice(bytes);
        self.bytes.extend_from_slice(SEPARATOR);
    }

    fn skip(&mut self, path: PathBuf, reason: SkipReason) {
        self.skipped.push(Skipped { path, reason });
    }
}

/// The folder whose text [`Corpus::default_for_repo`] reads: the nearest folder enclosing
/// the current directory that holds a `Cargo.toml` declaring `[workspace]` and a `src/`
/// folder (so a copy of the repository on another machine reads itself), else the
/// workspace folder this crate was built from, if it still exists.
pub fn repo_root() -> Result<PathBuf, DataError> {
    let cwd = std::env::current_dir().unwrap_or_default();
    let is_root = |dir: &Path| {
        dir.join("src").is_dir()
            && fs::read_to_string(dir.join("Cargo.toml"))
                .map(|toml| toml.lines().any(|l| l.trim() == "[workspace]"))
                .unwrap_or(false)
    };
    if let Some(dir) = cwd.ancestors().find(|d| is_root(d)) {
        return Ok(dir.to_owned());
    }
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if manifest_dir.join("Cargo.toml").is_file() {
        return Ok(manifest_dir);
    }
    Err(DataError::NoRepoRoot { cwd, manifest_dir })
}

/// Appends to `out` the paths (relative to `root`) of the files under `root/rel` that pass
/// the name filters.
fn walk(
    root: &Path,
    rel: &Path,
    extensions: Option<&[&str]>,
    out: &mut Vec<PathBuf>,
) -> Result<(), DataError> {
    let dir = root.join(rel);
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| DataError::Io { path, source }
    };
    for entry in fs::read_dir(&dir).map_err(io_err(&dir))? {
        let entry = entry.map_err(io_err(&dir))?;
        let name = entry.file_name();
        let name_str = name.to_string_lossy();
        if name_str.starts_with('.') {
            continue;
        }
        let kind = entry.file_type().map_err(io_err(&entry.path()))?;
        let child = rel.join(&name);
        if kind.is_dir() {
            if !SKIPPED_DIRS.contains(&name_str.as_ref()) {
                walk(root, &child, extensions, out)?;
            }
        } else if kind.is_file() {
            let wanted = match extensions {
                None => true,
                Some(exts) => Path::new(&name)
                    .extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| exts.contains(&e)),
            };
            if wanted {
                out.push(child);
            }
        }
        // Symbolic links and special files are neither followed nor read.
    }
    Ok(())
}

fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    fs::read(path).map_err(|source| DataError::Io {
        path: path.to_owned(),
        source,
    })
}

fn check_text(bytes: &[u8]) -> Result<(), SkipReason> {
    if bytes.is_empty() {
        Err(SkipReason::Empty)
    } else if bytes.contains(&0) {
        Err(SkipReason::Binary)
    } else if std::str::from_utf8(bytes).is_err() {
        Err(SkipReason::NotUtf8)
    } else {
        Ok(())
    }
}

/// Writes the tokens and targets of the window starting at `start` into the `seq_len`-long
/// output rows.
fn fill_window(data: &[u8], start: usize, tokens: &mut [i32], targets: &mut [i32]) {
    let seq_len = tokens.len();
    let window = &data[start..start + seq_len + 1];
    for (t, &b) in tokens.iter_mut().zip(&window[..seq_len]) {
        *t = i32::from(b);
    }
    for (t, &b) in targets.iter_mut().zip(&window[1..]) {
        *t = i32::from(b);
    }
}

/// Checks that `tokens` and `targets` hold `batch * seq_len` values each.
fn check_batch_buffers(
    batch: usize,
    seq_len: usize,
    tokens: &[i32],
    targets: &[i32],
) -> Result<(), DataError> {
    let expected = batch.saturating_mul(seq_len);
    for (what, got) in [
        ("batch tokens", tokens.len()),
        ("batch targets", targets.len()),
    ] {
        if got != expected {
            return Err(DataError::BatchShape {
                what,
                got,
                expected,
            });
        }
    }
    Ok(())
}

/// A corpus split into a training part (the front) and a validation part (the last whole
/// windows), made by [`Corpus::split`].
#[derive(Debug, Clone)]
pub struct Split {
    corpus: Corpus,
    seq_len: usize,
    valid: Range<usize>,
}

impl Split {
    /// The sequence length the split was made for.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The whole corpus.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// The training bytes (what a [`Sampler`] draws from).
    pub fn train(&self) -> &[u8] {
        &self.corpus.bytes[..self.valid.start]
    }

    /// The held-out bytes: [`validation_windows`](Self::validation_windows) windows of
    /// `seq_len + 1` bytes.
    pub fn valid(&self) -> &[u8] {
        &self.corpus.bytes[self.valid.clone()]
    }

    /// The byte range of the held-out part within the corpus.
    pub fn valid_range(&self) -> Range<usize> {
        self.valid.clone()
    }

    /// A training sampler over [`train`](Self::train) with this split's sequence length.
    pub fn sampler(&self, seed: u64) -> Result<Sampler, DataError> {
        Sampler::new(self.train().len(), self.seq_len, seed)
    }

    /// The number of held-out windows.
    pub fn validation_windows(&self) -> usize {
        self.valid.len() / (self.seq_len + 1)
    }

    /// The number of validation batches of `batch` windows that cover every held-out window
    /// once (the last one wraps around to the first windows when `batch` does not divide
    /// the count).
    pub fn validation_batches(&self, batch: usize) -> usize {
        self.validation_windows().div_ceil(batch.max(1))
    }

    /// Fills validation batch `index`: windows `index * batch + i` (modulo the number of
    /// windows) for `i` in `0..batch`, each `seq_len` tokens and targets, row after row. The
    /// same `(index, batch)` always gives the same data. An error (nothing written) if
    /// `tokens` or `targets` does not hold `batch * seq_len` values.
    pub fn validation_batch(
        &self,
        index: usize,
        batch: usize,
        tokens: &mut [i32],
        targets: &mut [i32],
    ) -> Result<(), DataError> {
        let seq_len = self.seq_len;
        check_batch_buffers(batch, seq_len, tokens, targets)?;
        let windows = self.validation_windows();
        let rows = tokens
            .chunks_exact_mut(seq_len)
            .zip(targets.chunks_exact_mut(seq_len));
        for (i, (tok, tgt)) in rows.enumerate() {
            let w = (index * batch + i) % windows;
            fill_window(self.valid(), w * (seq_len + 1), tok, tgt);
        }
        Ok(())
    }
}

/// A sampler's position, saved in a checkpoint and given to [`Sampler::from_state`] to
/// continue exactly where it stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The seed the sampler was made with.
    pub seed: u64,
    /// How many windows it has drawn.
    pub draws: u64,
    /// The length of the training bytes it draws from.
    pub corpus_len: usize,
    /// The sequence length.
    pub seq_len: usize,
}

/// Draws training windows at uniformly random offsets, from [`Rng`] stream `0xDA7A` of its
/// seed. Each window takes one 64-bit draw, so the position is the number of windows drawn.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: Rng,
    state: SamplerState,
}

impl Sampler {
    /// A sampler of windows of `seq_len + 1` bytes from training bytes of length
    /// `corpus_len`.
    pub fn new(corpus_len: usize, seq_len: usize, seed: u64) -> Result<Sampler, DataError> {
        if seq_len == 0 {
            return Err(DataError::ZeroSeqLen);
        }
        if corpus_len < seq_len + 1 {
            return Err(DataError::TooShort {
                len: corpus_len,
                seq_len,
                needed: seq_len + 1,
                what: "one training window of seq_len + 1 bytes",
            });
        }
        Ok(Sampler {
            rng: Rng::new(seed, SAMPLER_STREAM),
            state: SamplerState {
                seed,
                draws: 0,
                corpus_len,
                seq_len,
            },
        })
    }

    /// The sampler at a saved position, for training bytes of length `corpus_len` and
    /// sequence length `seq_len`, which must be those the state was saved with. It replays
    /// the generator `state.draws` times (about a second per billion windows).
    pub fn from_state(
        state: &SamplerState,
        corpus_len: usize,
        seq_len: usize,
    ) -> Result<Sampler, DataError> {
        if state.corpus_len != corpus_len || state.seq_len != seq_len {
            return Err(DataError::StateMismatch {
                saved_len: state.corpus_len,
                saved_seq_len: state.seq_len,
                len: corpus_len,
                seq_len,
            });
        }
        let mut sampler = Sampler::new(corpus_len, seq_len, state.seed)?;
        for _ in 0..state.draws {
            sampler.rng.next_u64();
        }
        sampler.state.draws = state.draws;
        Ok(sampler)
    }

    /// The position to save.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// The number of windows drawn so far.
    pub fn draws(&self) -> u64 {
        self.state.draws
    }

    /// The start offset of the next window (in `0..=corpus_len - seq_len - 1`).
    pub fn next_start(&mut self) -> usize {
        self.state.draws += 1;
        self.rng.below(self.state.corpus_len - self.state.seq_len)
    }

    /// Draws `batch` windows of `data` (the training bytes, of the length the sampler was
    /// made for) and writes their tokens (`window[..seq_len]`) and targets
    /// (`window[1..]`), row after row, into `out_tokens` and `out_targets`. An error
    /// (nothing drawn or written) if `data` is not `corpus_len` bytes long or an output
    /// does not hold `batch * seq_len` values.
    pub fn next_batch(
        &mut self,
        data: &[u8],
        batch: usize,
        out_tokens: &mut [i32],
        out_targets: &mut [i32],
    ) -> Result<(), DataError> {
        let seq_len = self.state.seq_len;
        if data.len() != self.state.corpus_len {
            return Err(DataError::BatchShape {
                what: "training bytes for this sampler",
                got: data.len(),
                expected: self.state.corpus_len,
            });
        }
        check_batch_buffers(batch, seq_len, out_tokens, out_targets)?;
        let rows = out_tokens
            .chunks_exact_mut(seq_len)
            .zip(out_targets.chunks_exact_mut(seq_len));
        for (tok, tgt) in rows {
            let start = self.next_start();
            fill_window(data, start, tok, tgt);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::train::test_util::TempDir;

    fn text(n: usize) -> Vec<u8> {
        (0..n).map(|i| b'a' + (i * 7 % 26) as u8).collect()
    }

    #[test]
    fn folder_walk_is_sorted_and_filtered() {
        let t = TempDir::new("walk");
        t.write("b.rs", b"bee");
        t.write("a/z.md", b"zed");
        t.write("a.txt", b"ay");
        t.write("a/b/c.txt", b"see");
        t.write(".git/config", b"hidden");
        t.write(".hidden.md", b"hidden");
        t.write("target/x.rs", b"build output");
        t.write("bin.rs", b"a\0b");
        t.write("latin1.txt", b"caf\xe9");
        t.write("empty.md", b"");
        t.write("big.txt", &vec![b'x'; MAX_FILE_BYTES as usize + 1]);
        t.write("data.csv", b"1,2");
        #[cfg(unix)]
        std::os::unix::fs::symlink(t.0.join("b.rs"), t.0.join("link.rs")).unwrap();

        let c = Corpus::from_path(&t.0).unwrap();
        let rel: Vec<_> = c
            .files()
            .iter()
            .map(|f| f.path.strip_prefix(&t.0).unwrap().to_str().unwrap())
            .collect();
        // Component-wise order: `a/...` before `a.txt`.
        assert_eq!(rel, ["a/b/c.txt", "a/z.md", "a.txt", "b.rs", "data.csv"]);
        assert_eq!(c.bytes(), b"see\n\nzed\n\nay\n\nbee\n\n1,2\n\n");
        assert_eq!(c.files()[2].offset, 10);
        assert_eq!(c.files()[2].len, 2);
        let mut skipped: Vec<_> = c
            .skipped()
            .iter()
            .map(|s| {
                let name = s.path.file_name().unwrap().to_str().unwrap();
                (name, s.reason.clone())
            })
            .collect();
        skipped.sort_by_key(|s| s.0);
        assert_eq!(
            skipped,
            [
                ("big.txt", SkipReason::TooLarge(MAX_FILE_BYTES + 1)),
                ("bin.rs", SkipReason::Binary),
                ("empty.md", SkipReason::Empty),
                ("latin1.txt", SkipReason::NotUtf8),
            ]
        );

        let c = Corpus::from_path_with_extensions(&t.0, &["rs", "md"]).unwrap();
        assert_eq!(c.bytes(), b"zed\n\nbee\n\n");
        let e = Corpus::from_path_with_extensions(&t.0, &["py"]).unwrap_err();
        assert!(matches!(e, DataError::NoText { .. }), "{e}");
    }

    #[test]
    fn single_file_and_errors() {
        let t = TempDir::new("file");
        t.write("one.txt", b"hello");
        t.write("bin.dat", b"\x00\x01");
        let c = Corpus::from_path(&t.0.join("one.txt")).unwrap();
        assert_eq!(c.bytes(), b"hello\n\n");
        let e = Corpus::from_path(&t.0.join("bin.dat")).unwrap_err();
        assert!(
            matches!(
                e,
                DataError::NotText {
                    reason: SkipReason::Binary,
                    ..
                }
            ),
            "{e}"
        );
        let e = Corpus::from_path(&t.0.join("missing")).unwrap_err();
        assert!(matches!(e, DataError::NotFound { .. }), "{e}");
        assert!(e.to_string().contains("does not exist"));
        let empty = TempDir::new("empty");
        let e = Corpus::from_path(&empty.0).unwrap_err();
        assert!(e.to_string().contains("no usable text"), "{e}");
        let e = c.split(4).unwrap_err();
        assert!(matches!(e, DataError::TooShort { needed: 10, .. }), "{e}");
        assert!(matches!(
            Sampler::new(4, 4, 0),
            Err(DataError::TooShort { needed: 5, .. })
        ));
        assert!(matches!(Sampler::new(4, 0, 0), Err(DataError::ZeroSeqLen)));
    }

    #[test]
    fn split_holds_out_whole_windows_at_the_end() {
        let bytes = text(10_000);
        let split = Corpus::from_bytes(bytes.clone()).split(15).unwrap();
        // 10_000 / 20 = 500 bytes -> 31 windows of 16.
        assert_eq!(split.validation_windows(), 31);
        assert_eq!(split.valid().len(), 31 * 16);
        assert_eq!(split.train().len() + split.valid().len(), 10_000);
        assert_eq!(split.valid(), &bytes[10_000 - 496..]);
        // Tiny corpus: one window each way at least.
        let split = Corpus::from_bytes(text(20)).split(9).unwrap();
        assert_eq!((split.train().len(), split.validation_windows()), (10, 1));
        assert_eq!(split.validation_batches(4), 1);
    }

    #[test]
    fn validation_batches_are_fixed_and_shifted() {
        let bytes = text(4000);
        let split = Corpus::from_bytes(bytes.clone()).split(7).unwrap();
        let n = split.validation_windows();
        assert_eq!(n, 25);
        assert_eq!(split.validation_batches(4), 7);
        let (mut tok, mut tgt) = (vec![0; 4 * 7], vec![0; 4 * 7]);
        split.validation_batch(6, 4, &mut tok, &mut tgt).unwrap();
        let start = split.valid_range().start;
        // Windows 24, then 0, 1, 2 (wrapped).
        for (row, w) in [24usize, 0, 1, 2].into_iter().enumerate() {
            let at = start + w * 8;
            for i in 0..7 {
                assert_eq!(tok[row * 7 + i], i32::from(bytes[at + i]));
                assert_eq!(tgt[row * 7 + i], i32::from(bytes[at + i + 1]));
            }
        }
        let (mut tok2, mut tgt2) = (vec![0; 4 * 7], vec![0; 4 * 7]);
        split.validation_batch(6, 4, &mut tok2, &mut tgt2).unwrap();
        assert_eq!((tok, tgt), (tok2, tgt2));
    }

    #[test]
    fn sampler_is_deterministic_in_range_and_shifted() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let (seq, batch) = (16, 8);
        let mut a = Sampler::new(data.len(), seq, 7).unwrap();
        let mut b = Sampler::new(data.len(), seq, 7).unwrap();
        let mut c = Sampler::new(data.len(), seq, 8).unwrap();
        let bufs = || (vec![0i32; batch * seq], vec![0i32; batch * seq]);
        let (mut ta, mut ga) = bufs();
        let (mut tb, mut gb) = bufs();
        let (mut tc, mut gc) = bufs();
        let mut max_start = 0;
        for _ in 0..200 {
            a.next_batch(&data, batch, &mut ta, &mut ga).unwrap();
            b.next_batch(&data, batch, &mut tb, &mut gb).unwrap();
            c.next_batch(&data, batch, &mut tc, &mut gc).unwrap();
            assert_eq!((&ta, &ga), (&tb, &gb), "same seed, same batches");
            for (tok, tgt) in ta.chunks(seq).zip(ga.chunks(seq)) {
                // data[i] = i % 256, so a window is consecutive values from its start.
                let start = tok[0] as usize;
                for i in 0..seq {
                    assert_eq!(tok[i] as usize, (start + i) % 256);
                    assert_eq!(tgt[i] as usize, (start + i + 1) % 256);
                }
            }
        }
        assert_ne!(ta, tc, "different seeds differ");
        assert_eq!(a.draws(), 200 * batch as u64);
        let mut s = Sampler::new(20, 4, 3).unwrap();
        for _ in 0..10_000 {
            let start = s.next_start();
            assert!(start + 5 <= 20);
            max_start = max_start.max(start);
        }
        assert_eq!(max_start, 15, "the last window is reachable");
    }

    #[test]
    fn wrong_batch_buffers_are_errors_and_draw_nothing() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut s = Sampler::new(data.len(), 16, 7).unwrap();
        let (mut t, mut g) = (vec![0i32; 8 * 16], vec![0i32; 8 * 16 - 1]);
        let e = s.next_batch(&data, 8, &mut t, &mut g).unwrap_err();
        assert!(
            e.to_string()
                .contains("batch targets: 127 given, 128 expected"),
            "{e}"
        );
        let mut g2 = vec![0i32; 8 * 16];
        let e = s.next_batch(&data[1..], 8, &mut t, &mut g2).unwrap_err();
        assert!(e.to_string().contains("999 given, 1000 expected"), "{e}");
        assert_eq!(s.draws(), 0, "nothing drawn");
        let split = Corpus::from_bytes(data).split(16).unwrap();
        assert!(split.validation_batch(0, 2, &mut t, &mut g).is_err());
    }

    #[test]
    fn restored_sampler_continues_bit_identically() {
        let data = text(5000);
        let (seq, batch) = (32, 4);
        let mut run = Sampler::new(data.len(), seq, 99).unwrap();
        let (mut t, mut g) = (vec![0; batch * seq], vec![0; batch * seq]);
        for _ in 0..37 {
            run.next_batch(&data, batch, &mut t, &mut g).unwrap();
        }
        let json = serde_json::to_string(&run.state()).unwrap();
        let state: SamplerState = serde_json::from_str(&json).unwrap();
        let mut resumed = Sampler::from_state(&state, data.len(), seq).unwrap();
        assert_eq!(resumed.state(), run.state());
        let (mut t2, mut g2) = (vec![0; batch * seq], vec![0; batch * seq]);
        for _ in 0..50 {
            run.next_batch(&data, batch, &mut t, &mut g).unwrap();
            resumed.next_batch(&data, batch, &mut t2, &mut g2).unwrap();
            assert_eq!((&t, &g), (&t2, &g2));
        }
        let e = Sampler::from_state(&state, data.len() - 1, seq).unwrap_err();
        assert!(matches!(e, DataError::StateMismatch { .. }), "{e}");
    }

    #[test]
    fn repo_corpus_reads_this_repository() {
        let root = repo_root().unwrap();
        assert!(root.join("Cargo.toml").is_file());
        let c = Corpus::default_for_repo().unwrap();
        assert!(
            c.files()
                .iter()
                .any(|f| f.path.ends_with("src/train/data.rs"))
        );
        assert!(c.files().iter().all(|f| {
            let rel = f.path.strip_prefix(&root).unwrap();
            let hidden_or_target = rel.components().any(|p| {
                let s = p.as_os_str().to_string_lossy();
                s.starts_with('.') || s == "target"
            });
            let ext = rel.extension().unwrap().to_str().unwrap();
            !hidden_or_target && REPO_EXTENSIONS.contains(&ext)
        }));
    }
}
