//! [`Block`]: one transformer block, `h -> h + attn(norm1(h)) -> h' + moe(norm2(h'))`, as a
//! [`Callable<bf16>`] of the graphed-callables runtime (and run eagerly through the same
//! methods).
//!
//! Forward, over a microbatch of `T = batch * seq` tokens of width `d`:
//!
//! ```text
//! n1 = rmsnorm(h0) w1           qkv = n1 Wqkv^T        o = attention(qkv)
//! h1 = h0 + o Wo^T              n2 = rmsnorm(h1) w2    h2 = h1 + moe(n2)
//! ```
//!
//! The residual stream is bf16 (Megatron's default); every op computes in f32 and rounds
//! once. The projections are [`Dense`] FP8 layers and the MoE is a [`MoeLayer`] whose FP8
//! expert weights come from its optimizer. Weight gradients follow the step-gradient rule of
//! the MoE layer: microbatch 0 of a step writes them, later microbatches add.
//!
//! What a microbatch's backward reads from its forward lives in the slot's saved buffers
//! ([`Callable::saved_bytes`]): the norms' `rstd`, the projections' FP8 `X^T` and scales,
//! `qkv`, the attention output and its log-sum-exp, `h1`, `n2`, the MoE's output and the
//! MoE's own saved buffers. Everything else is per-block scratch that one pass uses at a
//! time.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, Result, Stream};
use fp8_kernels::{AdamW, DelayedScaling, DeviceScalar};
use graphed_callables::{Callable, SegmentKind, Slot};

use super::attention::{Attention, AttentionShape};
use super::config::ModelConfig;
use super::dense::{Dense, DenseSaved};
use super::ops::{Ops, rmsnorm_backward_workspace_len};
use crate::moe::ep::{ExpertGroup, ExpertParallelMoe};
use crate::moe::layer::{ExpertGemm, MoeLayer, MoeLayerConfig};
use crate::moe::optim::MoeAdamW;
use crate::zeroed;

/// The saved buffers of a block's pass, before the MoE layer's own.
const OWN_SAVED: usize = 12;
/// Indices into the saved buffers.
const RSTD1: usize = 0;
const QKV_XT: usize = 1;
const QKV_SI: usize = 2;
const QKV: usize = 3;
const ATT_O: usize = 4;
const LSE: usize = 5;
const PROJ_XT: usize = 6;
const PROJ_SI: usize = 7;
const H1: usize = 8;
const RSTD2: usize = 9;
const N2: usize = 10;
const MOE_OUT: usize = 11;

/// An RMSNorm's weight and its gradient (f32, `[d]`).
#[derive(Debug)]
pub struct Norm {
    /// The weight.
    pub w: DeviceBuffer<f32>,
    /// Its gradient.
    pub dw: DeviceBuffer<f32>,
}

impl Norm {
    /// A norm of `w` with a zeroed gradient.
    pub fn new(stream: &Stream, w: &[f32]) -> Result<Norm> {
        Ok(Norm {
            w: DeviceBuffer::from_host(stream, w)?,
            dw: zeroed(stream, w.len())?,
        })
    }
}

/// Per-block scratch (one pass at a time).
#[derive(Debug)]
struct Scratch {
    /// `[T, d]`: norm1's output (the QKV input), then the projection's output.
    n1: DeviceBuffer<bf16>,
    proj: DeviceBuffer<bf16>,
    /// Backward: `[T, d]` gradients of n2, h1, the attention output and n1; `[T, 3d]` of qkv.
    dn2: DeviceBuffer<bf16>,
    dh1: DeviceBuffer<bf16>,
    d_o: DeviceBuffer<bf16>,
    dn1: DeviceBuffer<bf16>,
    dqkv: DeviceBuffer<bf16>,
    norm_ws: DeviceBuffer<f32>,
    attn_ws: DeviceBuffer<f32>,
}

/// One transformer block; see the [module documentation](self).
#[derive(Debug)]
pub struct Block {
    cfg: ModelConfig,
    ops: Arc<Ops>,
    attention: Arc<Attention>,
    /// The norms before attention and before the MoE layer.
    pub norm1: Norm,
    /// See `norm1`.
    pub norm2: Norm,
    /// `[3d, d]`: q, k, v.
    pub qkv: Dense,
    /// `[d, d]`: attention's output projection.
    pub proj: Dense,
    /// The MoE layer.
    pub moe: BlockMoe,
    scratch: Scratch,
    /// Fast accumulation in the projections' forward GEMMs.
    fast_forward: bool,
}

/// A block's MoE layer: all experts on this GPU, or this rank's part of an expert-parallel
/// layer. Both run as [`Callable`]s; the optimizer writes their FP8 expert weights.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per block, never moved in bulk
pub enum BlockMoe {
    /// Every expert here.
    Local(MoeLayer),
    /// `E / N` experts here, the rest on the other ranks of the group; full-layer
    /// ([`ExpertGemm::Grouped`], as [`Block::new_expert_parallel`] makes it: the block's
    /// segments follow the MoE layer's, and only the local layer's per-expert mode splits
    /// them around eager experts).
    ExpertParallel(ExpertParallelMoe),
}

impl BlockMoe {
    /// The whole layer's shape (under expert parallelism: this rank's tokens, every rank's
    /// experts).
    pub fn config(&self) -> MoeLayerConfig {
        match self {
            BlockMoe::Local(m) => m.config(),
            BlockMoe::ExpertParallel(m) => m.config(),
        }
    }

    /// The layer as the runtime drives it.
    fn callable(&self) -> &dyn Callable<bf16> {
        match self {
            BlockMoe::Local(m) => m,
            BlockMoe::ExpertParallel(m) => m,
        }
    }

    fn callable_mut(&mut self) -> &mut dyn Callable<bf16> {
        match self {
            BlockMoe::Local(m) => m,
            BlockMoe::ExpertParallel(m) => m,
        }
    }

    /// The layer's optimizer (AdamW with `hyper`; it writes the FP8 expert weights).
    pub fn optimizer(&self, stream: &Stream, hyper: AdamW) -> Result<MoeAdamW> {
        match self {
            BlockMoe::Local(m) => MoeAdamW::new(stream, m, hyper),
            BlockMoe::ExpertParallel(m) => MoeAdamW::new_expert_parallel(stream, m, hyper),
        }
    }
}

/// The initial weights of a block (host, f32).
#[derive(Debug, Clone)]
pub struct BlockParams {
    /// `[3d, d]`.
    pub wqkv: Vec<f32>,
    /// `[d, d]`.
    pub wo: Vec<f32>,
    /// The MoE layer's.
    pub moe: crate::moe::layer::MoeParams,
}

/// The tensors a block uses in the scaling state: QKV's three, the projection's three, then
/// the MoE layer's.
pub fn scaling_tensors(cfg: &ModelConfig) -> usize {
    scaling_tensors_per_rank(cfg, 1)
}

/// [`scaling_tensors`] of one rank's block when the experts are spread over `ranks` ranks
/// ([`Block::new_expert_parallel`]): the MoE layer's tensors are those of `E / ranks`
/// experts.
pub fn scaling_tensors_per_rank(cfg: &ModelConfig, ranks: usize) -> usize {
    2 * crate::linear::TENSORS + crate::moe::layer::tensors(cfg.experts / ranks.max(1))
}

impl Block {
    /// A block of `cfg` built from `params` (norm weights start at 1), using tensors
    /// `first_tensor .. first_tensor + `[`scaling_tensors`] of `scaling`, with the MoE
    /// layer's expert GEMMs run as `expert_gemm`. Allocates and uploads (not in a capture).
    pub fn new(
        stream: &Stream,
        cfg: &ModelConfig,
        params: &BlockParams,
        (ops, attention): (Arc<Ops>, Arc<Attention>),
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
        expert_gemm: ExpertGemm,
    ) -> Result<Block> {
        Block::build(
            stream,
            cfg,
            params,
            (ops, attention),
            scaling,
            first_tensor,
            (expert_gemm, None),
        )
    }

    /// [`new`](Self::new) for one rank of an expert-parallel model: the MoE layer is this
    /// rank's part of an [`ExpertParallelMoe`] over `group` (full-layer, grouped GEMMs), its
    /// experts' slices taken from `params` (all `E` experts' weights, the same on every
    /// rank), its tensors `first_tensor .. first_tensor + `[`scaling_tensors_per_rank`]. The
    /// rest of the block is replicated. Every rank of the group runs each pass at once.
    ///
    /// Errors: as [`new`](Self::new), and [`check_split`](crate::moe::ep::check_split)'s.
    pub fn new_expert_parallel(
        stream: &Stream,
        cfg: &ModelConfig,
        params: &BlockParams,
        (ops, attention): (Arc<Ops>, Arc<Attention>),
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
        group: Arc<dyn ExpertGroup>,
    ) -> Result<Block> {
        Block::build(
            stream,
            cfg,
            params,
            (ops, attention),
            scaling,
            first_tensor,
            (ExpertGemm::Grouped, Some(group)),
        )
    }

    fn build(
        stream: &Stream,
        cfg: &ModelConfig,
        params: &BlockParams,
        (ops, attention): (Arc<Ops>, Arc<Attention>),
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
        (expert_gemm, group): (ExpertGemm, Option<Arc<dyn ExpertGroup>>),
    ) -> Result<Block> {
        cfg.check()?;
        let (t, d) = (cfg.tokens(), cfg.d_model);
        let ones = vec![1.0f32; d];
        let qkv = Dense::new(
            stream,
            (t, d, 3 * d),
            &params.wqkv,
            scaling.clone(),
            first_tensor,
        )?;
        let proj = Dense::new(
            stream,
            (t, d, d),
            &params.wo,
            scaling.clone(),
            first_tensor + crate::linear::TENSORS,
        )?;
        let moe_cfg = crate::moe::layer::MoeLayerConfig {
            tokens: t,
            hidden: d,
            ffn: cfg.ffn,
            experts: cfg.experts,
            router: crate::moe::routing::RouterConfig {
                top_k: cfg.top_k,
                aux_coef: cfg.aux_coef,
                ..Default::default()
            },
            recipe: crate::moe::layer::Fp8Recipe::Hybrid,
            expert_gemm,
            scaling: Default::default(),
            grad_dtype: crate::moe::layer::GradDtype::Bf16,
        };
        let moe_first = first_tensor + 2 * crate::linear::TENSORS;
        let moe = match group {
            None => BlockMoe::Local(
                MoeLayer::new(stream, moe_cfg, &params.moe, scaling, moe_first)?
                    .with_step_gradients(true)
                    .with_fp8_weights_from_optimizer(stream, true)?,
            ),
            Some(group) => BlockMoe::ExpertParallel(
                ExpertParallelMoe::new(stream, moe_cfg, &params.moe, scaling, moe_first, group)?
                    .with_step_gradients(true)
                    .with_fp8_weights_from_optimizer(stream, true)?,
            ),
        };
        let act = |n: usize| zeroed::<bf16>(stream, n);
        let shape = attention_shape(cfg);
        let scratch = Scratch {
            n1: act(t * d)?,
            proj: act(t * d)?,
            dn2: act(t * d)?,
            dh1: act(t * d)?,
            d_o: act(t * d)?,
            dn1: act(t * d)?,
            dqkv: act(3 * t * d)?,
            norm_ws: zeroed(stream, rmsnorm_backward_workspace_len(t, d).max(1))?,
            attn_ws: zeroed(stream, Attention::backward_workspace_len(shape).max(1))?,
        };
        Ok(Block {
            cfg: *cfg,
            ops,
            attention,
            norm1: Norm::new(stream, &ones)?,
            norm2: Norm::new(stream, &ones)?,
            qkv,
            proj,
            moe,
            scratch,
            fast_forward: true,
        })
    }

    /// This block with the projections' and the MoE's forward GEMMs accumulating fast (the
    /// default, TransformerEngine's) or promoted.
    pub fn with_fast_forward_accumulation(mut self, on: bool) -> Block {
        self.fast_forward = on;
        self.moe = match self.moe {
            BlockMoe::Local(m) => BlockMoe::Local(m.with_fast_forward_accumulation(on)),
            BlockMoe::ExpertParallel(m) => {
                BlockMoe::ExpertParallel(m.with_fast_forward_accumulation(on))
            }
        };
        self
    }

    /// The f32 gradients of the block's dense parameters, with names: the norms, QKV, the
    /// projection.
    pub fn dense_params(&self) -> [(&'static str, &DeviceBuffer<f32>, &DeviceBuffer<f32>); 4] {
        [
            ("norm1", &self.norm1.w, &self.norm1.dw),
            ("norm2", &self.norm2.w, &self.norm2.dw),
            ("wqkv", self.qkv.weight(), self.qkv.weight_grad()),
            ("wo", self.proj.weight(), self.proj.weight_grad()),
        ]
    }

    /// The saved-buffer sizes in bytes (the block's own, then the MoE layer's).
    fn saved_sizes(&self) -> Vec<usize> {
        let (t, d, h) = (self.cfg.tokens(), self.cfg.d_model, self.cfg.heads);
        let mut s = vec![0; OWN_SAVED];
        s[RSTD1] = 4 * t;
        s[QKV_XT] = t * d;
        s[QKV_SI] = 4;
        s[QKV] = 2 * t * 3 * d;
        s[ATT_O] = 2 * t * d;
        s[LSE] = 4 * t * h;
        s[PROJ_XT] = t * d;
        s[PROJ_SI] = 4;
        s[H1] = 2 * t * d;
        s[RSTD2] = 4 * t;
        s[N2] = 2 * t * d;
        s[MOE_OUT] = 2 * t * d;
        s.extend(self.moe.callable().saved_bytes());
        s
    }

    /// Whether microbatch `slot`'s weight gradients add to the step's (microbatch 0 writes).
    fn accumulate(slot: &Slot<'_, bf16>) -> bool {
        slot.at().microbatch != 0
    }

    /// The pass's forward input and output, checked.
    fn io<'a>(
        &self,
        what: &str,
        a: &[&'a DeviceBuffer<bf16>],
        b: &[&'a DeviceBuffer<bf16>],
    ) -> Result<(&'a DeviceBuffer<bf16>, &'a DeviceBuffer<bf16>)> {
        let n = self.cfg.tokens() * self.cfg.d_model;
        match (a, b) {
            ([x], [y]) if x.len() == n && y.len() == n => Ok((x, y)),
            _ => Err(Error::InvalidArgument(format!(
                "Block {what}: takes one buffer of {n} elements in and out, got lengths {:?} \
                 and {:?}",
                a.iter().map(|x| x.len()).collect::<Vec<_>>(),
                b.iter().map(|x| x.len()).collect::<Vec<_>>()
            ))),
        }
    }

    /// Typed views of the slot's saved buffers.
    fn saved(&self, slot: &Slot<'_, bf16>) -> Result<Saved> {
        let s = slot.saved();
        let want = self.saved_sizes();
        if s.len() != want.len() || s.iter().zip(&want).any(|(b, &n)| b.len() != n) {
            return Err(Error::InvalidArgument(format!(
                "Block at {}: saved buffers of {:?} bytes, the block needs {want:?}",
                slot.at(),
                s.iter().map(|b| b.len()).collect::<Vec<_>>()
            )));
        }
        let f32s = |i: usize| s[i].reinterpret::<f32>();
        let bf16s = |i: usize| s[i].reinterpret::<bf16>();
        let dense = |xt: usize, si: usize| -> Result<DenseSaved> {
            Ok(DenseSaved {
                x_t: s[xt].share(),
                x_si: DeviceScalar::at(&f32s(si)?, 0)?,
            })
        };
        Ok(Saved {
            rstd1: f32s(RSTD1)?,
            qkv_in: dense(QKV_XT, QKV_SI)?,
            qkv: bf16s(QKV)?,
            o: bf16s(ATT_O)?,
            lse: f32s(LSE)?,
            proj_in: dense(PROJ_XT, PROJ_SI)?,
            h1: bf16s(H1)?,
            rstd2: f32s(RSTD2)?,
            n2: bf16s(N2)?,
            moe_out: bf16s(MOE_OUT)?,
        })
    }

    /// Forward up to the MoE layer: norm1, QKV, attention, projection, `h1`, norm2.
    fn forward_attention(&self, stream: &Stream, h0: &DeviceBuffer<bf16>, s: &Saved) -> Result<()> {
        let sc = &self.scratch;
        let eps = self.cfg.norm_eps;
        self.ops
            .rmsnorm_forward(stream, h0, &self.norm1.w, &sc.n1, &s.rstd1, eps)?;
        self.qkv
            .forward(stream, &sc.n1, &s.qkv, &s.qkv_in, self.fast_forward)?;
        let shape = attention_shape(&self.cfg);
        self.attention
            .forward(stream, shape, attention_scale(), &s.qkv, &s.o, &s.lse)?;
        self.proj
            .forward(stream, &s.o, &sc.proj, &s.proj_in, self.fast_forward)?;
        self.ops.add(stream, h0, &sc.proj, &s.h1)?;
        self.ops
            .rmsnorm_forward(stream, &s.h1, &self.norm2.w, &s.n2, &s.rstd2, eps)
    }

    /// Backward from `dn2` (the MoE input's gradient) and `dh2`: norm2, projection,
    /// attention, QKV, norm1, into `dh0`.
    fn backward_attention(
        &self,
        stream: &Stream,
        h0: &DeviceBuffer<bf16>,
        dh2: &DeviceBuffer<bf16>,
        dh0: &DeviceBuffer<bf16>,
        s: &Saved,
        accumulate: bool,
    ) -> Result<()> {
        let sc = &self.scratch;
        self.ops.rmsnorm_backward(
            stream,
            &s.h1,
            &self.norm2.w,
            &s.rstd2,
            &sc.dn2,
            Some(dh2),
            &sc.dh1,
            &self.norm2.dw,
            accumulate,
            &sc.norm_ws,
        )?;
        self.proj
            .backward(stream, &sc.dh1, Some(&sc.d_o), &s.proj_in, accumulate)?;
        let shape = attention_shape(&self.cfg);
        self.attention.backward(
            stream,
            shape,
            attention_scale(),
            &s.qkv,
            &s.o,
            &s.lse,
            &sc.d_o,
            &sc.dqkv,
            &sc.attn_ws,
        )?;
        self.qkv
            .backward(stream, &sc.dqkv, Some(&sc.dn1), &s.qkv_in, accumulate)?;
        self.ops.rmsnorm_backward(
            stream,
            h0,
            &self.norm1.w,
            &s.rstd1,
            &sc.dn1,
            Some(&sc.dh1),
            dh0,
            &self.norm1.dw,
            accumulate,
            &sc.norm_ws,
        )
    }

    /// The MoE layer's slot: input n2, output the MoE's output, its own saved buffers.
    fn moe_slot<'b>(slot: &'b Slot<'_, bf16>, s: &'b Saved) -> Slot<'b, bf16> {
        slot.with_buffers(
            vec![&s.n2],
            vec![&s.moe_out],
            slot.saved()[OWN_SAVED..].to_vec(),
        )
    }
}

/// Typed views of one pass's saved buffers.
struct Saved {
    rstd1: DeviceBuffer<f32>,
    qkv_in: DenseSaved,
    qkv: DeviceBuffer<bf16>,
    o: DeviceBuffer<bf16>,
    lse: DeviceBuffer<f32>,
    proj_in: DenseSaved,
    h1: DeviceBuffer<bf16>,
    rstd2: DeviceBuffer<f32>,
    n2: DeviceBuffer<bf16>,
    moe_out: DeviceBuffer<bf16>,
}

/// The attention shape of a microbatch of `cfg`.
pub fn attention_shape(cfg: &ModelConfig) -> AttentionShape {
    AttentionShape {
        batch: cfg.batch,
        seq: cfg.context,
        heads: cfg.heads,
        head_dim: super::config::HEAD_DIM,
    }
}

/// `1 / sqrt(head_dim)`.
fn attention_scale() -> f32 {
    1.0 / (super::config::HEAD_DIM as f32).sqrt()
}

impl Callable<bf16> for Block {
    fn input_lens(&self) -> Vec<usize> {
        vec![self.cfg.tokens() * self.cfg.d_model]
    }

    fn output_lens(&self) -> Vec<usize> {
        self.input_lens()
    }

    fn saved_bytes(&self) -> Vec<usize> {
        self.saved_sizes()
    }

    /// Casts QKV's and the projection's FP8 weights (the MoE layer's come from its
    /// optimizer); skipped on the device when the slot's noop flag reads 1.0.
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, bf16>) -> Result<()> {
        let noop = slot
            .skip_weight_cast()
            .map(|f| DeviceScalar::at(f, 0))
            .transpose()?;
        slot.record_tensors([self.qkv.first_tensor() + 1, self.proj.first_tensor() + 1]);
        self.qkv.cast_weight(stream, noop.as_ref())?;
        self.proj.cast_weight(stream, noop.as_ref())
    }

    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        let (h0, h2) = self.io("forward", inputs, outputs)?;
        let s = self.saved(slot)?;
        self.record_activations(slot);
        self.forward_attention(stream, h0, &s)?;
        let moe_slot = Self::moe_slot(slot, &s);
        self.moe
            .callable_mut()
            .forward(stream, &[&s.n2], &[&s.moe_out], &moe_slot)?;
        self.ops.add(stream, &s.h1, &s.moe_out, h2)
    }

    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        let (dh2, dh0) = self.io("backward", grad_outputs, grad_inputs)?;
        let h0 = self.forward_input(slot)?;
        let s = self.saved(slot)?;
        self.record_gradients(slot);
        let moe_slot = Self::moe_slot(slot, &s);
        self.moe
            .callable_mut()
            .backward(stream, &[dh2], &[&self.scratch.dn2], &moe_slot)?;
        self.backward_attention(stream, h0, dh2, dh0, &s, Self::accumulate(slot))
    }

    /// The MoE layer's: one graphed segment (grouped experts), or three (per-expert: the
    /// experts eager, reading the routing back).
    fn forward_segments(&self) -> Vec<SegmentKind> {
        self.moe.callable().forward_segments()
    }

    fn backward_segments(&self) -> Vec<SegmentKind> {
        self.moe.callable().backward_segments()
    }

    fn forward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        if self.moe.config().expert_gemm == ExpertGemm::Grouped {
            return match segment {
                0 => self.forward(stream, inputs, outputs, slot),
                _ => Err(self.segment_error(slot, "forward", segment)),
            };
        }
        let (h0, h2) = self.io("forward", inputs, outputs)?;
        let s = self.saved(slot)?;
        let moe_slot = Self::moe_slot(slot, &s);
        match segment {
            0 => {
                self.record_activations(slot);
                self.forward_attention(stream, h0, &s)?;
                self.moe.callable_mut().forward_segment(
                    0,
                    stream,
                    &[&s.n2],
                    &[&s.moe_out],
                    &moe_slot,
                )
            }
            2 => {
                self.moe.callable_mut().forward_segment(
                    2,
                    stream,
                    &[&s.n2],
                    &[&s.moe_out],
                    &moe_slot,
                )?;
                self.ops.add(stream, &s.h1, &s.moe_out, h2)
            }
            _ => Err(self.segment_error(slot, "forward", segment)),
        }
    }

    fn forward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.io("forward", inputs, outputs)?;
        let s = self.saved(slot)?;
        let moe_slot = Self::moe_slot(slot, &s);
        self.moe
            .callable()
            .forward_eager(segment, stream, &[&s.n2], &[&s.moe_out], &moe_slot)
    }

    fn backward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        if self.moe.config().expert_gemm == ExpertGemm::Grouped {
            return match segment {
                0 => self.backward(stream, grad_outputs, grad_inputs, slot),
                _ => Err(self.segment_error(slot, "backward", segment)),
            };
        }
        let (dh2, dh0) = self.io("backward", grad_outputs, grad_inputs)?;
        let s = self.saved(slot)?;
        let moe_slot = Self::moe_slot(slot, &s);
        let dn2 = &self.scratch.dn2;
        match segment {
            0 => {
                self.record_gradients(slot);
                self.moe
                    .callable_mut()
                    .backward_segment(0, stream, &[dh2], &[dn2], &moe_slot)
            }
            2 => {
                self.moe
                    .callable_mut()
                    .backward_segment(2, stream, &[dh2], &[dn2], &moe_slot)?;
                let h0 = self.forward_input(slot)?;
                self.backward_attention(stream, h0, dh2, dh0, &s, Self::accumulate(slot))
            }
            _ => Err(self.segment_error(slot, "backward", segment)),
        }
    }

    fn backward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        let (dh2, _) = self.io("backward", grad_outputs, grad_inputs)?;
        let s = self.saved(slot)?;
        let moe_slot = Self::moe_slot(slot, &s);
        self.moe
            .callable()
            .backward_eager(segment, stream, &[dh2], &[&self.scratch.dn2], &moe_slot)
    }
}

impl Block {
    /// Reports the projections' activation tensors (x) to warmup's recorder.
    fn record_activations(&self, slot: &Slot<'_, bf16>) {
        slot.record_tensors([self.qkv.first_tensor(), self.proj.first_tensor()]);
    }

    /// Reports the projections' gradient tensors (dY).
    fn record_gradients(&self, slot: &Slot<'_, bf16>) {
        slot.record_tensors([self.qkv.first_tensor() + 2, self.proj.first_tensor() + 2]);
    }

    /// The microbatch's forward input, which the backward's norm1 reads.
    fn forward_input<'a>(&self, slot: &Slot<'a, bf16>) -> Result<&'a DeviceBuffer<bf16>> {
        match slot.inputs() {
            [x] => Ok(x),
            i => Err(Error::InvalidArgument(format!(
                "Block at {}: the slot has {} forward inputs, the block one",
                slot.at(),
                i.len()
            ))),
        }
    }

    fn segment_error(&self, slot: &Slot<'_, bf16>, pass: &str, segment: usize) -> Error {
        Error::InvalidArgument(format!(
            "Block at {}: {pass} segment {segment} is not one of its graphed segments",
            slot.at()
        ))
    }
}
