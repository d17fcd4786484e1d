//! GPU tests of the device AdamW ([`fp8_kernels::optim`]): the elementwise update against the
//! bit-exact host model over several steps (f32 and bf16 gradients, with and without a
//! gradient scale and a bf16 copy, a length that leaves a scalar tail); the fused update +
//! FP8 cast-transpose against the update followed by `cast_transpose_batched` of its bf16
//! copy (fast and edge tiles, per-matrix scales, outputs poisoned first); captured steps
//! replaying like eager ones; bad arguments rejected with nothing written. Run with
//! `cargo test -p fp8-kernels -- --include-ignored` on a CUDA machine.

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::reference as r;
use fp8_kernels::{
    AdamW, AdamWState, AdamWTensor, BatchedCastOut, DeviceScalar, Fp8Format, HpBuffer, ScalarSlots,
    cast_transpose_batched,
};

mod common;
use common::*;

const HYPER: AdamW = AdamW {
    lr: 3e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// f32 master weights, their moments and a gradient buffer (f32 or bf16), on the device and
/// mirrored on the host.
struct Tensor {
    p: DeviceBuffer<f32>,
    m: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    g32: DeviceBuffer<f32>,
    g16: DeviceBuffer<bf16>,
    copy: DeviceBuffer<bf16>,
    host: [Vec<f32>; 3],
}

impl Tensor {
    fn new(stream: &Stream, seed: u64, n: usize) -> Tensor {
        let mut rng = Rng::new(seed);
        let p: Vec<f32> = (0..n).map(|_| rng.unit() * 0.05).collect();
        let zeros = vec![0f32; n];
        Tensor {
            p: DeviceBuffer::from_host(stream, &p).unwrap(),
            m: DeviceBuffer::from_host(stream, &zeros).unwrap(),
            v: DeviceBuffer::from_host(stream, &zeros).unwrap(),
            g32: DeviceBuffer::from_host(stream, &zeros).unwrap(),
            g16: DeviceBuffer::from_host(stream, &vec![bf16::ZERO; n]).unwrap(),
            copy: DeviceBuffer::from_host(stream, &vec![bf16::from_bits(0xffff); n]).unwrap(),
            host: [p, zeros.clone(), zeros],
        }
    }

    /// A fresh gradient (magnitudes spread over 2^-20 .. 2^2, some zeros) uploaded as f32 or
    /// bf16; returns what the kernel reads, widened.
    fn fresh_grad(&self, stream: &Stream, seed: u64, bf: bool) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let g: Vec<f32> = (0..self.p.len())
            .map(|i| {
                if i % 97 == 0 {
                    0.0
                } else {
                    rng.unit() * 2f32.powi((rng.next() % 22) as i32 - 20)
                }
            })
            .collect();
        if bf {
            let h: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
            self.g16.copy_from_host(stream, &h).unwrap();
            h.iter().map(|x| x.to_f32()).collect()
        } else {
            self.g32.copy_from_host(stream, &g).unwrap();
            g
        }
    }

    fn view(&self, bf: bool, copy: bool) -> AdamWTensor<'_> {
        AdamWTensor {
            param: &self.p,
            grad: if bf {
                HpBuffer::Bf16(&self.g16)
            } else {
                HpBuffer::F32(&self.g32)
            },
            exp_avg: &self.m,
            exp_avg_sq: &self.v,
            bf16_copy: copy.then_some(&self.copy),
        }
    }

    /// The host model's step on the mirror.
    fn host_step(&mut self, state: &[f32; 4], g: &[f32], gs: f32) {
        let [p, m, v] = &mut self.host;
        for i in 0..g.len() {
            r::adamw(&HYPER, state, g[i], gs, &mut p[i], &mut m[i], &mut v[i]);
        }
    }

    /// Device p, m, v equal to the mirror bit for bit.
    fn assert_matches_host(&self, stream: &Stream, what: &str) {
        for (name, dev, host) in [
            ("weights", &self.p, &self.host[0]),
            ("exp_avg", &self.m, &self.host[1]),
            ("exp_avg_sq", &self.v, &self.host[2]),
        ] {
            let got = dev.to_vec(stream).unwrap();
            let bad = got
                .iter()
                .zip(host)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            if let Some(i) = bad {
                panic!(
                    "{what}: {name}[{i}] = {:e}, host model {:e}",
                    got[i], host[i]
                );
            }
        }
    }
}

/// Two tensors' weights and moments, and two FP8 outputs (row-major, transposed), the same
/// bits.
fn assert_same(
    stream: &Stream,
    what: &str,
    (a, b): (&Tensor, &Tensor),
    fp8: [(&DeviceBuffer<u8>, &DeviceBuffer<u8>); 2],
) {
    for (name, x, y) in [
        ("weights", &a.p, &b.p),
        ("exp_avg", &a.m, &b.m),
        ("exp_avg_sq", &a.v, &b.v),
    ] {
        let (x, y) = (x.to_vec(stream).unwrap(), y.to_vec(stream).unwrap());
        assert!(
            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: {name} differ"
        );
    }
    for (name, (x, y)) in ["FP8 row-major", "FP8 transposed"].iter().zip(fp8) {
        assert_eq!(
            x.to_vec(stream).unwrap(),
            y.to_vec(stream).unwrap(),
            "{what}: {name}"
        );
    }
}

fn bf16_bits(stream: &Stream, b: &DeviceBuffer<bf16>) -> Vec<u16> {
    b.to_vec(stream)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn update_matches_the_host_model_bit_for_bit() {
    let (_ctx, stream) = setup();
    // 10_003: the vector loop and a scalar tail of 3.
    let n = 10_003;
    for (case, (bf, with_scale, copy)) in [
        (false, false, false),
        (true, false, true),
        (false, true, true),
        (true, true, false),
    ]
    .into_iter()
    .enumerate()
    {
        let what = format!("bf16 grad {bf}, grad scale {with_scale}, copy {copy}");
        let mut t = Tensor::new(&stream, 11 + case as u64, n);
        let state = AdamWState::new(&stream, HYPER).unwrap();
        let gs = DeviceScalar::new(&stream, 0.375).unwrap();
        let mut host_state = [0.0, HYPER.lr, 1.0, 1.0];
        for step in 0..4u64 {
            let g = t.fresh_grad(&stream, 100 * case as u64 + step, bf);
            state.begin_step(&stream).unwrap();
            state
                .update(&stream, &t.view(bf, copy), with_scale.then_some(&gs))
                .unwrap();
            r::adamw_begin(&mut host_state, HYPER.beta1, HYPER.beta2);
            t.host_step(&host_state, &g, if with_scale { 0.375 } else { 1.0 });
            t.assert_matches_host(&stream, &format!("{what}, step {step}"));
        }
        assert_eq!(state.steps(&stream).unwrap(), 4);
        let got = state.buffer().to_vec(&stream).unwrap();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            host_state.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{what}: state"
        );
        let copy_bits = bf16_bits(&stream, &t.copy);
        if copy {
            let want: Vec<u16> = t.host[0]
                .iter()
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect();
            assert_eq!(copy_bits, want, "{what}: bf16 copy");
        } else {
            assert!(
                copy_bits.iter().all(|&b| b == 0xffff),
                "{what}: no copy asked, yet it was written"
            );
        }
    }
}

/// Per-matrix (scale, scale_inv, amax) in one buffer each, scale_inv poisoned, amax zero.
struct Scalars {
    scale: DeviceBuffer<f32>,
    scale_inv: DeviceBuffer<f32>,
    amax: DeviceBuffer<f32>,
}

impl Scalars {
    fn new(stream: &Stream, count: usize) -> Scalars {
        let scales: Vec<f32> = (0..count).map(|g| 2f32.powi(8 + g as i32)).collect();
        Scalars {
            scale: DeviceBuffer::from_host(stream, &scales).unwrap(),
            scale_inv: DeviceBuffer::from_host(stream, &vec![f32::from_bits(POISON_F32); count])
                .unwrap(),
            amax: DeviceBuffer::from_host(stream, &vec![0f32; count]).unwrap(),
        }
    }

    fn out<'a>(&self, q: &'a DeviceBuffer<u8>, t: &'a DeviceBuffer<u8>) -> BatchedCastOut<'a> {
        let slots = |b: &DeviceBuffer<f32>| ScalarSlots::new(DeviceScalar::at(b, 0).unwrap(), 1);
        BatchedCastOut {
            data: q,
            data_t: t,
            format: Fp8Format::E4M3,
            scale: slots(&self.scale),
            scale_inv: slots(&self.scale_inv),
            amax: slots(&self.amax),
        }
    }

    fn bits(&self, stream: &Stream) -> Vec<u32> {
        [&self.scale_inv, &self.amax]
            .iter()
            .flat_map(|b| b.to_vec(stream).unwrap())
            .map(f32::to_bits)
            .collect()
    }
}

fn poisoned(stream: &Stream, n: usize) -> DeviceBuffer<u8> {
    DeviceBuffer::from_host(stream, &vec![0xaau8; n]).unwrap()
}

/// One side of a comparison: a tensor, its batch's scalars, poisoned FP8 outputs and an
/// optimizer state.
struct Side {
    t: Tensor,
    s: Scalars,
    q: DeviceBuffer<u8>,
    qt: DeviceBuffer<u8>,
    state: AdamWState,
}

impl Side {
    fn new(stream: &Stream, seed: u64, (count, rows, cols): (usize, usize, usize)) -> Side {
        let n = count * rows * cols;
        Side {
            t: Tensor::new(stream, seed, n),
            s: Scalars::new(stream, count),
            q: poisoned(stream, n),
            qt: poisoned(stream, n),
            state: AdamWState::new(stream, HYPER).unwrap(),
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_update_and_cast_equal_the_update_then_the_cast() {
    let (_ctx, stream) = setup();
    // The transpose's 128 x 128 tiles: none whole (80 x 96); an odd shape, whose matrices
    // start off 4-element alignment (33 x 50: the update one element at a time); whole tiles
    // with edges in both dimensions (272 x 144); whole tiles only (256 x 256).
    for (case, &(count, rows, cols, bf)) in [
        (3, 80, 96, false),
        (2, 33, 50, true),
        (2, 272, 144, false),
        (1, 256, 256, true),
    ]
    .iter()
    .enumerate()
    {
        let what = format!("{count} x [{rows}, {cols}], bf16 grad {bf}");
        let shape = (count, rows, cols);
        let [sa, sb] = [0, 1].map(|_| Side::new(&stream, 7 + case as u64, shape));
        let (a, qa, ta, state_a) = (&sa.t, &sa.q, &sa.qt, &sa.state);
        let (b, qb, tb, state_b) = (&sb.t, &sb.q, &sb.qt, &sb.state);
        let (sa, sb) = (&sa.s, &sb.s);
        let gs = DeviceScalar::new(&stream, 0.5).unwrap();
        for step in 0..3u64 {
            let g = a.fresh_grad(&stream, 1000 + step, bf);
            b.fresh_grad(&stream, 1000 + step, bf);
            let scale = (step == 1).then_some(&gs);
            // A: the update with its bf16 copy, then the batched cast of the copy.
            state_a.begin_step(&stream).unwrap();
            state_a.update(&stream, &a.view(bf, true), scale).unwrap();
            cast_transpose_batched(&stream, &a.copy, (count, rows, cols), &sa.out(qa, ta), None)
                .unwrap();
            // B: fused (the copy only on odd steps).
            state_b.begin_step(&stream).unwrap();
            state_b
                .update_cast_transpose_batched(
                    &stream,
                    &b.view(bf, step % 2 == 1),
                    (count, rows, cols),
                    &sb.out(qb, tb),
                    scale,
                )
                .unwrap();
            let step_what = format!("{what}, step {step}");
            assert_same(&stream, &step_what, (a, b), [(qa, qb), (ta, tb)]);
            assert_eq!(
                sa.bits(&stream),
                sb.bits(&stream),
                "{step_what}: scale_inv and amax"
            );
            if step % 2 == 1 {
                assert_eq!(
                    bf16_bits(&stream, &a.copy),
                    bf16_bits(&stream, &b.copy),
                    "{step_what}: copy"
                );
            }
            // And A's bytes are the reference cast of the updated weights rounded to bf16.
            let w: Vec<f32> =
                a.p.to_vec(&stream)
                    .unwrap()
                    .iter()
                    .map(|&x| bf16::from_f32(x).to_f32())
                    .collect();
            let q = qa.to_vec(&stream).unwrap();
            for gi in 0..count {
                let s = 2f32.powi(8 + gi as i32);
                let (want, want_t, want_amax) = r::cast_transpose_ref(
                    &w[gi * rows * cols..][..rows * cols],
                    rows,
                    cols,
                    s,
                    Fp8Format::E4M3,
                );
                assert_eq!(
                    &q[gi * rows * cols..][..rows * cols],
                    &want[..],
                    "{step_what}: matrix {gi}"
                );
                assert_eq!(
                    &ta.to_vec(&stream).unwrap()[gi * rows * cols..][..rows * cols],
                    &want_t[..]
                );
                let amax = sa.amax.to_vec(&stream).unwrap()[gi];
                assert!(
                    amax >= want_amax,
                    "{step_what}: amax {amax} below {want_amax}"
                );
            }
            let _ = g;
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn captured_steps_replay_like_eager_ones() {
    let (ctx, stream) = setup();
    let (count, rows, cols) = (2, 64, 64);
    let [sa, sb] = [0, 1].map(|_| Side::new(&stream, 5, (count, rows, cols)));
    let (a, qa, ta, state_a) = (&sa.t, &sa.q, &sa.qt, &sa.state);
    let (b, qb, tb, state_b) = (&sb.t, &sb.q, &sb.qt, &sb.state);
    let (sa, sb) = (&sa.s, &sb.s);
    let step = |state: &AdamWState, t: &Tensor, s: &Scalars, q, tt| -> cuda_graph::Result<()> {
        state.begin_step(&stream)?;
        state.update_cast_transpose_batched(
            &stream,
            &t.view(false, true),
            (count, rows, cols),
            &s.out(q, tt),
            None,
        )
    };
    let graph = capture(&ctx, &stream, || step(state_b, b, sb, qb, tb));
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for i in 0..3u64 {
        a.fresh_grad(&stream, 50 + i, false);
        b.fresh_grad(&stream, 50 + i, false);
        // A new learning rate on the second step, read on the device by both.
        if i == 1 {
            state_a.lr().unwrap().write(&stream, 1e-3).unwrap();
            state_b.lr().unwrap().write(&stream, 1e-3).unwrap();
        }
        step(state_a, a, sa, qa, ta).unwrap();
        exec.launch(&stream).unwrap();
        assert_same(
            &stream,
            &format!("replay {i}"),
            (a, b),
            [(qa, qb), (ta, tb)],
        );
        assert_eq!(
            bf16_bits(&stream, &a.copy),
            bf16_bits(&stream, &b.copy),
            "replay {i}"
        );
    }
    assert_eq!(state_b.steps(&stream).unwrap(), 3);
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_arguments_are_rejected_and_nothing_is_written() {
    let (ctx, stream) = setup();
    let n = 256;
    let t = Tensor::new(&stream, 3, n);
    let state = AdamWState::new(&stream, HYPER).unwrap();
    let short = DeviceBuffer::<f32>::alloc(&ctx, n - 1).unwrap();
    let f16g = DeviceBuffer::<cuda_graph::half::f16>::alloc(&ctx, n).unwrap();
    let (q, qt, q_short) = (
        poisoned(&stream, n),
        poisoned(&stream, n),
        poisoned(&stream, n - 4),
    );
    let s = Scalars::new(&stream, 2);
    let before = (t.p.to_vec(&stream).unwrap(), t.m.to_vec(&stream).unwrap());
    let fused = |shape, data| {
        state.update_cast_transpose_batched(
            &stream,
            &t.view(false, false),
            shape,
            &s.out(data, &qt),
            None,
        )
    };
    let cases: Vec<(&str, cuda_graph::Result<()>)> = vec![
        (
            "short moment",
            state.update(
                &stream,
                &AdamWTensor {
                    exp_avg: &short,
                    ..t.view(false, false)
                },
                None,
            ),
        ),
        (
            "f16 gradient",
            state.update(
                &stream,
                &AdamWTensor {
                    grad: HpBuffer::F16(&f16g),
                    ..t.view(false, false)
                },
                None,
            ),
        ),
        ("shape not the buffers'", fused((2, 8, 8), &q)),
        ("no matrices", fused((0, 16, 16), &q)),
        ("short output", fused((2, 8, 16), &q_short)),
        ("slots past their buffer", fused((4, 8, 8), &q)),
    ];
    for (what, res) in cases {
        let e = res.expect_err(what).to_string();
        assert!(!e.is_empty(), "{what}");
    }
    assert!(
        AdamWState::new(
            &stream,
            AdamW {
                beta1: 1.5,
                ..HYPER
            }
        )
        .is_err()
    );
    stream.synchronize().unwrap();
    assert_eq!(
        before,
        (t.p.to_vec(&stream).unwrap(), t.m.to_vec(&stream).unwrap())
    );
    assert!(q.to_vec(&stream).unwrap().iter().all(|&b| b == 0xaa));
    assert_eq!(state.steps(&stream).unwrap(), 0);
}
