//! FP8 formats and the high-precision element types the kernels read and write.

/// An 8-bit floating-point format (OCP FP8, as Hopper implements it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits; max finite 448; no infinities; NaN is
    /// `S.1111.111`. For forward tensors (weights, activations).
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits; max finite 57344; IEEE-style inf and NaN.
    /// For gradients.
    E5M2,
}

impl Fp8Format {
    /// Both formats, for loops in tests and benchmarks.
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// The largest finite value: 448 or 57344.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The bit pattern of the largest finite positive value (0x7E or 0x7B).
    pub const fn max_finite_bits(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7e,
            Fp8Format::E5M2 => 0x7b,
        }
    }

    /// The smallest positive normal value: 2^-6 or 2^-14.
    pub fn min_normal(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 2f32.powi(-6),
            Fp8Format::E5M2 => 2f32.powi(-14),
        }
    }

    /// The smallest positive subnormal value: 2^-9 or 2^-16.
    pub fn min_subnormal(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 2f32.powi(-9),
            Fp8Format::E5M2 => 2f32.powi(-16),
        }
    }

    /// Exponent bits.
    pub const fn exponent_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 4,
            Fp8Format::E5M2 => 5,
        }
    }

    /// Explicit mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// Exponent bias.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// Whether a byte is NaN in this format.
    pub const fn is_nan(self, bits: u8) -> bool {
        match self {
            Fp8Format::E4M3 => bits & 0x7f == 0x7f,
            Fp8Format::E5M2 => bits & 0x7f > 0x7c,
        }
    }

    /// Lower-case name used in kernel symbols: `e4m3` or `e5m2`.
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }
}

/// Element type of a high-precision tensor (a quantize input or dequantize output).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Lower-case name used in kernel symbols: `f32`, `f16` or `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
}
