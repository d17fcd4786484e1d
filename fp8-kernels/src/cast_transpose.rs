//! Cast-transpose: one pass over a `[rows, cols]` row-major high-precision matrix writes its
//! FP8 cast both row-major (`[rows, cols]`) and transposed (`[cols, rows]`), with amax fused.
//! The launcher validates everything first (nothing is enqueued on an error), then enqueues
//! one kernel without synchronising or allocating, so it works eagerly and inside a stream
//! capture alike.
//!
//! The kernel works on tiles of [`tile_rows`] x [`TILE_COLS`] elements through shared
//! memory. Tiles that are full, of a matrix with `rows % 16 == 0` and `cols % 16 == 0`, take
//! the fast path (16-byte loads, wide row-major stores, 16-byte stores of transposed rows);
//! every other tile (edges, odd shapes) goes element by element, so any shape works.

use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::format::DType;
use crate::module::kernel;
use crate::quantize::{ALIGN, idx};
use crate::tensor::{DeviceScalar, Fp8Tensor, HpBuffer, check_align, numel};

/// Threads per block of the cast-transpose kernel.
const THREADS: u32 = 256;
/// Columns of one cast-transpose tile.
pub const TILE_COLS: usize = 64;
/// Largest grid the kernel is launched with (CUDA's limit on `gridDim.x`).
const MAX_GRID: u64 = (1 << 31) - 1;

/// Rows of one cast-transpose tile for an input type: 128 for f16 / bf16, 64 for f32 (each
/// thread reads 4 rows of one 16-byte vector).
pub const fn tile_rows(dtype: DType) -> usize {
    4 * THREADS as usize * (16 / dtype.size()) / TILE_COLS
}

/// The number of tiles (= blocks launched) for a `[rows, cols]` input of `dtype`, or an error
/// when it exceeds the grid limit.
pub(crate) fn tile_count(rows: usize, cols: usize, dtype: DType) -> Result<u32> {
    let t =
        (rows.div_ceil(tile_rows(dtype)) as u64).saturating_mul(cols.div_ceil(TILE_COLS) as u64);
    if t > MAX_GRID {
        return Err(Error::InvalidArgument(format!(
            "cast-transpose of [{rows}, {cols}] needs {t} tiles, above the grid limit {MAX_GRID}"
        )));
    }
    Ok(t as u32)
}

/// Validates a matrix shape: both dimensions at least 1, element count within usize.
pub(crate) fn matrix_numel(what: &str, rows: usize, cols: usize) -> Result<usize> {
    if rows == 0 || cols == 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: shape [{rows}, {cols}] has an empty dimension"
        )));
    }
    numel(&[rows, cols])
}

/// Casts `input` (`[rows, cols]` row-major) to FP8 in `out.format()` twice in one pass:
/// row-major into `out` (shape `[rows, cols]`) and transposed into `out_t` (`[cols, rows]`
/// row-major, so `out_t[c * rows + r] == out[r * cols + c]`). Both are
/// `sat_rne(x * scale)` with `scale` read from `out.scale()` on the device; writes
/// `out.scale_inv() = 1 / scale`; maxes `max |input|` (unscaled; NaN wins, reported as the
/// canonical NaN) into `out.amax()`, which must hold a non-negative value. When `noop` is
/// given and holds 1.0 at run time, nothing at all is written.
///
/// Requirements (checked before any launch; nothing is written on an error):
/// `rows >= 1`, `cols >= 1`; `input.len() == rows * cols`; `out.shape() == [rows, cols]`;
/// `out_t.len() == rows * cols`; input, `out.data()` and `out_t` 16-byte aligned (buffers
/// from [`DeviceBuffer::alloc`] always are). Any `rows` and `cols` work; the fast path
/// covers matrices with `rows % 16 == 0` and `cols % 16 == 0` (all but the edge tiles).
pub fn cast_transpose<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    rows: usize,
    cols: usize,
    out: &Fp8Tensor,
    out_t: &DeviceBuffer<u8>,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let input: HpBuffer<'a> = input.into();
    let n = matrix_numel("cast_transpose", rows, cols)?;
    if input.len() != n {
        return Err(Error::InvalidArgument(format!(
            "cast_transpose: input has {} elements, [{rows}, {cols}] needs {n}",
            input.len()
        )));
    }
    check_align("cast_transpose input", input.device_ptr(), ALIGN)?;
    check_outputs("cast_transpose", rows, cols, out, out_t)?;
    let tiles = tile_count(rows, cols, input.dtype())?;
    let indices = slot_indices(out, noop)?;
    let name = format!(
        "fp8_cast_transpose_{}_{}",
        input.dtype().name(),
        out.format().name()
    );
    let (k, _sms) = kernel(stream.context(), &name)?;
    let (rows64, cols64) = (rows as u64, cols as u64);
    let null = 0u64;
    let out_t: &DeviceBuffer<u8> = out_t;
    let args = input
        .push_to(KernelArgs::new())
        .arg(out.data())
        .arg(out_t)
        .arg(&rows64)
        .arg(&cols64)
        .arg(out.scale().buffer())
        .arg(out.scale_inv().buffer())
        .arg(out.amax().buffer());
    let args = push_noop(args, noop, &null).arg(&indices);
    let cfg = LaunchConfig::linear(tiles, THREADS);
    // SAFETY: the kernel reads rows * cols input elements and writes rows * cols bytes to
    // each of out.data() and out_t, all checked to hold exactly that many and to be 16-byte
    // aligned (its widest access); tiles cover the matrix with blocks that bound-check every
    // element; each scalar slot index is inside its buffer (DeviceScalar checks it).
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

/// Checks the two outputs of a cast-transpose of a `[rows, cols]` matrix (`rows * cols`
/// checked by the caller): `out` of shape `[rows, cols]`, `out_t` of `rows * cols` bytes, both
/// 16-byte aligned.
pub(crate) fn check_outputs(
    what: &str,
    rows: usize,
    cols: usize,
    out: &Fp8Tensor,
    out_t: &DeviceBuffer<u8>,
) -> Result<()> {
    let n = matrix_numel(what, rows, cols)?;
    if out.shape() != [rows, cols] {
        return Err(Error::InvalidArgument(format!(
            "{what}: output shape {:?}, want [{rows}, {cols}]",
            out.shape()
        )));
    }
    if out_t.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{what}: transposed output has {} bytes, [{cols}, {rows}] needs {n}",
            out_t.len()
        )));
    }
    check_align(&format!("{what} output"), out.data().as_raw(), ALIGN)?;
    check_align(&format!("{what} transposed output"), out_t.as_raw(), ALIGN)
}

/// The kernel's `(scale, scale_inv, amax, noop)` slot indices.
pub(crate) fn slot_indices(out: &Fp8Tensor, noop: Option<&DeviceScalar>) -> Result<[u32; 4]> {
    Ok([
        idx(out.scale())?,
        idx(out.scale_inv())?,
        idx(out.amax())?,
        noop.map(idx).transpose()?.unwrap_or(0),
    ])
}

/// Pushes the noop flag's buffer, or a null pointer (`null` must hold 0).
pub(crate) fn push_noop<'a>(
    args: KernelArgs<'a>,
    noop: Option<&'a DeviceScalar>,
    null: &'a u64,
) -> KernelArgs<'a> {
    match noop {
        Some(s) => args.arg(s.buffer()),
        None => args.arg(null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_follow_the_dtype() {
        assert_eq!(tile_rows(DType::Bf16), 128);
        assert_eq!(tile_rows(DType::F16), 128);
        assert_eq!(tile_rows(DType::F32), 64);
        assert_eq!(tile_count(1, 1, DType::Bf16).ok(), Some(1));
        assert_eq!(tile_count(128, 64, DType::Bf16).ok(), Some(1));
        assert_eq!(tile_count(129, 65, DType::Bf16).ok(), Some(4));
        assert_eq!(tile_count(8192, 16384, DType::Bf16).ok(), Some(64 * 256));
        assert_eq!(tile_count(8192, 16384, DType::F32).ok(), Some(128 * 256));
        assert!(tile_count(usize::MAX / 2, 1 << 20, DType::F32).is_err());
    }

    #[test]
    fn empty_and_overflowing_shapes_are_rejected() {
        assert!(matrix_numel("t", 0, 5).is_err());
        assert!(matrix_numel("t", 5, 0).is_err());
        assert!(matrix_numel("t", usize::MAX, 2).is_err());
        assert_eq!(matrix_numel("t", 3, 5).ok(), Some(15));
    }

    use crate::prop_util::{config, dtype, fits, size as dim};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(config(100_000))]

        /// Tiles of 128 (16-bit inputs) or 64 (f32) rows by 64 columns cover the matrix; the
        /// count is accepted exactly up to the grid limit, and an error names the shape.
        #[test]
        fn tile_count_covers_the_matrix(rows in dim(), cols in dim(), dtype in dtype()) {
            let tile_rows: u128 = if dtype == DType::F32 { 64 } else { 128 };
            let tiles = (rows as u128).div_ceil(tile_rows) * (cols as u128).div_ceil(64);
            match tile_count(rows, cols, dtype) {
                Ok(t) => prop_assert_eq!(u128::from(t), tiles),
                Err(e) => {
                    prop_assert!(tiles > (1 << 31) - 1, "[{}, {}]: {}", rows, cols, e);
                    let msg = e.to_string();
                    prop_assert!(msg.contains(&format!("[{rows}, {cols}]")), "{}", msg);
                }
            }
        }

        /// Both dimensions at least 1 and the product within usize; an error names the
        /// shape.
        #[test]
        fn matrix_numel_checks_the_shape(rows in dim(), cols in dim()) {
            match matrix_numel("prop_matrix", rows, cols) {
                Ok(n) => {
                    prop_assert!(rows > 0 && cols > 0);
                    prop_assert_eq!(Some(n), fits(&[rows, cols]));
                }
                Err(e) => {
                    prop_assert!(rows == 0 || cols == 0 || fits(&[rows, cols]).is_none());
                    let msg = e.to_string();
                    prop_assert!(msg.contains(&format!("[{rows}, {cols}]")), "{}", msg);
                    if rows == 0 || cols == 0 {
                        prop_assert!(msg.contains("prop_matrix: "), "{}", msg);
                    }
                }
            }
        }
    }
}
