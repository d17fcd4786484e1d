//! Packed grouped GEMM tests (the dropless MoE layout): [`grouped_gemm_packed`] (forward and
//! data gradient) and [`grouped_gemm_wgrad`] (weight gradient) against the fp64 CPU
//! references of `gemm::reference`. GPU tests are `#[ignore]`d here; run them with
//! `cargo test -p fp8-kernels --test grouped_packed -- --include-ignored` on a CUDA machine.
//!
//! Data: the packed buffer is laid out as the MoE layer does it, each group's offset a
//! multiple of [`ALIGN_ROWS`]: random finite FP8 bytes in a group's real rows, zeros in its
//! padding rows, and 0x7f bytes (NaN in both formats) in the rows no group owns (at and past
//! `offsets[groups]`). The weight gradient reduces along those rows, so a kernel reading a
//! don't-care row would turn its result into NaN. Outputs are poisoned first (all-ones bytes,
//! a NaN in both types), or filled with known values when accumulating, and everything the
//! kernels must not write is compared bit for bit with what was there before.
//!
//! Error bounds, as `max |got - want| / max |want|` per group against the unrounded fp64
//! reference. Every FP8 value is exact in f16 and the product of two is exact in fp32, so
//! the kernel's only errors are the fp32 accumulation of `mma.sync` (one rounding per
//! 16-deep step of K, at most 2^-23 of the running sum) and the final rounding:
//! * f32 output: 1e-5, the bound `tests/gemm.rs` holds the same main loop to (also at
//!   K = 2048, against an fp32 reference); above K = 1342 it is widened to the linear worst
//!   case `K / 16 * 2^-23` of one rounding per k-step. These tests reduce over at most
//!   1152 rows, so 1e-5 applies throughout;
//! * bf16 output: 8e-3 (bf16 rounding alone is up to 2^-9 = 1.95e-3 of the largest value),
//!   as in `tests/gemm.rs`;
//! * `GemmPath::Hopper` (the sm_90a wgmma kernel): Hopper's FP8 tensor cores keep about 14
//!   bits within each 128-deep slice of K before the promotion into fp32 (fp8.md), so its
//!   f32 output is held to 2e-3, the bound `tests/gemm.rs` holds the dense sm_90a path to
//!   (2.1e-4 seen at K = 80).
//!
//! Exact expectations only where nothing is rounded or the one rounding is the reference's:
//! padding rows of the forward (A rows of zeros: the accumulator is exactly zero, so D is
//! the bias, or zero, rounded once; also when accumulating into f32, where `bias + D` is one
//! f32 rounding on both sides; compared as values, as the reference's zero may be -0),
//! weight-gradient groups with no rows (+0 bit for bit, or D unchanged when accumulating),
//! and every row or group that must not be written (bit for bit).

use std::ops::Range;
use std::sync::Arc;

use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, Error, GraphExec, InstantiateFlags, Result, Stream,
};
use fp8_kernels::gemm::reference::{
    RefPacked, RefWgrad, grouped_packed_f64, grouped_wgrad_f64, packed_rows, rel_error, round_to,
};
use fp8_kernels::gemm::{
    ALIGN_ROWS, GemmOptions, GemmPath, GroupedOperand, Operand, PackedShape, WgradShape,
    grouped_gemm_packed, grouped_gemm_wgrad,
};
use fp8_kernels::reference as r;

mod common;
use common::{BiasBuf, Out, Rng, setup};
use fp8_kernels::{DType, DeviceScalar, Fp8Format};

const E4: Fp8Format = Fp8Format::E4M3;
const E5: Fp8Format = Fp8Format::E5M2;
const BF16_BOUND: f64 = 8e-3;
const FORMATS: [(Fp8Format, Fp8Format); 4] = [(E4, E4), (E5, E4), (E4, E5), (E5, E5)];
/// A byte that is NaN in E4M3 and in E5M2: the contents of the don't-care rows.
const DONT_CARE: u8 = 0x7f;

/// f32-output bound of the sm_90a wgmma path (module docs).
const TENSOR_CORE_F32_BOUND: f64 = 2e-3;

/// The relative error allowed for a reduction of length `k` into `out` on `path` (module
/// docs).
fn bound(out: DType, k: usize, path: GemmPath) -> f64 {
    match (out, path) {
        (DType::F32, GemmPath::Hopper) => TENSOR_CORE_F32_BOUND,
        (DType::F32, _) => 1e-5f64.max(k as f64 / 16.0 * 2f64.powi(-23)),
        _ => BF16_BOUND,
    }
}

/// Where the groups' rows are.
#[derive(Debug, Clone)]
enum Rows {
    /// Real row counts per group, each group padded to a multiple of ALIGN_ROWS (zero rows),
    /// then `slack` don't-care tiles past `offsets[groups]`.
    Counts { counts: Vec<usize>, slack: usize },
    /// Offsets as given (possibly malformed), every row of every group real.
    Raw { offsets: Vec<i32>, capacity: usize },
}

/// The offsets, the capacity, and each group's real row count (None: all rows real).
struct Layout {
    offsets: Vec<i32>,
    capacity: usize,
    counts: Option<Vec<usize>>,
}

impl Rows {
    fn layout(&self) -> Layout {
        match self {
            Rows::Counts { counts, slack } => {
                let mut offsets = vec![0i32];
                let mut at = 0usize;
                for &c in counts {
                    at += c.div_ceil(ALIGN_ROWS) * ALIGN_ROWS;
                    offsets.push(i32::try_from(at).unwrap());
                }
                Layout {
                    offsets,
                    capacity: at + slack * ALIGN_ROWS,
                    counts: Some(counts.clone()),
                }
            }
            Rows::Raw { offsets, capacity } => Layout {
                offsets: offsets.clone(),
                capacity: *capacity,
                counts: None,
            },
        }
    }
    fn groups(&self) -> usize {
        match self {
            Rows::Counts { counts, .. } => counts.len(),
            Rows::Raw { offsets, .. } => offsets.len() - 1,
        }
    }
}

/// `[capacity, width]` packed FP8 rows: random in each group's real rows (as the kernels read
/// the offsets), zero in its padding rows, DONT_CARE in rows no group owns.
fn packed_data(rng: &mut Rng, lay: &Layout, width: usize, fmt: Fp8Format) -> Vec<u8> {
    let mut x = vec![DONT_CARE; lay.capacity * width];
    for (g, rows) in packed_rows(&lay.offsets, lay.capacity)
        .into_iter()
        .enumerate()
    {
        let real = lay.counts.as_ref().map_or(rows.len(), |c| c[g]);
        for (i, row) in rows.enumerate() {
            let dst = &mut x[row * width..(row + 1) * width];
            if i < real {
                dst.copy_from_slice(&rng.bytes(width, fmt));
            } else {
                dst.fill(0);
            }
        }
    }
    x
}

/// `[rows, cols]` -> `[cols, rows]`.
fn transpose(x: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut t = vec![0u8; x.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = x[i * cols + j];
        }
    }
    t
}

/// Random group sizes for `groups` groups, about half of them empty, the first and the
/// last empty, the others 1..=max rows.
fn sparse_counts(rng: &mut Rng, groups: usize, max: u64) -> Vec<usize> {
    (0..groups)
        .map(|g| {
            if g == 0 || g == groups - 1 || rng.next() % 2 == 0 {
                0
            } else {
                1 + (rng.next() % max) as usize
            }
        })
        .collect()
}

// ---- Forward / data gradient --------------------------------------------------------------

/// One packed forward case.
#[derive(Debug, Clone)]
struct Fwd {
    name: &'static str,
    rows: Rows,
    n: usize,
    k: usize,
    fa: Fp8Format,
    fb: Fp8Format,
    out: DType,
    bias: Option<DType>,
    accumulate: bool,
    per_group_scales: bool,
    path: GemmPath,
    /// The tile-width hint ([`GemmOptions::expected_rows`]).
    expected_rows: Option<usize>,
    /// The SM cap ([`GemmOptions::max_sms`]).
    max_sms: Option<usize>,
    seed: u64,
}

impl Fwd {
    fn new(name: &'static str, counts: &[usize], n: usize, k: usize) -> Fwd {
        Fwd {
            name,
            rows: Rows::Counts {
                counts: counts.to_vec(),
                slack: 2,
            },
            n,
            k,
            fa: E4,
            fb: E4,
            out: DType::F32,
            bias: None,
            accumulate: false,
            per_group_scales: false,
            path: GemmPath::Portable,
            expected_rows: None,
            max_sms: None,
            seed: (counts.len() * 7919 + n * 131 + k) as u64,
        }
    }
}

/// Host data of a forward case on the device, and its fp64 reference inputs.
/// The host side of a forward case: its data and the reference inputs.
struct FwdHost {
    lay: Layout,
    a_h: Vec<u8>,
    b_h: Vec<u8>,
    sa: f32,
    sb: Vec<f32>,
    /// The bias as drawn, and as the kernel sees it (rounded to its type).
    bias_vals: Vec<f32>,
    bias_w: Option<Vec<f32>>,
}

impl FwdHost {
    fn new(c: &Fwd) -> FwdHost {
        let lay = c.rows.layout();
        let groups = c.rows.groups();
        let mut rng = Rng::new(c.seed ^ (c.out as u64) << 40 ^ (c.fa as u64) << 48);
        let a_h = packed_data(&mut rng, &lay, c.k, c.fa);
        let b_h = rng.bytes(groups * c.n * c.k, c.fb);
        let sb: Vec<f32> = if c.per_group_scales {
            // Distinct per group, powers of two apart and not: 0.5, 0.75, ..., 2.0.
            (0..groups).map(|g| 0.5 + (g % 7) as f32 * 0.25).collect()
        } else {
            vec![1.5]
        };
        let bias_vals: Vec<f32> = (0..c.n).map(|_| rng.unit() * 1000.0).collect();
        let bias_w = c.bias.map(|dt| {
            bias_vals
                .iter()
                .map(|&x| r::widen(r::narrow(x, dt), dt))
                .collect()
        });
        FwdHost {
            lay,
            a_h,
            b_h,
            sa: 0.37,
            sb,
            bias_vals,
            bias_w,
        }
    }

    /// Checks D (`bits`, after the GEMM) against the reference for the offsets `offsets`:
    /// each group's rows to the bound, padding rows bit for bit, and every row no group owns
    /// unchanged from `before`. `prev`: D's values before, when accumulating.
    fn verify(
        &self,
        c: &Fwd,
        offsets: &[i32],
        out: DType,
        bits: &[u32],
        before: &[u32],
        prev: Option<&[f32]>,
    ) {
        let (cap, n, k) = (self.lay.capacity, c.n, c.k);
        let want = grouped_packed_f64(&RefPacked {
            capacity: cap,
            n,
            k,
            offsets,
            a: &self.a_h,
            a_format: c.fa,
            b: &self.b_h,
            b_format: c.fb,
            a_scale: self.sa,
            b_scales: &self.sb,
            bias: self.bias_w.as_deref(),
            d: prev,
        });
        let vals: Vec<f32> = bits.iter().map(|&b| r::widen(b, out)).collect();
        let mut owned = vec![false; cap];
        for (g, (rows, w)) in want.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            owned[rows.clone()].fill(true);
            let got = &vals[rows.start * n..rows.end * n];
            let e = rel_error(got, w);
            assert!(
                e < bound(out, k, c.path),
                "{} {c:?} offsets {offsets:?}: group {g} rows {rows:?}: relative error {e:e}",
                c.name
            );
            if !c.accumulate || out == DType::F32 {
                for row in rows.clone() {
                    if self.a_h[row * k..(row + 1) * k].iter().all(|&x| x == 0) {
                        for j in 0..n {
                            // `==`: the kernel's zero accumulator is +0, the f64 reference's
                            // sum of zero products may be -0.
                            let exact = round_to(w[(row - rows.start) * n + j], out);
                            let got = vals[row * n + j];
                            assert!(
                                got == exact,
                                "{}: group {g} padding row {row} column {j}: {got} != {exact}",
                                c.name
                            );
                        }
                    }
                }
            }
        }
        for row in (0..cap).filter(|&row| !owned[row]) {
            let p = (0..n).find(|&j| bits[row * n + j] != before[row * n + j]);
            assert!(
                p.is_none(),
                "{} offsets {offsets:?}: row {row} (no group's) written at column {p:?}",
                c.name
            );
        }
    }
}

/// A forward case's data on the device.
struct FwdRun {
    host: FwdHost,
    a: DeviceBuffer<u8>,
    b: DeviceBuffer<u8>,
    sa_d: DeviceScalar,
    sb_d: DeviceScalar,
    sb_groups: DeviceBuffer<f32>,
    bias: Option<BiasBuf>,
    offsets: DeviceBuffer<i32>,
}

impl FwdRun {
    fn new(stream: &Stream, c: &Fwd) -> FwdRun {
        let h = FwdHost::new(c);
        let bias = c.bias.map(|dt| BiasBuf::new(stream, dt, &h.bias_vals).0);
        FwdRun {
            a: DeviceBuffer::from_host(stream, &h.a_h).unwrap(),
            b: DeviceBuffer::from_host(stream, &h.b_h).unwrap(),
            sa_d: DeviceScalar::new(stream, h.sa).unwrap(),
            sb_d: DeviceScalar::new(stream, h.sb[0]).unwrap(),
            sb_groups: DeviceBuffer::from_host(stream, &h.sb).unwrap(),
            bias,
            offsets: DeviceBuffer::from_host(stream, &h.lay.offsets).unwrap(),
            host: h,
        }
    }

    fn shape(&self, c: &Fwd) -> PackedShape {
        PackedShape {
            groups: c.rows.groups(),
            capacity: self.host.lay.capacity,
            n: c.n,
            k: c.k,
        }
    }

    /// Enqueues the GEMM into `d` on `stream`.
    fn launch(&self, stream: &Stream, c: &Fwd, d: &Out) -> Result<()> {
        let a = Operand {
            data: &self.a,
            format: c.fa,
            scale_inv: &self.sa_d,
        };
        let b: GroupedOperand<'_> = if c.per_group_scales {
            GroupedOperand::per_group(&self.b, c.fb, &self.sb_groups)
        } else {
            Operand {
                data: &self.b,
                format: c.fb,
                scale_inv: &self.sb_d,
            }
            .into()
        };
        let mut opts = GemmOptions::new().accumulate(c.accumulate).path(c.path);
        if let Some(bb) = &self.bias {
            opts = opts.bias(bb.view());
        }
        if let Some(rows) = c.expected_rows {
            opts = opts.expected_rows(rows);
        }
        if let Some(sms) = c.max_sms {
            opts = opts.max_sms(sms);
        }
        grouped_gemm_packed(stream, self.shape(c), a, b, d.view(), &self.offsets, opts)
    }
}

/// D of `len` elements of `out` for one eager run: filled with known values (returned, as
/// the GEMM sees them) when accumulating, else poisoned; and its bits before the GEMM.
fn prepared_d(
    ctx: &Arc<Context>,
    stream: &Stream,
    out: DType,
    len: usize,
    accumulate: Option<u64>,
) -> (Out, Option<Vec<f32>>, Vec<u32>) {
    let mut d = Out::new(ctx, out, len);
    let prev = match accumulate {
        Some(seed) => {
            let mut rng = Rng::new(seed);
            let xs: Vec<f32> = (0..len).map(|_| rng.unit() * 5000.0).collect();
            Some(d.fill(stream, &xs))
        }
        None => {
            d.poison(stream);
            None
        }
    };
    let before = d.bits(stream);
    (d, prev, before)
}

/// Runs `c` eagerly and checks it.
fn check_fwd(ctx: &Arc<Context>, stream: &Stream, c: &Fwd) {
    let run = FwdRun::new(stream, c);
    let len = run.host.lay.capacity * c.n;
    let (d, prev, before) = prepared_d(ctx, stream, c.out, len, c.accumulate.then_some(c.seed + 1));
    run.launch(stream, c, &d)
        .unwrap_or_else(|e| panic!("{} {c:?}: grouped_gemm_packed failed: {e}", c.name));
    stream.synchronize().unwrap();
    run.host.verify(
        c,
        &run.host.lay.offsets,
        c.out,
        &d.bits(stream),
        &before,
        prev.as_deref(),
    );
}

/// Balanced and skewed groups, empty groups first, in the middle and last, one group with
/// every row, one group, N over several tiles, both outputs, both paths that take it.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_forward_group_layouts() {
    let (ctx, stream) = setup();
    let cases = [
        Fwd::new("balanced", &[200, 130, 256, 100], 72, 80),
        Fwd::new("skewed", &[700, 3, 0, 0, 50, 0, 1, 0], 40, 48),
        Fwd::new("empty first and last", &[0, 300, 0, 129, 0], 136, 272),
        Fwd::new("one group holds every row", &[0, 0, 777, 0], 24, 64),
        Fwd::new("one group", &[333], 72, 80),
        Fwd::new("exact tiles", &[128, 256, 128], 128, 32),
        Fwd::new("every group empty", &[0, 0], 24, 32),
    ];
    for base in cases {
        for out in [DType::F32, DType::Bf16] {
            for path in [GemmPath::Portable, GemmPath::Auto] {
                check_fwd(
                    &ctx,
                    &stream,
                    &Fwd {
                        out,
                        path,
                        ..base.clone()
                    },
                );
            }
        }
    }
}

/// The sm_90a kernel (explicit `GemmPath::Hopper`) on the aligned layouts, every format pair,
/// per-group scales, bias and accumulation, and 256 groups: the same checks as the portable
/// kernel's. On a device other than compute capability 9.0 the path is refused instead.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_forward_on_hopper() {
    let (ctx, stream) = setup();
    let hopper = ctx.device().compute_capability().unwrap() == (9, 0);
    let mut cases = vec![
        Fwd::new("balanced", &[200, 130, 256, 100], 72, 80),
        Fwd::new("skewed", &[700, 3, 0, 0, 50, 0, 1, 0], 40, 48),
        Fwd::new("empty first and last", &[0, 300, 0, 129, 0], 136, 272),
        Fwd::new("one group holds every row", &[0, 0, 777, 0], 24, 64),
        Fwd::new("exact tiles", &[128, 256, 128], 128, 32),
        Fwd::new("every group empty", &[0, 0], 24, 32),
        Fwd::new("wide", &[1000, 24, 512], 392, 256),
    ];
    for (fa, fb) in FORMATS {
        cases.push(Fwd {
            fa,
            fb,
            ..Fwd::new("formats", &[150, 0, 260, 1], 72, 80)
        });
    }
    for accumulate in [false, true] {
        cases.push(Fwd {
            accumulate,
            bias: Some(DType::Bf16),
            per_group_scales: true,
            ..Fwd::new("options", &[150, 0, 260, 1], 136, 48)
        });
    }
    // The tile-width hint: 72 m-tiles of N = 392 take 192-wide tiles for the capacity, 128-wide
    // ones for a hint of 1 row (clamped up) and the capacity for a hint past it (clamped down).
    for expected_rows in [None, Some(0), Some(1), Some(usize::MAX)] {
        cases.push(Fwd {
            expected_rows,
            ..Fwd::new("tile-width hint", &[3000, 2000, 4100], 392, 256)
        });
    }
    cases.push(Fwd {
        per_group_scales: true,
        ..Fwd::new(
            "256 groups",
            &sparse_counts(&mut Rng::new(256), 256, 40),
            24,
            32,
        )
    });
    for base in cases {
        for out in [DType::F32, DType::Bf16] {
            let c = Fwd {
                out,
                path: GemmPath::Hopper,
                ..base.clone()
            };
            if hopper {
                check_fwd(&ctx, &stream, &c);
            } else {
                let run = std::panic::AssertUnwindSafe(|| check_fwd(&ctx, &stream, &c));
                let err = std::panic::catch_unwind(run);
                assert!(
                    err.is_err(),
                    "{}: GemmPath::Hopper ran on a non-sm_90 device",
                    c.name
                );
            }
        }
    }
}

/// 256 groups (about half empty, the first and the last among them), small N and K, one
/// scale and one scale per group.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_forward_256_groups() {
    let (ctx, stream) = setup();
    let counts = sparse_counts(&mut Rng::new(256), 256, 40);
    for per_group_scales in [false, true] {
        for out in [DType::F32, DType::Bf16] {
            check_fwd(
                &ctx,
                &stream,
                &Fwd {
                    out,
                    per_group_scales,
                    bias: Some(DType::F32),
                    ..Fwd::new("256 groups", &counts, 24, 32)
                },
            );
        }
    }
}

/// Every format combination (E5M2 x E4M3 is the data gradient: dY x W^T), per-group scales,
/// bias of both types, accumulation into both outputs.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_forward_formats_scales_bias_accumulate() {
    let (ctx, stream) = setup();
    let counts = [150, 0, 260, 1];
    for (fa, fb) in FORMATS {
        for out in [DType::F32, DType::Bf16] {
            check_fwd(
                &ctx,
                &stream,
                &Fwd {
                    fa,
                    fb,
                    out,
                    ..Fwd::new("formats", &counts, 72, 80)
                },
            );
        }
    }
    for out in [DType::F32, DType::Bf16] {
        for bias in [None, Some(DType::F32), Some(DType::Bf16)] {
            for accumulate in [false, true] {
                for per_group_scales in [false, true] {
                    check_fwd(
                        &ctx,
                        &stream,
                        &Fwd {
                            fa: E5,
                            out,
                            bias,
                            accumulate,
                            per_group_scales,
                            ..Fwd::new("options", &counts, 136, 48)
                        },
                    );
                }
            }
        }
    }
}

/// Offsets that are not multiples of 128 (group boundaries inside a row tile, still
/// non-decreasing) and malformed ones that stay non-decreasing once clamped (negative, past
/// capacity, not multiples of 16): the kernel computes exactly the rows `packed_rows` gives.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_forward_unaligned_and_clamped_offsets() {
    let (ctx, stream) = setup();
    for (offsets, capacity) in [
        (vec![0, 48, 48, 200, 304], 512),
        (vec![0, 16, 32, 48, 64, 80], 128),
        (vec![-5, 100, 5000], 256),
        (vec![i32::MIN, 130, i32::MAX], 384),
        (vec![64, 192, 256], 384),
    ] {
        for out in [DType::F32, DType::Bf16] {
            check_fwd(
                &ctx,
                &stream,
                &Fwd {
                    rows: Rows::Raw {
                        offsets: offsets.clone(),
                        capacity,
                    },
                    out,
                    bias: Some(DType::F32),
                    ..Fwd::new("unaligned offsets", &[0], 40, 48)
                },
            );
        }
    }
}

/// Decreasing offsets (overlapping groups): the documented guarantee only, that nothing at
/// or past `eff(groups)` is written and nothing faults (the stream stays usable).
#[test]
#[ignore = "needs a CUDA device"]
fn packed_forward_decreasing_offsets_stay_in_bounds() {
    let (ctx, stream) = setup();
    for (offsets, capacity) in [
        (vec![0, 256, 128, 384], 512),
        (vec![0, 512, 256], 512),
        (vec![384, 128, 0, 256], 512),
    ] {
        let c = Fwd {
            rows: Rows::Raw {
                offsets: offsets.clone(),
                capacity,
            },
            ..Fwd::new("decreasing offsets", &[0], 40, 48)
        };
        let run = FwdRun::new(&stream, &c);
        let mut d = Out::new(&ctx, c.out, capacity * c.n);
        d.poison(&stream);
        run.launch(&stream, &c, &d).unwrap();
        stream.synchronize().unwrap();
        // eff(groups), as the module documentation defines it.
        let total = usize::try_from(*offsets.last().unwrap())
            .unwrap_or(0)
            .min(capacity)
            / 16
            * 16;
        let bits = d.bits(&stream);
        let p = bits[total * c.n..].iter().position(|&b| b != u32::MAX);
        assert!(p.is_none(), "{offsets:?}: row {total} + {p:?}/n written");
    }
    // The context is healthy: a well-formed case still runs right.
    check_fwd(&ctx, &stream, &Fwd::new("after", &[100, 0, 50], 40, 48));
}

// ---- Weight gradient ----------------------------------------------------------------------

/// One packed weight-gradient case: `D[g] = dY_g^T . X_g`, A = dY^T `[m, capacity]`,
/// B = X^T `[n, capacity]`.
#[derive(Debug, Clone)]
struct Wg {
    name: &'static str,
    rows: Rows,
    m: usize,
    n: usize,
    fa: Fp8Format,
    fb: Fp8Format,
    out: DType,
    accumulate: bool,
    path: GemmPath,
    /// The SM cap ([`GemmOptions::max_sms`]).
    max_sms: Option<usize>,
    seed: u64,
}

impl Wg {
    fn new(name: &'static str, counts: &[usize], m: usize, n: usize) -> Wg {
        Wg {
            name,
            rows: Rows::Counts {
                counts: counts.to_vec(),
                slack: 1,
            },
            m,
            n,
            // dY is E5M2 (a gradient), X is E4M3.
            fa: E5,
            fb: E4,
            out: DType::F32,
            accumulate: false,
            path: GemmPath::Portable,
            max_sms: None,
            seed: (counts.len() * 6007 + m * 131 + n) as u64,
        }
    }
}

/// The host side of a weight-gradient case: its data.
struct WgHost {
    lay: Layout,
    a_h: Vec<u8>,
    b_h: Vec<u8>,
}

/// A weight-gradient case's data on the device.
struct WgRun {
    host: WgHost,
    a: DeviceBuffer<u8>,
    b: DeviceBuffer<u8>,
    sa: DeviceScalar,
    sb: DeviceScalar,
    offsets: DeviceBuffer<i32>,
}

const WG_SA: f32 = 0.125;
const WG_SB: f32 = 3.0;

impl WgHost {
    fn new(c: &Wg) -> WgHost {
        let lay = c.rows.layout();
        let mut rng = Rng::new(c.seed ^ (c.out as u64) << 40 ^ (c.fa as u64) << 48);
        // The packed dY [capacity, m] and X [capacity, n], transposed as cast-transpose
        // would write them.
        let dy = packed_data(&mut rng, &lay, c.m, c.fa);
        let x = packed_data(&mut rng, &lay, c.n, c.fb);
        let a_h = transpose(&dy, lay.capacity, c.m);
        let b_h = transpose(&x, lay.capacity, c.n);
        WgHost { lay, a_h, b_h }
    }

    /// Checks D (`bits`) for the offsets `offsets`: groups with rows to the bound, groups
    /// without +0 (or unchanged from `before` when accumulating), bit for bit.
    fn verify(
        &self,
        c: &Wg,
        offsets: &[i32],
        out: DType,
        bits: &[u32],
        before: &[u32],
        prev: Option<&[f32]>,
    ) {
        let (m, n) = (c.m, c.n);
        let want = grouped_wgrad_f64(&RefWgrad {
            capacity: self.lay.capacity,
            m,
            n,
            offsets,
            a: &self.a_h,
            a_format: c.fa,
            b: &self.b_h,
            b_format: c.fb,
            a_scale: WG_SA,
            b_scale: WG_SB,
            d: prev,
        });
        let vals: Vec<f32> = bits.iter().map(|&b| r::widen(b, out)).collect();
        for (g, rows) in packed_rows(offsets, self.lay.capacity)
            .into_iter()
            .enumerate()
        {
            let span: Range<usize> = g * m * n..(g + 1) * m * n;
            if rows.is_empty() {
                let expect = if c.accumulate {
                    &before[span.clone()]
                } else {
                    &vec![0u32; m * n][..]
                };
                let p = (0..m * n).find(|&i| bits[span.start + i] != expect[i]);
                assert!(
                    p.is_none(),
                    "{} offsets {offsets:?}: group {g} has no rows but element {p:?} is {:#x}",
                    c.name,
                    p.map_or(0, |i| bits[span.start + i])
                );
                continue;
            }
            let e = rel_error(&vals[span.clone()], &want[span]);
            assert!(
                e < bound(out, rows.len(), c.path),
                "{} {c:?} offsets {offsets:?}: group {g} (K = {}): relative error {e:e}",
                c.name,
                rows.len()
            );
        }
    }
}

impl WgRun {
    fn new(stream: &Stream, c: &Wg) -> WgRun {
        let h = WgHost::new(c);
        WgRun {
            a: DeviceBuffer::from_host(stream, &h.a_h).unwrap(),
            b: DeviceBuffer::from_host(stream, &h.b_h).unwrap(),
            sa: DeviceScalar::new(stream, WG_SA).unwrap(),
            sb: DeviceScalar::new(stream, WG_SB).unwrap(),
            offsets: DeviceBuffer::from_host(stream, &h.lay.offsets).unwrap(),
            host: h,
        }
    }

    fn launch(&self, stream: &Stream, c: &Wg, d: &Out) -> Result<()> {
        grouped_gemm_wgrad(
            stream,
            WgradShape {
                groups: c.rows.groups(),
                capacity: self.host.lay.capacity,
                m: c.m,
                n: c.n,
            },
            Operand {
                data: &self.a,
                format: c.fa,
                scale_inv: &self.sa,
            },
            Operand {
                data: &self.b,
                format: c.fb,
                scale_inv: &self.sb,
            },
            d.view(),
            &self.offsets,
            GemmOptions {
                max_sms: c.max_sms,
                ..GemmOptions::new().accumulate(c.accumulate).path(c.path)
            },
        )
    }
}

/// Runs `c` eagerly and checks it.
fn check_wg(ctx: &Arc<Context>, stream: &Stream, c: &Wg) {
    let run = WgRun::new(stream, c);
    let len = c.rows.groups() * c.m * c.n;
    let (d, prev, before) = prepared_d(ctx, stream, c.out, len, c.accumulate.then_some(c.seed + 1));
    run.launch(stream, c, &d)
        .unwrap_or_else(|e| panic!("{} {c:?}: grouped_gemm_wgrad failed: {e}", c.name));
    stream.synchronize().unwrap();
    run.host.verify(
        c,
        &run.host.lay.offsets,
        c.out,
        &d.bits(stream),
        &before,
        prev.as_deref(),
    );
}

/// Balanced and skewed groups, K_g = 0 first, in the middle and last, one group with every
/// row (K = 1024), one group, M and N over several tiles and partial, both outputs,
/// overwrite and accumulate (groups without rows: +0, or untouched).
#[test]
#[ignore = "needs a CUDA device"]
fn wgrad_group_layouts() {
    let (ctx, stream) = setup();
    let cases = [
        Wg::new("balanced", &[200, 130, 256, 100], 72, 80),
        Wg::new("skewed, empty first and last", &[0, 700, 0, 3, 0], 136, 40),
        Wg::new("one group holds every row", &[0, 0, 900, 0], 200, 24),
        Wg::new("one group", &[333], 72, 136),
        Wg::new("every group empty", &[0, 0, 0], 40, 24),
    ];
    for base in cases {
        for out in [DType::F32, DType::Bf16] {
            for accumulate in [false, true] {
                for path in [GemmPath::Portable, GemmPath::Auto] {
                    check_wg(
                        &ctx,
                        &stream,
                        &Wg {
                            out,
                            accumulate,
                            path,
                            ..base.clone()
                        },
                    );
                }
            }
        }
    }
}

/// The sm_90a kernel (explicit `GemmPath::Hopper`) on the aligned layouts of
/// `wgrad_group_layouts`, every format pair and 256 groups, both outputs, overwrite and
/// accumulate: the same checks as the portable kernel's (groups without rows +0 or untouched
/// bit for bit, rows no group owns hold NaN and must not be read). On a device other than
/// compute capability 9.0 the path is refused instead.
#[test]
#[ignore = "needs a CUDA device"]
fn wgrad_on_hopper() {
    let (ctx, stream) = setup();
    let hopper = ctx.device().compute_capability().unwrap() == (9, 0);
    let mut cases = vec![
        Wg::new("balanced", &[200, 130, 256, 100], 72, 80),
        Wg::new("skewed, empty first and last", &[0, 700, 0, 3, 0], 136, 40),
        Wg::new("one group holds every row", &[0, 0, 900, 0], 200, 24),
        Wg::new("one group", &[333], 72, 136),
        Wg::new("every group empty", &[0, 0, 0], 40, 24),
        Wg::new("wide", &[1000, 24, 512], 264, 392),
        Wg::new(
            "256 groups",
            &sparse_counts(&mut Rng::new(258), 256, 40),
            24,
            40,
        ),
    ];
    for (fa, fb) in FORMATS {
        cases.push(Wg {
            fa,
            fb,
            ..Wg::new("formats", &[150, 0, 260, 1], 72, 80)
        });
    }
    for base in cases {
        for out in [DType::F32, DType::Bf16] {
            for accumulate in [false, true] {
                let c = Wg {
                    out,
                    accumulate,
                    path: GemmPath::Hopper,
                    ..base.clone()
                };
                if hopper {
                    check_wg(&ctx, &stream, &c);
                } else {
                    let run = std::panic::AssertUnwindSafe(|| check_wg(&ctx, &stream, &c));
                    assert!(
                        std::panic::catch_unwind(run).is_err(),
                        "{}: GemmPath::Hopper ran on a non-sm_90 device",
                        c.name
                    );
                }
            }
        }
    }
}

/// 256 groups, about half with K_g = 0 (the first and the last among them), small M and N.
#[test]
#[ignore = "needs a CUDA device"]
fn wgrad_256_groups() {
    let (ctx, stream) = setup();
    let counts = sparse_counts(&mut Rng::new(257), 256, 40);
    for out in [DType::F32, DType::Bf16] {
        for accumulate in [false, true] {
            check_wg(
                &ctx,
                &stream,
                &Wg {
                    out,
                    accumulate,
                    ..Wg::new("256 groups", &counts, 24, 40)
                },
            );
        }
    }
}

/// Every format combination; offsets that are malformed (negative, past capacity, not
/// multiples of 16, decreasing): the weight gradient always reduces exactly over the rows
/// `packed_rows` gives, and never reads a column past `eff(groups)` (those hold NaN).
#[test]
#[ignore = "needs a CUDA device"]
fn wgrad_formats_and_malformed_offsets() {
    let (ctx, stream) = setup();
    for (fa, fb) in FORMATS {
        for out in [DType::F32, DType::Bf16] {
            check_wg(
                &ctx,
                &stream,
                &Wg {
                    fa,
                    fb,
                    out,
                    ..Wg::new("formats", &[150, 0, 260, 1], 72, 80)
                },
            );
        }
    }
    for (offsets, capacity) in [
        (vec![0, 48, 48, 200, 304], 512),
        (vec![-5, 100, 5000], 256),
        (vec![0, 256, 128, 384], 512),
        (vec![0, 512, 256], 512),
        (vec![384, 128, 0, 256], 512),
        (vec![i32::MIN, i32::MAX], 128),
    ] {
        for accumulate in [false, true] {
            check_wg(
                &ctx,
                &stream,
                &Wg {
                    rows: Rows::Raw {
                        offsets: offsets.clone(),
                        capacity,
                    },
                    accumulate,
                    ..Wg::new("malformed offsets", &[0], 40, 24)
                },
            );
        }
    }
}

// ---- Graphs, validation -------------------------------------------------------------------

/// Both GEMMs captured once into one graph, replayed with two different offsets uploaded
/// between the replays (and back): each replay is right for the offsets it ran with, and the
/// rows past `offsets[groups]` keep their poison.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_gemms_in_a_graph_with_changing_offsets() {
    let (ctx, stream) = setup();
    let (groups, capacity, n, k) = (4usize, 1152usize, 72usize, 80usize);
    let offsets_sets: [[i32; 5]; 3] = [
        [0, 256, 256, 640, 768],
        [0, 0, 512, 640, 1024],
        [0, 128, 256, 384, 512],
    ];
    for out in [DType::F32, DType::Bf16] {
        // Every row of the packed buffers holds data (which rows are real changes with the
        // offsets); these initial offsets only size the data and are replaced below.
        let all_real = Rows::Raw {
            offsets: vec![0, 288, 576, 864, capacity as i32],
            capacity,
        };
        let fwd = Fwd {
            rows: all_real.clone(),
            out,
            bias: Some(DType::Bf16),
            per_group_scales: true,
            path: GemmPath::Auto,
            ..Fwd::new("graph forward", &[0], n, k)
        };
        // Weight gradient of the same packed rows: m = n, n = k.
        let wg = Wg {
            rows: all_real,
            out,
            path: GemmPath::Auto,
            ..Wg::new("graph wgrad", &[0], n, k)
        };
        let frun = FwdRun::new(&stream, &fwd);
        let wrun = WgRun::new(&stream, &wg);
        // One offsets buffer for both GEMMs, as the MoE layer would share it.
        let offsets = &frun.offsets;
        let mut df = Out::new(&ctx, out, capacity * n);
        let mut dw = Out::new(&ctx, out, groups * n * k);
        let enqueue = |s: &Stream, df: &Out, dw: &Out| -> Result<()> {
            frun.launch(s, &fwd, df)?;
            grouped_gemm_wgrad(
                s,
                WgradShape {
                    groups,
                    capacity,
                    m: wg.m,
                    n: wg.n,
                },
                Operand {
                    data: &wrun.a,
                    format: wg.fa,
                    scale_inv: &wrun.sa,
                },
                Operand {
                    data: &wrun.b,
                    format: wg.fb,
                    scale_inv: &wrun.sb,
                },
                dw.view(),
                offsets,
                GemmOptions::new().path(wg.path),
            )
        };
        // Eagerly once (loads the module outside the capture), then captured.
        enqueue(&stream, &df, &dw).unwrap();
        stream.synchronize().unwrap();
        let graph = stream
            .capture(CaptureMode::ThreadLocal, |s| enqueue(s.stream(), &df, &dw))
            .unwrap();
        assert_eq!(graph.nodes().unwrap().len(), 2, "two launches");
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
        for offs in [
            offsets_sets[0],
            offsets_sets[1],
            offsets_sets[0],
            offsets_sets[2],
        ] {
            offsets.copy_from_host(&stream, &offs).unwrap();
            df.poison(&stream);
            dw.poison(&stream);
            let (before_f, before_w) = (df.bits(&stream), dw.bits(&stream));
            exec.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            frun.host
                .verify(&fwd, &offs, out, &df.bits(&stream), &before_f, None);
            wrun.host
                .verify(&wg, &offs, out, &dw.bits(&stream), &before_w, None);
        }
    }
}

/// Bad arguments are rejected with InvalidArgument naming them, before any launch: D keeps
/// its poison.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_bad_arguments_are_rejected_and_nothing_is_written() {
    let (ctx, stream) = setup();
    let (groups, capacity, n, k) = (3usize, 256usize, 24usize, 32usize);
    let a = DeviceBuffer::<u8>::alloc(&ctx, capacity * k).unwrap();
    let b = DeviceBuffer::<u8>::alloc(&ctx, groups * n * k).unwrap();
    let s = DeviceScalar::new(&stream, 1.0).unwrap();
    let scales2 = DeviceBuffer::<f32>::from_host(&stream, &[1.0, 2.0]).unwrap();
    let offsets = DeviceBuffer::<i32>::from_host(&stream, &[0, 128, 128, 256]).unwrap();
    let offsets_short = DeviceBuffer::<i32>::from_host(&stream, &[0, 128, 256]).unwrap();
    let bias = DeviceBuffer::<f32>::alloc(&ctx, n).unwrap();
    let mut d = Out::new(&ctx, DType::F32, capacity * n);
    d.poison(&stream);
    // wgrad with m = n, n = k: A [n, capacity], B [k, capacity], D [groups, n, k].
    let wa = DeviceBuffer::<u8>::alloc(&ctx, n * capacity).unwrap();
    let wb = DeviceBuffer::<u8>::alloc(&ctx, k * capacity).unwrap();
    let mut dw = Out::new(&ctx, DType::F32, groups * n * k);
    dw.poison(&stream);
    let op = |data| Operand {
        data,
        format: E4,
        scale_inv: &s,
    };
    let portable = GemmOptions::new().path(GemmPath::Portable);
    let fwd = |shape: PackedShape, b: GroupedOperand<'_>, offs, opts| {
        grouped_gemm_packed(&stream, shape, op(&a), b, d.view(), offs, opts)
    };
    let shape = PackedShape {
        groups,
        capacity,
        n,
        k,
    };
    let wshape = WgradShape {
        groups,
        capacity,
        m: n,
        n: k,
    };
    let wgrad = |shape: WgradShape, offs, opts| {
        grouped_gemm_wgrad(&stream, shape, op(&wa), op(&wb), dw.view(), offs, opts)
    };
    let results: Vec<(&str, &str, Result<()>)> = vec![
        (
            "offsets of groups entries",
            "offsets has 3",
            fwd(shape, op(&b).into(), &offsets_short, portable),
        ),
        (
            "capacity not a multiple of 128",
            "capacity = 200",
            fwd(
                PackedShape {
                    capacity: 200,
                    ..shape
                },
                op(&b).into(),
                &offsets,
                portable,
            ),
        ),
        (
            "K not a multiple of 16",
            "K = 40",
            fwd(
                PackedShape { k: 40, ..shape },
                op(&b).into(),
                &offsets,
                portable,
            ),
        ),
        (
            "groups = 0",
            "groups = 0",
            fwd(
                PackedShape { groups: 0, ..shape },
                op(&b).into(),
                &offsets,
                portable,
            ),
        ),
        (
            "B of the wrong group count",
            "B has",
            fwd(
                PackedShape { groups: 2, ..shape },
                op(&b).into(),
                &offsets_short,
                portable,
            ),
        ),
        (
            "per-group scales of the wrong length",
            "B scales has 2",
            fwd(
                shape,
                GroupedOperand::per_group(&b, E4, &scales2),
                &offsets,
                portable,
            ),
        ),
        (
            "wgrad with a bias",
            "bias",
            wgrad(wshape, &offsets, portable.bias(&bias)),
        ),
        (
            "wgrad offsets of groups entries",
            "offsets has 3",
            wgrad(wshape, &offsets_short, portable),
        ),
        (
            "wgrad capacity not a multiple of 16",
            "capacity = 250",
            wgrad(
                WgradShape {
                    capacity: 250,
                    ..wshape
                },
                &offsets,
                portable,
            ),
        ),
    ];
    for (what, fragment, res) in results {
        match res {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains(fragment), "{what}: {msg:?} lacks {fragment:?}")
            }
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    stream.synchronize().unwrap();
    assert!(
        d.bits(&stream).iter().all(|&x| x == u32::MAX),
        "a rejected call wrote D"
    );
    assert!(
        dw.bits(&stream).iter().all(|&x| x == u32::MAX),
        "a rejected call wrote the wgrad D"
    );
}

/// CPU: the test's own layout helper gives offsets that are multiples of ALIGN_ROWS, and
/// `packed_rows` returns them unchanged with the real rows first in each range.
#[test]
fn layout_from_counts() {
    let lay = Rows::Counts {
        counts: vec![0, 300, 0, 129, 0],
        slack: 2,
    }
    .layout();
    assert_eq!(lay.offsets, vec![0, 0, 384, 384, 640, 640]);
    assert_eq!(lay.capacity, 640 + 256);
    assert_eq!(
        packed_rows(&lay.offsets, lay.capacity),
        vec![0..0, 0..384, 384..384, 384..640, 640..640]
    );
    let x = packed_data(&mut Rng::new(1), &lay, 16, E4);
    // Row 299 real, rows 300..384 padding, 640.. don't-care.
    assert!(x[299 * 16..300 * 16].iter().any(|&b| b != 0));
    assert!(x[300 * 16..384 * 16].iter().all(|&b| b == 0));
    assert!(x[640 * 16..].iter().all(|&b| b == DONT_CARE));
    assert!(r::decode(DONT_CARE, E4).is_nan() && r::decode(DONT_CARE, E5).is_nan());
    assert_eq!(transpose(&[1, 2, 3, 4, 5, 6], 2, 3), vec![1, 4, 2, 5, 3, 6]);
}

/// Times both packed GEMMs at an MoE-like size (prints ms and TFLOP/s over the rows the
/// offsets hold; no bound asserted) and checks the outputs are finite.
#[test]
#[ignore = "needs a CUDA device"]
fn packed_throughput() {
    let (ctx, stream) = setup();
    // 8 experts, 8192 rows in all (skewed), hidden 2048, expert width 4096.
    let counts = [2048usize, 1024, 1536, 512, 1024, 768, 640, 640];
    let lay = Rows::Counts {
        counts: counts.to_vec(),
        slack: 0,
    }
    .layout();
    let (groups, cap, n, k) = (counts.len(), lay.capacity, 4096usize, 2048usize);
    let rows = *lay.offsets.last().unwrap() as usize;
    let mut rng = Rng::new(11);
    let x = DeviceBuffer::from_host(&stream, &rng.bytes(cap * k, E4)).unwrap();
    let w = DeviceBuffer::from_host(&stream, &rng.bytes(groups * n * k, E4)).unwrap();
    let dyt = DeviceBuffer::from_host(&stream, &rng.bytes(n * cap, E5)).unwrap();
    let xt = DeviceBuffer::from_host(&stream, &rng.bytes(k * cap, E4)).unwrap();
    let offsets = DeviceBuffer::from_host(&stream, &lay.offsets).unwrap();
    let s = DeviceScalar::new(&stream, 1.0).unwrap();
    let y = Out::new(&ctx, DType::Bf16, cap * n);
    let dw = Out::new(&ctx, DType::F32, groups * n * k);
    let op = |data, format| Operand {
        data,
        format,
        scale_inv: &s,
    };
    let opts = GemmOptions::new().path(GemmPath::Portable);
    let fwd = || {
        grouped_gemm_packed(
            &stream,
            PackedShape {
                groups,
                capacity: cap,
                n,
                k,
            },
            op(&x, E4),
            op(&w, E4),
            y.view(),
            &offsets,
            opts,
        )
        .unwrap()
    };
    let wgrad = || {
        grouped_gemm_wgrad(
            &stream,
            WgradShape {
                groups,
                capacity: cap,
                m: n,
                n: k,
            },
            op(&dyt, E5),
            op(&xt, E4),
            dw.view(),
            &offsets,
            opts,
        )
        .unwrap()
    };
    let flop = 2.0 * (rows * n * k) as f64;
    for (name, run) in [
        ("packed forward", &fwd as &dyn Fn()),
        ("packed wgrad", &wgrad),
    ] {
        run();
        stream.synchronize().unwrap();
        let iters = 10;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            run();
        }
        stream.synchronize().unwrap();
        let secs = t.elapsed().as_secs_f64() / f64::from(iters);
        println!(
            "{name} {groups} groups, {rows} rows, n {n}, k {k}: {:.3} ms, {:.1} TFLOP/s",
            secs * 1e3,
            flop / secs / 1e12
        );
    }
    let finite = |o: &Out| {
        o.bits(&stream)
            .iter()
            .all(|&b| r::widen(b, o.dtype()).is_finite())
    };
    assert!(
        finite(&y) && finite(&dw),
        "output left poisoned or not finite"
    );
}

/// [`GemmOptions::max_sms`]: the packed GEMM and the weight gradient on 1, 3 and 7 SMs
/// (each CTA then walks many tiles; 7 also leaves a CTA fewer tiles than its neighbours)
/// hold the fp64 reference like the full grid; a captured launch has exactly the capped
/// grid (the uncapped one: a CTA per SM, or per tile); `max_sms(0)` is refused with nothing
/// written. The portable kernels (one CTA a tile) ignore the cap; on a device other than
/// compute capability 9.0 they run these cases.
#[test]
#[ignore = "needs a CUDA device"]
fn max_sms_caps_the_persistent_grid() {
    let (ctx, stream) = setup();
    let hopper = ctx.device().compute_capability().unwrap() == (9, 0);
    let path = if hopper {
        GemmPath::Hopper
    } else {
        GemmPath::Portable
    };
    for sms in [1, 3, 7] {
        for out in [DType::F32, DType::Bf16] {
            check_fwd(
                &ctx,
                &stream,
                &Fwd {
                    out,
                    path,
                    max_sms: Some(sms),
                    ..Fwd::new("max_sms", &[300, 0, 129, 64], 392, 256)
                },
            );
            check_wg(
                &ctx,
                &stream,
                &Wg {
                    out,
                    path,
                    max_sms: Some(sms),
                    ..Wg::new("max_sms", &[200, 130, 0, 100], 264, 136)
                },
            );
        }
    }
    // The captured grids.
    let c = Fwd {
        path,
        ..Fwd::new("grid", &[300, 0, 129, 64], 392, 256)
    };
    let run = FwdRun::new(&stream, &c);
    let d = Out::new(&ctx, c.out, run.host.lay.capacity * c.n);
    let grid = |max_sms: Option<usize>| {
        let graph = common::capture(&ctx, &stream, || {
            run.launch(
                &stream,
                &Fwd {
                    max_sms,
                    ..c.clone()
                },
                &d,
            )
        });
        let kernels: Vec<_> = graph
            .nodes()
            .unwrap()
            .into_iter()
            .filter(|n| n.kind == cuda_graph::NodeKind::Kernel)
            .map(|n| cuda_graph::KernelNode::try_from(n).unwrap())
            .collect();
        assert_eq!(kernels.len(), 1, "one kernel node");
        graph.kernel_grid(&kernels[0]).unwrap()
    };
    if hopper {
        let all = ctx.device().multiprocessor_count().unwrap() as u32;
        let tiles = (run.host.lay.capacity.div_ceil(128) * c.n.div_ceil(128)) as u32;
        assert_eq!(grid(Some(3)), (3, 1, 1), "3 SMs");
        assert_eq!(
            grid(Some(100_000)).0,
            grid(None).0,
            "a cap above the device's"
        );
        assert!(
            grid(None).0 <= all.min(tiles) && grid(None).0 > 3,
            "{:?}",
            grid(None)
        );
    } else {
        assert_eq!(
            grid(Some(3)),
            grid(None),
            "the portable kernel ignores the cap"
        );
    }
    // max_sms = 0: refused, D untouched.
    let (d, _, before) = prepared_d(&ctx, &stream, c.out, run.host.lay.capacity * c.n, None);
    let err = run
        .launch(
            &stream,
            &Fwd {
                max_sms: Some(0),
                ..c.clone()
            },
            &d,
        )
        .expect_err("max_sms = 0");
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("max_sms")),
        "{err}"
    );
    stream.synchronize().unwrap();
    assert!(d.bits(&stream) == before, "a refused GEMM wrote D");
    let wc = Wg {
        max_sms: Some(0),
        path,
        ..Wg::new("zero", &[200, 130], 72, 80)
    };
    let wrun = WgRun::new(&stream, &wc);
    let (d, _, before) = prepared_d(&ctx, &stream, wc.out, 2 * 72 * 80, None);
    assert!(matches!(
        wrun.launch(&stream, &wc, &d),
        Err(Error::InvalidArgument(_))
    ));
    stream.synchronize().unwrap();
    assert!(
        d.bits(&stream) == before,
        "a refused weight gradient wrote D"
    );
}
