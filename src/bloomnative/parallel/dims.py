"""The parallel layout (dp_replicate x dp_shard x cp x tp x pp) and its device mesh."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from bloomnative.config import ParallelismConfig


class LayoutError(ValueError):
    """An impossible parallel layout, described with what to change."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the world size.

    Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost so its ranks
    are neighbours, on one node; cp next, so a sequence's ring stays on a node as long as
    cp x tp fits one).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1

    @classmethod
    def from_config(cls, par: ParallelismConfig, world_size: int) -> ParallelDims:
        """The degrees of a [parallelism] section on `world_size` processes: dp_shard = -1
        filled with what is left of the world size, the product checked."""
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(par, name) < 1:
                raise LayoutError(f"parallelism.{name} must be >= 1, got {getattr(par, name)}")
        fixed = par.dp_replicate * par.cp * par.tp * par.pp
        dp_shard = par.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not divisible by dp_replicate*cp*tp*pp = "
                    f"{par.dp_replicate}*{par.cp}*{par.tp}*{par.pp} = {fixed}; change NPROC or "
                    "the degrees"
                )
            dp_shard = world_size // fixed
        if dp_shard < 1:
            raise LayoutError(f"parallelism.dp_shard must be >= 1 or -1, got {dp_shard}")
        if fixed * dp_shard != world_size:
            raise LayoutError(
                f"dp_replicate*dp_shard*cp*tp*pp = {par.dp_replicate}*{dp_shard}*{par.cp}*"
                f"{par.tp}*{par.pp} = "
                f"{fixed * dp_shard} but the world size is {world_size}; make the product equal "
                f"NPROC x nodes (or set parallelism.dp_shard = -1)"
            )
        return cls(par.dp_replicate, dp_shard, par.tp, par.pp, world_size, par.cp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """Ranks one FSDP unit is sharded over: dp_shard x cp (context-parallel ranks hold the
        same parameters, so they shard them instead of replicating them, as torchtitan does)."""
        return self.dp_shard * self.cp

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The mesh with named dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"; size-1 dims
        kept so names always resolve), and its data-parallel ranks flattened into one "dp" dim
        (the ranks that see different batches: the loader's group). The flattened meshes of
        `fsdp_mesh` and `loss_mesh` are created here too, in the same order on every rank."""
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        # Kept, not sliced from the root later: torch deprecates slicing flattened dims.
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self.fsdp_mesh(mesh)
        self.loss_mesh(mesh)
        return mesh, dp_mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """What FSDP2 shards over: dp_shard x cp flattened into "dp_shard_cp", with dp_replicate
        in front of it (2-D: HSDP) when dp_replicate > 1."""
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.dp_replicate == 1:
            return shard
        with warnings.catch_warnings():
            # HSDP needs the 2-D (replicate, shard) mesh, which torch can only slice from the
            # root; torch warns that slicing a flattened dim will be deprecated.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh["dp_replicate", "dp_shard_cp"]

    def loss_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The ranks whose tokens make up one global batch of one pipeline stage and tensor
        rank: dp_replicate x dp_shard x cp flattened ("dp_cp"); losses, token counts and the
        like are summed over it."""
        return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    @cached_property
    def summary(self) -> str:
        return (
            f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
            f"cp={self.cp} tp={self.tp} (world {self.world_size})"
        )
