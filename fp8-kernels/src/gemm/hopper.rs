//! The sm_90a GEMM path (`kernels/gemm_sm90.cuh`): TMA loads through a 6-stage mbarrier
//! ring, wgmma (QGMMA) consumers with fp32 promotion every 128 of K (or, with fast
//! accumulation, the tensor cores' own sum over all of K; with block scaling, each 128-deep
//! block's products scaled by its row's and column block's scale_inv as they are promoted),
//! a persistent grid of one CTA per SM whose tile scheduler reads the per-group row counts
//! on the device.
//!
//! Alignment rules of this path (stricter than the entry points'; a problem outside them is
//! an `InvalidArgument` before anything is enqueued, so the caller can fall back):
//! * K a positive multiple of 16 (TMA needs 16-byte row strides);
//! * N even (the epilogue stores two adjacent columns at once);
//! * A and B data 16-byte aligned (TMA), D 8-byte aligned;
//! * m, N, K, groups and `groups * m` below 2^31.
//!
//! Tile 128 x BN x 128 with BN 128 or 192, or 256 for fast accumulation and for the promoted
//! E4M3 x E4M3 to bf16 sum (each k-block's products in two 128-column halves beside the
//! 256-column sum), chosen per problem to fill the SMs; edge tiles read zeros past the tensor
//! (TMA out-of-bounds fill) and store only rows below the group's count and columns below N.
//! The 256-wide grouped and packed kernels run a last wave that would leave half the grid
//! idle as column halves on twice the CTAs ([`tail_halves`]), decided on the device from the
//! tiles the row counts leave.
//!
//! Skinny problems (a plain GEMM of at most 128 rows whose column tiles leave SMs idle) run
//! `kernels/gemm_skinny.cuh` instead: swap-AB, K split over a thread-block cluster, the
//! partial sums added through distributed shared memory ([`skinny_plan`]).
//!
//! Epilogue: a problem that writes whole tiles of D (the packed layouts, or grouped blocks
//! without row counts; D 16-byte aligned with rows a multiple of 16 bytes; overwriting, or
//! accumulating into f32) goes through shared memory and TMA stores (reduce-adds in L2 when
//! accumulating), overlapped with the next tile's main loop; the others store from registers.

// Reached through the entry points in `gemm/`, written alongside this path.

use std::sync::{Arc, Mutex};

use cuda_graph::sys::{
    CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cuda_graph::{
    Context, DeviceBuffer, Error, Kernel, KernelArgs, LaunchAttribute, LaunchConfig, Result, Stream,
};

use super::packed::{GroupScales, PackedProblem, WgradProblem};
use super::{Bias, BlockOperand, GemmOptions, GemmOut, GemmProblem};
use crate::cast_transpose::slot_indices;
use crate::format::Fp8Format;
use crate::module::kernel;
use crate::quantize::idx;
use crate::tensor::Fp8Tensor;

/// Tile edge in M and K (keep in step with `BM`, `BK` in the kernel).
const TILE: usize = 128;
/// Threads per CTA (producer warpgroup + two consumer warpgroups).
const THREADS: u32 = 384;

/// The most dynamic shared memory a CTA may have on sm_90 (227 KiB).
const SMEM_LIMIT: usize = 232_448;

/// The packed layout (forward and data-gradient GEMMs) with fewer groups than this keeps its
/// offsets in shared memory (`OFFSETS_CACHED` in the kernel; the space is reserved in every
/// configuration).
const OFFSETS_CACHED: usize = 64;

/// Shared memory of one stage's block scales in the block-scaled kernel (`BLOCK_SCALE_BYTES`
/// there): A's for a tile's 128 rows, B's for two 128-column blocks, 16-byte padded.
const BLOCK_SCALE_BYTES: usize = 4 * (TILE + 4);

/// Rows of one TMA store box of the epilogue (a consumer warpgroup's half of the tile).
const STORE_ROWS: usize = 64;

/// Dynamic shared memory of tile width `bn` and output elements of `out_size` bytes with
/// `scales` bytes more a stage (the block-scaled kernel's, [`BLOCK_SCALE_BYTES`]; keep in step
/// with `Cfg<BN, Out, SCALES>` in the kernel): the ring of A and B tiles, as deep as fits (at
/// most 6 stages) beside the epilogue's staging (two consumers' 64 x `bn` outputs, or half of
/// them for f32 at 192, which the kernel stores in two parts), the barriers, the packed
/// layout's cached group offsets ([`OFFSETS_CACHED`] ints), each stage's scales, 1 KiB
/// alignment slack.
fn smem_bytes(bn: usize, out_size: usize, scales: usize) -> usize {
    let stage = TILE * TILE + bn * TILE + scales;
    // (The block-scaled 256-wide tile in 4 parts: 4 stages with its scales, not 3.)
    let parts = if bn == 256 && scales > 0 {
        4
    } else if (bn == 192 && out_size == 4) || bn == 256 {
        2
    } else {
        1
    };
    let staging = 2 * STORE_ROWS * (bn / parts) * out_size;
    let stages = ((SMEM_LIMIT - 1024 - staging - 2 * 6 * 8 - 4 * OFFSETS_CACHED) / stage).min(6);
    stages * stage + staging + 2 * stages * 8 + 4 * OFFSETS_CACHED + 1024
}

/// The tile width (128 or 192, and 256 where `wide`) for a problem: waves of tiles over the
/// SMs times the width (a wave of 192-wide tiles takes 1.5x as long), with 192 credited for
/// its efficiency (its wgmma reads less shared memory per FLOP): 30% with the promoted sum
/// (1356 against 958-961 TFLOP/s at 8192^3, 1276-1278 against 981-986 at 4096x7168x4096 on an
/// H200, thirteenth session), 10% with `fast` accumulation (1385 against 1345, 1355 against
/// 1336); 128 wins where the wave count decides, e.g. 2048^3 and M <= 128. (Since the 128-wide
/// promoted tiles pipeline their sums, forced widths measure 192's edge per tile at 5-8%:
/// 1406 against 1312 at 8192^3, 1324 against 1289 at 4096x7168x4096, sixteenth session. A 7%
/// credit moved grouped blocks and the 256-expert MoE layer's GEMMs to 128 and measured no
/// faster: grouped 8 x 512 rows 958 at 128 against 952 at 192, the E = 256 step with bf16
/// gradients 2.370 ms against 2.312. So 30% stays.)
/// The same for both output types: f32 at 192 stores its tile in two parts to keep 4 stages,
/// like bf16.
/// `wide` (a kernel with a 256-wide instance: fast accumulation, the promoted sum of E4M3 x
/// E4M3 to bf16 in plain GEMMs and grouped blocks, with or without row counts since its tail
/// halves, and the block-scaled sum) takes 256 where
/// its waves cost no more than the narrower choice's. Fast: 1478 against 1370 TFLOP/s at 4096x7168x4096, 1170
/// against 1120 at 2048^3 on an H200; promoted (fourteenth session): 1307 against 1268, 1066
/// against 926 (128 wide). At 8192^3 (16 waves of 256 against 21 of 192: fast 1416 against
/// 1430, promoted 1322 against 1339) and skinny M it keeps the narrower tile.
fn choose_bn_for(groups: usize, m: usize, n: usize, sms: usize, fast: bool, wide: bool) -> usize {
    let cost = |bn: usize| {
        let tiles = groups.max(1) * m.div_ceil(TILE) * n.div_ceil(bn);
        tiles.div_ceil(sms.max(1)) * bn
    };
    // 192's credit: 30% for the promoted sum, 10% for fast accumulation (measured above).
    let credit = if fast { 11 } else { 13 };
    let narrow = if cost(192).saturating_mul(10) <= cost(128).saturating_mul(credit) {
        192
    } else {
        128
    };
    if wide && cost(256) <= cost(narrow) {
        256
    } else {
        narrow
    }
}

/// Reduction rows per group (`capacity / groups`, the most a group holds on average) up to
/// which an f32 weight gradient takes 128-wide tiles.
const WGRAD_F32_NARROW_ROWS: usize = 256;

/// The weight gradient's tile width: `forced`, else 128 for an f32 D with at most
/// [`WGRAD_F32_NARROW_ROWS`] rows per group on average, else `None` (the width
/// `choose_bn_for` picks: 192 for the MoE layer's shapes). On an H200, 8 x 4096 x 2048 with
/// 128 rows per group (the layer's T = 256 regime, whose tiles have one k-block): f32 77-79 us
/// at 128 against 81-84 at 192 (three runs), and the T = 256 f32 step 0.269 / 0.270 ms against
/// 0.275 / 0.273 in one run; with 1024 rows per group 128 is slower in the T = 4096 step (ncu:
/// 86 + 160 us against 79 + 154) and its f32 step 0.892 / 0.889 ms against 0.886 / 0.883.
/// bf16 keeps 192 (40 us against 51 at 128 rows per group).
fn wgrad_bn(
    forced: Option<usize>,
    out_size: usize,
    capacity: usize,
    groups: usize,
) -> Option<usize> {
    let narrow = out_size == 4 && capacity <= WGRAD_F32_NARROW_ROWS.saturating_mul(groups.max(1));
    forced.or(narrow.then_some(128))
}

/// The kernels' flag (bit 2 of `flags.w`) for L2 eviction hints on their bulk copies: the
/// packed layout's weights (B) leave L2 first; the weight gradient's output leaves first and
/// its operands stay. Set where the data is used that way (below).
const L2_HINTS: u32 = 4;

/// Reduction rows per group (`capacity / groups`) up to which the weight gradient takes the
/// [`L2_HINTS`]: its tiles have a k-block or two, and its output, written once, is most of its
/// traffic. On an H200, 8 x 4096 x 2048 with 128 rows a group: bf16 37 us against 41 without,
/// f32 65 against 75; with 1024 rows a group the same either way; the MoE layer's T = 256
/// backward 0.123-0.124 ms against 0.126-0.127 (bf16 gradients), 0.169-0.171 against
/// 0.178-0.179 (f32).
const WGRAD_STREAM_ROWS: usize = 256;

/// Whether a packed GEMM's weights are read about once (`expected` rows over `groups`, at most
/// one row tile a group on average): then they take the [`L2_HINTS`] (leave L2 first) and do
/// not push out what the kernels around it reuse. On an H200 the MoE layer's T = 256 step (64
/// rows an expert) took 0.195-0.197 ms against 0.199-0.201 with bf16 gradients; at T = 4096
/// (1024 rows an expert, each weight box read by 8 row tiles) the hint cost 8-10 us, so it is
/// left off there.
fn weights_stream_once(expected: usize, groups: usize) -> bool {
    expected <= TILE.saturating_mul(groups.max(1))
}

/// Whether a weight gradient of `capacity` reduction rows over `groups` takes the
/// [`L2_HINTS`] (at most [`WGRAD_STREAM_ROWS`] a group on average).
fn wgrad_output_streams(capacity: usize, groups: usize) -> bool {
    capacity <= WGRAD_STREAM_ROWS.saturating_mul(groups.max(1))
}

/// Whether the device of `ctx` runs this path (compute capability 9.0, for which the fatbin
/// holds sm_90a code).
pub(crate) fn available(ctx: &Arc<Context>) -> Result<bool> {
    Ok(ctx.device().compute_capability()? == (9, 0))
}

/// Checks this path's alignment rules (see the module docs).
pub(crate) fn check(p: &GemmProblem<'_>) -> Result<()> {
    let bad = |msg: String| Err(Error::InvalidArgument(format!("sm90 GEMM: {msg}")));
    if p.k == 0 || p.k % 16 != 0 {
        return bad(format!("K = {} is not a positive multiple of 16", p.k));
    }
    if p.n % 2 != 0 {
        return bad(format!("N = {} is odd", p.n));
    }
    let lim = i32::MAX as usize;
    let rows = p.groups.saturating_mul(p.m);
    if p.m > lim || p.n > lim || p.k > lim || p.groups > lim || rows > lim {
        return bad(format!(
            "m = {}, N = {}, K = {}, groups = {} exceed 2^31",
            p.m, p.n, p.k, p.groups
        ));
    }
    if p.a.data.as_raw() % 16 != 0 || p.b.data.as_raw() % 16 != 0 {
        return bad("A and B must be 16-byte aligned".into());
    }
    if p.d.device_ptr() % 8 != 0 {
        return bad("D must be 8-byte aligned".into());
    }
    Ok(())
}

/// A 3-D tiled tensor map over `dims` = `[cols, rows, groups]` elements of `elem_size` bytes
/// at `ptr` (rows contiguous), box `[box_cols, box_rows, 1]`, 128-byte swizzle, no
/// out-of-bounds fill (loads read zeros past the edges, stores skip them).
fn encode_3d(
    ptr: u64,
    (dtype, elem_size): (CUtensorMapDataType, usize),
    [cols, rows, groups]: [usize; 3],
    box_dims: [usize; 2],
    promotion: CUtensorMapL2promotion,
) -> Result<[u64; 16]> {
    // Byte strides of dimensions 1 and 2 (dimension 0 is contiguous).
    let strides = [cols * elem_size, rows * cols * elem_size];
    encode_3d_strided(
        ptr,
        dtype,
        [cols, rows, groups],
        strides,
        box_dims,
        promotion,
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// A fused cast's map (`BOX64` in the kernel): `[rows, cols]` bytes, boxes of 64 rows x 64
/// bytes in the 64-byte swizzle.
fn cast_map(buf: &DeviceBuffer<u8>, rows: usize, cols: usize) -> Result<[u64; 16]> {
    encode_3d_strided(
        buf.as_raw(),
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        [cols, rows, 1],
        [cols, rows * cols],
        [64, 64],
        CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
    )
}

/// [`encode_3d`] with the byte strides of dimensions 1 and 2 given (multiples of 16): e.g. a
/// split-K view, whose "groups" are K-slices of the same rows.
fn encode_3d_strided(
    ptr: u64,
    dtype: CUtensorMapDataType,
    [cols, rows, groups]: [usize; 3],
    [stride_rows, stride_groups]: [usize; 2],
    [box_cols, box_rows]: [usize; 2],
    promotion: CUtensorMapL2promotion,
    swizzle: CUtensorMapSwizzle,
) -> Result<[u64; 16]> {
    let drv = cuda_graph::sys::driver()?;
    let encode = drv.cuTensorMapEncodeTiled()?;
    let dims = [cols as u64, rows as u64, groups as u64];
    let strides = [stride_rows as u64, stride_groups as u64];
    let bx = [box_cols as u32, box_rows as u32, 1];
    let el = [1u32, 1, 1];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is to a live local array of the length the rank (3) implies; the
    // global address is a live buffer the callers' validation sized to hold every element
    // the dimensions and strides reach; the driver only writes `map`.
    let rc = unsafe {
        encode(
            &mut map,
            dtype,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            bx.as_ptr(),
            el.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            promotion,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(Error::driver("cuTensorMapEncodeTiled", rc));
    }
    Ok(map.opaque)
}

/// The operands' tensor map over `[groups, rows, k]` bytes, box `[1, box_rows, 128]`.
fn tensor_map(
    buf: &DeviceBuffer<u8>,
    groups: usize,
    rows: usize,
    k: usize,
    box_rows: usize,
) -> Result<[u64; 16]> {
    encode_3d(
        buf.as_raw(),
        (CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
        [k, rows, groups],
        [TILE, box_rows],
        CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    )
}

/// The store epilogue's tensor map of D as `[groups, rows, n]` elements (box 64 rows x one
/// 128-byte swizzle row of columns), or `None` when D does not allow one (not 16-byte aligned,
/// rows not a multiple of 16 bytes, sizes past the map's limits): the kernel then stores from
/// registers.
fn store_map(d: &GemmOut<'_>, groups: usize, rows: usize, n: usize) -> Result<Option<[u64; 16]>> {
    let (es, ptr) = (d.elem_size(), d.device_ptr());
    let dtype = match d {
        GemmOut::Bf16(_) => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        GemmOut::F32(_) => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    };
    // Strides below 2^40 bytes, dimensions below 2^32 (the driver's limits).
    let bytes = groups
        .checked_mul(rows)
        .and_then(|x| x.checked_mul(n))
        .and_then(|x| x.checked_mul(es));
    let fits = (n * es) % 16 == 0
        && ptr % 16 == 0
        && groups.max(rows).max(n) < 1 << 32
        && bytes.is_some_and(|b| b < 1 << 40);
    if !fits || groups == 0 || rows == 0 || n == 0 {
        return Ok(None);
    }
    encode_3d(
        ptr,
        (dtype, es),
        [n, rows, groups],
        [128 / es, STORE_ROWS],
        CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
    )
    .map(Some)
}

/// The epilogue flags (`flags.w` of the kernel): bit 0 accumulate, bit 1 the store epilogue
/// (when `store` holds D's map, and D is f32 if accumulating: the boxes are then added into
/// D by the copy engine; a bf16 sum would round twice). The map goes to the kernel with bit
/// 1, zeros otherwise.
fn epilogue(accumulate: bool, d: &GemmOut<'_>, store: Option<[u64; 16]>) -> (u32, [u64; 16]) {
    match store {
        Some(map) if !accumulate => (2, map),
        Some(map) if matches!(d, GemmOut::F32(_)) => (3, map),
        _ => (u32::from(accumulate), [0; 16]),
    }
}

/// Whether a GEMM with fast accumulation allowed (`fast`) takes the fast-accumulation kernels:
/// they exist for E4M3 x E4M3 with a bf16 D (the forward GEMMs, where TransformerEngine
/// accumulates fast); other problems keep the promoted sum.
/// `out` is D's type name ([`GemmOut::name`]).
fn fast_instance(fast: bool, formats: (Fp8Format, Fp8Format), out: &str) -> bool {
    fast && formats == (Fp8Format::E4M3, Fp8Format::E4M3) && out == "bf16"
}

/// The SM count, cached with the module (any kernel of it will do).
fn sm_count(stream: &Stream) -> Result<u32> {
    Ok(kernel(stream.context(), "fp8_gemm_ref_e4m3_e4m3")?.1)
}

/// The SMs a persistent grid may take: the device's, capped at `max_sms`
/// ([`GemmOptions::max_sms`](super::GemmOptions::max_sms), at least 1).
fn grid_sms(stream: &Stream, max_sms: Option<usize>) -> Result<usize> {
    let sms = sm_count(stream)? as usize;
    Ok(max_sms.map_or(sms, |cap| cap.clamp(1, sms.max(1))))
}

/// The kernel of a layout (`""` grouped blocks, `"packed_"`, `"wgrad_"`), operand formats,
/// output type (`GemmOut::name`) and tile width.
fn kernel_name(layout: &str, a: Fp8Format, b: Fp8Format, out: &str, bn: usize) -> String {
    format!(
        "fp8_gemm_sm90_{layout}{}_{}_{out}_n{bn}",
        a.name(),
        b.name()
    )
}

/// Whether the kernel of `layout` (as [`kernel_name`] takes it) at tile width `bn` computes
/// a short last wave in column halves (the kernels' `HALVES`: the 256-wide tiles of grouped
/// blocks and of the packed layout, not block-scaled or fused SwiGLU): the tiles of a last wave
/// that would leave at least half the grid idle run as two 128-column halves each, on twice
/// the CTAs, with the same bits. These kernels load B in boxes of `bn / 2` rows.
fn tail_halves(layout: &str, bn: usize) -> bool {
    bn == 256 && matches!(layout, "" | "fast_" | "packed_fast_")
}

/// The rows of B's box for the kernel of `layout` at width `bn`: `bn`, or `bn / 2` where the
/// kernel loads a tile's B as two boxes ([`tail_halves`], the fused SwiGLU's gate and up rows).
fn b_box_rows(layout: &str, bn: usize) -> usize {
    if tail_halves(layout, bn) || layout.contains("swiglu") {
        bn / 2
    } else {
        bn
    }
}

/// The refusals the packed launches share, before anything else: a device other than 9.0
/// and an odd N (the epilogue stores column pairs). `what` names the launch in the error.
fn check_packed_device(stream: &Stream, what: &str, n: usize) -> Result<()> {
    let bad = |msg: String| Err(Error::InvalidArgument(format!("sm90 {what}: {msg}")));
    if !available(stream.context())? {
        return bad("the device is not compute capability 9.0 (use GemmPath::Auto)".into());
    }
    if n % 2 != 0 {
        return bad(format!("N = {n} is odd"));
    }
    Ok(())
}

/// Enqueues the (validated) problem on `stream`: no synchronisation, no allocation, so it can
/// be captured. Row counts, when given, are read by the kernel at run time. A plain GEMM of
/// at most 128 rows whose column tiles leave SMs idle takes the skinny kernel
/// ([`skinny_plan`]); another plain GEMM with a workspace whose tiles leave SMs idle splits K
/// over it ([`split_k`]); neither with [`GemmOptions::whole_k`](super::GemmOptions::whole_k).
pub(crate) fn launch(stream: &Stream, p: &GemmProblem<'_>) -> Result<()> {
    let plain = p.groups <= 1 && p.counts.is_none();
    let split = plain && !p.whole_k;
    if plain {
        check(p)?;
    }
    if split {
        if let Some((kern, plan)) = skinny_plan_on(stream, p)? {
            return launch_skinny(stream, p, &kern, plan);
        }
    }
    if let Some(ws) = p.workspace.filter(|_| split) {
        let splits = split_k(p.m, p.n, p.k, grid_sms(stream, p.max_sms)?, ws.len());
        if splits > 1 {
            return launch_split_k(stream, p, ws, splits);
        }
    }
    launch_with(stream, p, None)
}

/// Rows of A up to which a plain GEMM takes the skinny kernel (`kernels/gemm_skinny.cuh`).
const SKINNY_ROWS: usize = 128;

/// Columns of D one skinny CTA covers (two consumers of 64).
const SKINNY_COLS: usize = 128;

/// The skinny kernel's row width for `m` rows of A (64 for m <= 64, else 128).
fn skinny_width(m: usize) -> usize {
    if m <= 64 { 64 } else { 128 }
}

/// The skinny kernel's plan for a plain `m x n x k` GEMM: `(mn, splits)`, `mn` its row width
/// ([`skinny_width`]) and `splits` the cluster size along K: the most, from 8 down to 2, such
/// that all `ceil(n / 128)` clusters are resident at once (`resident(s)`: how many clusters of
/// `s` CTAs the device holds at once) and each CTA has at least 2 k-blocks. `None` (the
/// regular tiles) for m over [`SKINNY_ROWS`] or 0, N not a multiple of 4 (the kernel stores
/// four columns at a time), or no such split.
///
/// Why one wave of clusters: the CTAs of a cluster share a GPC, so a cluster size that does
/// not divide a GPC's SMs leaves some idle, and an H200 (132 SMs) holds 66 clusters of 2, 39
/// of 3, 30 of 4, 17 of 6 and 15 of 8 of these CTAs. On it (TFLOP/s, back-to-back launches,
/// promoted sums), 64 x 4096 x 7168 (32 column tiles) in clusters of 1 / 2 / 3 / 4 / 6 / 8:
/// 212 / 324 / 360 / 255 / 246 / 204 (3 is the most that fit: 96 CTAs); 128 x 7168 x 2048
/// (56): 325 / 412 / 236 / 274 / 141 / 144 (2); 32 x 7168 x 2048 (56) best in 2 (126 against
/// 81 in 3); 16 x 4096 x 7168 level in 2 and 3 (72-74). One CTA a column tile (no split) was
/// slower than the regular tiles, which the plan then leaves the problem to.
fn skinny_plan(
    m: usize,
    n: usize,
    k: usize,
    resident: impl Fn(usize) -> usize,
) -> Option<(usize, usize)> {
    if m == 0 || m > SKINNY_ROWS || n == 0 || n % 4 != 0 {
        return None;
    }
    let tiles = n.div_ceil(SKINNY_COLS);
    let kb = k.div_ceil(TILE);
    let splits = (2..=MAX_CLUSTER)
        .rev()
        .find(|&s| kb >= 2 * s && tiles <= resident(s))?;
    Some((skinny_width(m), splits))
}

/// The largest portable thread-block cluster.
const MAX_CLUSTER: usize = 8;

/// [`skinny_plan`] for `p` on `stream`'s device, with the kernel it runs (its shared-memory
/// limit set): the resident clusters asked from the driver ([`resident_clusters`]), at most
/// `max_sms / s` of `s` CTAs when the problem caps its SMs.
fn skinny_plan_on(
    stream: &Stream,
    p: &GemmProblem<'_>,
) -> Result<Option<(Kernel, (usize, usize))>> {
    if p.m == 0 || p.m > SKINNY_ROWS {
        return Ok(None);
    }
    let mn = skinny_width(p.m);
    let formats = (p.a.format, p.b.format);
    let layout = if fast_instance(p.fast, formats, p.d.name()) {
        "skinny_fast_"
    } else {
        "skinny_"
    };
    let name = format!(
        "fp8_gemm_sm90_{layout}{}_{}_{}_m{mn}",
        p.a.format.name(),
        p.b.format.name(),
        p.d.name()
    );
    let (kern, _) = kernel(stream.context(), &name)?;
    let smem = skinny_smem_bytes(mn);
    kern.set_max_dynamic_shared_memory(smem)?;
    let sms = grid_sms(stream, p.max_sms)?;
    let resident = resident_clusters(&kern, smem, sms);
    Ok(skinny_plan(p.m, p.n, p.k, |s| resident[s].min(sms / s)).map(|plan| (kern, plan)))
}

/// How many clusters of `s` CTAs of `kern` (`smem` bytes of dynamic shared memory each) the
/// device holds at once, for s = 0 ..= [`MAX_CLUSTER`] (index s; 0 for s = 0 and for sizes
/// the driver refuses), asked from the driver once per kernel. Where it can not answer at all
/// (a driver before 11.8), `7 sms / (8 s)`: most SMs, some left for clusters that do not fit.
fn resident_clusters(kern: &Kernel, smem: usize, sms: usize) -> [usize; MAX_CLUSTER + 1] {
    static CACHE: Mutex<Vec<(usize, [usize; MAX_CLUSTER + 1])>> = Mutex::new(Vec::new());
    let key = kern.as_raw() as usize;
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, table)) = cache.iter().find(|(k, _)| *k == key) {
        return *table;
    }
    let mut table = [0; MAX_CLUSTER + 1];
    for (s, slot) in table.iter_mut().enumerate().skip(1) {
        let cfg = LaunchConfig {
            shared_mem_bytes: smem as u32,
            ..LaunchConfig::linear(s as u32, THREADS)
        }
        .with(LaunchAttribute::ClusterDimension(s as u32, 1, 1));
        *slot = kern.max_active_clusters(&cfg).map_or(0, |c| c as usize);
    }
    if table.iter().all(|&c| c == 0) {
        for (s, slot) in table.iter_mut().enumerate().skip(1) {
            *slot = 7 * sms / (8 * s);
        }
    }
    cache.push((key, table));
    table
}

/// Dynamic shared memory of the skinny kernel of row width `mn` (keep in step with
/// `SkinnyCfg` in the kernel): the ring of B (128 rows) and A (`mn` rows) k-blocks, as deep as
/// fits (at most 12; the partial tile, `mn` rows of 132 f32, takes the ring's space after the
/// main loop), the barriers, 1 KiB alignment slack.
fn skinny_smem_bytes(mn: usize) -> usize {
    const MAX_STAGES: usize = 12;
    let stage = SKINNY_COLS * TILE + mn * TILE;
    let stages = ((SMEM_LIMIT - 1024 - 2 * MAX_STAGES * 8) / stage).min(MAX_STAGES);
    stages * stage + 2 * stages * 8 + 1024
}

/// A plain GEMM of at most 128 rows on the skinny kernel `kern` ([`skinny_plan_on`]), as the
/// plan says: clusters of `splits` CTAs, each CTA 128 columns of D over one slice of K, the
/// slices' partial sums added in shared memory across the cluster (no workspace; the sum's
/// order is fixed).
fn launch_skinny(
    stream: &Stream,
    p: &GemmProblem<'_>,
    kern: &Kernel,
    (mn, splits): (usize, usize),
) -> Result<()> {
    let smem = skinny_smem_bytes(mn);
    let ta = tensor_map(p.a.data, 1, p.m, p.k, mn)?;
    let tb = tensor_map(p.b.data, 1, p.n, p.k, SKINNY_COLS)?;
    let grid = (p.n.div_ceil(SKINNY_COLS) * splits) as u32;
    let cfg = LaunchConfig {
        shared_mem_bytes: smem as u32,
        ..LaunchConfig::linear(grid, THREADS)
    }
    .with(LaunchAttribute::ClusterDimension(splits as u32, 1, 1));
    let dims = [p.m as u32, p.n as u32, p.k as u32, 0];
    let null = 0u64;
    // A and B reach the kernel only through their tensor maps: `uses` keeps them alive in a
    // captured graph, as the buffers passed as arguments are.
    let args = KernelArgs::new()
        .uses(p.a.data)
        .uses(p.b.data)
        .arg(&ta)
        .arg(&tb);
    let args = match &p.d {
        GemmOut::Bf16(b) => args.arg(*b),
        GemmOut::F32(b) => args.arg(*b),
    };
    let (args, bias_kind) = push_bias(args, &p.bias, &null);
    let flags = [
        idx(p.a.scale_inv)?,
        idx(p.b.scale_inv)?,
        bias_kind,
        u32::from(p.accumulate),
    ];
    let args = args
        .arg(p.a.scale_inv.buffer())
        .arg(p.b.scale_inv.buffer())
        .arg(&dims)
        .arg(&flags);
    // SAFETY: the tensor maps cover exactly A ([m, K], boxes of `mn` >= m rows: zeros past m)
    // and B ([n, K]), so TMA reads stay inside them; the kernel writes (and, accumulating,
    // reads) D ([m, n], validated; n a multiple of 4 and D 8-byte aligned, so its 4-column
    // groups are whole) only at rows below m and columns below n; bias has n elements; the
    // scalar indices are inside their buffers; the grid is whole clusters of `splits` CTAs.
    unsafe { stream.launch_pdl(kern, &cfg, &args) }
}

/// The K splits of a plain `m x n x k` GEMM on `sms` SMs with `ws_bytes` of workspace: 1
/// (no split) when its 128 x 128 tiles already fill a quarter of the SMs (fewer splits than
/// 4 do not pay for the reduce: 184 against 212 TFLOP/s at 128x7168x2048 in 2 splits), K is
/// not whole 128-deep blocks or the workspace holds no two f32 copies of D; otherwise the most splits up to
/// [`MAX_SPLIT_K`](super::MAX_SPLIT_K) that divide the k-blocks evenly, leave each split at
/// least 4 of them, fit the workspace and do not make more tiles than SMs.
fn split_k(m: usize, n: usize, k: usize, sms: usize, ws_bytes: usize) -> usize {
    let tiles = m.div_ceil(TILE) * n.div_ceil(128);
    let copy = m * n * 4;
    if tiles == 0 || 4 * tiles > sms || k % TILE != 0 || copy == 0 {
        return 1;
    }
    let kb = k / TILE;
    let most = (sms / tiles)
        .min(super::MAX_SPLIT_K)
        .min(kb / 4)
        .min(ws_bytes / copy);
    (2..=most).rev().find(|s| kb % s == 0).unwrap_or(1)
}

/// A plain GEMM split over K in `splits` slices: the grouped kernel (f32 out, 128 wide, store
/// epilogue) over views of A and B whose groups are the K-slices of the same rows writes
/// `splits` partial products `alpha * A[:, slice] . B[:, slice]^T` into the workspace as
/// `[splits, m, n]` f32; `fp8_gemm_split_reduce_*` adds them in split order into D, with the
/// bias, and D's old contents when accumulating.
fn launch_split_k(
    stream: &Stream,
    p: &GemmProblem<'_>,
    ws: &DeviceBuffer<u8>,
    splits: usize,
) -> Result<()> {
    let (m, n, k) = (p.m, p.n, p.k);
    let ks = k / splits;
    let copies = splits * m * n * 4;
    // Whole f32s of the workspace (its length need not be a multiple of 4).
    let partial = ws.slice(0..ws.len() / 4 * 4)?.reinterpret::<f32>()?;
    if partial.as_raw() % 16 != 0 || ws.len() < copies {
        return Err(Error::InvalidArgument(format!(
            "sm90 split-K: the workspace ({} bytes at {:#x}) is not 16-byte aligned or holds \
             fewer than {copies} bytes",
            ws.len(),
            partial.as_raw()
        )));
    }
    let partial = partial.slice(..splits * m * n)?;
    let formats = (p.a.format, p.b.format);
    let out = GemmOut::F32(&partial);
    let (bn, kern, cfg) = select(
        stream,
        "",
        formats,
        &out,
        Outputs::plain(splits, m, n),
        Some(128),
        p.max_sms,
    )?;
    let u8map = CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
    let l2 = CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    // A [m, K] and B [n, K] as [splits][rows][ks]: row stride K, slice stride ks (bytes). The
    // slice stride is below the row stride; a driver that refuses such a view gets the GEMM
    // unsplit (nothing was enqueued yet).
    let view = |data: &DeviceBuffer<u8>, rows: usize, box_rows: usize| {
        encode_3d_strided(
            data.as_raw(),
            u8map,
            [ks, rows, splits],
            [k, ks],
            [TILE, box_rows],
            l2,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        )
    };
    let (Ok(ta), Ok(tb)) = (view(p.a.data, m, TILE), view(p.b.data, n, bn)) else {
        return launch_with(stream, p, None);
    };
    let (epi, td) = epilogue(false, &out, store_map(&out, splits, m, n)?);
    let dims = [m as u32, n as u32, ks as u32, splits as u32];
    let null = 0u64;
    let no_bias = None;
    let operands = KernelArgs::new().uses(p.a.data).uses(p.b.data);
    let (args, _) = push_head(operands, [&ta, &tb, &td], &out, &no_bias, &null);
    let flags = [idx(p.a.scale_inv)?, idx(p.b.scale_inv)?, 0, epi];
    let args = args
        .arg(p.a.scale_inv.buffer())
        .arg(p.b.scale_inv.buffer())
        .arg(&null)
        .arg(&dims)
        .arg(&flags);
    // SAFETY: the maps view A ([m, K]) and B ([n, K]) as `splits` slices of `ks` = K / splits
    // columns (slice s starts at byte s * ks of each row, and s * ks + ks <= K), so TMA reads
    // stay inside them; the kernel writes the partial buffer (splits * m * n f32, checked
    // above) only inside its [splits, m, n] blocks, through the store map of the same extent;
    // no bias, no counts; the scalar indices are inside their buffers.
    unsafe { stream.launch_pdl(&kern, &cfg, &args) }?;
    split_reduce(stream, p, &partial, splits)
}

/// `D = sum over s of partial[s] (+ bias) (+ D)` in split order, two columns per thread.
fn split_reduce(
    stream: &Stream,
    p: &GemmProblem<'_>,
    partial: &DeviceBuffer<f32>,
    splits: usize,
) -> Result<()> {
    let (m, n) = (p.m, p.n);
    let name = format!("fp8_gemm_split_reduce_{}", p.d.name());
    let (kern, sms) = kernel(stream.context(), &name)?;
    let pairs = m * n / 2;
    let blocks = pairs.div_ceil(256).min(sms as usize * 8).max(1) as u32;
    let dims = [m as u32, n as u32, splits as u32, u32::from(p.accumulate)];
    let null = 0u64;
    let args = KernelArgs::new().arg(partial);
    let args = match &p.d {
        GemmOut::Bf16(b) => args.arg(*b),
        GemmOut::F32(b) => args.arg(*b),
    };
    let (args, bias_kind) = push_bias(args, &p.bias, &null);
    let args = args.arg(&dims).arg(&bias_kind);
    // SAFETY: the kernel reads `splits` f32 copies of [m, n] from `partial` (sized so by the
    // caller), the bias's n elements, and reads (when accumulating) and writes D's m * n
    // elements (validated); N is even, so each thread's column pair lies in one row.
    unsafe { stream.launch_pdl(&kern, &LaunchConfig::linear(blocks, 256), &args) }
}

/// [`launch`] with the tile width forced (128, 192, or 256 where the kernel has that width; see
/// [`select`]) or chosen (`None`).
fn launch_with(stream: &Stream, p: &GemmProblem<'_>, bn: Option<usize>) -> Result<()> {
    launch_epilogue(stream, p, bn, true)
}

/// [`launch_with`], and with `store` false every tile through the register epilogue (the
/// tests compare the two epilogues).
fn launch_epilogue(
    stream: &Stream,
    p: &GemmProblem<'_>,
    bn: Option<usize>,
    store: bool,
) -> Result<()> {
    check(p)?;
    let groups = p.groups.max(1);
    let formats = (p.a.format, p.b.format);
    let layout = if fast_instance(p.fast, formats, p.d.name()) {
        "fast_"
    } else {
        ""
    };
    let out = Outputs {
        groups,
        m: p.m,
        n: p.n,
        counted: p.counts.is_some(),
    };
    let (bn, k, cfg) = select(stream, layout, formats, &p.d, out, bn, p.max_sms)?;
    let ta = tensor_map(p.a.data, groups, p.m, p.k, TILE)?;
    let tb = tensor_map(p.b.data, groups, p.n, p.k, b_box_rows(layout, bn))?;
    // With row counts the kernel stores through the map only the tiles whose rows all lie
    // below their group's count; a group's last, partial tile goes from registers.
    let store = store
        .then(|| store_map(&p.d, groups, p.m, p.n))
        .transpose()?
        .flatten();
    let (epi, td) = epilogue(p.accumulate, &p.d, store);
    let dims = [p.m as u32, p.n as u32, p.k as u32, groups as u32];
    let null = 0u64;
    let operands = KernelArgs::new().uses(p.a.data).uses(p.b.data);
    let (args, bias_kind) = push_head(operands, [&ta, &tb, &td], &p.d, &p.bias, &null);
    let flags = [idx(p.a.scale_inv)?, idx(p.b.scale_inv)?, bias_kind, epi];
    let args = args.arg(p.a.scale_inv.buffer()).arg(p.b.scale_inv.buffer());
    let args = match p.counts {
        Some(c) => args.arg(c),
        None => args.arg(&null),
    }
    .arg(&dims)
    .arg(&flags);
    // SAFETY: the tensor maps cover exactly A ([groups, m, K]) and B ([groups, N, K]), so
    // TMA reads stay inside them (zeros past the edges); the kernel writes D only at rows
    // below min(count, m) and columns below N of each group's [m, N] block, which the entry
    // points' validation sized (the store map is D's [groups, m, N], TMA stores skip what lies
    // outside it, and with counts the kernel stores through it only tiles whose every row is
    // below the group's count); bias has N elements; counts
    // has `groups` int32s; each scalar index is inside its buffer (DeviceScalar checks it).
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

/// Enqueues a (validated) block-scaled GEMM ([`super::gemm_blockwise`]) on the sm_90a
/// kernel: E4M3 operands, 128-wide tiles, each k-block's products scaled by its row's and
/// column block's scale_inv as they are added to the f32 sum. An [`Error::InvalidArgument`]
/// (nothing enqueued) for other formats, shapes or alignments it does not take.
/// `opts` gives the bias, accumulation and SM cap.
pub(crate) fn launch_blockwise(
    stream: &Stream,
    shape: (usize, usize, usize),
    operands: (&BlockOperand<'_>, &BlockOperand<'_>),
    d: &GemmOut<'_>,
    opts: &GemmOptions<'_>,
) -> Result<()> {
    launch_blockwise_with(stream, shape, operands, d, opts, None)
}

/// [`launch_blockwise`] with the tile width forced (128, 192, or 256 with bf16 out) or chosen
/// (`None`, as for per-tensor scales: [`choose_bn_for`]).
fn launch_blockwise_with(
    stream: &Stream,
    (m, n, k): (usize, usize, usize),
    (a, b): (&BlockOperand<'_>, &BlockOperand<'_>),
    d: &GemmOut<'_>,
    opts: &GemmOptions<'_>,
    forced: Option<usize>,
) -> Result<()> {
    let (bias, accumulate) = (&opts.bias, opts.accumulate);
    if (a.format, b.format) != (Fp8Format::E4M3, Fp8Format::E4M3) {
        return Err(Error::InvalidArgument(format!(
            "sm90 block-scaled GEMM: {} x {} operands (E4M3 x E4M3 only)",
            a.format.name(),
            b.format.name()
        )));
    }
    if k % 16 != 0 || n % 2 != 0 || m == 0 || n == 0 {
        return Err(Error::InvalidArgument(format!(
            "sm90 block-scaled GEMM: {m} x {n} x {k} (K a multiple of 16, N even)"
        )));
    }
    let lim = i32::MAX as usize;
    if m > lim || n > lim || k > lim {
        return Err(Error::InvalidArgument(format!(
            "sm90 block-scaled GEMM: {m} x {n} x {k} exceeds 2^31"
        )));
    }
    if a.data.as_raw() % 16 != 0 || b.data.as_raw() % 16 != 0 || d.device_ptr() % 8 != 0 {
        return Err(Error::InvalidArgument(
            "sm90 block-scaled GEMM: A and B must be 16-byte aligned, D 8-byte".into(),
        ));
    }
    let formats = (a.format, b.format);
    let (bn, kern, cfg) = select(
        stream,
        "block_",
        formats,
        d,
        Outputs::plain(1, m, n),
        forced,
        opts.max_sms,
    )?;
    let ta = tensor_map(a.data, 1, m, k, TILE)?;
    let tb = tensor_map(b.data, 1, n, k, bn)?;
    let (epi, td) = epilogue(accumulate, d, store_map(d, 1, m, n)?);
    let dims = [m as u32, n as u32, k as u32, 1];
    let null = 0u64;
    let operands = KernelArgs::new().uses(a.data).uses(b.data);
    let (args, bias_kind) = push_head(operands, [&ta, &tb, &td], d, bias, &null);
    let flags = [0, 0, bias_kind, epi];
    let args = args
        .arg(a.scales_inv)
        .arg(b.scales_inv)
        .arg(&null)
        .arg(&dims)
        .arg(&flags);
    // SAFETY: the tensor maps cover exactly A ([m, K]) and B ([n, K]), so TMA reads stay
    // inside them; the kernel reads sa[r * ceil(K/128) + kb] for rows r < m and
    // sb[blk * ceil(K/128) + kb] for B's 128-row blocks blk < ceil(N/128) (a tile's blocks
    // clamped to the last), kb < ceil(K/128) (the caller checked both lengths), and writes D
    // ([m, N], validated) only at rows below m and columns below N (the store map has D's
    // extent); bias has N elements.
    unsafe { stream.launch_pdl(&kern, &cfg, &args) }
}

/// Enqueues a (validated) packed grouped GEMM ([`super::grouped_gemm_packed`]) on the sm_90a
/// kernel: the persistent TMA + wgmma kernel with the packed tile order (m-tiles up to
/// `offsets[groups]`, each tile's group found by a binary search over the device offsets, B
/// of that group, one scale_inv per group when given). Needs every offset a multiple of 128
/// (a tile then belongs to one group, which the dropless layout guarantees; otherwise a
/// tile's rows past its first row's group are computed with that group, or left unwritten
/// when accumulating) and `N` even.
pub(crate) fn launch_packed(stream: &Stream, p: &PackedProblem<'_>) -> Result<()> {
    check_packed_device(stream, "packed GEMM", p.shape.n)?;
    check_packed_limits(p)?;
    enqueue_packed(stream, p, packed_bn(stream, p)?, None)
}

/// The packed GEMM of fc1 with the SwiGLU cast of D fused into its epilogue
/// ([`super::grouped_gemm_packed_swiglu`]), `h` = (the row-major output `[capacity, n / 2]`
/// with its scalars, the transposed bytes), both checked by the caller. `Ok(false)`, with
/// nothing enqueued, where the fused kernel does not take the problem: another device,
/// operands other than E4M3 x E4M3, an E5M2 `h`, accumulation, a D the store epilogue can not
/// write, or a tile width whose halves do not divide `n / 2` (F a multiple of 64 for the
/// 128-wide tile, of 128 for the 256-wide one). The caller then runs the two kernels.
pub(crate) fn launch_packed_swiglu(
    stream: &Stream,
    p: &PackedProblem<'_>,
    h: (&Fp8Tensor, &DeviceBuffer<u8>),
) -> Result<bool> {
    let (capacity, n) = (p.shape.capacity, p.shape.n);
    let e4 = Fp8Format::E4M3;
    let fits = available(stream.context())?
        && !p.accumulate
        && (p.a.format, p.b.format) == (e4, e4)
        && h.0.format() == e4
        && matches!(p.d, GemmOut::Bf16(_))
        && store_map(&p.d, 1, capacity, n)?.is_some();
    if !fits {
        return Ok(false);
    }
    check_packed_limits(p)?;
    let fast = fast_instance(p.fast, (e4, e4), p.d.name());
    let Some(bn) = swiglu_bn(packed_bn(stream, p)?, fast, n / 2) else {
        return Ok(false);
    };
    enqueue_packed(stream, p, bn, Some(h)).map(|()| true)
}

/// The fused SwiGLU kernel's tile width for the width `bn` the plain packed GEMM would take:
/// its gate and up halves must be whole 64-column store boxes that tile F = `ffn` (the kernel
/// has 256 with fast accumulation, 128 with both sums), so 256 stays where F allows it and
/// 192 becomes 128; `None` where F is not a multiple of 64.
pub(crate) fn swiglu_bn(bn: usize, fast: bool, ffn: usize) -> Option<usize> {
    if fast && bn == 256 && ffn % 128 == 0 {
        Some(256)
    } else if ffn % 64 == 0 {
        Some(128)
    } else {
        None
    }
}

/// The packed kernels' 32-bit index limits.
fn check_packed_limits(p: &PackedProblem<'_>) -> Result<()> {
    let (groups, capacity, n, k) = (p.shape.groups, p.shape.capacity, p.shape.n, p.shape.k);
    let lim = i32::MAX as usize;
    if capacity > lim || n > lim || k > lim || groups.saturating_mul(n) > lim {
        return Err(Error::InvalidArgument(format!(
            "sm90 packed GEMM: capacity = {capacity}, N = {n}, K = {k}, groups = {groups} \
             exceed 2^31"
        )));
    }
    Ok(())
}

/// The packed GEMM's tile width: for the rows expected in use (the grid is sized for the
/// whole capacity).
fn packed_bn(stream: &Stream, p: &PackedProblem<'_>) -> Result<usize> {
    let capacity = p.shape.capacity;
    let rows = p.expected_rows.map_or(capacity, |r| r.clamp(1, capacity));
    let fast = fast_instance(p.fast, (p.a.format, p.b.format), p.d.name());
    let sms = grid_sms(stream, p.max_sms)?;
    Ok(choose_bn_for(1, rows, p.shape.n, sms, fast, fast))
}

/// Enqueues the packed kernel of tile width `bn`; with `swiglu` (h and h^T), the fused
/// SwiGLU instance (whose store epilogue [`launch_packed_swiglu`] checked), writing h.
fn enqueue_packed(
    stream: &Stream,
    p: &PackedProblem<'_>,
    bn: usize,
    swiglu: Option<(&Fp8Tensor, &DeviceBuffer<u8>)>,
) -> Result<()> {
    let (groups, capacity, n, k) = (p.shape.groups, p.shape.capacity, p.shape.n, p.shape.k);
    let formats = (p.a.format, p.b.format);
    let fast = fast_instance(p.fast, formats, p.d.name());
    let layout = match (swiglu.is_some(), fast) {
        (false, false) => "packed_",
        (false, true) => "packed_fast_",
        (true, false) => "packed_swiglu_",
        (true, true) => "packed_swiglu_fast_",
    };
    let (bn, kern, cfg) = select(
        stream,
        layout,
        formats,
        &p.d,
        Outputs::plain(1, capacity, n),
        Some(bn),
        p.max_sms,
    )?;
    let ta = tensor_map(p.a.data, 1, capacity, k, TILE)?;
    // The fused kernel loads each B tile as two boxes (gate rows, then up rows), the 256-wide
    // fast one as two halves.
    let tb = tensor_map(p.b.data, groups, n, k, b_box_rows(layout, bn))?;
    let (epi, td) = epilogue(p.accumulate, &p.d, store_map(&p.d, 1, capacity, n)?);
    let dims = [capacity as u32, n as u32, k as u32, groups as u32];
    let h_idx = swiglu.map(|(out, _)| slot_indices(out, None)).transpose()?;
    // h's maps: [capacity, n / 2] and its transpose.
    let h_maps = swiglu
        .map(|(out, out_t)| -> Result<_> {
            Ok((
                cast_map(out.data(), capacity, n / 2)?,
                cast_map(out_t, n / 2, capacity)?,
            ))
        })
        .transpose()?;
    let null = 0u64;
    let operands = KernelArgs::new().uses(p.a.data).uses(p.b.data);
    let (args, bias_kind) = push_head(operands, [&ta, &tb, &td], &p.d, &p.bias, &null);
    let (sb_idx, sb, sbg) = match p.b.scale_inv {
        GroupScales::Tensor(s) => (idx(s)?, Some(s.buffer()), None),
        GroupScales::PerGroup(buf) => (0, None, Some(buf)),
    };
    let expected = p.expected_rows.map_or(capacity, |r| r.clamp(1, capacity));
    let hints = if weights_stream_once(expected, groups) {
        L2_HINTS
    } else {
        0
    };
    let flags = [idx(p.a.scale_inv)?, sb_idx, bias_kind, epi | hints];
    let args = args.arg(p.a.scale_inv.buffer());
    let args = match sb {
        Some(b) => args.arg(b),
        None => args.arg(&null),
    };
    let args = match sbg {
        Some(b) => args.arg(b),
        None => args.arg(&null),
    }
    .arg(p.offsets)
    .arg(&dims)
    .arg(&flags);
    let args = match (swiglu, &h_idx, &h_maps) {
        (Some((out, out_t)), Some(h_idx), Some((ty, tyt))) => args
            .arg(ty)
            .arg(tyt)
            .arg(out.data())
            .arg(out_t)
            .arg(out.scale().buffer())
            .arg(out.scale_inv().buffer())
            .arg(out.amax().buffer())
            .arg(h_idx),
        _ => args,
    };
    // SAFETY: the tensor maps cover exactly A ([capacity, K]) and B ([groups, N, K]), so TMA
    // reads stay inside them (zeros past the edges); the kernel writes D ([capacity, N],
    // validated) only at rows below the clamped offsets[groups] rounded up to a tile, capped
    // at capacity (the store map is D's [capacity, N]; TMA stores skip what lies outside it),
    // and columns below N; the group index comes from a binary search over the groups + 1 offsets (validated
    // length) and stays in 0..groups, which bounds B's group coordinate and the per-group
    // scales (groups values, validated); bias has N elements; scalar indices are inside their
    // buffers. The fused SwiGLU kernel also writes h at the same rows (below capacity) and
    // columns below N / 2, into out.data() ([capacity, N / 2]) and out_t ([N / 2, capacity]),
    // whose sizes the caller checked (through maps of exactly those extents, built above),
    // and the three scalar slots (indices checked above).
    unsafe { stream.launch_pdl(&kern, &cfg, &args) }
}

/// Enqueues a (validated) packed weight gradient ([`super::grouped_gemm_wgrad`]) on the sm_90a
/// kernel: every `(group, m-tile, n-tile)` tile reduces over its group's columns
/// `offsets[g] .. offsets[g + 1]` of A `[m, capacity]` and B `[n, capacity]`, read on the
/// device, in 128-column blocks. Needs every offset a multiple of 128 (a block then belongs to
/// one group, which the dropless layout guarantees; other offsets are clamped to
/// `[0, capacity]` and rounded out to whole blocks, so a group may then also sum its
/// neighbours' columns) and `N` even.
pub(crate) fn launch_wgrad(stream: &Stream, p: &WgradProblem<'_>) -> Result<()> {
    launch_wgrad_with(stream, p, None, true)
}

/// [`launch_wgrad`] with the tile width forced (128 or 192) or chosen (`None`), and with
/// `store` false every tile through the register epilogue (the probes compare them).
fn launch_wgrad_with(
    stream: &Stream,
    p: &WgradProblem<'_>,
    bn: Option<usize>,
    store: bool,
) -> Result<()> {
    let (groups, capacity, m, n) = (p.shape.groups, p.shape.capacity, p.shape.m, p.shape.n);
    check_packed_device(stream, "wgrad GEMM", n)?;
    let lim = i32::MAX as usize;
    let tiles = groups
        .saturating_mul(m.div_ceil(TILE))
        .saturating_mul(n.div_ceil(128));
    if capacity > lim || m > lim || n > lim || tiles > lim {
        return Err(Error::InvalidArgument(format!(
            "sm90 wgrad GEMM: capacity = {capacity}, M = {m}, N = {n}, groups = {groups} \
             exceed 2^31 tiles or rows"
        )));
    }
    let formats = (p.a.format, p.b.format);
    let bn = wgrad_bn(bn, p.d.elem_size(), capacity, groups);
    let (bn, kern, cfg) = select(
        stream,
        "wgrad_",
        formats,
        &p.d,
        Outputs::plain(groups, m, n),
        bn,
        p.max_sms,
    )?;
    let ta = tensor_map(p.a.data, 1, m, capacity, TILE)?;
    let tb = tensor_map(p.b.data, 1, n, capacity, bn)?;
    let store = store
        .then(|| store_map(&p.d, groups, m, n))
        .transpose()?
        .flatten();
    let (epi, td) = epilogue(p.accumulate, &p.d, store);
    let dims = [m as u32, n as u32, capacity as u32, groups as u32];
    let hints = if wgrad_output_streams(capacity, groups) {
        L2_HINTS
    } else {
        0
    };
    let flags = [idx(p.a.scale_inv)?, idx(p.b.scale_inv)?, 0, epi | hints];
    let args = KernelArgs::new()
        .uses(p.a.data)
        .uses(p.b.data)
        .arg(&ta)
        .arg(&tb)
        .arg(&td);
    let args = match &p.d {
        GemmOut::Bf16(b) => args.arg(*b),
        GemmOut::F32(b) => args.arg(*b),
    }
    .arg(p.a.scale_inv.buffer())
    .arg(p.b.scale_inv.buffer())
    .arg(p.offsets)
    .arg(&dims)
    .arg(&flags);
    // SAFETY: the tensor maps cover exactly A ([m, capacity]) and B ([n, capacity]), so TMA
    // reads stay inside them (zeros past the edges); the kernel writes D ([groups, m, N],
    // validated, and the store map's extent) only at rows below m and columns below N of
    // group g's block, g < groups;
    // offsets has groups + 1 int32s (validated), clamped to [0, capacity] before use; scalar
    // indices are inside their buffers.
    unsafe { stream.launch_pdl(&kern, &cfg, &args) }
}

/// The outputs a launch covers: `groups` blocks of `m x n`; `counted` where row counts on the
/// device may leave groups part full, so that the host can not cost the waves of its tiles.
#[derive(Clone, Copy, Debug)]
struct Outputs {
    groups: usize,
    m: usize,
    n: usize,
    counted: bool,
}

impl Outputs {
    /// Every group full.
    fn plain(groups: usize, m: usize, n: usize) -> Self {
        Outputs {
            groups,
            m,
            n,
            counted: false,
        }
    }
}

/// The tile width (`forced`: 128 or 192, or 256 where `layout` has a 256-wide kernel; an
/// [`Error::InvalidArgument`] otherwise; or chosen for the outputs), the kernel of `layout`
/// (as [`kernel_name`] takes it) for the operand formats and D's type with its dynamic shared
/// memory allowed, and the persistent launch over the tiles: one CTA per SM at most, on at
/// most `max_sms` SMs.
fn select(
    stream: &Stream,
    layout: &str,
    (fa, fb): (Fp8Format, Fp8Format),
    d: &GemmOut<'_>,
    out: Outputs,
    forced: Option<usize>,
    max_sms: Option<usize>,
) -> Result<(usize, cuda_graph::Kernel, LaunchConfig)> {
    let Outputs { groups, m, n, .. } = out;
    // 256 columns: the fast-accumulation kernels, the plain promoted one of E4M3 x E4M3 to
    // bf16 (grouped blocks) and the block-scaled one to bf16.
    let fast = layout.contains("fast_");
    let e4 = Fp8Format::E4M3;
    let bf16 = d.name() == "bf16";
    let has_256 =
        fast || (layout.is_empty() && (fa, fb) == (e4, e4) && bf16) || (layout == "block_" && bf16);
    if let Some(bn) = forced.filter(|&bn| !(bn == 128 || bn == 192 || (has_256 && bn == 256))) {
        return Err(Error::InvalidArgument(format!("tile width {bn}")));
    }
    // The widths are costed as if every group were full. With row counts the tiles are known
    // on the device only, and skewed counts can leave the 256-wide tiles' last wave nearly
    // empty; the kernels with tail halves run such a wave in halves. (Before them the promoted
    // sum took 256 only without counts: 8 groups of 2048 down to 32 rows, N = 4096, K = 2048
    // on an H200, 845-856 TFLOP/s at 256 against 900-931 at 192; full groups 1041-1064 against
    // 949-977.)
    let wide = has_256 && (!out.counted || tail_halves(layout, 256));
    let sms = grid_sms(stream, max_sms)?;
    let es = d.elem_size();
    let bn = forced.unwrap_or_else(|| choose_bn_for(groups, m, n, sms, fast, wide));
    let (k, _) = kernel(stream.context(), &kernel_name(layout, fa, fb, d.name(), bn))?;
    let scales = if layout == "block_" {
        BLOCK_SCALE_BYTES
    } else {
        0
    };
    let smem = smem_bytes(bn, es, scales);
    k.set_max_dynamic_shared_memory(smem)?;
    let tiles = groups.max(1) * m.div_ceil(TILE) * n.div_ceil(bn);
    let grid = tiles.min(sms).max(1) as u32;
    let cfg = LaunchConfig {
        shared_mem_bytes: smem as u32,
        ..LaunchConfig::linear(grid, THREADS)
    };
    Ok((bn, k, cfg))
}

/// Pushes the kernels' first parameters: the tensor maps of A, B and D's store, D and the
/// bias (`null`, which holds 0, when absent); returns the args and the bias kind flag (0
/// none, 1 bf16, 2 f32).
fn push_head<'a>(
    args: KernelArgs<'a>,
    maps: [&'a [u64; 16]; 3],
    d: &'a GemmOut<'a>,
    bias: &'a Option<Bias<'a>>,
    null: &'a u64,
) -> (KernelArgs<'a>, u32) {
    let args = args.arg(maps[0]).arg(maps[1]).arg(maps[2]);
    let args = match d {
        GemmOut::Bf16(b) => args.arg(*b),
        GemmOut::F32(b) => args.arg(*b),
    };
    push_bias(args, bias, null)
}

/// Pushes the bias (`null`, which holds 0, when absent); returns the args and the bias kind
/// flag (0 none, 1 bf16, 2 f32).
fn push_bias<'a>(
    args: KernelArgs<'a>,
    bias: &'a Option<Bias<'a>>,
    null: &'a u64,
) -> (KernelArgs<'a>, u32) {
    match bias {
        None => (args.arg(null), 0),
        Some(Bias::Bf16(b)) => (args.arg(*b), 1),
        Some(Bias::F32(b)) => (args.arg(*b), 2),
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    #[test]
    fn kernel_names_match_the_entry_points() {
        // The names the entry macros of gemm_sm90.cuh give: FP8K_GEMM_SM90{,_PACKED,_WGRAD},
        // _FAST, _BLOCK and _SWIGLU.
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        for (layout, a, b, out, bn, want) in [
            ("", e4, e5, "bf16", 128, "fp8_gemm_sm90_e4m3_e5m2_bf16_n128"),
            (
                "packed_",
                e5,
                e4,
                "bf16",
                192,
                "fp8_gemm_sm90_packed_e5m2_e4m3_bf16_n192",
            ),
            (
                "wgrad_",
                e5,
                e4,
                "f32",
                128,
                "fp8_gemm_sm90_wgrad_e5m2_e4m3_f32_n128",
            ),
            (
                "fast_",
                e4,
                e4,
                "bf16",
                192,
                "fp8_gemm_sm90_fast_e4m3_e4m3_bf16_n192",
            ),
            (
                "packed_fast_",
                e4,
                e4,
                "bf16",
                128,
                "fp8_gemm_sm90_packed_fast_e4m3_e4m3_bf16_n128",
            ),
            (
                "block_",
                e4,
                e4,
                "f32",
                192,
                "fp8_gemm_sm90_block_e4m3_e4m3_f32_n192",
            ),
            (
                "packed_swiglu_fast_",
                e4,
                e4,
                "bf16",
                256,
                "fp8_gemm_sm90_packed_swiglu_fast_e4m3_e4m3_bf16_n256",
            ),
            (
                "packed_swiglu_",
                e4,
                e4,
                "bf16",
                128,
                "fp8_gemm_sm90_packed_swiglu_e4m3_e4m3_bf16_n128",
            ),
        ] {
            assert_eq!(kernel_name(layout, a, b, out, bn), want);
        }
    }

    #[test]
    fn fused_swiglu_tile_width() {
        // (the plain GEMM's width, fast accumulation, F) -> the fused kernel's width: 256
        // stays where fast and F allow, the others take 128 where 64-column halves tile F.
        for (bn, fast, ffn, want) in [
            (256, true, 2048, Some(256)),
            (256, true, 256, Some(256)),
            (256, true, 192, Some(128)),
            (192, true, 2048, Some(128)),
            (128, true, 2048, Some(128)),
            (192, false, 2048, Some(128)),
            (128, false, 64, Some(128)),
            (256, true, 80, None),
            (128, false, 96, None),
        ] {
            assert_eq!(swiglu_bn(bn, fast, ffn), want, "{bn} {fast} {ffn}");
        }
    }

    #[test]
    fn skinny_plan_choice() {
        // Clusters of s resident at once on an H200 (132 SMs; the driver's answers for 1, 2,
        // 3, 4, 6 and 8, and 5 and 7 between their neighbours').
        const H200: [usize; 9] = [0, 132, 66, 39, 30, 24, 17, 16, 15];
        let h200 = |s: usize| H200[s];
        for ((m, n, k), want) in [
            // 32 column tiles: clusters of 3 (32 of 4 do not fit at once); 64 rows at most:
            // 64 wide.
            ((64, 4096, 7168), Some((64, 3))),
            ((1, 4096, 7168), Some((64, 3))),
            // 56 column tiles: clusters of 2 (112 SMs); 65..=128 rows: 128 wide.
            ((128, 7168, 2048), Some((128, 2))),
            ((65, 7168, 2048), Some((128, 2))),
            // 8 column tiles: 8; 16: 7; 17: 6; too few k-blocks for more (2 each at least).
            ((16, 1024, 4096), Some((64, 8))),
            ((16, 2048, 4096), Some((64, 7))),
            ((16, 2176, 4096), Some((64, 6))),
            ((16, 2048, 1024), Some((64, 4))),
            ((16, 2048, 512), Some((64, 2))),
            // No split: too few k-blocks, or more column tiles than clusters of 2 fit.
            ((16, 2048, 384), None),
            ((64, 8576, 4096), None),
            ((64, 8448, 4096), Some((64, 2))),
            // More rows than the kernel covers, none, or N not a multiple of 4.
            ((129, 4096, 7168), None),
            ((0, 4096, 7168), None),
            ((64, 4098, 7168), None),
        ] {
            assert_eq!(skinny_plan(m, n, k, h200), want, "{m}x{n}x{k}");
        }
        // A device that holds fewer clusters (an SM cap): fewer splits, or none.
        assert_eq!(skinny_plan(64, 4096, 7168, |s| 64 / s), Some((64, 2)));
        assert_eq!(skinny_plan(64, 4096, 7168, |s| 32 / s), None);
        // The shared memory fits a CTA, with at least 4 stages.
        for mn in [64, 128] {
            let bytes = skinny_smem_bytes(mn);
            let stage = (128 + mn) * 128;
            assert!(bytes <= SMEM_LIMIT && bytes >= 4 * stage, "m{mn}: {bytes}");
        }
        assert_eq!(skinny_smem_bytes(64), 9 * 24576 + 9 * 16 + 1024);
        assert_eq!(skinny_smem_bytes(128), 7 * 32768 + 7 * 16 + 1024);
    }

    #[test]
    fn split_k_choice() {
        let big = usize::MAX;
        // (m, n, k, workspace bytes) -> splits on 132 SMs.
        for (m, n, k, ws, want) in [
            // 32 tiles: 4 splits fill 128 SMs; 56 k-blocks split evenly.
            (64, 4096, 7168, big, 4),
            // 56 tiles, more than a quarter of the SMs: no split (2 splits measured 184
            // against 212 TFLOP/s unsplit on an H200: the reduce costs more than it saves).
            (128, 7168, 2048, big, 1),
            // 2 tiles: up to MAX_SPLIT_K, 32 k-blocks: 8.
            (16, 256, 4096, big, 8),
            // Enough tiles already, K not in whole blocks, K too short to split.
            (8192, 8192, 8192, big, 1),
            (64, 4096, 7000, big, 1),
            (64, 4096, 512, big, 1),
            // The workspace: 3 copies of D allow 3 splits, which do not divide 56: 2; one
            // copy allows none.
            (64, 4096, 7168, 3 * 64 * 4096 * 4, 2),
            (64, 4096, 7168, 64 * 4096 * 4, 1),
        ] {
            assert_eq!(
                split_k(m, n, k, 132, ws),
                want,
                "{m} x {n} x {k}, {ws} bytes"
            );
        }
        assert_eq!(
            super::super::split_k_workspace_bytes(super::super::GemmShape::new(64, 4096, 7168)),
            8 * 64 * 4096 * 4
        );
    }

    #[test]
    fn fast_kernels_only_for_e4m3_pairs_into_bf16() {
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        assert!(fast_instance(true, (e4, e4), "bf16"));
        assert!(!fast_instance(false, (e4, e4), "bf16"));
        assert!(!fast_instance(true, (e4, e4), "f32"));
        for pair in [(e4, e5), (e5, e4), (e5, e5)] {
            assert!(!fast_instance(true, pair, "bf16"), "{pair:?}");
        }
    }

    #[test]
    fn wgrad_tile_width() {
        // f32 weight gradients with few rows per group take 128 unless forced; the others
        // are left to choose_bn_for. The MoE layer's capacities at E = 8, top-2, 128-row
        // alignment: T = 256 -> 1536 rows (192 a group), T = 4096 -> 9216 (1152 a group).
        assert_eq!(wgrad_bn(None, 4, 1536, 8), Some(128));
        assert_eq!(wgrad_bn(None, 4, 9216, 8), None);
        assert_eq!(wgrad_bn(None, 4, 2048, 8), Some(128));
        assert_eq!(wgrad_bn(None, 4, 2049, 8), None);
        assert_eq!(wgrad_bn(None, 2, 1536, 8), None);
        assert_eq!(wgrad_bn(None, 4, 0, 0), Some(128));
        assert_eq!(wgrad_bn(Some(192), 4, 1536, 8), Some(192));
        assert_eq!(wgrad_bn(Some(128), 2, 9216, 8), Some(128));
    }

    #[test]
    fn tail_halves_and_b_boxes() {
        // The 256-wide grouped and packed tiles, not block-scaled, SwiGLU or narrower.
        for layout in ["", "fast_", "packed_fast_"] {
            assert!(tail_halves(layout, 256), "{layout}");
            assert_eq!(b_box_rows(layout, 256), 128, "{layout}");
            for bn in [128, 192] {
                assert!(!tail_halves(layout, bn), "{layout} {bn}");
                assert_eq!(b_box_rows(layout, bn), bn, "{layout} {bn}");
            }
        }
        for layout in ["block_", "packed_", "wgrad_"] {
            assert!(!tail_halves(layout, 256), "{layout}");
            assert_eq!(b_box_rows(layout, 256), 256, "{layout}");
        }
        // The fused SwiGLU loads gate and up rows as two boxes at every width.
        for (layout, bn) in [("packed_swiglu_", 128), ("packed_swiglu_fast_", 256)] {
            assert!(!tail_halves(layout, bn));
            assert_eq!(b_box_rows(layout, bn), bn / 2);
        }
    }

    #[test]
    fn l2_hint_rules() {
        // The MoE layer at E = 8, top-2, 128-row alignment: T = 256 expects 1024 rows (one
        // row tile an expert: the weights stream), T = 4096 8704; E = 256 top-8 at T = 4096
        // expects 49152 (1.5 tiles an expert).
        assert!(weights_stream_once(1024, 8));
        assert!(!weights_stream_once(1025, 8));
        assert!(!weights_stream_once(8704, 8));
        assert!(!weights_stream_once(49152, 256));
        assert!(weights_stream_once(100, 0));
        // Weight gradients: T = 256's capacity 1536 (192 rows an expert) takes the hints,
        // T = 4096's 9216 does not.
        assert!(wgrad_output_streams(1536, 8));
        assert!(wgrad_output_streams(2048, 8));
        assert!(!wgrad_output_streams(2049, 8));
        assert!(!wgrad_output_streams(9216, 8));
        assert!(!wgrad_output_streams(usize::MAX, 1));
    }

    #[test]
    fn tile_width_choice() {
        // (groups, m, n) -> width on 132 SMs.
        for (g, m, n, bn) in [
            (1, 8192, 8192, 192),
            (1, 4096, 7168, 192),
            (1, 2048, 2048, 128),
            (1, 128, 7168, 128),
            (1, 64, 4096, 128),
            // 8 groups of 4 m-tiles: 6 waves of 192 against 8 of 128.
            (8, 512, 4096, 192),
            // The MoE layer's packed GEMMs (H = F = 2048, 8 experts, top-2) for the rows
            // expected in use: T = 256 (1024 rows: 8 m-tiles, a weight-streaming problem whose
            // narrower tiles spread over more SMs), T = 4096 (8704 rows).
            (1, 1024, 4096, 128),
            (1, 1024, 2048, 128),
            (1, 8704, 4096, 192),
            (1, 8704, 2048, 192),
        ] {
            assert_eq!(
                choose_bn_for(g, m, n, 132, false, false),
                bn,
                "{g} x {m} x {n}"
            );
        }
        // With the 256-wide instance (fast accumulation, and the promoted E4M3 x E4M3 to bf16
        // sum): where its waves cost no more.
        for (g, m, n, bn) in [
            (1, 8192, 8192, 192),
            (1, 4096, 7168, 256),
            (1, 2048, 2048, 256),
            (1, 128, 7168, 128),
            (1, 64, 4096, 128),
            (1, 8704, 4096, 256),
            (1, 8704, 2048, 192),
            (8, 512, 4096, 256),
        ] {
            assert_eq!(
                choose_bn_for(g, m, n, 132, true, true),
                bn,
                "fast, wide {g} x {m} x {n}"
            );
            assert_eq!(
                choose_bn_for(g, m, n, 132, false, true),
                bn,
                "promoted, wide {g} x {m} x {n}"
            );
        }
        // Ring stages beside the staging (2 x 64 x bn outputs), as the kernel's Cfg computes.
        // The cached offsets (256 bytes) cost no stage anywhere.
        assert_eq!(smem_bytes(128, 2, 0), 6 * 32768 + 32768 + 96 + 256 + 1024);
        // 256 wide (fast accumulation, bf16): the staging in two parts, 4 stages of 48 KiB.
        assert_eq!(smem_bytes(256, 2, 0), 4 * 49152 + 32768 + 64 + 256 + 1024);
        assert_eq!(smem_bytes(128, 4, 0), 5 * 32768 + 65536 + 80 + 256 + 1024);
        assert_eq!(smem_bytes(192, 2, 0), 4 * 40960 + 49152 + 64 + 256 + 1024);
        assert_eq!(smem_bytes(192, 4, 0), 4 * 40960 + 49152 + 64 + 256 + 1024);
        // The block-scaled kernel's scales (528 bytes a stage) cost a stage at 128 wide.
        let sc = BLOCK_SCALE_BYTES;
        assert_eq!(sc, 528);
        assert_eq!(
            smem_bytes(128, 2, sc),
            5 * (32768 + sc) + 32768 + 80 + 256 + 1024
        );
        assert_eq!(
            smem_bytes(128, 4, sc),
            4 * (32768 + sc) + 65536 + 64 + 256 + 1024
        );
        assert_eq!(
            smem_bytes(192, 2, sc),
            4 * (40960 + sc) + 49152 + 64 + 256 + 1024
        );
        // At 256 wide (bf16) the staging in 4 parts keeps 4 stages.
        assert_eq!(
            smem_bytes(256, 2, sc),
            4 * (49152 + sc) + 16384 + 64 + 256 + 1024
        );
        for (bn, es, sc) in [
            (128, 2, 0),
            (128, 4, 0),
            (192, 2, 0),
            (192, 4, 0),
            (256, 2, 0),
            (128, 2, sc),
            (128, 4, sc),
            (192, 2, sc),
            (192, 4, sc),
            (256, 2, sc),
        ] {
            assert!(smem_bytes(bn, es, sc) <= SMEM_LIMIT);
        }
    }

    use proptest::prelude::*;
    use proptest::test_runner::RngAlgorithm;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 100_000,
            rng_algorithm: RngAlgorithm::XorShift,
            ..ProptestConfig::default()
        })]

        /// Any problem that passes the module's validation (groups <= 65535, N tiles and M
        /// tiles within the grid, D's `groups * m * n` elements within usize) gets a width
        /// of 128 or 192 without overflow, on any SM count (and 128, 192 or 256 where wide).
        #[test]
        fn tile_width_of_any_valid_problem(
            groups in prop_oneof![1usize..=8, 1usize..=65535],
            m in prop_oneof![1usize..=20_000, 1usize..=((1 << 31) - 1) * 64],
            n in prop_oneof![1usize..=20_000, 1usize..=65535 * 128],
            sms in prop_oneof![Just(132usize), 1usize..=1024, any::<usize>()],
        ) {
            let d = (groups as u128) * (m as u128) * (n as u128);
            if d <= usize::MAX as u128 {
                for fast in [false, true] {
                    let bn = choose_bn_for(groups, m, n, sms, fast, false);
                    prop_assert!(bn == 128 || bn == 192, "{}", bn);
                    let wide = choose_bn_for(groups, m, n, sms, fast, true);
                    prop_assert!(wide == 128 || wide == 192 || wide == 256, "{}", wide);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! GPU tests of this path (ignored without a device): fp64 CPU reference on small
    //! shapes, the naive GPU reference kernel on a large one, grouped GEMM replayed in a
    //! captured graph with changing counts, and a throughput probe.

    use std::time::Instant;

    use cuda_graph::{
        CaptureMode, Context, DeviceBuffer, Event, GraphExec, InstantiateFlags, KernelArgs,
        LaunchConfig, Stream,
    };

    use super::*;
    use crate::format::Fp8Format;
    use crate::gemm::Operand;
    use crate::reference::decode;
    use crate::tensor::DeviceScalar;
    use cuda_graph::half::bf16;

    const SA: f32 = 0.5;
    const SB: f32 = 0.25;
    const POISON_BF16: u16 = 0x7fc1;
    const POISON_F32: u32 = 0x7fc0_0001;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Random FP8 bytes, no NaN and no infinity.
        fn fp8(&mut self, n: usize, fmt: Fp8Format) -> Vec<u8> {
            (0..n)
                .map(|_| {
                    loop {
                        let b = self.next() as u8;
                        let special = match fmt {
                            Fp8Format::E4M3 => b & 0x7f == 0x7f,
                            Fp8Format::E5M2 => b & 0x7c == 0x7c,
                        };
                        if !special {
                            break b;
                        }
                    }
                })
                .collect()
        }
        fn f32s(&mut self, n: usize, amp: f32) -> Vec<f32> {
            (0..n)
                .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * amp)
                .collect()
        }
    }

    fn to_bf16(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
    fn from_bf16(b: bf16) -> f32 {
        b.to_f32()
    }

    #[derive(Clone, Copy, PartialEq, Debug)]
    enum BiasKind {
        None,
        Bf16,
        F32,
    }

    #[derive(Clone)]
    struct Case {
        m: usize,
        n: usize,
        k: usize,
        groups: usize,
        counts: Option<Vec<i32>>,
        fa: Fp8Format,
        fb: Fp8Format,
        f32_out: bool,
        bias: BiasKind,
        accumulate: bool,
        /// Fast accumulation allowed.
        fast: bool,
    }

    impl Case {
        fn plain(m: usize, n: usize, k: usize) -> Case {
            Case {
                m,
                n,
                k,
                groups: 1,
                counts: None,
                fa: Fp8Format::E4M3,
                fb: Fp8Format::E4M3,
                f32_out: false,
                bias: BiasKind::None,
                accumulate: false,
                fast: false,
            }
        }
    }

    /// Host data of one case and the fp64 reference (for rows below the counts).
    struct HostData {
        a: Vec<u8>,
        b: Vec<u8>,
        /// `a` and `b` decoded once (the reference reads each value n or m times).
        a_val: Vec<f64>,
        b_val: Vec<f64>,
        bias: Vec<f32>,
        d0: Vec<f32>,
    }

    fn host_data(c: &Case, seed: u64) -> HostData {
        let mut rng = Rng(seed | 1);
        let a = rng.fp8(c.groups * c.m * c.k, c.fa);
        let b = rng.fp8(c.groups * c.n * c.k, c.fb);
        let mut bias = rng.f32s(c.n, 1000.0);
        let mut d0 = rng.f32s(c.groups * c.m * c.n, 1000.0);
        // Round what is stored as bf16 so host and device see the same values.
        if c.bias == BiasKind::Bf16 {
            bias.iter_mut().for_each(|x| *x = from_bf16(to_bf16(*x)));
        }
        if !c.f32_out {
            d0.iter_mut().for_each(|x| *x = from_bf16(to_bf16(*x)));
        }
        HostData::new(c, a, b, bias, d0)
    }

    impl HostData {
        fn new(c: &Case, a: Vec<u8>, b: Vec<u8>, bias: Vec<f32>, d0: Vec<f32>) -> Self {
            let values = |v: &[u8], f| {
                let table: Vec<f64> = (0..=255).map(|x| f64::from(decode(x, f))).collect();
                v.iter().map(|&x| table[usize::from(x)]).collect()
            };
            HostData {
                a_val: values(&a, c.fa),
                b_val: values(&b, c.fb),
                a,
                b,
                bias,
                d0,
            }
        }
    }

    fn reference(c: &Case, h: &HostData, g: usize, r: usize, col: usize) -> f64 {
        let a = &h.a_val[(g * c.m + r) * c.k..][..c.k];
        let b = &h.b_val[(g * c.n + col) * c.k..][..c.k];
        let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let mut v = dot * f64::from(SA) * f64::from(SB);
        if c.bias != BiasKind::None {
            v += f64::from(h.bias[col]);
        }
        if c.accumulate {
            v += f64::from(h.d0[(g * c.m + r) * c.n + col]);
        }
        v
    }

    /// Device buffers of one case.
    struct Dev {
        a: DeviceBuffer<u8>,
        b: DeviceBuffer<u8>,
        sa: DeviceScalar,
        sb: DeviceScalar,
        d16: DeviceBuffer<bf16>,
        d32: DeviceBuffer<f32>,
        bias16: DeviceBuffer<bf16>,
        bias32: DeviceBuffer<f32>,
        counts: DeviceBuffer<i32>,
    }

    fn upload(s: &Stream, c: &Case, h: &HostData) -> Dev {
        let b16: Vec<bf16> = h.bias.iter().map(|&x| to_bf16(x)).collect();
        let counts = c.counts.clone().unwrap_or_else(|| vec![0; c.groups]);
        Dev {
            a: DeviceBuffer::from_host(s, &h.a).unwrap(),
            b: DeviceBuffer::from_host(s, &h.b).unwrap(),
            sa: DeviceScalar::new(s, SA).unwrap(),
            sb: DeviceScalar::new(s, SB).unwrap(),
            d16: DeviceBuffer::alloc(s.context(), c.groups * c.m * c.n).unwrap(),
            d32: DeviceBuffer::alloc(s.context(), c.groups * c.m * c.n).unwrap(),
            bias16: DeviceBuffer::from_host(s, &b16).unwrap(),
            bias32: DeviceBuffer::from_host(s, &h.bias).unwrap(),
            counts: DeviceBuffer::from_host(s, &counts).unwrap(),
        }
    }

    /// Poisons D, or fills it with the accumulate input.
    fn reset_d(s: &Stream, c: &Case, h: &HostData, dv: &mut Dev) {
        let len = c.groups * c.m * c.n;
        if c.f32_out {
            let v: Vec<f32> = if c.accumulate {
                h.d0.clone()
            } else {
                vec![f32::from_bits(POISON_F32); len]
            };
            dv.d32.copy_from_host(s, &v).unwrap();
        } else {
            let v: Vec<bf16> = if c.accumulate {
                h.d0.iter().map(|&x| to_bf16(x)).collect()
            } else {
                vec![bf16::from_bits(POISON_BF16); len]
            };
            dv.d16.copy_from_host(s, &v).unwrap();
        }
    }

    fn problem<'a>(c: &Case, dv: &'a Dev) -> GemmProblem<'a> {
        GemmProblem {
            m: c.m,
            n: c.n,
            k: c.k,
            groups: c.groups,
            counts: c.counts.as_ref().map(|_| &dv.counts),
            a: Operand {
                data: &dv.a,
                format: c.fa,
                scale_inv: &dv.sa,
            },
            b: Operand {
                data: &dv.b,
                format: c.fb,
                scale_inv: &dv.sb,
            },
            d: if c.f32_out {
                GemmOut::F32(&dv.d32)
            } else {
                GemmOut::Bf16(&dv.d16)
            },
            bias: match c.bias {
                BiasKind::None => None,
                BiasKind::Bf16 => Some(Bias::Bf16(&dv.bias16)),
                BiasKind::F32 => Some(Bias::F32(&dv.bias32)),
            },
            accumulate: c.accumulate,
            fast: c.fast,
            workspace: None,
            max_sms: None,
            whole_k: false,
        }
    }

    /// D as f32, whatever its type.
    fn read_d(s: &Stream, c: &Case, dv: &Dev) -> Vec<f32> {
        if c.f32_out {
            dv.d32.to_vec(s).unwrap()
        } else {
            dv.d16
                .to_vec(s)
                .unwrap()
                .into_iter()
                .map(from_bf16)
                .collect()
        }
    }

    /// D's values as bits (bf16 outputs widened to f32 first), for bit-for-bit comparisons.
    fn d_bits(s: &Stream, c: &Case, dv: &Dev) -> Vec<u32> {
        read_d(s, c, dv).iter().map(|x| x.to_bits()).collect()
    }

    /// Checks D against the fp64 reference (rows below the counts) and the poison (rows at
    /// or above them, which must be untouched); returns max |err| / max |ref|.
    fn verify(s: &Stream, c: &Case, h: &HostData, dv: &Dev, counts: Option<&[i32]>) -> f64 {
        let got = read_d(s, c, dv);
        let raw16 = (!c.f32_out).then(|| dv.d16.to_vec(s).unwrap());
        let (mut max_err, mut max_ref) = (0f64, 0f64);
        for g in 0..c.groups {
            let rows = counts.map_or(c.m, |cs| (cs[g].max(0) as usize).min(c.m));
            for r in 0..c.m {
                for col in 0..c.n {
                    let i = (g * c.m + r) * c.n + col;
                    if r >= rows {
                        let untouched = if c.accumulate {
                            got[i] == h.d0[i]
                        } else if let Some(raw) = &raw16 {
                            raw[i].to_bits() == POISON_BF16
                        } else {
                            got[i].to_bits() == POISON_F32
                        };
                        assert!(
                            untouched,
                            "group {g} row {r} col {col} (count {rows}) was written: {}",
                            got[i]
                        );
                        continue;
                    }
                    let want = reference(c, h, g, r, col);
                    assert!(
                        got[i].is_finite(),
                        "group {g} row {r} col {col}: {} (want {want})",
                        got[i]
                    );
                    max_err = max_err.max((f64::from(got[i]) - want).abs());
                    max_ref = max_ref.max(want.abs());
                }
            }
        }
        if max_ref == 0.0 {
            max_err
        } else {
            max_err / max_ref
        }
    }

    /// Relative error bound: bf16 output rounding (2^-8 relative), or for f32 output the
    /// tensor cores' own accumulation inside each 128-deep chunk (about 14 mantissa bits,
    /// which random full-range FP8 data turns into up to about 4e-4 of max |ref|, as measured
    /// on an H200).
    fn bound(c: &Case) -> f64 {
        if c.f32_out { 1e-3 } else { 1e-2 }
    }

    /// A block-scaled E4M3 operand.
    fn e4m3_blocks<'a>(
        data: &'a DeviceBuffer<u8>,
        scales_inv: &'a DeviceBuffer<f32>,
    ) -> BlockOperand<'a> {
        BlockOperand {
            data,
            format: Fp8Format::E4M3,
            scales_inv,
        }
    }

    fn setup() -> (Arc<Context>, Stream) {
        let ctx = Context::default_device().unwrap();
        assert!(
            available(&ctx).unwrap(),
            "these tests need a compute capability 9.0 device"
        );
        let s = Stream::new(&ctx).unwrap();
        (ctx, s)
    }

    fn run_case(s: &Stream, c: &Case, seed: u64) {
        run_case_with(s, c, seed, None);
    }

    fn run_case_with(s: &Stream, c: &Case, seed: u64, bn: Option<usize>) {
        let h = host_data(c, seed);
        let mut dv = upload(s, c, &h);
        reset_d(s, c, &h, &mut dv);
        launch_with(s, &problem(c, &dv), bn).unwrap();
        s.synchronize().unwrap();
        let err = verify(s, c, &h, &dv, c.counts.as_deref());
        let what = format!(
            "{}x{}x{} g{} {}x{} f32_out={} bias={} acc={} bn={bn:?}",
            c.m,
            c.n,
            c.k,
            c.groups,
            c.fa.name(),
            c.fb.name(),
            c.f32_out,
            c.bias != BiasKind::None,
            c.accumulate
        );
        println!("{what}: max|err|/max|ref| = {err:.3e}");
        assert!(err < bound(c), "{what}: relative error {err:.3e}");
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn small_shapes_match_fp64_reference() {
        let (_ctx, s) = setup();
        let shapes = [
            (128, 128, 128),
            (200, 136, 256),
            (64, 256, 512),
            (1, 128, 128),
            (77, 130, 96),
            (300, 8, 16),
            (129, 258, 400),
        ];
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            for f32_out in [false, true] {
                for bn in [128, 192] {
                    let mut c = Case::plain(m, n, k);
                    c.f32_out = f32_out;
                    run_case_with(&s, &c, 17 + i as u64, Some(bn));
                }
            }
        }
    }

    /// The block-scaled kernel at every tile width (128 and 192 for both outputs, 256 for
    /// bf16), against the fp64 reference of `sum_kb sa[row, kb] * sb[col / 128, kb] * (A . B
    /// over k-block kb)`: N with 192-wide tiles that start on (even tiles) and half-way into
    /// (odd tiles) B's 128-column blocks, 256-wide tiles whose second half is past N or
    /// partial, and a last partial tile, K with a partial last block, M not a multiple of the
    /// tile. The scales span 2^-6 .. 2^6, so a product scaled by a neighbouring block's scale
    /// lands far outside the bound. Other widths (and 256 with f32 out) are refused.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn blockwise_at_every_width_matches_the_fp64_reference() {
        let (_ctx, s) = setup();
        for (m, n, k) in [
            (130usize, 520usize, 400usize),
            (200, 384, 256),
            (64, 200, 128),
        ] {
            let kbt = k.div_ceil(128);
            for f32_out in [false, true] {
                let mut c = Case::plain(m, n, k);
                c.f32_out = f32_out;
                let h = host_data(&c, (m * n + k) as u64);
                let mut rng = Rng((m * 7 + n) as u64 | 1);
                let mut scales = |len: usize| -> Vec<f32> {
                    (0..len)
                        .map(|_| 2f32.powi((rng.next() % 13) as i32 - 6))
                        .collect()
                };
                let (sa, sb) = (scales(m * kbt), scales(n.div_ceil(128) * kbt));
                let want: Vec<f64> = (0..m * n)
                    .map(|i| {
                        let (r, col) = (i / n, i % n);
                        (0..kbt)
                            .map(|kb| {
                                let ks = kb * 128..(kb * 128 + 128).min(k);
                                let dot: f64 =
                                    ks.map(|j| h.a_val[r * k + j] * h.b_val[col * k + j]).sum();
                                dot * f64::from(sa[r * kbt + kb])
                                    * f64::from(sb[col / 128 * kbt + kb])
                            })
                            .sum()
                    })
                    .collect();
                let mut dv = upload(&s, &c, &h);
                let sa_d = DeviceBuffer::from_host(&s, &sa).unwrap();
                let sb_d = DeviceBuffer::from_host(&s, &sb).unwrap();
                let (a_d, b_d) = (
                    DeviceBuffer::from_host(&s, &h.a).unwrap(),
                    DeviceBuffer::from_host(&s, &h.b).unwrap(),
                );
                let (a, b) = (e4m3_blocks(&a_d, &sa_d), e4m3_blocks(&b_d, &sb_d));
                let widths: &[usize] = if f32_out {
                    &[128, 192]
                } else {
                    &[128, 192, 256]
                };
                for &bn in widths {
                    reset_d(&s, &c, &h, &mut dv);
                    let out = if f32_out {
                        GemmOut::F32(&dv.d32)
                    } else {
                        GemmOut::Bf16(&dv.d16)
                    };
                    launch_blockwise_with(
                        &s,
                        (m, n, k),
                        (&a, &b),
                        &out,
                        &GemmOptions::new(),
                        Some(bn),
                    )
                    .unwrap();
                    s.synchronize().unwrap();
                    let got = read_d(&s, &c, &dv);
                    let (mut err, mut mag) = (0f64, 0f64);
                    for (g, w) in got.iter().zip(&want) {
                        assert!(g.is_finite(), "{m}x{n}x{k} bn {bn}: {g} (want {w})");
                        err = err.max((f64::from(*g) - w).abs());
                        mag = mag.max(w.abs());
                    }
                    let rel = err / mag;
                    println!("blockwise {m}x{n}x{k} f32_out={f32_out} bn={bn}: {rel:.3e}");
                    assert!(
                        rel < bound(&c),
                        "{m}x{n}x{k} bn {bn} f32_out {f32_out}: {rel:e}"
                    );
                }
                // No 256-wide f32 instance; no width past those.
                let out32 = GemmOut::F32(&dv.d32);
                let out16 = GemmOut::Bf16(&dv.d16);
                for (out, bn) in [(&out32, 256), (&out16, 320), (&out16, 64)] {
                    let refused = launch_blockwise_with(
                        &s,
                        (m, n, k),
                        (&a, &b),
                        out,
                        &GemmOptions::new(),
                        Some(bn),
                    );
                    assert!(
                        matches!(refused, Err(Error::InvalidArgument(_))),
                        "bn {bn}: {refused:?}"
                    );
                }
            }
        }
    }

    /// Fast accumulation (E4M3 x E4M3, bf16 out): against the fp64 reference at K up to
    /// 4096, plain, with a bias, accumulating, and grouped blocks with counts, every width
    /// (and the promoted sum's 256-wide kernel on the same cases);
    /// its error beside the promoted sum's (printed). Where no fast kernel exists (f32 out,
    /// E5M2) the option changes nothing: the same bits as without it.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn fast_accumulation_matches_the_fp64_reference() {
        let (_ctx, s) = setup();
        let mut seed = 300;
        let mut cases = Vec::new();
        for (m, n, k) in [(256, 384, 4096), (200, 136, 256), (129, 258, 400)] {
            cases.push(Case::plain(m, n, k));
        }
        let mut c = Case::plain(150, 264, 1024);
        c.bias = BiasKind::F32;
        cases.push(c.clone());
        c.accumulate = true;
        cases.push(c);
        let mut c = Case::plain(160, 200, 2048);
        c.groups = 3;
        c.counts = Some(vec![100, 0, 160]);
        cases.push(c);
        for mut c in cases {
            // (And the promoted sum at 256 wide, E4M3 x E4M3 to bf16: in two 128-column halves.)
            for (fast, bn) in [(true, 128), (true, 192), (true, 256), (false, 256)] {
                c.fast = fast;
                run_case_with(&s, &c, seed, Some(bn));
                seed += 1;
            }
        }
        // BN 256 (fast only): the store epilogue (two parts through the staging) and the
        // register epilogue write the same bits, with and without a bias, at the edges.
        for (m, n, k, bias) in [
            (200, 520, 256, BiasKind::None),
            (77, 264, 384, BiasKind::F32),
        ] {
            let mut c = Case::plain(m, n, k);
            c.fast = true;
            c.bias = bias;
            let h = host_data(&c, seed);
            seed += 1;
            let mut dv = upload(&s, &c, &h);
            let mut bits = Vec::new();
            for store in [true, false] {
                reset_d(&s, &c, &h, &mut dv);
                launch_epilogue(&s, &problem(&c, &dv), Some(256), store).unwrap();
                bits.push(d_bits(&s, &c, &dv));
            }
            assert!(
                bits[0] == bits[1],
                "{m}x{n}x{k} bn 256: the epilogues differ"
            );
        }
        // The promoted kernels have a 256-wide tile for E4M3 x E4M3 to bf16 only.
        let mut c = Case::plain(128, 256, 128);
        c.f32_out = true;
        let h = host_data(&c, seed);
        let dv = upload(&s, &c, &h);
        assert!(launch_with(&s, &problem(&c, &dv), Some(256)).is_err());
        // No fast kernel for these: the option is ignored, bit for bit.
        for (fa, f32_out) in [(Fp8Format::E4M3, true), (Fp8Format::E5M2, false)] {
            let mut c = Case::plain(200, 136, 1024);
            c.fa = fa;
            c.f32_out = f32_out;
            let h = host_data(&c, seed);
            let mut dv = upload(&s, &c, &h);
            let mut bits = Vec::new();
            for fast in [false, true] {
                c.fast = fast;
                reset_d(&s, &c, &h, &mut dv);
                launch(&s, &problem(&c, &dv)).unwrap();
                bits.push(d_bits(&s, &c, &dv));
            }
            assert!(
                bits[0] == bits[1],
                "{} f32_out {f32_out}: fast changed it",
                fa.name()
            );
        }
    }

    /// Cases of at most 128 rows with a bias and accumulation: an f32 bias into f32, overwritten and
    /// accumulated, and a bf16 bias accumulated into bf16.
    fn bias_and_accumulate_cases() -> [Case; 3] {
        let mut c = Case::plain(100, 264, 2048);
        c.f32_out = true;
        c.bias = BiasKind::F32;
        let overwrite = c.clone();
        c.accumulate = true;
        let mut b = Case::plain(48, 520, 2048);
        b.bias = BiasKind::Bf16;
        b.accumulate = true;
        [overwrite, c, b]
    }

    /// The skinny kernel (swap-AB, K split over a cluster, partials summed in distributed
    /// shared memory) against the fp64 reference: both row widths, every cluster size, every
    /// format pair, both outputs, a bias of each type, accumulation, fast accumulation, K with
    /// a partial last block and m, n not multiples of the tiles; each case checks that `launch`
    /// takes the skinny kernel on this device. Then the same problem captured in a graph and
    /// replayed: the same bits as the eager launch.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn skinny_matches_the_fp64_reference() {
        let (_ctx, s) = setup();
        let mut cases = Vec::new();
        for (m, n, k) in [
            (64, 4096, 1024),
            (1, 512, 2048),
            (37, 1028, 2000),
            (100, 1544, 1024),
            (128, 264, 4096),
            (16, 256, 8192),
            (64, 7168, 1024),
            (128, 7168, 512),
            (64, 2048, 2048),
        ] {
            cases.push(Case::plain(m, n, k));
        }
        let pairs = [
            (Fp8Format::E4M3, Fp8Format::E5M2),
            (Fp8Format::E5M2, Fp8Format::E4M3),
            (Fp8Format::E5M2, Fp8Format::E5M2),
        ];
        for (i, (fa, fb)) in pairs.into_iter().enumerate() {
            let mut c = Case::plain(48 + 40 * i, 520, 2048);
            (c.fa, c.fb) = (fa, fb);
            c.f32_out = i % 2 == 0;
            cases.push(c);
        }
        cases.extend(bias_and_accumulate_cases());
        for (m, n) in [(64, 4096), (120, 1032)] {
            let mut c = Case::plain(m, n, 4096);
            c.fast = true;
            cases.push(c);
        }
        let mut plans = std::collections::BTreeSet::new();
        for (seed, c) in cases.iter().enumerate() {
            let h = host_data(c, 900 + seed as u64);
            let mut dv = upload(&s, c, &h);
            reset_d(&s, c, &h, &mut dv);
            let plan = skinny_plan_on(&s, &problem(c, &dv))
                .unwrap()
                .map(|(_, plan)| plan);
            assert!(plan.is_some(), "{}x{}x{} is not skinny", c.m, c.n, c.k);
            plans.insert(plan);
            launch(&s, &problem(c, &dv)).unwrap();
            s.synchronize().unwrap();
            let err = verify(&s, c, &h, &dv, None);
            let what = format!(
                "{}x{}x{} {}x{} plan {plan:?} f32_out={} bias={:?} acc={} fast={}",
                c.m,
                c.n,
                c.k,
                c.fa.name(),
                c.fb.name(),
                c.f32_out,
                c.bias,
                c.accumulate,
                c.fast
            );
            println!("{what}: max|err|/max|ref| = {err:.3e}");
            assert!(err < bound(c), "{what}: relative error {err:.3e}");
        }
        println!("plans taken: {plans:?}");
        // Every cluster size at both widths, forced, on one problem of each width (promoted
        // and fast sums, a partial last k-block; K a multiple of 16, as the tensor maps need).
        for (m, n, k) in [(50, 1000, 2000), (128, 520, 2064)] {
            for fast in [false, true] {
                let mut c = Case::plain(m, n, k);
                c.fast = fast;
                let h = host_data(&c, 950 + m as u64);
                let mut dv = upload(&s, &c, &h);
                let (kern, (mn, _)) = skinny_plan_on(&s, &problem(&c, &dv)).unwrap().unwrap();
                for splits in 1..=MAX_CLUSTER {
                    reset_d(&s, &c, &h, &mut dv);
                    launch_skinny(&s, &problem(&c, &dv), &kern, (mn, splits)).unwrap();
                    s.synchronize().unwrap();
                    let err = verify(&s, &c, &h, &dv, None);
                    let what = format!("{m}x{n}x{k} m{mn} clusters of {splits} fast={fast}");
                    println!("{what}: max|err|/max|ref| = {err:.3e}");
                    assert!(err < bound(&c), "{what}: relative error {err:.3e}");
                }
            }
        }
        // Captured and replayed: the eager launch's bits.
        let mut c = Case::plain(64, 4096, 1024);
        c.bias = BiasKind::Bf16;
        let h = host_data(&c, 77);
        let mut dv = upload(&s, &c, &h);
        reset_d(&s, &c, &h, &mut dv);
        launch(&s, &problem(&c, &dv)).unwrap();
        s.synchronize().unwrap();
        let eager = d_bits(&s, &c, &dv);
        reset_d(&s, &c, &h, &mut dv);
        let graph = s
            .capture(CaptureMode::ThreadLocal, |scope| {
                launch(scope.stream(), &problem(&c, &dv))
            })
            .unwrap();
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
        for _ in 0..3 {
            exec.launch(&s).unwrap();
        }
        s.synchronize().unwrap();
        assert_eq!(d_bits(&s, &c, &dv), eager, "replayed skinny GEMM");
    }

    /// Split K (a workspace, skinny M): against the fp64 reference with both output types,
    /// a bias and accumulation; each case does split on this device; a misaligned or
    /// overlapping workspace is refused by `gemm`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn split_k_matches_the_fp64_reference() {
        let (ctx, s) = setup();
        let sms = sm_count(&s).unwrap() as usize;
        let mut seed = 400;
        let mut cases = vec![Case::plain(64, 384, 3584), Case::plain(16, 256, 4096)];
        cases.extend(bias_and_accumulate_cases());
        for c in cases {
            let bytes =
                super::super::split_k_workspace_bytes(super::super::GemmShape::new(c.m, c.n, c.k));
            let ws = DeviceBuffer::<u8>::alloc(&ctx, bytes).unwrap();
            ws.memset_bytes(&s, 0xff).unwrap();
            let splits = split_k(c.m, c.n, c.k, sms, bytes);
            assert!(splits > 1, "{}x{}x{} does not split", c.m, c.n, c.k);
            let h = host_data(&c, seed);
            seed += 1;
            let mut dv = upload(&s, &c, &h);
            reset_d(&s, &c, &h, &mut dv);
            let p = GemmProblem {
                workspace: Some(&ws),
                ..problem(&c, &dv)
            };
            // (`launch` gives these shapes to the skinny kernel, which needs no workspace.)
            launch_split_k(&s, &p, &ws, splits).unwrap();
            s.synchronize().unwrap();
            let err = verify(&s, &c, &h, &dv, None);
            let what = format!(
                "{}x{}x{} in {splits} splits, f32_out={} bias={:?} acc={}",
                c.m, c.n, c.k, c.f32_out, c.bias, c.accumulate
            );
            println!("{what}: max|err|/max|ref| = {err:.3e}");
            assert!(err < bound(&c), "{what}: relative error {err:.3e}");
            // The split path ran: the last split's partial products are in the workspace
            // (all-ones bytes, a NaN pattern, before).
            let partial = ws.to_vec(&s).unwrap();
            let last = &partial[(splits - 1) * c.m * c.n * 4..splits * c.m * c.n * 4];
            assert!(
                last.iter().any(|&b| b != 0xff),
                "{what}: the workspace was not written"
            );
        }
        // gemm refuses a workspace that overlaps an operand or is misaligned.
        let c = Case::plain(64, 384, 3584);
        let h = host_data(&c, seed);
        let dv = upload(&s, &c, &h);
        let op = |data, scale_inv| Operand {
            data,
            format: Fp8Format::E4M3,
            scale_inv,
        };
        let shape = super::super::GemmShape::new(c.m, c.n, c.k);
        let ws = DeviceBuffer::<u8>::alloc(&ctx, 64 << 20).unwrap();
        let odd = ws.slice(8..).unwrap();
        for (bad, what) in [(&dv.a, "overlaps A"), (&odd, "not 16-byte aligned")] {
            let e = super::super::gemm(
                &s,
                shape,
                op(&dv.a, &dv.sa),
                op(&dv.b, &dv.sb),
                &dv.d16,
                super::super::GemmOptions::new().workspace(bad),
            );
            assert!(
                matches!(&e, Err(Error::InvalidArgument(m)) if m.contains(what)),
                "{what}: {e:?}"
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn formats_bias_and_accumulate() {
        let (_ctx, s) = setup();
        let mut seed = 100;
        for (fa, fb) in [
            (Fp8Format::E5M2, Fp8Format::E4M3),
            (Fp8Format::E4M3, Fp8Format::E5M2),
            (Fp8Format::E5M2, Fp8Format::E5M2),
        ] {
            let mut c = Case::plain(200, 136, 256);
            c.fa = fa;
            c.fb = fb;
            run_case(&s, &c, seed);
            seed += 1;
        }
        for bias in [BiasKind::Bf16, BiasKind::F32] {
            for accumulate in [false, true] {
                for f32_out in [false, true] {
                    let mut c = Case::plain(150, 264, 384);
                    c.bias = bias;
                    c.accumulate = accumulate;
                    c.f32_out = f32_out;
                    run_case(&s, &c, seed);
                    seed += 1;
                }
            }
        }
        let mut c = Case::plain(70, 64, 128);
        c.accumulate = true;
        run_case(&s, &c, seed);
    }

    /// The store epilogue (no counts: shared memory + TMA stores, or reduce-adds into an f32
    /// D when accumulating), the register epilogue (counts of every row, every tile forced to
    /// it: the same problem, from registers) and the two mixed (counts: whole tiles stored,
    /// each group's last, partial tile from registers) write the same bits, for both outputs, both widths, no bias and either
    /// bias type, accumulating into f32, and edges of rows (m not a multiple of 64) and columns (N not a
    /// multiple of the store box) that the TMA store clips.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn store_and_register_epilogues_agree_bit_for_bit() {
        let (_ctx, s) = setup();
        let mut seed = 300;
        let outs = [(false, false), (true, false), (true, true)];
        // Every bias kind on the first shape; no bias and an f32 one at the edges.
        let all = &[BiasKind::None, BiasKind::Bf16, BiasKind::F32][..];
        let two = &[BiasKind::None, BiasKind::F32][..];
        for (m, n, k, groups, biases) in [
            (200, 136, 256, 3, all),
            (77, 8, 128, 1, two),
            (300, 328, 384, 2, two),
        ] {
            for ((f32_out, accumulate), &bias) in outs
                .into_iter()
                .flat_map(|o| biases.iter().map(move |b| (o, b)))
            {
                for bn in [128, 192] {
                    let mut c = Case::plain(m, n, k);
                    c.groups = groups;
                    c.f32_out = f32_out;
                    c.accumulate = accumulate;
                    c.bias = bias;
                    let h = host_data(&c, seed);
                    seed += 1;
                    let mut dv = upload(&s, &c, &h);
                    let mut run = |counts: Option<Vec<i32>>, store: bool| {
                        c.counts = counts;
                        if let Some(cs) = &c.counts {
                            dv.counts.copy_from_host(&s, cs).unwrap();
                        }
                        reset_d(&s, &c, &h, &mut dv);
                        launch_epilogue(&s, &problem(&c, &dv), Some(bn), store).unwrap();
                        s.synchronize().unwrap();
                        let bits: Vec<u32> = if f32_out {
                            dv.d32
                                .to_vec(&s)
                                .unwrap()
                                .iter()
                                .map(|x| x.to_bits())
                                .collect()
                        } else {
                            let v = dv.d16.to_vec(&s).unwrap();
                            v.iter().map(|x| u32::from(x.to_bits())).collect()
                        };
                        // (The register epilogue's bits are compared with these.)
                        if c.counts.is_none() {
                            let err = verify(&s, &c, &h, &dv, None);
                            assert!(err < bound(&c), "{m}x{n}x{k}: relative error {err:.3e}");
                        }
                        bits
                    };
                    let stored = run(None, true);
                    let every_row = Some(vec![m as i32; groups]);
                    // Counts, every tile from registers; then counts with the whole tiles
                    // stored and each group's last, partial one from registers.
                    let registers = run(every_row.clone(), false);
                    let mixed = run(every_row, true);
                    let what = format!(
                        "{m}x{n}x{k} g{groups} f32_out={f32_out} acc={accumulate} bias={:?} bn={bn}",
                        c.bias
                    );
                    assert!(stored == registers, "{what}: the epilogues differ");
                    assert!(stored == mixed, "{what}: the mixed epilogue differs");
                }
            }
        }
    }

    /// Tail halves (the 256-wide kernels, promoted and fast): with the grid capped so that
    /// the last wave of tiles is whole (more than half the grid), in halves after whole tiles,
    /// or all halves (every tile in the one wave), D is the same bits, and matches the fp64
    /// reference with the counts' rows untouched: grouped blocks with counts (the register
    /// epilogue's partial tiles among the halves), N with a partial second half and a tile
    /// whose second half lies past N, a bias, and accumulation into bf16.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn tail_halves_agree_bit_for_bit_with_whole_tiles() {
        let (_ctx, s) = setup();
        // 3 groups of at most 256 rows, N = 612: 3 column tiles, the last 100 wide.
        for (counts, caps) in [
            // 2 + 2 + 1 m-tiles: 15 tiles. 4 SMs: 3 left, whole; 7: 1 left, in halves; 12:
            // 3 left, in halves (6 of 12).
            (vec![256, 130, 70], [4usize, 7, 12]),
            // 2 + 1 + 0: 9 tiles on a grid of 18 (the host's tiles): all in halves; 5: 4
            // left, whole; 8: 1 left, in halves.
            (vec![256, 10, 0], [5, 8, 18]),
        ] {
            for fast in [false, true] {
                for (bias, accumulate) in [
                    (BiasKind::None, false),
                    (BiasKind::Bf16, false),
                    (BiasKind::None, true),
                ] {
                    let mut c = Case::plain(256, 612, 384);
                    c.groups = 3;
                    c.counts = Some(counts.clone());
                    c.fast = fast;
                    c.bias = bias;
                    c.accumulate = accumulate;
                    let h = host_data(&c, 91 + counts[1] as u64);
                    let mut dv = upload(&s, &c, &h);
                    let mut first: Option<Vec<u32>> = None;
                    for cap in caps {
                        reset_d(&s, &c, &h, &mut dv);
                        let p = GemmProblem {
                            max_sms: Some(cap),
                            ..problem(&c, &dv)
                        };
                        launch_with(&s, &p, Some(256)).unwrap();
                        s.synchronize().unwrap();
                        let what = format!(
                            "counts {counts:?} fast {fast} bias {bias:?} acc {accumulate} cap {cap}"
                        );
                        let err = verify(&s, &c, &h, &dv, Some(&counts));
                        println!("tail halves, {what}: {err:.3e}");
                        assert!(err < bound(&c), "{what}: relative error {err:e}");
                        let bits = d_bits(&s, &c, &dv);
                        match &first {
                            None => first = Some(bits),
                            Some(f) => {
                                assert!(*f == bits, "{what}: bits differ from cap {}", caps[0])
                            }
                        }
                    }
                }
            }
        }
    }

    /// Tile widths forced against the automatic choice (TFLOP/s of the real rows): grouped
    /// blocks with counts (bench gemm's 8 x 512 rows and its skewed split, N = 4096, K =
    /// 2048), promoted and fast, and the block-scaled GEMM at bench gemm's two shapes.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn width_probe() {
        let (_ctx, s) = setup();
        let tf = |rows: usize, n: usize, k: usize, ms: f64| 2.0 * (rows * n * k) as f64 / ms / 1e9;
        for counts in [vec![512i32; 8], vec![2048, 1024, 512, 256, 128, 64, 32, 32]] {
            let m = *counts.iter().max().unwrap() as usize;
            let rows: usize = counts.iter().map(|&c| c as usize).sum();
            let (n, k) = (4096, 2048);
            let mut c = Case::plain(m, n, k);
            c.groups = 8;
            c.counts = Some(counts.clone());
            let mut rng = Rng(5);
            let (a, b) = (rng.fp8(8 * m * k, c.fa), rng.fp8(8 * n * k, c.fb));
            let h = HostData::new(&c, a, b, vec![0.0; n], Vec::new());
            for fast in [false, true] {
                c.fast = fast;
                let dv = upload(&s, &c, &h);
                let p = problem(&c, &dv);
                for bn in [Some(128), Some(192), Some(256), None] {
                    let ms = mean_ms(&s, &mut || launch_with(&s, &p, bn).unwrap());
                    println!(
                        "grouped {counts:?} fast {fast} bn {bn:?}: {ms:.4} ms, {:.0} TFLOP/s",
                        tf(rows, n, k, ms)
                    );
                }
            }
        }
        for (m, n, k) in [(8192usize, 8192usize, 8192usize), (4096, 7168, 4096)] {
            let kbt = k.div_ceil(128);
            let mut rng = Rng(7);
            let a_d = DeviceBuffer::from_host(&s, &rng.fp8(m * k, Fp8Format::E4M3)).unwrap();
            let b_d = DeviceBuffer::from_host(&s, &rng.fp8(n * k, Fp8Format::E4M3)).unwrap();
            let sa_d = DeviceBuffer::from_host(&s, &vec![1.0f32; m * kbt]).unwrap();
            let sb_d = DeviceBuffer::from_host(&s, &vec![1.0f32; n.div_ceil(128) * kbt]).unwrap();
            let d = DeviceBuffer::<bf16>::alloc(s.context(), m * n).unwrap();
            let (a, b) = (e4m3_blocks(&a_d, &sa_d), e4m3_blocks(&b_d, &sb_d));
            let out = GemmOut::Bf16(&d);
            for bn in [Some(128), Some(192), Some(256), None] {
                let ms = mean_ms(&s, &mut || {
                    launch_blockwise_with(&s, (m, n, k), (&a, &b), &out, &GemmOptions::new(), bn)
                        .unwrap()
                });
                println!(
                    "block-scaled {m}x{n}x{k} bn {bn:?}: {ms:.3} ms, {:.0} TFLOP/s",
                    tf(m, n, k, ms)
                );
            }
        }
    }

    /// Mean milliseconds per call of `f` over 10 calls after 3 untimed ones (CUDA events).
    fn mean_ms(s: &Stream, f: &mut dyn FnMut()) -> f64 {
        for _ in 0..3 {
            f();
        }
        let (t0, t1) = (
            Event::new(s.context()).unwrap(),
            Event::new(s.context()).unwrap(),
        );
        t0.record(s).unwrap();
        for _ in 0..10 {
            f();
        }
        t1.record(s).unwrap();
        t1.synchronize().unwrap();
        f64::from(Event::elapsed_ms(&t0, &t1).unwrap()) / 10.0
    }

    /// The grouped weight gradient's f32 output rate (the MoE layer's fc1 shape, 8 experts of
    /// 128 and of 1024 rows, overwritten) against a memset of the same bytes, in one run.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn wgrad_write_probe() {
        use super::super::packed::WgradShape;
        let (ctx, s) = setup();
        let (groups, m, n) = (8usize, 4096usize, 2048usize);
        let d = DeviceBuffer::<f32>::alloc(&ctx, groups * m * n).unwrap();
        let time = |f: &mut dyn FnMut()| mean_ms(&s, f);
        let bytes = (groups * m * n * 4) as f64;
        let ms = time(&mut || d.memset_bytes(&s, 0).unwrap());
        println!(
            "memset {} MB: {ms:.3} ms, {:.2} TB/s",
            bytes / 1e6,
            bytes / ms / 1e9
        );
        let d16 = DeviceBuffer::<bf16>::alloc(&ctx, groups * m * n).unwrap();
        for per in [128usize, 1024] {
            let capacity = groups * per;
            let a =
                DeviceBuffer::from_host(&s, &Rng(5).fp8(m * capacity, Fp8Format::E5M2)).unwrap();
            let b =
                DeviceBuffer::from_host(&s, &Rng(6).fp8(n * capacity, Fp8Format::E4M3)).unwrap();
            let offs: Vec<i32> = (0..=groups).map(|g| (g * per) as i32).collect();
            let offsets = DeviceBuffer::from_host(&s, &offs).unwrap();
            let one = DeviceScalar::new(&s, 1.0).unwrap();
            let p = WgradProblem {
                shape: WgradShape {
                    groups,
                    capacity,
                    m,
                    n,
                },
                a: Operand {
                    data: &a,
                    format: Fp8Format::E5M2,
                    scale_inv: &one,
                },
                b: Operand {
                    data: &b,
                    format: Fp8Format::E4M3,
                    scale_inv: &one,
                },
                d: GemmOut::F32(&d),
                offsets: &offsets,
                accumulate: false,
                max_sms: None,
            };
            let ms = time(&mut || launch_wgrad(&s, &p).unwrap());
            let tf = 2.0 * (groups * per * m * n) as f64 / (ms * 1e-3) / 1e12;
            println!(
                "wgrad {groups} x {m} x {n}, K {per} per group: {ms:.3} ms, {:.2} TB/s written, \
                 {tf:.0} TFLOP/s",
                bytes / ms / 1e9
            );
            // Each output type, tile width and epilogue.
            for (out, dname) in [(GemmOut::F32(&d), "f32"), (GemmOut::Bf16(&d16), "bf16")] {
                for (bn, store) in [(128, true), (192, true), (128, false), (192, false)] {
                    let q = WgradProblem { d: out, ..p };
                    let ms = time(&mut || launch_wgrad_with(&s, &q, Some(bn), store).unwrap());
                    let tf = 2.0 * (groups * per * m * n) as f64 / (ms * 1e-3) / 1e12;
                    let epi = if store { "TMA store" } else { "registers" };
                    println!(
                        "  {dname} out, n{bn}, {epi}: {:.1} us, {tf:.0} TFLOP/s",
                        ms * 1e3
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn rejects_what_it_cannot_do() {
        let (_ctx, s) = setup();
        for (m, n, k) in [(128, 128, 120), (128, 127, 128)] {
            let c = Case::plain(m, n, k);
            let h = host_data(&c, 5);
            let dv = upload(&s, &c, &h);
            let e = launch(&s, &problem(&c, &dv));
            assert!(
                matches!(e, Err(Error::InvalidArgument(_))),
                "{m}x{n}x{k} should be rejected"
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn grouped_counts_replayed_in_a_graph() {
        let (_ctx, s) = setup();
        let first = vec![0, 200, 77, 128, 1];
        let mut c = Case::plain(200, 136, 256);
        c.groups = 5;
        c.counts = Some(first.clone());
        let h = host_data(&c, 77);
        let mut dv = upload(&s, &c, &h);
        for bn in [128, 192] {
            dv.counts.copy_from_host(&s, &first).unwrap();
            // Eager first.
            reset_d(&s, &c, &h, &mut dv);
            launch_with(&s, &problem(&c, &dv), Some(bn)).unwrap();
            s.synchronize().unwrap();
            let err = verify(&s, &c, &h, &dv, Some(&first));
            assert!(err < bound(&c), "eager grouped: {err:.3e}");
            // Captured once, replayed with other counts (the same buffers).
            let graph = s
                .capture(CaptureMode::ThreadLocal, |scope| {
                    launch_with(scope.stream(), &problem(&c, &dv), Some(bn))
                })
                .unwrap();
            let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
            for counts in [
                vec![0, 200, 77, 128, 1],
                vec![5, 0, 200, 1, 0],
                vec![0, 0, 0, 0, 0],
                vec![200, 200, 200, 200, 200],
                vec![-3, 300, 129, 64, 63],
            ] {
                dv.counts.copy_from_host(&s, &counts).unwrap();
                reset_d(&s, &c, &h, &mut dv);
                exec.launch(&s).unwrap();
                s.synchronize().unwrap();
                let err = verify(&s, &c, &h, &dv, Some(&counts));
                println!("grouped bn {bn} replay counts {counts:?}: {err:.3e}");
                assert!(
                    err < bound(&c),
                    "bn {bn} replay with counts {counts:?}: {err:.3e}"
                );
            }
        }
    }

    /// The naive GPU reference (f32, no bias) into `out`.
    fn gpu_reference(s: &Stream, c: &Case, dv: &Dev, out: &DeviceBuffer<f32>) {
        let name = format!("fp8_gemm_ref_{}_{}", c.fa.name(), c.fb.name());
        let (k, _) = kernel(s.context(), &name).unwrap();
        let dims = [c.m as u32, c.n as u32, c.k as u32, 0];
        let ids = [idx(&dv.sa).unwrap(), idx(&dv.sb).unwrap()];
        let args = KernelArgs::new()
            .arg(&dv.a)
            .arg(&dv.b)
            .arg(out)
            .arg(dv.sa.buffer())
            .arg(dv.sb.buffer())
            .arg(&dims)
            .arg(&ids);
        let cfg = LaunchConfig {
            grid: (c.n.div_ceil(128) as u32, c.m as u32, 1),
            block: (128, 1, 1),
            shared_mem_bytes: 0,
            attributes: Vec::new(),
        };
        // SAFETY: the reference reads m*k and n*k bytes and writes m*n floats, the sizes of
        // these buffers.
        unsafe { s.launch(&k, &cfg, &args) }.unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn large_matches_gpu_reference() {
        let (ctx, s) = setup();
        let mut c = Case::plain(1000, 1536, 2048);
        c.f32_out = true;
        let h = host_data(&c, 9);
        let mut dv = upload(&s, &c, &h);
        for bn in [128, 192] {
            reset_d(&s, &c, &h, &mut dv);
            launch_with(&s, &problem(&c, &dv), Some(bn)).unwrap();
            let r = DeviceBuffer::<f32>::alloc(&ctx, c.m * c.n).unwrap();
            gpu_reference(&s, &c, &dv, &r);
            s.synchronize().unwrap();
            let got = dv.d32.to_vec(&s).unwrap();
            let want = r.to_vec(&s).unwrap();
            let (mut e, mut mx) = (0f64, 0f64);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(g.is_finite(), "element {i}: {g}");
                e = e.max((f64::from(g) - f64::from(w)).abs());
                mx = mx.max(f64::from(w).abs());
            }
            println!("large vs GPU reference, bn {bn}: {:.3e}", e / mx);
            assert!(e / mx < 1e-3, "large bn {bn}: {:.3e}", e / mx);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn throughput_probe() {
        let (_ctx, s) = setup();
        for (m, n, k) in [
            (8192, 8192, 8192),
            (4096, 7168, 4096),
            (2048, 2048, 2048),
            (128, 7168, 2048),
            (64, 4096, 7168),
            (16, 4096, 7168),
            (32, 7168, 2048),
        ] {
            let c = Case::plain(m, n, k);
            let mut rng = Rng(3);
            let (a, b) = (rng.fp8(m * k, c.fa), rng.fp8(n * k, c.fb));
            let h = HostData::new(&c, a, b, Vec::new(), Vec::new());
            let mut hb = h;
            hb.bias = vec![0.0; n];
            let mut dv = upload(&s, &c, &hb);
            reset_d(&s, &c, &hb, &mut dv);
            let p = problem(&c, &dv);
            for bn in [128, 192, 256] {
                let ms = mean_ms(&s, &mut || launch_with(&s, &p, Some(bn)).unwrap());
                let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
                println!("  forced bn={bn}: {ms:.3} ms, {tflops:.0} TFLOP/s");
            }
            // Fast accumulation at every width (256 exists only there).
            let pf = GemmProblem { fast: true, ..p };
            for bn in [128, 192, 256] {
                let ms = mean_ms(&s, &mut || launch_with(&s, &pf, Some(bn)).unwrap());
                let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
                println!("  fast accumulation, forced bn={bn}: {ms:.3} ms, {tflops:.0} TFLOP/s");
            }
            // The skinny kernel at every cluster size, both sums.
            if m <= SKINNY_ROWS {
                for splits in 1..=MAX_CLUSTER {
                    for (q, what) in [(&p, "promoted"), (&pf, "fast")] {
                        let (kern, (mn, _)) = skinny_plan_on(&s, q).unwrap().unwrap();
                        let ms = mean_ms(&s, &mut || {
                            launch_skinny(&s, q, &kern, (mn, splits)).unwrap()
                        });
                        let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
                        println!(
                            "  skinny m{mn}, clusters of {splits}, {what}: {ms:.4} ms, {tflops:.0} \
                             TFLOP/s"
                        );
                    }
                }
            }
            // The automatic choice, timed and checked.
            for _ in 0..3 {
                launch(&s, &p).unwrap();
            }
            let (t0, t1) = (
                Event::new(s.context()).unwrap(),
                Event::new(s.context()).unwrap(),
            );
            let iters = 20;
            let wall = Instant::now();
            t0.record(&s).unwrap();
            for _ in 0..iters {
                launch(&s, &p).unwrap();
            }
            t1.record(&s).unwrap();
            t1.synchronize().unwrap();
            let ms = Event::elapsed_ms(&t0, &t1).unwrap() as f64 / f64::from(iters);
            let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
            println!(
                "sm90 GEMM {m}x{n}x{k} bf16 (bn {}): {ms:.3} ms, {tflops:.0} TFLOP/s (wall {:?})",
                choose_bn_for(
                    p.groups,
                    p.m,
                    p.n,
                    s.context().device().multiprocessor_count().unwrap() as usize,
                    false,
                    true
                ),
                wall.elapsed()
            );
            // Spot-check 64 entries against the fp64 reference.
            let got = read_d(&s, &c, &dv);
            let mut rng = Rng(11);
            for _ in 0..64 {
                let (r, col) = ((rng.next() as usize) % m, (rng.next() as usize) % n);
                let want = reference(&c, &hb, 0, r, col);
                let g = f64::from(got[r * n + col]);
                assert!(
                    (g - want).abs() <= 1e-2 * want.abs() + 1e-2 * 448.0 * 448.0,
                    "{m}x{n}x{k} ({r}, {col}): {g} vs {want}"
                );
            }
        }
    }

    /// Host microseconds per call of `f` (median over 7 batches of 100 calls).
    fn host_us(f: &mut dyn FnMut()) -> f64 {
        let mut v: Vec<f64> = (0..7)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..100 {
                    f();
                }
                t.elapsed().as_secs_f64() * 1e4
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v[3]
    }

    /// Where a skinny GEMM's single-call time goes: the host's pieces of the launch, the
    /// device time between events with the host's enqueue exposed (as `bench gemm` times one
    /// call) and hidden behind a long kernel, and the resident clusters per cluster size.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn latency_probe() {
        let (_ctx, s) = setup();
        let sms = sm_count(&s).unwrap() as usize;
        // A blocker: a 2048^3 GEMM (~30 us), long enough to hide any host enqueue.
        let cb = Case::plain(2048, 2048, 2048);
        let mut rng = Rng(5);
        let hb0 = HostData::new(
            &cb,
            rng.fp8(2048 * 2048, cb.fa),
            rng.fp8(2048 * 2048, cb.fb),
            Vec::new(),
            Vec::new(),
        );
        let mut dvb = upload(&s, &cb, &hb0);
        reset_d(&s, &cb, &hb0, &mut dvb);
        let pb = problem(&cb, &dvb);
        for (m, n, k) in [(64, 4096, 7168), (128, 7168, 2048)] {
            let c = Case::plain(m, n, k);
            let (a, b) = (rng.fp8(m * k, c.fa), rng.fp8(n * k, c.fb));
            let mut h = HostData::new(&c, a, b, Vec::new(), Vec::new());
            h.bias = vec![0.0; n];
            let mut dv = upload(&s, &c, &h);
            reset_d(&s, &c, &h, &mut dv);
            let p = problem(&c, &dv);
            let (kern, plan) = skinny_plan_on(&s, &p).unwrap().unwrap();
            let mn = plan.0;
            let smem = skinny_smem_bytes(mn);
            println!(
                "{m}x{n}x{k}: plan {plan:?}; clusters of 0..=8 resident: {:?}",
                resident_clusters(&kern, smem, sms)
            );
            let name = format!("fp8_gemm_sm90_skinny_e4m3_e4m3_bf16_m{mn}");
            let t_plan = host_us(&mut || drop(skinny_plan_on(&s, &p).unwrap()));
            let t_kernel = host_us(&mut || drop(kernel(s.context(), &name).unwrap()));
            let t_sms = host_us(&mut || {
                std::hint::black_box(sm_count(&s).unwrap());
            });
            let t_attr = host_us(&mut || kern.set_max_dynamic_shared_memory(smem).unwrap());
            let t_map = host_us(&mut || {
                std::hint::black_box(tensor_map(p.b.data, 1, n, k, 128).unwrap());
            });
            let t_check = host_us(&mut || check(&p).unwrap());
            s.synchronize().unwrap();
            let t_launch = host_us(&mut || {
                launch(&s, &p).unwrap();
            });
            s.synchronize().unwrap();
            println!(
                "  host us: kernel lookup {t_kernel:.2}, sm_count {t_sms:.2}, smem attribute \
                 {t_attr:.2}, tensor map {t_map:.2}, check {t_check:.2}, plan {t_plan:.2}, whole \
                 launch {t_launch:.2}"
            );
            let (e0, e1) = (
                Event::new(s.context()).unwrap(),
                Event::new(s.context()).unwrap(),
            );
            let mut exposed = Vec::new();
            let mut hidden = Vec::new();
            for _ in 0..3 {
                launch(&s, &p).unwrap();
            }
            for _ in 0..25 {
                s.synchronize().unwrap();
                e0.record(&s).unwrap();
                launch(&s, &p).unwrap();
                e1.record(&s).unwrap();
                e1.synchronize().unwrap();
                exposed.push(f64::from(Event::elapsed_ms(&e0, &e1).unwrap()) * 1e3);
                launch_with(&s, &pb, Some(128)).unwrap();
                e0.record(&s).unwrap();
                launch(&s, &p).unwrap();
                e1.record(&s).unwrap();
                e1.synchronize().unwrap();
                hidden.push(f64::from(Event::elapsed_ms(&e0, &e1).unwrap()) * 1e3);
            }
            exposed.sort_by(f64::total_cmp);
            hidden.sort_by(f64::total_cmp);
            let fl = 2.0 * (m * n * k) as f64 * 1e-6;
            println!(
                "  one call between events: host enqueue exposed {:.2} us ({:.0} TFLOP/s), hidden \
                 {:.2} us ({:.0} TFLOP/s)",
                exposed[12],
                fl / exposed[12],
                hidden[12],
                fl / hidden[12]
            );
            // The launch alone, arguments built once: cluster and PDL attributes on and off.
            {
                let ta = tensor_map(p.a.data, 1, m, k, mn).unwrap();
                let tb = tensor_map(p.b.data, 1, n, k, SKINNY_COLS).unwrap();
                let dims = [m as u32, n as u32, k as u32, 0];
                let flags = [0u32, 0, 0, 0];
                let null = 0u64;
                let GemmOut::Bf16(dd) = &p.d else { panic!() };
                let args = KernelArgs::new()
                    .arg(&ta)
                    .arg(&tb)
                    .arg(*dd)
                    .arg(&null)
                    .arg(p.a.scale_inv.buffer())
                    .arg(p.b.scale_inv.buffer())
                    .arg(&dims)
                    .arg(&flags);
                let grid = n.div_ceil(SKINNY_COLS) as u32 * 2;
                let plain = LaunchConfig {
                    shared_mem_bytes: smem as u32,
                    ..LaunchConfig::linear(grid, THREADS)
                };
                let cl = plain
                    .clone()
                    .with(LaunchAttribute::ClusterDimension(2, 1, 1));
                for (what, cfg, pdl) in [
                    ("cluster + PDL", &cl, true),
                    ("cluster", &cl, false),
                    ("PDL", &plain, true),
                    ("no attributes", &plain, false),
                ] {
                    s.synchronize().unwrap();
                    // SAFETY: the skinny kernel's arguments as launch_skinny passes them.
                    let us = host_us(&mut || unsafe {
                        if pdl {
                            s.launch_pdl(&kern, cfg, &args).unwrap()
                        } else {
                            s.launch(&kern, cfg, &args).unwrap()
                        }
                    });
                    s.synchronize().unwrap();
                    println!("  host us, launch only, {what}: {us:.2}");
                }
            }
        }
    }
}
