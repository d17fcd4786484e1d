//! The collectives on the GPU, eagerly and captured in graphs.
//!
//! Every GPU of the machine takes part: one process drives them all
//! (`Communicator::init_all`), so on one GPU these are one-rank communicators (each collective
//! must then return its input, bit for bit) and on several they reduce and move real data
//! across GPUs; the expected values are computed on the host from the inputs either way.
//! Inputs are fresh random values (the seed is printed; `NCCL_TEST_SEED` replays one), every
//! output is poisoned first (0xFF bytes), and the captured graphs are replayed on new inputs.
//!
//! NCCL comes from `CUDA_GRAPH_NCCL_LIBRARY` or the loader's search: a machine without it
//! fails these tests with the loader's message.

// Rank loops index several per-rank vectors (communicators, streams, buffers) at once.
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use cuda_graph::driver::Device;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use cuda_graph_nccl::{Communicator, Error, ReduceOp, UniqueId, group};

struct Rng(u64);

impl Rng {
    fn fresh() -> Rng {
        let seed = std::env::var("NCCL_TEST_SEED")
            .ok()
            .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
                    | 1
            });
        println!("NCCL_TEST_SEED={seed:#x}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Values in [-8, 8) on a 1/64 grid: sums over a few ranks are exact in f32.
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() % 1024) as f32 / 64.0 - 8.0)
            .collect()
    }
}

/// One rank per GPU of the machine, each with a stream.
struct Ranks {
    comms: Vec<Communicator>,
    streams: Vec<Stream>,
}

impl Ranks {
    fn new() -> Ranks {
        let n = Device::count().expect("a CUDA driver");
        assert!(n >= 1, "no CUDA device");
        let ctxs: Vec<Arc<Context>> = (0..n)
            .map(|i| Context::new(Device::get(i).unwrap()).unwrap())
            .collect();
        let comms = Communicator::init_all(&ctxs).expect("NCCL communicators");
        let streams = ctxs.iter().map(|c| Stream::new(c).unwrap()).collect();
        Ranks { comms, streams }
    }

    fn n(&self) -> usize {
        self.comms.len()
    }

    fn upload(&self, data: &[Vec<f32>]) -> Vec<DeviceBuffer<f32>> {
        data.iter()
            .zip(&self.streams)
            .map(|(d, s)| DeviceBuffer::from_host(s, d).unwrap())
            .collect()
    }

    fn poisoned(&self, len: usize) -> Vec<DeviceBuffer<f32>> {
        self.streams
            .iter()
            .map(|s| {
                let b = DeviceBuffer::alloc(s.context(), len).unwrap();
                b.memset_bytes(s, 0xFF).unwrap();
                b
            })
            .collect()
    }

    fn download(&self, bufs: &[DeviceBuffer<f32>]) -> Vec<Vec<f32>> {
        bufs.iter()
            .zip(&self.streams)
            .map(|(b, s)| b.to_vec(s).unwrap())
            .collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The element-wise reduction of every rank's input, as the host computes it.
fn reduce_host(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    (0..inputs[0].len())
        .map(|i| {
            let mut it = inputs.iter().map(|v| v[i]);
            let first = it.next().unwrap();
            it.fold(first, |a, b| match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Prod => a * b,
            })
        })
        .map(|x| {
            if op == ReduceOp::Avg {
                x / inputs.len() as f32
            } else {
                x
            }
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn all_reduce_sum_and_max_match_the_host() {
    let ranks = Ranks::new();
    let mut rng = Rng::fresh();
    // An odd length: no collective may assume a multiple of anything.
    let len = 100_003;
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
        let inputs: Vec<Vec<f32>> = (0..ranks.n()).map(|_| rng.f32s(len)).collect();
        let send = ranks.upload(&inputs);
        let recv = ranks.poisoned(len);
        group(|| {
            for r in 0..ranks.n() {
                ranks.comms[r].all_reduce(&send[r], &recv[r], op, &ranks.streams[r])?;
            }
            Ok(())
        })
        .unwrap();
        let want = bits(&reduce_host(&inputs, op));
        for (r, got) in ranks.download(&recv).iter().enumerate() {
            assert!(bits(got) == want, "{op:?}: rank {r} differs from the host");
        }
        // In place: the input buffers become the result.
        group(|| {
            for r in 0..ranks.n() {
                ranks.comms[r].all_reduce_in_place(&send[r], op, &ranks.streams[r])?;
            }
            Ok(())
        })
        .unwrap();
        for (r, got) in ranks.download(&send).iter().enumerate() {
            assert!(bits(got) == want, "{op:?} in place: rank {r} differs");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gather_scatter_broadcast_and_all_to_all_move_the_right_blocks() {
    let ranks = Ranks::new();
    let n = ranks.n();
    let mut rng = Rng::fresh();
    let block = 4099;
    let inputs: Vec<Vec<f32>> = (0..n).map(|_| rng.f32s(block * n)).collect();
    let send = ranks.upload(&inputs);

    // all_gather of each rank's first block.
    let firsts: Vec<DeviceBuffer<f32>> = send.iter().map(|b| b.slice(..block).unwrap()).collect();
    let gathered = ranks.poisoned(block * n);
    group(|| {
        for r in 0..n {
            ranks.comms[r].all_gather(&firsts[r], &gathered[r], &ranks.streams[r])?;
        }
        Ok(())
    })
    .unwrap();
    let want: Vec<f32> = inputs.iter().flat_map(|v| v[..block].to_vec()).collect();
    for (r, got) in ranks.download(&gathered).iter().enumerate() {
        assert!(bits(got) == bits(&want), "all_gather: rank {r}");
    }

    // reduce_scatter: rank r keeps block r of the sum.
    let scattered = ranks.poisoned(block);
    group(|| {
        for r in 0..n {
            ranks.comms[r].reduce_scatter(
                &send[r],
                &scattered[r],
                ReduceOp::Sum,
                &ranks.streams[r],
            )?;
        }
        Ok(())
    })
    .unwrap();
    let sum = reduce_host(&inputs, ReduceOp::Sum);
    for (r, got) in ranks.download(&scattered).iter().enumerate() {
        assert!(
            bits(got) == bits(&sum[r * block..(r + 1) * block]),
            "reduce_scatter: rank {r}"
        );
    }

    // broadcast from the last rank.
    let root = n - 1;
    let bcast = ranks.poisoned(block * n);
    group(|| {
        for r in 0..n {
            ranks.comms[r].broadcast(&send[r], &bcast[r], root, &ranks.streams[r])?;
        }
        Ok(())
    })
    .unwrap();
    for (r, got) in ranks.download(&bcast).iter().enumerate() {
        assert!(bits(got) == bits(&inputs[root]), "broadcast: rank {r}");
    }

    // all_to_all: block p of rank r lands in block r of rank p.
    let a2a = ranks.poisoned(block * n);
    group(|| {
        for r in 0..n {
            ranks.comms[r].all_to_all(&send[r], &a2a[r], &ranks.streams[r])?;
        }
        Ok(())
    })
    .unwrap();
    for (p, got) in ranks.download(&a2a).iter().enumerate() {
        for r in 0..n {
            let want = &inputs[r][p * block..(p + 1) * block];
            assert!(
                bits(&got[r * block..(r + 1) * block]) == bits(want),
                "all_to_all: {r} -> {p}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn uneven_all_to_all_moves_exactly_the_counted_rows() {
    let ranks = Ranks::new();
    let n = ranks.n();
    let mut rng = Rng::fresh();
    // counts[r][p]: what rank r sends to rank p (zero included).
    let counts: Vec<Vec<usize>> = (0..n)
        .map(|_| (0..n).map(|_| (rng.next() % 3000) as usize).collect())
        .collect();
    let inputs: Vec<Vec<f32>> = counts.iter().map(|c| rng.f32s(c.iter().sum())).collect();
    let send = ranks.upload(&inputs);
    let recv_counts: Vec<Vec<usize>> = (0..n)
        .map(|p| (0..n).map(|r| counts[r][p]).collect())
        .collect();
    // One spare element past the end stays poisoned.
    let recv: Vec<DeviceBuffer<f32>> = recv_counts
        .iter()
        .zip(&ranks.streams)
        .map(|(c, s)| {
            let b = DeviceBuffer::alloc(s.context(), c.iter().sum::<usize>() + 1).unwrap();
            b.memset_bytes(s, 0xFF).unwrap();
            b
        })
        .collect();
    group(|| {
        for r in 0..n {
            ranks.comms[r].all_to_all_v(
                &send[r],
                &counts[r],
                &recv[r],
                &recv_counts[r],
                &ranks.streams[r],
            )?;
        }
        Ok(())
    })
    .unwrap();
    let got = ranks.download(&recv);
    for p in 0..n {
        let mut want = Vec::new();
        for r in 0..n {
            let start: usize = counts[r][..p].iter().sum();
            want.extend_from_slice(&inputs[r][start..start + counts[r][p]]);
        }
        let total = want.len();
        assert!(
            bits(&got[p][..total]) == bits(&want),
            "all_to_all_v: rank {p}"
        );
        assert_eq!(
            got[p][total].to_bits(),
            u32::MAX,
            "all_to_all_v wrote past its counts"
        );
    }
}

/// One rank's operands of the captured test: `send` (`n` blocks) is the input of every
/// collective; the others are outputs.
struct Operands {
    send: DeviceBuffer<f32>,
    sum: DeviceBuffer<f32>,
    amax: DeviceBuffer<f32>,
    gathered: DeviceBuffer<f32>,
    /// The even all-to-all's output.
    even: DeviceBuffer<f32>,
    /// The uneven all-to-all's output.
    uneven: DeviceBuffer<f32>,
}

impl Operands {
    fn share(&self) -> Operands {
        Operands {
            send: self.send.share(),
            sum: self.sum.share(),
            amax: self.amax.share(),
            gathered: self.gathered.share(),
            even: self.even.share(),
            uneven: self.uneven.share(),
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn captured_collectives_replay_on_new_data_and_keep_their_operands_alive() {
    let ranks = Ranks::new();
    let n = ranks.n();
    let mut rng = Rng::fresh();
    let block = 16_411;
    // Uneven all-to-all: rank r sends (r + 2 p + 1) * 97 elements to rank p.
    let count = |r: usize, p: usize| (r + 2 * p + 1) * 97;
    let alloc = |p: usize, len: usize| {
        let b = DeviceBuffer::alloc(ranks.streams[p].context(), len).unwrap();
        b.memset_bytes(&ranks.streams[p], 0xFF).unwrap();
        b
    };
    let ops: Vec<Operands> = (0..n)
        .map(|p| Operands {
            send: alloc(p, block * n),
            sum: alloc(p, block * n),
            amax: alloc(p, 256),
            gathered: alloc(p, block * n),
            even: alloc(p, block * n),
            uneven: alloc(p, (0..n).map(|r| count(r, p)).sum()),
        })
        .collect();
    let execs = capture_each_rank(&ranks, &ops, block, &count);
    // Only the graphs hold the operands' handles now.
    let views: Vec<Operands> = ops.iter().map(Operands::share).collect();
    drop(ops);
    for replay in 0..3 {
        let inputs: Vec<Vec<f32>> = (0..n).map(|_| rng.f32s(block * n)).collect();
        let amaxes: Vec<Vec<f32>> = (0..n).map(|_| rng.f32s(256)).collect();
        for r in 0..n {
            let (v, st) = (&views[r], &ranks.streams[r]);
            v.send.copy_from_host(st, &inputs[r]).unwrap();
            v.amax.copy_from_host(st, &amaxes[r]).unwrap();
            for out in [&v.sum, &v.gathered, &v.even, &v.uneven] {
                out.memset_bytes(st, 0xFF).unwrap();
            }
        }
        for r in 0..n {
            execs[r].launch(&ranks.streams[r]).unwrap();
        }
        let sum = bits(&reduce_host(&inputs, ReduceOp::Sum));
        let max = bits(&reduce_host(&amaxes, ReduceOp::Max));
        let gathered: Vec<f32> = inputs.iter().flat_map(|v| v[..block].to_vec()).collect();
        for p in 0..n {
            let (v, st) = (&views[p], &ranks.streams[p]);
            let got = |b: &DeviceBuffer<f32>| bits(&b.to_vec(st).unwrap());
            assert!(got(&v.sum) == sum, "replay {replay}: rank {p} sum");
            assert!(got(&v.amax) == max, "replay {replay}: rank {p} max");
            assert!(
                got(&v.gathered) == bits(&gathered),
                "replay {replay}: rank {p} all_gather"
            );
            let a2a: Vec<f32> = (0..n)
                .flat_map(|r| inputs[r][p * block..(p + 1) * block].to_vec())
                .collect();
            assert!(
                got(&v.even) == bits(&a2a),
                "replay {replay}: rank {p} all_to_all"
            );
            let a2av: Vec<f32> = (0..n)
                .flat_map(|r| {
                    let start: usize = (0..p).map(|q| count(r, q)).sum();
                    inputs[r][start..start + count(r, p)].to_vec()
                })
                .collect();
            assert!(
                got(&v.uneven) == bits(&a2av),
                "replay {replay}: rank {p} all_to_all_v"
            );
        }
    }
}

/// Captures each rank's collectives on its stream, one thread per rank: NCCL needs every
/// rank's call of a collective in flight at once (the first one sets up the connections), and
/// a capture scope runs one stream's closure at a time, so one thread could not drive them
/// all; the threads' captures meet in NCCL as eager calls do.
fn capture_each_rank(
    ranks: &Ranks,
    ops: &[Operands],
    block: usize,
    count: &(dyn Fn(usize, usize) -> usize + Sync),
) -> Vec<GraphExec> {
    let n = ranks.n();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (comm, stream, o) = (&ranks.comms[r], &ranks.streams[r], &ops[r]);
                scope.spawn(move || {
                    let sends: Vec<usize> = (0..n).map(|p| count(r, p)).collect();
                    let recvs: Vec<usize> = (0..n).map(|q| count(q, r)).collect();
                    let graph = stream.capture(CaptureMode::ThreadLocal, |sc| {
                        let s = sc.stream();
                        comm.all_reduce(&o.send, &o.sum, ReduceOp::Sum, s)?;
                        comm.all_reduce_in_place(&o.amax, ReduceOp::Max, s)?;
                        comm.all_gather(&o.send.slice(..block)?, &o.gathered, s)?;
                        comm.all_to_all(&o.send, &o.even, s)?;
                        comm.all_to_all_v(&o.send, &sends, &o.uneven, &recvs, s)?;
                        Ok(())
                    })?;
                    GraphExec::instantiate(&graph, InstantiateFlags::empty())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("capture thread").expect("capture"))
            .collect()
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_arguments_are_refused_before_nccl() {
    let ranks = Ranks::new();
    let (comm, stream) = (&ranks.comms[0], &ranks.streams[0]);
    let a = DeviceBuffer::<f32>::alloc(stream.context(), 10).unwrap();
    let b = DeviceBuffer::<f32>::alloc(stream.context(), 11).unwrap();
    let invalid = |r: cuda_graph_nccl::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(invalid(comm.all_reduce(&a, &b, ReduceOp::Sum, stream)));
    assert!(invalid(comm.all_gather(&a, &b, stream)));
    assert!(invalid(comm.reduce_scatter(&b, &a, ReduceOp::Sum, stream)));
    assert!(invalid(comm.broadcast(&a, &a, ranks.n(), stream)));
    assert!(invalid(comm.send(&a, ranks.n(), stream)));
    assert!(invalid(comm.all_to_all_v(
        &a,
        &vec![11; ranks.n()],
        &a,
        &vec![0; ranks.n()],
        stream
    )));
    assert!(invalid(comm.all_to_all_v(
        &a,
        &[1],
        &a,
        &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        stream
    )));
    // A second one-rank communicator through init_rank: rank 1 of 1 is refused.
    let id = UniqueId::new().unwrap();
    assert!(matches!(
        Communicator::init_rank(stream.context(), 1, 1, &id),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_one_rank_communicator_from_a_unique_id_reduces_to_its_input() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let id = UniqueId::new().unwrap();
    // The id survives the hex round trip a launcher's environment variable makes.
    let id = UniqueId::from_hex(&id.to_hex()).unwrap();
    let comm = Communicator::init_rank(&ctx, 1, 0, &id).unwrap();
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let mut rng = Rng::fresh();
    let data = rng.f32s(1000);
    let buf = DeviceBuffer::from_host(&stream, &data).unwrap();
    comm.all_reduce_in_place(&buf, ReduceOp::Sum, &stream)
        .unwrap();
    assert!(bits(&buf.to_vec(&stream).unwrap()) == bits(&data));
    comm.async_error().unwrap();
}
