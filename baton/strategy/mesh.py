"""The device mesh of a parallel layout (`ParallelConfig`): which workers shard, replicate, split sequences and split
tensors, and the `RankInfo` by which the cluster dispatches rows and collects outputs.

Ranks are laid out pp × dp_replicate × dp_shard × cp × tp, tp varying fastest (as torchtitan and Megatron do), so a
tensor-parallel group is a run of consecutive ranks, on one node where the node holds it. FSDP2 shards each pipeline
stage over dp_shard × cp (a context-parallel rank holds a slice of every sequence and so a part of every gradient)
and, with dp_replicate > 1, replicates over dp_replicate (HSDP); pp is outermost, so each stage is a block of
consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from baton.distributed.worker import RankInfo
from baton.strategy.base import ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelMesh:
    """The mesh of this process's group, and the sub-meshes and groups the strategy uses.

    fsdp: what `fully_shard` takes, within this rank's pipeline stage: dp_shard × cp flattened, with dp_replicate as
        an outer dimension for HSDP.
    dp_group: the ranks of this stage that hold different rows (dp_replicate × dp_shard): sums over the batch run
        over it.
    """

    config: ParallelConfig
    mesh: DeviceMesh  # DIMS
    fsdp: DeviceMesh
    dp_group: object

    @classmethod
    def build(cls, config: ParallelConfig, device_type: str) -> "ParallelMesh":
        shape = (config.pp, config.dp_replicate, config.dp_shard(dist.get_world_size()), config.cp, config.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
        # torch names a flattened dimension once per mesh; these are the two the strategy needs.
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        fsdp = shard if config.dp_replicate == 1 else mesh["dp_replicate", "dp_shard_cp"]
        dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        return cls(config, mesh, fsdp, dp_group)

    @property
    def tp(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def stage_first_rank(self) -> int:
        """The lowest global rank of this rank's pipeline stage: the one that writes the stage's whole weights and
        sends its unsplit ones (rank 0 without pp)."""
        return int(self.mesh.mesh[self.mesh.get_local_rank("pp")].min())

    @property
    def fsdp_size(self) -> int:
        """Over how many ranks FSDP averages each gradient (dp_replicate × dp_shard × cp)."""
        return self.fsdp.size()

    @property
    def rank_info(self) -> RankInfo:
        pp, replicate, shard, cp, tp = (self.mesh.get_local_rank(dim) for dim in DIMS)
        dp_shard = self.mesh["dp_shard"].size()
        return RankInfo(dp_rank=replicate * dp_shard + shard, dp_size=self.config.dp_replicate * dp_shard,
                        tp_rank=tp, tp_size=self.config.tp, cp_rank=cp, cp_size=self.config.cp,
                        pp_rank=pp, pp_size=self.config.pp)
