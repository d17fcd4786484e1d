//! [`Rng`]: the seeded generator of the benchmarks, the soak and the tests' data.

/// A seeded xorshift64* stream: the data of the benchmarks and the soak, deterministic per
/// (seed, stream).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Stream number `stream` of seed `seed` (different streams are unrelated).
    pub fn new(seed: u64, stream: u64) -> Rng {
        // splitmix64 of the pair, never zero (xorshift stays at zero).
        let mut z = seed
            .wrapping_add(stream.wrapping_mul(0xD6E8_FEB8_6659_FD93))
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)).max(1))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64() >> 32) * n as u128) >> 32) as usize
    }

    /// Uniform in `[-scale, scale)`, on a grid of `scale / 2^23`.
    pub fn uniform(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
    }

    /// Fills `out` with [`uniform`](Self::uniform)`(scale)` values.
    pub fn fill_uniform(&mut self, out: &mut [f32], scale: f32) {
        for v in out {
            *v = self.uniform(scale);
        }
    }

    /// `n` values [`uniform`](Self::uniform)`(scale)`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        let mut v = vec![0f32; n];
        self.fill_uniform(&mut v, scale);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_streams_differ_and_stay_in_range() {
        let (mut a, mut b) = (Rng::new(1, 0), Rng::new(1, 1));
        assert_ne!(a.next_u64(), b.next_u64());
        let mut c = Rng::new(1, 0);
        let _ = c.next_u64();
        assert_eq!(
            a.next_u64(),
            c.next_u64(),
            "same seed and stream, same values"
        );
        let mut r = Rng::new(0, 0);
        let mut seen = [false; 5];
        for _ in 0..10_000 {
            let u = r.uniform(2.0);
            assert!((-2.0..2.0).contains(&u), "{u}");
            seen[r.below(5)] = true;
        }
        assert_eq!(seen, [true; 5]);
        assert_eq!(r.below(0), 0);
    }
}
