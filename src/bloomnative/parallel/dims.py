"""The parallel layout (dp_replicate x dp_shard x tp x pp) and its device mesh."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """An impossible parallel layout, described with what to change."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the world size.

    Mesh dims, outermost first: pp, dp_replicate, dp_shard, tp (tp innermost so its ranks are
    neighbours, on one node).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int):
        """Fills dp_shard = -1 with what is left of the world size and checks the product."""
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp)):
            if value < 1:
                raise LayoutError(f"parallelism.{name} must be >= 1, got {value}")
        fixed = dp_replicate * tp * pp
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not divisible by dp_replicate*tp*pp = "
                    f"{dp_replicate}*{tp}*{pp} = {fixed}; change NPROC or the degrees"
                )
            dp_shard = world_size // fixed
        if dp_shard < 1:
            raise LayoutError(f"parallelism.dp_shard must be >= 1 or -1, got {dp_shard}")
        if fixed * dp_shard != world_size:
            raise LayoutError(
                f"dp_replicate*dp_shard*tp*pp = {dp_replicate}*{dp_shard}*{tp}*{pp} = "
                f"{fixed * dp_shard} but the world size is {world_size}; make the product equal "
                f"NPROC x nodes (or set parallelism.dp_shard = -1)"
            )
        return cls(dp_replicate, dp_shard, tp, pp, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The mesh with named dims ("pp", "dp_replicate", "dp_shard", "tp"; size-1 dims kept so
        names always resolve), and its data-parallel ranks flattened into one "dp" dim (the
        ranks that see different batches: the loader's and the loss average's group)."""
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        # Kept, not sliced from the root later: torch deprecates slicing flattened dims.
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh, dp_mesh

    @cached_property
    def summary(self) -> str:
        return (
            f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
            f"tp={self.tp} (world {self.world_size})"
        )
