//! Block-scaled quantize (DeepSeek-V3 style): one fp32 scale per 1x128 row block
//! (activations) or per 128x128 tile (weights) of a `[rows, cols]` row-major matrix, derived
//! on the device from the block's own amax. The launcher validates everything first (nothing
//! is enqueued on an error), then enqueues one kernel without synchronising or allocating, so
//! it works eagerly and inside a stream capture alike.
//!
//! Semantics, per block (what [`reference::quantize_blockwise_ref`] models bit for bit):
//! * `amax_b = max |x|` over the block's real elements, in f32 after exact widening; a NaN
//!   anywhere in the block makes `amax_b` NaN;
//! * `scale = fp8_max / amax_b` as one f32 division (round to nearest even); `scale = 1`
//!   when `amax_b` is 0, inf or NaN; `scale = f32::MAX` when the quotient overflows to inf
//!   (that is [`reference::current_scale`]);
//! * `y = sat_rne(x * scale)` (the product rounded to f32, then encoded as
//!   [`reference::encode`] does: saturating, NaN to NaN);
//! * `scales_inv[block] = 1.0 / scale` (one f32 division).
//!
//! [`reference::quantize_blockwise_ref`]: crate::reference::quantize_blockwise_ref
//! [`reference::current_scale`]: crate::reference::current_scale
//! [`reference::encode`]: crate::reference::encode

use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::cast_transpose::matrix_numel;
use crate::format::{DType, Fp8Format};
use crate::module::kernel;
use crate::quantize::ALIGN;
use crate::tensor::{HpBuffer, check_align};

/// Threads per block of the block-scaled kernels (8 warps).
const THREADS: u32 = 256;
/// Largest grid the kernels are launched with (CUDA's limit on `gridDim.x`).
const MAX_GRID: u64 = (1 << 31) - 1;

/// The shape of the blocks that share one scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockShape {
    /// 1 row x 128 columns (activations). Scales: `[rows, ceil(cols / 128)]` row-major.
    Row1x128,
    /// 128 rows x 128 columns (weights). Scales: `[ceil(rows / 128), ceil(cols / 128)]`
    /// row-major.
    Tile128x128,
}

impl BlockShape {
    /// Rows and columns of one block: (1, 128) or (128, 128).
    pub const fn dims(self) -> (usize, usize) {
        match self {
            BlockShape::Row1x128 => (1, 128),
            BlockShape::Tile128x128 => (128, 128),
        }
    }

    /// The shape of the scale matrix for a `[rows, cols]` input: blocks down, blocks across.
    /// Edge blocks are partial and count as whole blocks.
    pub const fn scales_shape(self, rows: usize, cols: usize) -> (usize, usize) {
        let (br, bc) = self.dims();
        (rows.div_ceil(br), cols.div_ceil(bc))
    }

    /// The number of scales for a `[rows, cols]` input; `usize::MAX` where that number
    /// overflows `usize` (no buffer is that long, so a length check against it fails).
    pub const fn scales_len(self, rows: usize, cols: usize) -> usize {
        let (r, c) = self.scales_shape(rows, cols);
        r.saturating_mul(c)
    }

    /// Lower-case name used in kernel symbols: `1x128` or `128x128`.
    pub const fn name(self) -> &'static str {
        match self {
            BlockShape::Row1x128 => "1x128",
            BlockShape::Tile128x128 => "128x128",
        }
    }
}

/// Blocks one group of lanes does in the vector 1x128 kernel (`BW1X128_U` in the kernel).
const VEC_BLOCKS_PER_GROUP: u64 = 4;

/// Whether the 1x128 vector kernel applies: every row starts on a 16-byte boundary (the
/// input is 16-byte aligned, and `cols` is a multiple of the 16-byte vector's elements).
pub(crate) fn vector_1x128(dtype: DType, cols: usize) -> bool {
    cols % (16 / dtype.size()) == 0
}

/// Grid size for a block shape: for 1x128, 8 blocks per CTA (a warp each), or with the vector
/// kernel 8 warps of `32 / (128 / V)` lane groups doing [`VEC_BLOCKS_PER_GROUP`] blocks each;
/// for 128x128, one CTA per tile.
pub(crate) fn blockwise_grid(
    block: BlockShape,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Result<u32> {
    let blocks = (rows.div_ceil(block.dims().0) as u64).saturating_mul(cols.div_ceil(128) as u64);
    let warps_per_cta = u64::from(THREADS / 32);
    let grid = match block {
        BlockShape::Row1x128 if vector_1x128(dtype, cols) => {
            let groups_per_warp = 32 / (128 / (16 / dtype.size() as u64));
            blocks.div_ceil(warps_per_cta * groups_per_warp * VEC_BLOCKS_PER_GROUP)
        }
        BlockShape::Row1x128 => blocks.div_ceil(warps_per_cta),
        BlockShape::Tile128x128 => blocks,
    };
    if grid > MAX_GRID {
        return Err(Error::InvalidArgument(format!(
            "blockwise quantize of [{rows}, {cols}] needs a grid of {grid}, above {MAX_GRID}"
        )));
    }
    Ok(grid as u32)
}

/// Quantizes `input` (`[rows, cols]` row-major) to `format` with one scale per block of
/// `block`: writes the FP8 bytes, row-major `[rows, cols]`, to `out` and each block's
/// `1 / scale` to `scales_inv`, laid out as [`BlockShape::scales_shape`] row-major. Nothing is read from or accumulated into
/// device scalars: every scale comes from its block alone.
///
/// Per block (bit for bit what [`reference::quantize_blockwise_ref`] computes):
/// * `amax_b = max |x|` over the block's real elements (edge blocks are partial), in f32
///   after exact widening; a NaN anywhere in the block makes `amax_b` NaN;
/// * `scale = fp8_max / amax_b` as one f32 division; `scale = 1` when `amax_b` is 0, inf or
///   NaN; `scale = f32::MAX` when the quotient overflows ([`reference::current_scale`]);
/// * `y = sat_rne(x * scale)`, the product rounded to f32 first ([`reference::quantize`]);
/// * `scales_inv[block] = 1.0 / scale`.
///
/// [`reference::quantize_blockwise_ref`]: crate::reference::quantize_blockwise_ref
/// [`reference::current_scale`]: crate::reference::current_scale
/// [`reference::quantize`]: crate::reference::quantize
///
/// Requirements (checked before any launch; nothing is written on an error):
/// `rows >= 1`, `cols >= 1`; `input.len() == out.len() == rows * cols`;
/// `scales_inv.len() == block.scales_len(rows, cols)`; input and `out` 16-byte aligned,
/// `scales_inv` 4-byte aligned (buffers from [`DeviceBuffer::alloc`] always are). Any shape
/// works; 1x128 takes a 16-byte-load path when `cols` is a multiple of `16 / element size`.
// The signature mirrors the other launchers (stream, input, shape, then outputs); a
// parameter struct would only hide that.
#[allow(clippy::too_many_arguments)]
pub fn quantize_blockwise<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    rows: usize,
    cols: usize,
    block: BlockShape,
    format: Fp8Format,
    out: &DeviceBuffer<u8>,
    scales_inv: &DeviceBuffer<f32>,
) -> Result<()> {
    let input: HpBuffer<'a> = input.into();
    let n = matrix_numel("quantize_blockwise", rows, cols)?;
    if input.len() != n || out.len() != n {
        return Err(Error::InvalidArgument(format!(
            "quantize_blockwise: [{rows}, {cols}] needs {n} elements; input has {}, output {}",
            input.len(),
            out.len()
        )));
    }
    let ns = block.scales_len(rows, cols);
    if scales_inv.len() != ns {
        return Err(Error::InvalidArgument(format!(
            "quantize_blockwise: {} scales given, {block:?} blocks of [{rows}, {cols}] need {ns}",
            scales_inv.len()
        )));
    }
    check_align("quantize_blockwise input", input.device_ptr(), ALIGN)?;
    check_align("quantize_blockwise output", out.as_raw(), ALIGN)?;
    check_align("quantize_blockwise scales", scales_inv.as_raw(), 4)?;
    let grid = blockwise_grid(block, input.dtype(), rows, cols)?;
    let vec = block == BlockShape::Row1x128 && vector_1x128(input.dtype(), cols);
    let name = format!(
        "fp8_quantize_{}{}_{}_{}",
        block.name(),
        if vec { "v" } else { "" },
        input.dtype().name(),
        format.name()
    );
    let (k, _sms) = kernel(stream.context(), &name)?;
    let (rows64, cols64) = (rows as u64, cols as u64);
    let out: &DeviceBuffer<u8> = out;
    let scales_inv: &DeviceBuffer<f32> = scales_inv;
    let args = input
        .push_to(KernelArgs::new())
        .arg(out)
        .arg(scales_inv)
        .arg(&rows64)
        .arg(&cols64);
    let cfg = LaunchConfig::linear(grid, THREADS);
    // SAFETY: the kernel reads rows * cols input elements and writes rows * cols bytes of
    // out (both checked to hold exactly that many, aligned) and one f32 per block of
    // scales_inv (checked to hold scales_len); every access is bound-checked against
    // rows / cols in the kernel.
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_layouts() {
        assert_eq!(BlockShape::Row1x128.scales_shape(3, 200), (3, 2));
        assert_eq!(BlockShape::Row1x128.scales_shape(1, 128), (1, 1));
        assert_eq!(BlockShape::Row1x128.scales_shape(1, 129), (1, 2));
        assert_eq!(BlockShape::Tile128x128.scales_shape(130, 257), (2, 3));
        assert_eq!(BlockShape::Tile128x128.scales_shape(257, 130), (3, 2));
        assert_eq!(BlockShape::Tile128x128.scales_len(128, 128), 1);
        assert_eq!(BlockShape::Row1x128.scales_len(128, usize::MAX), usize::MAX);
    }

    #[test]
    fn grids() {
        let (row, tile) = (BlockShape::Row1x128, BlockShape::Tile128x128);
        let (f32_, bf16) = (DType::F32, DType::Bf16);
        // Scalar 1x128 kernel (cols not a multiple of the vector): 8 blocks a CTA.
        assert_eq!(blockwise_grid(row, bf16, 1, 1).ok(), Some(1));
        assert_eq!(blockwise_grid(row, bf16, 8, 129).ok(), Some(2));
        assert_eq!(blockwise_grid(row, bf16, 9, 129).ok(), Some(3));
        assert_eq!(blockwise_grid(row, f32_, 3, 202).ok(), Some(1));
        // Vector kernel: 64 blocks a CTA for 16-bit inputs, 32 for f32.
        assert!(vector_1x128(bf16, 200) && !vector_1x128(bf16, 202));
        assert!(vector_1x128(f32_, 4) && !vector_1x128(f32_, 6));
        assert_eq!(blockwise_grid(row, bf16, 64, 128).ok(), Some(1));
        assert_eq!(blockwise_grid(row, bf16, 65, 128).ok(), Some(2));
        assert_eq!(blockwise_grid(row, f32_, 33, 128).ok(), Some(2));
        assert_eq!(blockwise_grid(row, bf16, 8192, 16384).ok(), Some(16384));
        assert_eq!(blockwise_grid(tile, bf16, 257, 130).ok(), Some(6));
        assert!(blockwise_grid(row, bf16, 1 << 40, 1 << 20).is_err());
        assert!(blockwise_grid(row, bf16, 1 << 40, (1 << 20) + 1).is_err());
    }

    use crate::prop_util::{config, dtype, fits, size as dim};
    use proptest::prelude::*;
    use proptest::sample::select;

    fn block() -> impl Strategy<Value = BlockShape> {
        select(vec![BlockShape::Row1x128, BlockShape::Tile128x128])
    }

    proptest! {
        #![proptest_config(config(100_000))]

        /// Blocks down and across, edge blocks counted whole; the count never panics.
        #[test]
        fn scale_layout(block in block(), rows in dim(), cols in dim()) {
            let block_rows = if block == BlockShape::Row1x128 { 1 } else { 128 };
            let (r, c) = block.scales_shape(rows, cols);
            prop_assert_eq!((r, c), (rows.div_ceil(block_rows), cols.div_ceil(128)));
            let len = block.scales_len(rows, cols);
            prop_assert_eq!(len, fits(&[r, c]).unwrap_or(usize::MAX));
        }

        /// The vector kernel takes rows that start on 16 bytes.
        #[test]
        fn vector_kernel_needs_16_byte_rows(dtype in dtype(), cols in dim()) {
            let bytes = cols as u128 * dtype.size() as u128;
            prop_assert_eq!(vector_1x128(dtype, cols), bytes % 16 == 0);
        }

        /// The grid covers every block with no CTA idle: 8 blocks a CTA (scalar 1x128),
        /// 64 (vector, 16-bit input) or 32 (vector, f32), 1 (128x128); accepted exactly up to
        /// the grid limit; an error names the shape.
        #[test]
        fn blockwise_grid_covers_the_blocks(
            block in block(), dtype in dtype(), rows in dim(), cols in dim(),
        ) {
            let block_rows = if block == BlockShape::Row1x128 { 1 } else { 128 };
            let blocks = (rows as u128).div_ceil(block_rows) * (cols as u128).div_ceil(128);
            let per_cta: u128 = match block {
                BlockShape::Tile128x128 => 1,
                BlockShape::Row1x128 if (cols as u128 * dtype.size() as u128) % 16 != 0 => 8,
                BlockShape::Row1x128 if dtype == DType::F32 => 32,
                BlockShape::Row1x128 => 64,
            };
            let want = blocks.div_ceil(per_cta);
            match blockwise_grid(block, dtype, rows, cols) {
                Ok(g) => {
                    prop_assert_eq!(u128::from(g), want);
                    prop_assert!(u128::from(g) * per_cta >= blocks);
                    prop_assert!(g == 0 || u128::from(g - 1) * per_cta < blocks);
                }
                Err(e) => {
                    prop_assert!(want > (1 << 31) - 1, "{:?} [{}, {}]: {}", block, rows, cols, e);
                    let msg = e.to_string();
                    prop_assert!(msg.contains(&format!("[{rows}, {cols}]")), "{}", msg);
                }
            }
        }
    }
}
