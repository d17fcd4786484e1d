// The one translation unit of the crate's fatbin: every kernel family's header.
// build.rs compiles this file alone; add a family by including its .cuh here.
#include "common.cuh"
#include "quantize.cuh"
#include "scaling.cuh"
#include "cast_transpose.cuh"
#include "moe_cast.cuh"
#include "block_scale.cuh"
#include "adamw.cuh"
#include "gemm_sm90.cuh"
#include "gemm_mma.cuh"
