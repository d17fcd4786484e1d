//! Checkpoints of the train job: a folder holding the tensors in `model.safetensors` and the
//! rest of the run's state (step, sampler and RNG positions, model configuration, whatever
//! the caller passes) in `state.json`.
//!
//! The caller owns the tensor list and the state's structure: [`save`] takes
//! [`TensorData`] (name, [`Dtype`], shape, little-endian bytes) and a `serde_json::Value`;
//! [`load`] gives them back in a [`Checkpoint`], whose [`expect`](Checkpoint::expect) checks
//! each tensor's dtype and shape by name and [`state_as`](Checkpoint::state_as) reads the
//! state into the caller's type.
//!
//! # Files
//!
//! `state.json` wraps the caller's state with what [`load`] checks:
//!
//! ```json
//! { "format": "fp8-moe-checkpoint", "version": 1,
//!   "model": { "bytes": 123456, "fnv1a64": "cbf29ce484222325" },
//!   "state": { ...the caller's value... } }
//! ```
//!
//! `model.safetensors` is the standard format (readable by Python's `safetensors`); its
//! size and 64-bit FNV-1a hash are recorded in `state.json`, so a truncated, padded or
//! altered file is refused before it is parsed.
//!
//! # Atomic replacement
//!
//! [`save`] writes both files into a fresh sibling folder `<dir>.tmp-<pid>-<nonce>` and
//! syncs them to disk; then, if `dir` exists, renames it aside to `<dir>.old-<pid>-<nonce>`,
//! renames the new folder to `dir`, syncs the parent folder and deletes the old one. So
//! `dir`, whenever it exists, holds one complete checkpoint: the old one until the new one
//! replaces it. A crash can leave behind a `.tmp-` sibling (possibly partial: delete it) and,
//! between the two renames, no `dir` at all but a complete `.old-` sibling (the previous
//! checkpoint: rename it back); [`load`]'s error for a missing `dir` lists such leftovers. A
//! save that fails with an error removes its `.tmp-` folder and puts the old checkpoint back.
//! [`save`] only replaces a folder that holds nothing but checkpoint files (or nothing), and
//! never a regular file or a symbolic link.
//!
//! ```no_run
//! use fp8_moe::train::checkpoint::{self, Dtype, TensorData};
//!
//! # fn main() -> Result<(), checkpoint::CheckpointError> {
//! let w = TensorData::from_slice("embed.weight", &[256, 4], &[0.5f32; 1024]);
//! let state = serde_json::json!({ "step": 100, "config": { "d_model": 4 } });
//! checkpoint::save("runs/a/checkpoint".as_ref(), &[w], &state)?;
//!
//! let ckpt = checkpoint::load("runs/a/checkpoint".as_ref())?;
//! let w: Vec<f32> = ckpt.expect("embed.weight", Dtype::F32, &[256, 4])?.to_vec()?;
//! let step = ckpt.state["step"].as_u64();
//! # let _ = (w, step);
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The `format` field of `state.json`.
pub const FORMAT: &str = "fp8-moe-checkpoint";
/// The layout version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The tensors' file inside a checkpoint folder.
pub const MODEL_FILE: &str = "model.safetensors";
/// The state's file inside a checkpoint folder.
pub const STATE_FILE: &str = "state.json";

/// Why a checkpoint could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// [`load`] was given a path that is not a folder.
    #[error("checkpoint {} is not a folder (a checkpoint is a folder holding {MODEL_FILE} and {STATE_FILE})", path.display())]
    NotAFolder {
        /// The path.
        path: PathBuf,
    },
    /// The checkpoint folder does not exist.
    #[error("checkpoint {} does not exist{}", dir.display(), leftover_hint(leftovers))]
    Missing {
        /// The folder.
        dir: PathBuf,
        /// Siblings an interrupted save left (`<dir>.old-*`, `<dir>.tmp-*`).
        leftovers: Vec<PathBuf>,
    },
    /// The folder lacks one of the two files.
    #[error("checkpoint {} is incomplete: {file} is missing", dir.display())]
    MissingFile {
        /// The folder.
        dir: PathBuf,
        /// The missing file's name.
        file: &'static str,
    },
    /// A file system operation failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done ("write", "rename", ...).
        action: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// `state.json` is not valid JSON or lacks the checkpoint fields.
    #[error("{} is not a valid checkpoint state file: {source}", path.display())]
    BadState {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// `state.json` is of another format or version.
    #[error(
        "{} is format {found}, but this build reads {FORMAT} version {FORMAT_VERSION}",
        path.display()
    )]
    UnsupportedFormat {
        /// The file.
        path: PathBuf,
        /// The format and version found.
        found: String,
    },
    /// `model.safetensors` is not the size recorded at save.
    #[error(
        "{} is {found} bytes but was saved with {expected}: the file is truncated or was \
         altered",
        path.display()
    )]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// Its size when saved.
        expected: u64,
        /// Its size now.
        found: u64,
    },
    /// `model.safetensors` does not have the hash recorded at save.
    #[error(
        "{} is corrupt: its FNV-1a hash is {found}, {expected} was recorded at save",
        path.display()
    )]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The hash recorded (hex).
        expected: String,
        /// The hash of the file now (hex).
        found: String,
    },
    /// `model.safetensors` does not parse.
    #[error("{} is not a valid safetensors file: {reason}", path.display())]
    BadModel {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        reason: String,
    },
    /// A tensor's element type is not one of [`Dtype`].
    #[error("{} holds tensor `{name}` of type {dtype}, which this build does not read", path.display())]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The type, as safetensors names it.
        dtype: String,
    },
    /// A tensor asked for is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint (it has {available})")]
    MissingTensor {
        /// The tensor asked for.
        name: String,
        /// The tensors present, comma-separated (shortened when many).
        available: String,
    },
    /// A tensor's type or shape is not the one expected.
    #[error(
        "tensor `{name}`: expected {expected_dtype} {expected_shape:?}, the checkpoint has \
         {found_dtype} {found_shape:?}"
    )]
    TensorMismatch {
        /// The tensor.
        name: String,
        /// The type expected.
        expected_dtype: Dtype,
        /// The shape expected.
        expected_shape: Vec<usize>,
        /// The type found.
        found_dtype: Dtype,
        /// The shape found.
        found_shape: Vec<usize>,
    },
    /// A tensor's bytes do not match its type and shape.
    #[error("tensor `{name}`: {len} bytes, but {dtype} {shape:?} takes {expected}")]
    TensorSize {
        /// The tensor.
        name: String,
        /// Its type.
        dtype: Dtype,
        /// Its shape.
        shape: Vec<usize>,
        /// The bytes given.
        len: usize,
        /// The bytes the type and shape take.
        expected: usize,
    },
    /// Two tensors given to [`save`] share a name.
    #[error("tensor name `{name}` is given twice")]
    DuplicateTensor {
        /// The name.
        name: String,
    },
    /// [`save`] was asked to replace something that is not a checkpoint folder.
    #[error(
        "refusing to write a checkpoint over {}: {why} (only empty folders and checkpoint \
         folders are replaced)",
        path.display()
    )]
    NotACheckpoint {
        /// The path.
        path: PathBuf,
        /// What it is.
        why: String,
    },
    /// The state does not deserialize into the type asked for by
    /// [`Checkpoint::state_as`].
    #[error("the checkpoint's state does not have the expected fields: {source}")]
    StateShape {
        /// The deserializer's error.
        source: serde_json::Error,
    },
}

fn leftover_hint(leftovers: &[PathBuf]) -> String {
    if leftovers.is_empty() {
        return String::new();
    }
    let names: Vec<_> = leftovers.iter().map(|p| p.display().to_string()).collect();
    format!(
        "; an interrupted save left {} (a `.old-` folder is the previous checkpoint, complete: \
         rename it back; a `.tmp-` folder may be partial)",
        names.join(", ")
    )
}

/// Element types of checkpoint tensors (those of safetensors that the host reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Dtype {
    /// `u8`.
    U8,
    /// `i8`.
    I8,
    /// `u16`.
    U16,
    /// `i16`.
    I16,
    /// `u32`.
    U32,
    /// `i32`.
    I32,
    /// `u64`.
    U64,
    /// `i64`.
    I64,
    /// IEEE half ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    Bf16,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// FP8 E4M3 (raw bytes).
    F8E4M3,
    /// FP8 E5M2 (raw bytes).
    F8E5M2,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            Dtype::U8 => S::U8,
            Dtype::I8 => S::I8,
            Dtype::U16 => S::U16,
            Dtype::I16 => S::I16,
            Dtype::U32 => S::U32,
            Dtype::I32 => S::I32,
            Dtype::U64 => S::U64,
            Dtype::I64 => S::I64,
            Dtype::F16 => S::F16,
            Dtype::Bf16 => S::BF16,
            Dtype::F32 => S::F32,
            Dtype::F64 => S::F64,
            Dtype::F8E4M3 => S::F8_E4M3,
            Dtype::F8E5M2 => S::F8_E5M2,
        }
    }

    fn from_safetensors(d: safetensors::Dtype) -> Option<Dtype> {
        use safetensors::Dtype as S;
        Some(match d {
            S::U8 => Dtype::U8,
            S::I8 => Dtype::I8,
            S::U16 => Dtype::U16,
            S::I16 => Dtype::I16,
            S::U32 => Dtype::U32,
            S::I32 => Dtype::I32,
            S::U64 => Dtype::U64,
            S::I64 => Dtype::I64,
            S::F16 => Dtype::F16,
            S::BF16 => Dtype::Bf16,
            S::F32 => Dtype::F32,
            S::F64 => Dtype::F64,
            S::F8_E4M3 => Dtype::F8E4M3,
            S::F8_E5M2 => Dtype::F8E5M2,
            _ => return None,
        })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Dtype::U8 => "u8",
            Dtype::I8 => "i8",
            Dtype::U16 => "u16",
            Dtype::I16 => "i16",
            Dtype::U32 => "u32",
            Dtype::I32 => "i32",
            Dtype::U64 => "u64",
            Dtype::I64 => "i64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::F8E4M3 => "f8e4m3",
            Dtype::F8E5M2 => "f8e5m2",
        };
        f.write_str(name)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A host element type with a [`Dtype`]: what [`TensorData::from_slice`] and
/// [`TensorData::to_vec`] convert (FP8 tensors are built from raw bytes instead).
pub trait Element: Copy + sealed::Sealed {
    /// Its checkpoint type.
    const DTYPE: Dtype;
    /// Appends its little-endian bytes.
    fn put_le(self, out: &mut Vec<u8>);
    /// Reads it from `DTYPE.size()` little-endian bytes.
    fn get_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: Dtype = Dtype::$d;
            fn put_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("one element's bytes"))
            }
        }
    )*};
}

element!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, half::f16 => F16, half::bf16 => Bf16, f32 => F32, f64 => F64,
);

/// One tensor of a checkpoint: its name, element type, shape and little-endian bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct TensorData {
    /// Its name (unique in a checkpoint).
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its dimensions, outermost first (empty for a scalar).
    pub shape: Vec<usize>,
    /// `shape.iter().product() * dtype.size()` little-endian bytes.
    pub bytes: Vec<u8>,
}

impl fmt::Debug for TensorData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorData")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl TensorData {
    /// A tensor of `data`'s values.
    ///
    /// # Panics
    ///
    /// If `data.len()` is not the product of `shape`.
    pub fn from_slice<T: Element>(name: &str, shape: &[usize], data: &[T]) -> TensorData {
        assert_eq!(
            data.len(),
            shape.iter().product::<usize>(),
            "tensor `{name}`: {} values for shape {shape:?}",
            data.len()
        );
        let mut bytes = Vec::with_capacity(data.len() * T::DTYPE.size());
        for &v in data {
            v.put_le(&mut bytes);
        }
        TensorData {
            name: name.to_owned(),
            dtype: T::DTYPE,
            shape: shape.to_vec(),
            bytes,
        }
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values, if the tensor's type is `T`'s.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, CheckpointError> {
        if self.dtype != T::DTYPE {
            return Err(self.mismatch(T::DTYPE, &self.shape));
        }
        self.check_size()?;
        Ok(self
            .bytes
            .chunks_exact(T::DTYPE.size())
            .map(T::get_le)
            .collect())
    }

    fn check_size(&self) -> Result<(), CheckpointError> {
        let expected = self.numel() * self.dtype.size();
        if self.bytes.len() != expected {
            return Err(CheckpointError::TensorSize {
                name: self.name.clone(),
                dtype: self.dtype,
                shape: self.shape.clone(),
                len: self.bytes.len(),
                expected,
            });
        }
        Ok(())
    }

    fn mismatch(&self, dtype: Dtype, shape: &[usize]) -> CheckpointError {
        CheckpointError::TensorMismatch {
            name: self.name.clone(),
            expected_dtype: dtype,
            expected_shape: shape.to_vec(),
            found_dtype: self.dtype,
            found_shape: self.shape.clone(),
        }
    }
}

impl safetensors::View for &TensorData {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype.to_safetensors()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// A loaded checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The tensors by name.
    pub tensors: BTreeMap<String, TensorData>,
    /// The caller's state, as given to [`save`].
    pub state: Value,
}

impl Checkpoint {
    /// The tensor `name`, if present.
    pub fn get(&self, name: &str) -> Option<&TensorData> {
        self.tensors.get(name)
    }

    /// The tensor `name`, checked to have type `dtype` and shape `shape`.
    pub fn expect(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
    ) -> Result<&TensorData, CheckpointError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                name: name.to_owned(),
                available: self.names_for_error(),
            })?;
        if t.dtype != dtype || t.shape != shape {
            return Err(t.mismatch(dtype, shape));
        }
        Ok(t)
    }

    /// The state read into `T`.
    pub fn state_as<T: DeserializeOwned>(&self) -> Result<T, CheckpointError> {
        T::deserialize(&self.state).map_err(|source| CheckpointError::StateShape { source })
    }

    fn names_for_error(&self) -> String {
        const SHOWN: usize = 8;
        if self.tensors.is_empty() {
            return "no tensors".into();
        }
        let s: Vec<&str> = self
            .tensors
            .keys()
            .take(SHOWN)
            .map(String::as_str)
            .collect();
        let more = self.tensors.len().saturating_sub(SHOWN);
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        format!("{}{tail}", s.join(", "))
    }
}

#[derive(Serialize, Deserialize)]
struct StateFile {
    format: String,
    version: u32,
    model: ModelFile,
    state: Value,
}

#[derive(Serialize, Deserialize)]
struct ModelFile {
    bytes: u64,
    /// Hex, so that tools reading JSON numbers as doubles keep every bit.
    fnv1a64: String,
}

/// 64-bit FNV-1a: a change of any single byte always changes the hash (each step is a
/// bijection of the state), and it needs no dependency. It guards against truncation and
/// corruption, not against tampering.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CheckpointError {
    let path = path.to_owned();
    move |source| CheckpointError::Io {
        action,
        path,
        source,
    }
}

/// Saves `tensors` and `state` as the checkpoint folder `dir`, atomically replacing the
/// checkpoint there, if any (see the [module docs](self)). Missing parent folders are
/// created.
pub fn save(dir: &Path, tensors: &[TensorData], state: &Value) -> Result<(), CheckpointError> {
    let mut names = std::collections::HashSet::new();
    for t in tensors {
        t.check_size()?;
        if !names.insert(t.name.as_str()) {
            return Err(CheckpointError::DuplicateTensor {
                name: t.name.clone(),
            });
        }
    }
    let model = safetensors::serialize(tensors.iter().map(|t| (t.name.as_str(), t)), None)
        .map_err(|e| CheckpointError::BadModel {
            path: dir.join(MODEL_FILE),
            reason: format!("cannot encode: {e}"),
        })?;
    let state_file = StateFile {
        format: FORMAT.to_owned(),
        version: FORMAT_VERSION,
        model: ModelFile {
            bytes: model.len() as u64,
            fnv1a64: format!("{:016x}", fnv1a64(&model)),
        },
        state: state.clone(),
    };
    let mut state_json =
        serde_json::to_vec_pretty(&state_file).map_err(|source| CheckpointError::BadState {
            path: dir.join(STATE_FILE),
            source,
        })?;
    state_json.push(b'\n');

    let exists = check_replaceable(dir)?;
    let (parent, name) = split_dir(dir)?;
    fs::create_dir_all(&parent).map_err(io_err("create", &parent))?;
    let tmp = fresh_sibling(&parent, &name, "tmp");
    fs::create_dir(&tmp).map_err(io_err("create", &tmp))?;
    let written = (|| {
        write_synced(&tmp.join(MODEL_FILE), &model)?;
        fault("model written")?;
        write_synced(&tmp.join(STATE_FILE), &state_json)?;
        fault("state written")?;
        sync_dir(&tmp)
    })();
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }

    if !exists {
        if let Err(e) = fs::rename(&tmp, dir) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(io_err("rename into place", dir)(e));
        }
        return sync_dir(&parent);
    }
    let old = fresh_sibling(&parent, &name, "old");
    if let Err(e) = fs::rename(dir, &old) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(io_err("move the previous checkpoint aside", dir)(e));
    }
    let swapped = fault("old moved aside")
        .and_then(|()| fs::rename(&tmp, dir).map_err(io_err("rename into place", dir)));
    if let Err(e) = swapped {
        // Put the previous checkpoint back; if even that fails, the error names where it is.
        if let Err(back) = fs::rename(&old, dir) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(io_err("restore the previous checkpoint from", &old)(back));
        }
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    sync_dir(&parent)?;
    // The new checkpoint is in place; a failure to delete the old copy leaves only litter.
    let _ = fs::remove_dir_all(&old);
    Ok(())
}

/// Checks, before a long run, that [`save`] will be able to write `dir`: a path ending in a
/// folder name, not a file, a symbolic link or a folder holding anything but a checkpoint,
/// in a parent folder (made if missing) where a new folder can be created. The actual save
/// checks all of it again.
pub fn check_target(dir: &Path) -> Result<(), CheckpointError> {
    check_replaceable(dir)?;
    let (parent, name) = split_dir(dir)?;
    fs::create_dir_all(&parent).map_err(io_err("create", &parent))?;
    let probe = fresh_sibling(&parent, &name, "probe");
    fs::create_dir(&probe).map_err(io_err("create a folder beside", dir))?;
    fs::remove_dir(&probe).map_err(io_err("remove", &probe))
}

/// Loads and validates the checkpoint folder `dir`: both files present, the format and
/// version known, `model.safetensors` of the recorded size and hash and parseable, every
/// tensor of a supported type.
pub fn load(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(CheckpointError::NotAFolder {
                path: dir.to_owned(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(CheckpointError::Missing {
                dir: dir.to_owned(),
                leftovers: leftovers(dir),
            });
        }
        Err(e) => return Err(io_err("read", dir)(e)),
    }
    let read = |file: &'static str| {
        let path = dir.join(file);
        fs::read(&path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                CheckpointError::MissingFile {
                    dir: dir.to_owned(),
                    file,
                }
            } else {
                io_err("read", &path)(e)
            }
        })
    };
    let state_path = dir.join(STATE_FILE);
    let state_bytes = read(STATE_FILE)?;
    let header: Value =
        serde_json::from_slice(&state_bytes).map_err(|source| CheckpointError::BadState {
            path: state_path.clone(),
            source,
        })?;
    let format = header.get("format").and_then(Value::as_str);
    let version = header.get("version").and_then(Value::as_u64);
    if format != Some(FORMAT) || version != Some(u64::from(FORMAT_VERSION)) {
        return Err(CheckpointError::UnsupportedFormat {
            path: state_path,
            found: format!(
                "{} version {}",
                format.unwrap_or("(none)"),
                version.map_or("(none)".into(), |v| v.to_string())
            ),
        });
    }
    let state_file: StateFile =
        serde_json::from_value(header).map_err(|source| CheckpointError::BadState {
            path: state_path,
            source,
        })?;

    let model_path = dir.join(MODEL_FILE);
    let model = read(MODEL_FILE)?;
    if model.len() as u64 != state_file.model.bytes {
        return Err(CheckpointError::SizeMismatch {
            path: model_path,
            expected: state_file.model.bytes,
            found: model.len() as u64,
        });
    }
    let hash = format!("{:016x}", fnv1a64(&model));
    if !hash.eq_ignore_ascii_case(&state_file.model.fnv1a64) {
        return Err(CheckpointError::ChecksumMismatch {
            path: model_path,
            expected: state_file.model.fnv1a64,
            found: hash,
        });
    }
    let parsed = SafeTensors::deserialize(&model).map_err(|e| CheckpointError::BadModel {
        path: model_path.clone(),
        reason: e.to_string(),
    })?;
    let mut tensors = BTreeMap::new();
    for (name, view) in parsed.iter() {
        let dtype = Dtype::from_safetensors(view.dtype()).ok_or_else(|| {
            CheckpointError::UnsupportedDtype {
                path: model_path.clone(),
                name: name.to_owned(),
                dtype: view.dtype().to_string(),
            }
        })?;
        let t = TensorData {
            name: name.to_owned(),
            dtype,
            shape: view.shape().to_vec(),
            bytes: view.data().to_vec(),
        };
        tensors.insert(t.name.clone(), t);
    }
    Ok(Checkpoint {
        tensors,
        state: state_file.state,
    })
}

/// Whether `dir` exists, after checking that it may be replaced: an empty folder or one
/// holding only checkpoint files.
fn check_replaceable(dir: &Path) -> Result<bool, CheckpointError> {
    let refuse = |why: &str| {
        Err(CheckpointError::NotACheckpoint {
            path: dir.to_owned(),
            why: why.to_owned(),
        })
    };
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err("inspect", dir)(e)),
    };
    if meta.file_type().is_symlink() {
        return refuse("it is a symbolic link");
    }
    if !meta.is_dir() {
        return refuse("it is a file, not a folder");
    }
    for entry in fs::read_dir(dir).map_err(io_err("read", dir))? {
        let entry = entry.map_err(io_err("read", dir))?;
        let name = entry.file_name();
        if name != MODEL_FILE && name != STATE_FILE {
            return refuse(&format!(
                "it holds `{}`, which is not part of a checkpoint",
                name.to_string_lossy()
            ));
        }
    }
    Ok(true)
}

/// The parent folder and final name of `dir`.
fn split_dir(dir: &Path) -> Result<(PathBuf, std::ffi::OsString), CheckpointError> {
    let name = dir
        .file_name()
        .ok_or_else(|| CheckpointError::NotACheckpoint {
            path: dir.to_owned(),
            why: "a checkpoint path must end in a folder name".into(),
        })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_owned()))
}

/// `<parent>/<name>.<kind>-<pid>-<nonce>`, a name no other save (in this or another process)
/// picks.
fn fresh_sibling(parent: &Path, name: &std::ffi::OsStr, kind: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut file = name.to_owned();
    file.push(format!(".{kind}-{}-{nanos:08x}{n}", std::process::id()));
    parent.join(file)
}

/// Siblings of `dir` named as an interrupted [`save`] leaves them.
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let Ok((parent, name)) = split_dir(dir) else {
        return Vec::new();
    };
    let name = name.to_string_lossy();
    let prefixes = [format!("{name}.old-"), format!("{name}.tmp-")];
    let mut found: Vec<PathBuf> = fs::read_dir(&parent)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            prefixes.iter().any(|p| n.starts_with(p.as_str()))
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(io_err("create", path))?;
    f.write_all(bytes).map_err(io_err("write", path))?;
    f.sync_all().map_err(io_err("sync", path))
}

/// Makes a folder's entries (new files, renames) durable.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err("sync", dir))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// The stage of [`save`] at which the test in this thread makes it fail.
    static FAIL_AT: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// An injected failure, in tests, at the named stage of [`save`].
fn fault(stage: &'static str) -> Result<(), CheckpointError> {
    #[cfg(test)]
    if FAIL_AT.get() == Some(stage) {
        return Err(CheckpointError::Io {
            action: "continue (injected failure)",
            path: PathBuf::from(stage),
            source: io::Error::other("injected"),
        });
    }
    let _ = stage;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use crate::train::test_util::TempDir;

    fn tensors(scale: f32) -> Vec<TensorData> {
        let w: Vec<f32> = (0..24).map(|i| i as f32 * scale).collect();
        let b: Vec<half::bf16> = (0..4).map(|i| half::bf16::from_f32(i as f32)).collect();
        vec![
            TensorData::from_slice("layer.0.w", &[4, 6], &w),
            TensorData::from_slice("layer.0.b", &[4], &b),
            TensorData::from_slice("tokens", &[3], &[1i32, -2, 3]),
            TensorData {
                name: "fp8".into(),
                dtype: Dtype::F8E4M3,
                shape: vec![2, 2],
                bytes: vec![0x38, 0x40, 0xb8, 0x00],
            },
            TensorData::from_slice("step", &[], &[7u64]),
        ]
    }

    fn state(step: u64) -> Value {
        json!({ "step": step, "sampler": { "seed": 1, "draws": 40 }, "config": { "d": 4 } })
    }

    #[test]
    fn round_trip() {
        let t = TempDir::new("roundtrip");
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(0.5), &state(10)).unwrap();
        let c = load(&dir).unwrap();
        assert_eq!(c.state, state(10));
        assert_eq!(c.tensors.len(), 5);
        for want in tensors(0.5) {
            assert_eq!(c.get(&want.name), Some(&want));
        }
        let w: Vec<f32> = c
            .expect("layer.0.w", Dtype::F32, &[4, 6])
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(w[23], 11.5);
        let b = c.expect("layer.0.b", Dtype::Bf16, &[4]).unwrap();
        assert_eq!(b.to_vec::<half::bf16>().unwrap()[3].to_f32(), 3.0);
        assert_eq!(c.get("step").unwrap().to_vec::<u64>().unwrap(), [7]);
        #[derive(Deserialize)]
        struct S {
            step: u64,
        }
        assert_eq!(c.state_as::<S>().unwrap().step, 10);
        assert!(matches!(
            c.state_as::<Vec<u8>>(),
            Err(CheckpointError::StateShape { .. })
        ));
        // The model file is plain safetensors.
        let bytes = fs::read(dir.join(MODEL_FILE)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.names().len(), 5);
        assert_eq!(t.entries(), ["ckpt"], "no temporary folders left");
    }

    #[test]
    fn expect_names_the_tensor_and_both_types_and_shapes() {
        let t = TempDir::new("expect");
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        let c = load(&dir).unwrap();
        let e = c.expect("layer.1.w", Dtype::F32, &[4, 6]).unwrap_err();
        assert!(matches!(e, CheckpointError::MissingTensor { .. }));
        let msg = e.to_string();
        assert!(
            msg.contains("`layer.1.w`") && msg.contains("layer.0.w"),
            "{msg}"
        );
        let e = c.expect("layer.0.w", Dtype::F32, &[6, 4]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `layer.0.w`: expected f32 [6, 4], the checkpoint has f32 [4, 6]"
        );
        let e = c.expect("layer.0.w", Dtype::Bf16, &[4, 6]).unwrap_err();
        assert!(e.to_string().contains("expected bf16 [4, 6]"), "{e}");
        let e = c.get("tokens").unwrap().to_vec::<f32>().unwrap_err();
        assert!(matches!(e, CheckpointError::TensorMismatch { .. }), "{e}");
    }

    #[test]
    fn truncated_flipped_and_foreign_files_are_rejected() {
        let t = TempDir::new("corrupt");
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        let model = dir.join(MODEL_FILE);
        let good = fs::read(&model).unwrap();

        fs::write(&model, &good[..good.len() - 3]).unwrap();
        let e = load(&dir).unwrap_err();
        assert!(matches!(e, CheckpointError::SizeMismatch { .. }), "{e}");
        assert!(e.to_string().contains("model.safetensors"), "{e}");

        let mut flipped = good.clone();
        flipped[good.len() - 5] ^= 0x10;
        fs::write(&model, &flipped).unwrap();
        let e = load(&dir).unwrap_err();
        assert!(matches!(e, CheckpointError::ChecksumMismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("model.safetensors is corrupt"),
            "{e}"
        );

        // Garbage with a matching recorded size and hash still fails to parse, by name.
        let junk = vec![0xffu8; 64];
        fs::write(&model, &junk).unwrap();
        let state_path = dir.join(STATE_FILE);
        let mut sf: Value = serde_json::from_slice(&fs::read(&state_path).unwrap()).unwrap();
        sf["model"] = json!({ "bytes": 64, "fnv1a64": format!("{:016x}", fnv1a64(&junk)) });
        fs::write(&state_path, serde_json::to_vec(&sf).unwrap()).unwrap();
        let e = load(&dir).unwrap_err();
        assert!(matches!(e, CheckpointError::BadModel { .. }), "{e}");
        assert!(e.to_string().contains("model.safetensors"), "{e}");

        sf["version"] = json!(99);
        fs::write(&state_path, serde_json::to_vec(&sf).unwrap()).unwrap();
        let e = load(&dir).unwrap_err();
        assert!(e.to_string().contains("version 99"), "{e}");

        fs::write(&state_path, b"{ not json").unwrap();
        let e = load(&dir).unwrap_err();
        assert!(matches!(e, CheckpointError::BadState { .. }), "{e}");

        fs::remove_file(&state_path).unwrap();
        let e = load(&dir).unwrap_err();
        assert!(
            matches!(
                e,
                CheckpointError::MissingFile {
                    file: STATE_FILE,
                    ..
                }
            ),
            "{e}"
        );
        let e = load(&t.0.join("nowhere")).unwrap_err();
        assert!(matches!(e, CheckpointError::Missing { .. }), "{e}");
        // Missing parents are created.
        save(&t.0.join("runs/a/ckpt"), &tensors(1.0), &state(5)).unwrap();
        assert_eq!(load(&t.0.join("runs/a/ckpt")).unwrap().state["step"], 5);
        let e = load(&t.0.join("nowhere2")).unwrap_err();
        assert!(matches!(e, CheckpointError::Missing { .. }), "{e}");
    }

    #[test]
    fn save_validates_tensors() {
        let t = TempDir::new("validate");
        let mut ts = tensors(1.0);
        ts.push(ts[0].clone());
        let e = save(&t.0.join("a"), &ts, &state(0)).unwrap_err();
        assert!(matches!(e, CheckpointError::DuplicateTensor { .. }), "{e}");
        let mut ts = tensors(1.0);
        ts[0].bytes.pop();
        let e = save(&t.0.join("a"), &ts, &state(0)).unwrap_err();
        assert!(
            e.to_string().contains("95 bytes, but f32 [4, 6] takes 96"),
            "{e}"
        );
        assert!(t.entries().is_empty());
    }

    #[test]
    fn save_replaces_an_existing_checkpoint() {
        let t = TempDir::new("replace");
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        save(&dir, &tensors(2.0), &state(2)).unwrap();
        let c = load(&dir).unwrap();
        assert_eq!(c.state["step"], 2);
        assert_eq!(c.get("layer.0.w"), Some(&tensors(2.0)[0]));
        assert_eq!(t.entries(), ["ckpt"]);
        // An empty folder is replaced too.
        let empty = t.0.join("empty");
        fs::create_dir(&empty).unwrap();
        save(&empty, &tensors(1.0), &state(3)).unwrap();
        assert_eq!(load(&empty).unwrap().state["step"], 3);
    }

    #[test]
    fn failed_save_leaves_the_old_checkpoint_intact() {
        let t = TempDir::new("fail");
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        let before = fs::read(dir.join(MODEL_FILE)).unwrap();
        for stage in ["model written", "state written", "old moved aside"] {
            FAIL_AT.set(Some(stage));
            let e = save(&dir, &tensors(2.0), &state(2)).unwrap_err();
            FAIL_AT.set(None);
            assert!(e.to_string().contains("injected"), "{stage}: {e}");
            let c = load(&dir).unwrap();
            assert_eq!(c.state["step"], 1, "{stage}");
            assert_eq!(fs::read(dir.join(MODEL_FILE)).unwrap(), before, "{stage}");
            assert_eq!(t.entries(), ["ckpt"], "{stage}: nothing left behind");
        }
        // A parent that is a file: the save fails before touching anything.
        fs::write(t.0.join("file"), b"x").unwrap();
        let e = save(&t.0.join("file/ckpt"), &tensors(1.0), &state(1)).unwrap_err();
        assert!(matches!(e, CheckpointError::Io { .. }), "{e}");
    }

    #[test]
    fn crash_between_renames_is_reported_with_the_leftover() {
        let t = TempDir::new("crash");
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        // What a crash after moving the old checkpoint aside leaves.
        let old = t.0.join("ckpt.old-1-2");
        fs::rename(&dir, &old).unwrap();
        let e = load(&dir).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("ckpt.old-1-2") && msg.contains("rename it back"),
            "{msg}"
        );
        assert_eq!(load(&old).unwrap().state["step"], 1);
    }

    #[test]
    fn a_save_target_is_checked_before_a_run_and_a_file_is_not_a_checkpoint_to_load() {
        let t = TempDir::new("target");
        let file = t.0.join("notes.txt");
        fs::write(&file, b"keep me").unwrap();
        // A file, a folder of other things, a path without a folder name: refused up front.
        let e = check_target(&file).unwrap_err();
        assert!(e.to_string().contains("it is a file"), "{e}");
        let folder = t.0.join("src");
        fs::create_dir(&folder).unwrap();
        fs::write(folder.join("main.rs"), b"").unwrap();
        assert!(check_target(&folder).is_err());
        assert!(check_target(Path::new(".")).is_err());
        // A new folder under missing parents, or an existing checkpoint: fine, and nothing
        // is left behind by the check.
        let fresh = t.0.join("a/b/ckpt");
        check_target(&fresh).unwrap();
        assert!(!fresh.exists());
        assert_eq!(fs::read_dir(t.0.join("a/b")).unwrap().count(), 0);
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        check_target(&dir).unwrap();
        // Loading a file says it is not a checkpoint folder (not a save-side refusal).
        let e = load(&file).unwrap_err();
        assert!(matches!(e, CheckpointError::NotAFolder { .. }), "{e}");
        assert!(e.to_string().contains("is not a folder"), "{e}");
    }

    #[test]
    fn refuses_to_clobber_what_is_not_a_checkpoint() {
        let t = TempDir::new("clobber");
        let file = t.0.join("notes.txt");
        fs::write(&file, b"keep me").unwrap();
        let e = save(&file, &tensors(1.0), &state(1)).unwrap_err();
        assert!(matches!(e, CheckpointError::NotACheckpoint { .. }), "{e}");
        assert_eq!(fs::read(&file).unwrap(), b"keep me");

        let folder = t.0.join("src");
        fs::create_dir(&folder).unwrap();
        fs::write(folder.join("main.rs"), b"fn main() {}").unwrap();
        let e = save(&folder, &tensors(1.0), &state(1)).unwrap_err();
        assert!(e.to_string().contains("`main.rs`"), "{e}");
        assert!(folder.join("main.rs").exists());

        // A checkpoint folder with something extra inside is not replaced either.
        let dir = t.0.join("ckpt");
        save(&dir, &tensors(1.0), &state(1)).unwrap();
        fs::write(dir.join("extra"), b"").unwrap();
        assert!(save(&dir, &tensors(2.0), &state(2)).is_err());
        assert_eq!(load(&dir).unwrap().state["step"], 1);
        assert_eq!(t.entries(), ["ckpt", "notes.txt", "src"]);
    }

    #[test]
    fn fnv1a64_matches_the_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
