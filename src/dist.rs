//! Beyond one GPU: which GPU a launched process drives, its communicator, and the FP8 amax
//! reduction group over NCCL (TransformerEngine's `fp8_group`).
//!
//! `fp8-moe --gpus N <command>` starts N processes of `<command>` (see
//! [`cuda_graph_nccl::launch`]); each finds its place in the job with [`Placement::from_env`]
//! and its communicator with [`communicator`]. Run directly, a process is rank 0 of 1, and
//! its communicator is a one-rank NCCL communicator (the same code path, with nothing to
//! exchange).

use std::sync::Arc;

use cuda_graph::driver::Device;
use cuda_graph::{Context, DeviceBuffer, Stream};
use cuda_graph_nccl::rendezvous::RendezvousConfig;
use cuda_graph_nccl::{Communicator, ReduceOp, UniqueId};
use fp8_kernels::{HpBuffer, ReductionGroup};

use crate::moe::ep::{ExpertGroup, GroupOp};

/// Where this process stands in a job: its rank, the rank count and its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// This process's rank (`RANK`).
    pub rank: usize,
    /// The number of ranks (`WORLD_SIZE`).
    pub world_size: usize,
    /// Its rank on this machine (`LOCAL_RANK`): the GPU it drives.
    pub local_rank: usize,
}

impl Placement {
    /// Rank 0 of 1 on GPU 0: a process run directly.
    pub const SINGLE: Placement = Placement {
        rank: 0,
        world_size: 1,
        local_rank: 0,
    };

    /// From the launcher's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`), or
    /// [`SINGLE`](Self::SINGLE) when `RANK` is not set.
    ///
    /// Errors: a set variable that is not a number, or a rank outside the world, named.
    pub fn from_env() -> Result<Placement, String> {
        Placement::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) over any lookup (tests).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Placement, String> {
        let Some(rank) = lookup("RANK") else {
            return Ok(Placement::SINGLE);
        };
        let num = |name: &str, v: Option<String>| -> Result<usize, String> {
            let v = v.ok_or_else(|| format!("RANK is set but {name} is not"))?;
            v.trim()
                .parse()
                .map_err(|_| format!("{name}={v} is not a non-negative integer"))
        };
        let p = Placement {
            rank: num("RANK", Some(rank))?,
            world_size: num("WORLD_SIZE", lookup("WORLD_SIZE"))?,
            local_rank: num("LOCAL_RANK", lookup("LOCAL_RANK"))?,
        };
        if p.rank >= p.world_size {
            return Err(format!(
                "RANK={} is outside WORLD_SIZE={}",
                p.rank, p.world_size
            ));
        }
        Ok(p)
    }

    /// The primary context of this process's GPU (`LOCAL_RANK`).
    pub fn context(&self) -> cuda_graph::Result<Arc<Context>> {
        let ordinal = i32::try_from(self.local_rank).map_err(|_| {
            cuda_graph::Error::InvalidArgument(format!("LOCAL_RANK {} too large", self.local_rank))
        })?;
        Context::new(Device::get(ordinal)?)
    }
}

/// This process's communicator over the whole job: through the launcher's rendezvous
/// (`MASTER_ADDR`, `MASTER_PORT`) when `placement` has several ranks, else a one-rank
/// communicator.
///
/// Errors: those of [`Communicator::from_env`] and [`Communicator::init_rank`] (no NCCL, a
/// rank that never arrived).
pub fn communicator(
    ctx: &Arc<Context>,
    placement: &Placement,
) -> cuda_graph_nccl::Result<Communicator> {
    if placement.world_size == 1 {
        let id = UniqueId::new()?;
        return Communicator::init_rank(ctx, 1, 0, &id);
    }
    let cfg = RendezvousConfig::from_env()?;
    Communicator::from_rendezvous(ctx, &cfg)
}

/// The amax reduction over NCCL: every rank's amaxes replaced by their maximum over the
/// communicator's ranks, so all ranks compute the same FP8 scales (TransformerEngine's
/// `fp8_group`). Enqueued on the hook's stream, so inside a captured step it is part of the
/// graph. Every rank must reduce the same number of amaxes at the same point of its step.
#[derive(Debug, Clone)]
pub struct NcclGroup {
    comm: Communicator,
}

impl NcclGroup {
    /// A group over `comm`'s ranks.
    pub fn new(comm: Communicator) -> NcclGroup {
        NcclGroup { comm }
    }

    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }
}

impl ReductionGroup for NcclGroup {
    fn all_reduce_max(
        &self,
        stream: &Stream,
        amaxes: &DeviceBuffer<f32>,
    ) -> cuda_graph::Result<()> {
        Ok(self
            .comm
            .all_reduce_in_place(amaxes, ReduceOp::Max, stream)?)
    }

    fn size(&self) -> usize {
        self.comm.size()
    }
}

/// Expert parallelism over NCCL: the all-gathers and the all-to-all of
/// [`ExpertParallelMoe`](crate::moe::ep::ExpertParallelMoe), on the caller's stream
/// (capturable).
impl ExpertGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn all_gather(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<u8>,
        recv: &DeviceBuffer<u8>,
    ) -> cuda_graph::Result<()> {
        Ok(self.comm.all_gather(send, recv, stream)?)
    }

    fn all_to_all(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<u8>,
        recv: &DeviceBuffer<u8>,
    ) -> cuda_graph::Result<()> {
        Ok(self.comm.all_to_all(send, recv, stream)?)
    }

    fn all_to_all_v(
        &self,
        stream: &Stream,
        (send, send_counts): (&DeviceBuffer<u8>, &[usize]),
        (recv, recv_counts): (&DeviceBuffer<u8>, &[usize]),
    ) -> cuda_graph::Result<()> {
        Ok(self
            .comm
            .all_to_all_v(send, send_counts, recv, recv_counts, stream)?)
    }

    fn all_reduce(
        &self,
        stream: &Stream,
        buf: HpBuffer<'_>,
        op: GroupOp,
    ) -> cuda_graph::Result<()> {
        let op = match op {
            GroupOp::Sum => ReduceOp::Sum,
            GroupOp::Avg => ReduceOp::Avg,
            GroupOp::Max => ReduceOp::Max,
        };
        let comm = &self.comm;
        Ok(match buf {
            HpBuffer::F32(b) => comm.all_reduce_in_place(b, op, stream),
            HpBuffer::F16(b) => comm.all_reduce_in_place(b, op, stream),
            HpBuffer::Bf16(b) => comm.all_reduce_in_place(b, op, stream),
        }?)
    }

    /// One NCCL group.
    fn batch(&self, calls: &mut dyn FnMut() -> cuda_graph::Result<()>) -> cuda_graph::Result<()> {
        Ok(cuda_graph_nccl::group(|| Ok(calls()?))?)
    }

    fn capturable(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn placement_reads_the_launcher_variables() {
        assert_eq!(Placement::from_vars(vars(&[])), Ok(Placement::SINGLE));
        let p = Placement::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
        ]));
        assert_eq!(
            p,
            Ok(Placement {
                rank: 3,
                world_size: 4,
                local_rank: 1
            })
        );
    }

    #[test]
    fn placement_names_what_is_wrong() {
        let e = Placement::from_vars(vars(&[("RANK", "1"), ("LOCAL_RANK", "0")])).unwrap_err();
        assert!(e.contains("WORLD_SIZE"), "{e}");
        let e = Placement::from_vars(vars(&[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
        ]))
        .unwrap_err();
        assert!(e.contains("RANK=x"), "{e}");
        let e = Placement::from_vars(vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
        ]))
        .unwrap_err();
        assert!(e.contains("outside"), "{e}");
    }
}
