//! Cast-transpose: one pass over a `[rows, cols]` row-major high-precision matrix writes its
//! FP8 cast both row-major (`[rows, cols]`) and transposed (`[cols, rows]`), with amax fused;
//! and the same for a batch of equally shaped matrices in one launch, each with its own
//! scale, scale_inv and amax ([`cast_transpose_batched`]: e.g. every expert weight of a MoE
//! layer). The launchers validate everything first (nothing is enqueued on an error), then
//! enqueue one kernel without synchronising or allocating, so they work eagerly and inside a
//! stream capture alike.
//!
//! The kernel works on tiles of [`tile_rows`] x [`TILE_COLS`] elements through shared
//! memory, with a fixed grid of a few CTAs per SM that loop over the tiles (each issues its
//! next tile's loads before storing the current one). Tiles of a matrix with
//! `rows % 16 == 0` and `cols % 16 == 0` that lie inside it take the fast path (16-byte
//! loads, wide row-major stores, 16-byte stores of transposed rows); every other tile
//! (edges, odd shapes) goes element by element, so any shape works.

use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::format::{DType, Fp8Format};
use crate::module::kernel;
use crate::quantize::{ALIGN, idx};
use crate::tensor::{DeviceScalar, Fp8Tensor, HpBuffer, check_align, numel};

/// Threads per block of the cast-transpose kernels.
pub(crate) const THREADS: u32 = 256;
/// Resident blocks per SM the plain cast's grid is sized for (its `__launch_bounds__`; keep in
/// step with `CT_CTAS_PER_SM` in `kernels/cast_transpose.cuh`).
pub(crate) const CTAS_PER_SM: u32 = 4;
/// Columns of one cast-transpose tile.
pub const TILE_COLS: usize = 64;
/// Most tiles one matrix may have (the kernels count tiles in 32 bits).
const MAX_TILES: u64 = (1 << 31) - 1;
/// Most matrices of one batched launch (CUDA's limit on `gridDim.y`).
pub const MAX_BATCH: usize = 65_535;

/// Rows of one cast-transpose tile for an input type: 128 for f16 / bf16, 64 for f32 (each
/// thread reads 4 rows of one 16-byte vector).
pub const fn tile_rows(dtype: DType) -> usize {
    4 * THREADS as usize * (16 / dtype.size()) / TILE_COLS
}

/// The number of tiles of a `[rows, cols]` input of `dtype`, or an error when it exceeds what
/// the kernels count.
pub(crate) fn tile_count(rows: usize, cols: usize, dtype: DType) -> Result<u32> {
    let t =
        (rows.div_ceil(tile_rows(dtype)) as u64).saturating_mul(cols.div_ceil(TILE_COLS) as u64);
    if t > MAX_TILES {
        return Err(Error::InvalidArgument(format!(
            "cast-transpose of [{rows}, {cols}] needs {t} tiles, above the limit {MAX_TILES}"
        )));
    }
    Ok(t as u32)
}

/// Blocks per matrix of a persistent cast-transpose grid: the `ctas_per_sm` per SM that can
/// be resident, shared by the `count` matrices (rounded down: a block beyond them would start
/// only when another ends, and finish a whole block's work after the rest), never more than
/// the matrix's `tiles`, at least 1.
pub(crate) fn blocks_per_matrix(tiles: u32, sms: u32, ctas_per_sm: u32, count: u32) -> u32 {
    let resident = u64::from(sms.max(1)) * u64::from(ctas_per_sm);
    let per = resident / u64::from(count.max(1));
    per.min(u64::from(tiles)).max(1) as u32
}

/// Validates a batch of `count` matrices of `[rows, cols]`: `1 <= count <= MAX_BATCH`, both
/// dimensions at least 1, the total element count within usize (returned).
pub(crate) fn batch_numel(what: &str, (count, rows, cols): (usize, usize, usize)) -> Result<usize> {
    if !(1..=MAX_BATCH).contains(&count) {
        return Err(Error::InvalidArgument(format!(
            "{what}: count = {count} must be within 1..={MAX_BATCH}"
        )));
    }
    matrix_numel(what, rows, cols)?
        .checked_mul(count)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what}: {count} x [{rows}, {cols}] overflows usize"
            ))
        })
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
    let what = "cast_transpose";
    let n = matrix_numel(what, rows, cols)?;
    if input.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{what}: input has {} elements, [{rows}, {cols}] needs {n}",
            input.len()
        )));
    }
    check_align(format_args!("{what} input"), input.device_ptr(), ALIGN)?;
    check_outputs(what, rows, cols, out, out_t)?;
    // One matrix: each slot's index, stride 0 (launch adds the noop flag's index).
    let [scale, scale_inv, amax, _] = slot_indices(out, None)?;
    let slots = [[scale, 0], [scale_inv, 0], [amax, 0]];
    let buffers = [out.scale(), out.scale_inv(), out.amax()].map(DeviceScalar::buffer);
    launch(
        stream,
        input,
        (out.data(), out_t, out.format()),
        (1, rows, cols),
        (buffers, slots),
        noop,
    )
}

/// `count` device scalars of one buffer, one per matrix of a batch: matrix `g`'s is element
/// `first.index() + g * stride` of `first.buffer()`. A [`DelayedScaling`](crate::DelayedScaling)'s
/// scales and amax slots of consecutive tensors `t0 ..` are
/// [`scale_slots(t0)`](crate::DelayedScaling::scale_slots) and
/// [`amax_slots(t0)`](crate::DelayedScaling::amax_slots).
#[derive(Debug, Clone)]
pub struct ScalarSlots {
    first: DeviceScalar,
    stride: usize,
}

impl ScalarSlots {
    /// The slots `first`, then every `stride` elements after it (stride 0: one slot shared by
    /// every matrix).
    pub fn new(first: DeviceScalar, stride: usize) -> ScalarSlots {
        ScalarSlots { first, stride }
    }

    /// Matrix 0's slot.
    pub fn first(&self) -> &DeviceScalar {
        &self.first
    }

    /// Elements between consecutive matrices' slots.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Matrix `g`'s slot (an error when it lies outside the buffer).
    pub fn get(&self, g: usize) -> Result<DeviceScalar> {
        let i = g
            .checked_mul(self.stride)
            .and_then(|o| o.checked_add(self.first.index()))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("ScalarSlots: slot {g} overflows usize"))
            })?;
        DeviceScalar::at(self.first.buffer(), i)
    }

    /// `(first index, stride)` as the kernel takes them, after checking that the `count`
    /// slots lie inside the buffer at u32 indices.
    pub(crate) fn kernel_indices(
        &self,
        what: impl std::fmt::Display,
        count: usize,
    ) -> Result<[u32; 2]> {
        let (first, len) = (self.first.index(), self.first.buffer().len());
        if !slots_fit(first, self.stride, count, len) {
            return Err(Error::InvalidArgument(format!(
                "{what}: {count} slots from index {first} every {} elements do not fit a \
                 buffer of {len} (at u32 indices)",
                self.stride
            )));
        }
        // With count >= 2 the stride is at most the last index (a u32); with one matrix the
        // kernel never multiplies by it.
        Ok([first as u32, self.stride.min(u32::MAX as usize) as u32])
    }
}

/// Whether `count >= 1` slots at `first + g * stride` all lie inside a buffer of `len`
/// elements at indices the kernels' u32 arithmetic reaches.
fn slots_fit(first: usize, stride: usize, count: usize, len: usize) -> bool {
    count >= 1
        && (count - 1)
            .checked_mul(stride)
            .and_then(|o| o.checked_add(first))
            .is_some_and(|last| last < len && last <= u32::MAX as usize)
}

/// Where [`cast_transpose_batched`] writes: `count` matrices' FP8 bytes, row-major and
/// transposed, and their scalars.
#[derive(Debug, Clone)]
pub struct BatchedCastOut<'a> {
    /// Row-major outputs: matrix `g` (`[rows, cols]`) at byte `g * rows * cols`.
    pub data: &'a DeviceBuffer<u8>,
    /// Transposed outputs: matrix `g` (`[cols, rows]`) at byte `g * rows * cols`.
    pub data_t: &'a DeviceBuffer<u8>,
    /// The FP8 format of both.
    pub format: Fp8Format,
    /// The scale each matrix is multiplied by, read on the device.
    pub scale: ScalarSlots,
    /// Written with `1 / scale` per matrix.
    pub scale_inv: ScalarSlots,
    /// Each matrix's `max |x|` maxed in (each slot must hold a non-negative value).
    pub amax: ScalarSlots,
}

impl BatchedCastOut<'_> {
    /// The (scale, scale_inv, amax) slots' `[first index, stride]` as the kernels take them,
    /// after checking that `count` slots of each lie inside their buffers.
    pub(crate) fn kernel_slots(&self, what: &str, count: usize) -> Result<[[u32; 2]; 3]> {
        Ok([
            self.scale
                .kernel_indices(format_args!("{what} scale"), count)?,
            self.scale_inv
                .kernel_indices(format_args!("{what} scale_inv"), count)?,
            self.amax
                .kernel_indices(format_args!("{what} amax"), count)?,
        ])
    }
}

/// [`cast_transpose`] of `count` matrices of `[rows, cols]` in one launch: matrix `g` is
/// `input[g * rows * cols ..][.. rows * cols]`, cast with its own scale (`out.scale.get(g)`)
/// into `out.data` and `out.data_t` at byte `g * rows * cols`, with its `1 / scale` written to
/// `out.scale_inv.get(g)` and its `max |x|` maxed into `out.amax.get(g)`. The bytes and
/// scalars are exactly those of `count` separate [`cast_transpose`] calls. When `noop` (one
/// flag for the whole batch) is given and holds 1.0 at run time, nothing at all is written.
///
/// Requirements (checked before any launch; nothing is written on an error):
/// `1 <= count <= `[`MAX_BATCH`]; `rows >= 1`, `cols >= 1`; `input`, `out.data` and
/// `out.data_t` of exactly `count * rows * cols` elements, 16-byte aligned; every matrix's
/// slots inside their buffers. Slots may be shared (stride 0): amax then gets the max over
/// the matrices sharing it; a shared scale_inv suits a shared scale only.
///
/// ```no_run
/// use cuda_graph::{Context, DeviceBuffer, Stream};
/// use cuda_graph::half::bf16;
/// use fp8_kernels::{BatchedCastOut, DeviceScalar, Fp8Format, ScalarSlots, cast_transpose_batched};
///
/// let ctx = Context::default_device()?;
/// let stream = Stream::new(&ctx)?;
/// let (experts, rows, cols) = (8, 256, 128);
/// let n = experts * rows * cols;
/// let w = DeviceBuffer::from_host(&stream, &vec![bf16::ONE; n])?;
/// let (w_q, w_t) = (DeviceBuffer::<u8>::alloc(&ctx, n)?, DeviceBuffer::<u8>::alloc(&ctx, n)?);
/// // Per expert: scale, scale_inv, amax, side by side in one buffer of 3 * experts floats.
/// let scalars = DeviceBuffer::from_host(&stream, &[1.0f32, 1.0, 0.0].repeat(experts))?;
/// let slots = |i| Ok::<_, cuda_graph::Error>(ScalarSlots::new(DeviceScalar::at(&scalars, i)?, 3));
/// let out = BatchedCastOut {
///     data: &w_q,
///     data_t: &w_t,
///     format: Fp8Format::E4M3,
///     scale: slots(0)?,
///     scale_inv: slots(1)?,
///     amax: slots(2)?,
/// };
/// cast_transpose_batched(&stream, &w, (experts, rows, cols), &out, None)?;
/// assert_eq!(out.amax.get(experts - 1)?.read(&stream)?, 1.0);
/// # Ok::<(), cuda_graph::Error>(())
/// ```
pub fn cast_transpose_batched<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    (count, rows, cols): (usize, usize, usize),
    out: &BatchedCastOut<'_>,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let input: HpBuffer<'a> = input.into();
    let what = "cast_transpose_batched";
    let n = batch_numel(what, (count, rows, cols))?;
    for (name, len) in [
        ("input", input.len()),
        ("row-major output", out.data.len()),
        ("transposed output", out.data_t.len()),
    ] {
        if len != n {
            return Err(Error::InvalidArgument(format!(
                "{what}: {name} has {len} elements, {count} x [{rows}, {cols}] needs {n}"
            )));
        }
    }
    check_align(format_args!("{what} input"), input.device_ptr(), ALIGN)?;
    check_align(format_args!("{what} output"), out.data.as_raw(), ALIGN)?;
    check_align(
        format_args!("{what} transposed output"),
        out.data_t.as_raw(),
        ALIGN,
    )?;
    let slots = out.kernel_slots(what, count)?;
    let buffers = [&out.scale, &out.scale_inv, &out.amax].map(|s| s.first.buffer());
    launch(
        stream,
        input,
        (out.data, out.data_t, out.format),
        (count, rows, cols),
        (buffers, slots),
        noop,
    )
}

/// Enqueues the cast-transpose kernel on `count` matrices (`count`, shape, lengths, alignment
/// and slots checked by the caller): the outputs and format, and the (scale, scale_inv,
/// amax) buffers with their `[first index, stride]`.
fn launch(
    stream: &Stream,
    input: HpBuffer<'_>,
    (y, yt, format): (&DeviceBuffer<u8>, &DeviceBuffer<u8>, Fp8Format),
    (count, rows, cols): (usize, usize, usize),
    (buffers, slots): ([&DeviceBuffer<f32>; 3], [[u32; 2]; 3]),
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let tiles = tile_count(rows, cols, input.dtype())?;
    let noop_idx = noop.map(idx).transpose()?.unwrap_or(0);
    let indices = [slots[0][0], slots[1][0], slots[2][0], noop_idx];
    let strides = [slots[0][1], slots[1][1], slots[2][1]];
    let name = format!(
        "fp8_cast_transpose_{}_{}",
        input.dtype().name(),
        format.name()
    );
    let (k, sms) = kernel(stream.context(), &name)?;
    let (rows64, cols64) = (rows as u64, cols as u64);
    let null = 0u64;
    let args = input
        .push_to(KernelArgs::new())
        .arg(y)
        .arg(yt)
        .arg(&rows64)
        .arg(&cols64)
        .arg(buffers[0])
        .arg(buffers[1])
        .arg(buffers[2]);
    let args = push_noop(args, noop, &null).arg(&indices).arg(&strides);
    let count = count as u32; // at most MAX_BATCH (checked)
    let cfg = LaunchConfig {
        grid: (blocks_per_matrix(tiles, sms, CTAS_PER_SM, count), count, 1),
        ..LaunchConfig::linear(1, THREADS)
    };
    // SAFETY: the kernel reads count * rows * cols input elements and writes that many bytes
    // to each of y and yt, all checked to hold exactly that many and to be 16-byte aligned
    // (its widest access; every matrix starts 16-byte aligned whenever the fast path runs, as
    // it needs rows % 16 == 0); the blocks bound-check every element of their tiles; the
    // scalar slots first + g * stride (g < count) are inside their buffers (checked).
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
    check_align(format_args!("{what} output"), out.data().as_raw(), ALIGN)?;
    check_align(
        format_args!("{what} transposed output"),
        out_t.as_raw(),
        ALIGN,
    )
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
    fn persistent_grid_shares_the_sms_among_the_matrices() {
        // 132 SMs x 4: one matrix takes 528 blocks, 8 take 66 each (7: 75, all resident),
        // never more than tiles.
        assert_eq!(blocks_per_matrix(100_000, 132, 4, 1), 528);
        assert_eq!(blocks_per_matrix(1024, 132, 4, 8), 66);
        assert_eq!(blocks_per_matrix(1024, 132, 4, 7), 75);
        assert_eq!(blocks_per_matrix(10, 132, 4, 1), 10);
        assert_eq!(blocks_per_matrix(1, 132, 4, 65_535), 1);
        assert_eq!(blocks_per_matrix(5, 0, 4, 1), 4);
    }

    #[test]
    fn batch_slots_must_fit_their_buffer() {
        assert!(slots_fit(0, 1, 8, 8));
        assert!(!slots_fit(0, 1, 9, 8));
        assert!(!slots_fit(1, 1, 8, 8));
        // A history-strided amax: tensors 4 .. 12 of 16 with a history of 1024.
        assert!(slots_fit(4 * 1024, 1024, 8, 16 * 1024));
        assert!(!slots_fit(9 * 1024, 1024, 8, 16 * 1024));
        // Stride 0 shares one slot; one matrix ignores the stride.
        assert!(slots_fit(3, 0, 65_535, 4));
        assert!(slots_fit(3, usize::MAX, 1, 4));
        assert!(!slots_fit(0, usize::MAX, 2, usize::MAX));
        assert!(!slots_fit(0, 1, 0, 4));
        // The kernels index in u32.
        let big = u32::MAX as usize + 2;
        assert!(slots_fit(u32::MAX as usize, 1, 1, big));
        assert!(!slots_fit(u32::MAX as usize, 1, 2, big));
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
        /// count is accepted exactly up to the kernels' limit, and an error names the shape.
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
