"""The 4-D process topology of fleet and the communication groups of one rank.

Paddle's axis order, outermost first: ``data, pipe, sharding, model``. A rank's coordinate is
its index in a row-major array of shape ``(dp, pp, sharding, mp)``, so model-parallel peers
are neighbours (the axis that talks most stays inside a machine) and data-parallel replicas
are farthest apart. With dp=pp=sharding=mp=2 (16 ranks):

====  =====  ====  ========  =====
rank  data   pipe  sharding  model
====  =====  ====  ========  =====
0     0      0     0         0
1     0      0     0         1
2     0      0     1         0
4     0      1     0         0
8     1      0     0         0
====  =====  ====  ========  =====

Rank 5's groups: model [4, 5], sharding [5, 7], pipe [1, 5], data [5, 13].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mpipar.compat.collective import Group, new_group
from mpipar.mesh import ProcessMesh

AXES = ("data", "pipe", "sharding", "model")


class ParallelMode:
    """Paddle's ``ParallelMode``: which wrapper ``distributed_model`` picks."""

    DATA_PARALLEL = 0
    TENSOR_PARALLEL = 1
    PIPELINE_PARALLEL = 2
    SHARDING_PARALLEL = 3


class CommunicateTopology:
    """Ranks laid out on named axes (Paddle's ``CommunicateTopology``)."""

    def __init__(self, hybrid_group_names: Sequence[str] = AXES, dims: Sequence[int] = (1, 1, 1, 1)) -> None:
        if len(hybrid_group_names) != len(dims):
            raise ValueError(f"CommunicateTopology: {len(hybrid_group_names)} axis names but {len(dims)} dims")
        self._names = list(hybrid_group_names)
        self._dims = [int(d) for d in dims]
        self._ranks = np.arange(int(np.prod(self._dims))).reshape(self._dims)

    def get_hybrid_group_names(self) -> list[str]:
        return list(self._names)

    def get_dim(self, axis_name: str) -> int:
        return self._dims[self._axis(axis_name)]

    def world_size(self) -> int:
        return int(self._ranks.size)

    def get_rank(self, **coords: int) -> int:
        """The rank at the given coordinate of every axis (``get_rank(data=0, pipe=1, sharding=0, model=1)``)."""
        if set(coords) != set(self._names):
            raise ValueError(f"get_rank needs one coordinate per axis {self._names}, got {sorted(coords)}")
        index = []
        for name in self._names:
            c, n = coords[name], self.get_dim(name)
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n:
                raise ValueError(f"get_rank: {name}={c!r} is outside the axis of size {n}")
            index.append(c)
        return int(self._ranks[tuple(index)])

    def get_coord(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world_size():
            raise ValueError(f"get_coord: rank {rank} is outside the topology of {self.world_size()} ranks")
        return tuple(int(c) for c in np.unravel_index(rank, self._dims))

    def get_axis_list(self, axis_name: str, index: int) -> list[int]:
        """Every rank whose coordinate on ``axis_name`` is ``index``."""
        return sorted(int(r) for r in np.take(self._ranks, index, axis=self._axis(axis_name)).reshape(-1))

    def get_comm_list(self, axis_name: str) -> list[list[int]]:
        """The groups along ``axis_name``: ranks that differ only in that coordinate."""
        a = self._axis(axis_name)
        moved = np.moveaxis(self._ranks, a, -1).reshape(-1, self._dims[a])
        return [[int(r) for r in row] for row in moved]

    def get_rank_from_stage(self, global_rank: int, **kwargs: int) -> int:
        """``global_rank``'s coordinate with the named axes replaced (``pipe=stage``)."""
        coord = dict(zip(self._names, self.get_coord(global_rank), strict=True))
        coord.update(kwargs)
        return self.get_rank(**coord)

    def mesh(self) -> ProcessMesh:
        """The same layout as a ``ProcessMesh`` (placements can use its axes)."""
        return ProcessMesh(self._ranks.tolist(), dim_names=list(self._names))

    def _axis(self, axis_name: str) -> int:
        if axis_name not in self._names:
            raise ValueError(f"topology axis {axis_name!r} is unknown; the axes are {self._names}")
        return self._names.index(axis_name)


class HybridCommunicateGroup:
    """One rank's view of the topology: its coordinate and its group along every axis."""

    def __init__(self, topology: CommunicateTopology, rank: int) -> None:
        self._topo = topology
        self.global_rank = int(rank)
        self.nranks = topology.world_size()
        coord = dict(zip(topology.get_hybrid_group_names(), topology.get_coord(rank), strict=True))
        self._coord = coord
        self._groups: dict[str, Group] = {}
        # Every rank creates every group in the same order, as Paddle requires of new_group.
        for axis in AXES:
            for ranks in topology.get_comm_list(axis):
                group = new_group(ranks)
                if self.global_rank in ranks:
                    self._groups[axis] = group
        self._check_group = new_group(list(range(self.nranks)))
        stage = coord["pipe"]
        pp = topology.get_dim("pipe")
        self._prev_rank = topology.get_rank_from_stage(rank, pipe=(stage - 1) % pp)
        self._next_rank = topology.get_rank_from_stage(rank, pipe=(stage + 1) % pp)

    # ------------------------------------------------------------------ the whole topology
    def topology(self) -> CommunicateTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_parallel_mode(self) -> int:
        _dp, pp, sh, mp = (self._topo.get_dim(a) for a in AXES)
        if mp == 1 and pp == 1 and sh == 1:
            return ParallelMode.DATA_PARALLEL
        if mp == 1 and pp == 1:
            return ParallelMode.SHARDING_PARALLEL
        if pp == 1:
            return ParallelMode.TENSOR_PARALLEL
        return ParallelMode.PIPELINE_PARALLEL

    def get_check_parallel_group(self, sharding: bool = False) -> Group:
        """The whole world (Paddle checks for inf/nan across it)."""
        return self._check_group

    # ------------------------------------------------------------------ per axis
    def _rank(self, axis: str) -> int:
        return self._coord[axis]

    def _size(self, axis: str) -> int:
        return self._topo.get_dim(axis)

    def _src(self, axis: str) -> int:
        return self._groups[axis].ranks[0]

    def get_data_parallel_rank(self) -> int:
        return self._rank("data")

    def get_data_parallel_world_size(self) -> int:
        return self._size("data")

    def get_data_parallel_group(self) -> Group:
        return self._groups["data"]

    def get_data_parallel_group_src_rank(self) -> int:
        return self._src("data")

    def get_model_parallel_rank(self) -> int:
        return self._rank("model")

    def get_model_parallel_world_size(self) -> int:
        return self._size("model")

    def get_model_parallel_group(self) -> Group:
        return self._groups["model"]

    def get_model_parallel_group_src_rank(self) -> int:
        return self._src("model")

    def get_stage_id(self) -> int:
        return self._rank("pipe")

    def get_pipe_parallel_rank(self) -> int:
        return self._rank("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        return self._size("pipe")

    def get_pipe_parallel_group(self) -> Group:
        return self._groups["pipe"]

    def get_p2p_groups(self) -> tuple[int, int]:
        """The previous and next stage's ranks (with this rank's other coordinates; wrapping around)."""
        return self._prev_rank, self._next_rank

    def get_rank_from_stage(self, stage_id: int, **kwargs: int) -> int:
        return self._topo.get_rank_from_stage(self.global_rank, pipe=stage_id, **kwargs)

    @property
    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    @property
    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self.get_pipe_parallel_world_size() - 1

    def get_sharding_parallel_rank(self) -> int:
        return self._rank("sharding")

    def get_sharding_parallel_world_size(self) -> int:
        return self._size("sharding")

    def get_sharding_parallel_group(self) -> Group:
        return self._groups["sharding"]

    def get_sharding_parallel_group_src_rank(self) -> int:
        return self._src("sharding")

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={self._topo.get_dim(a)}" for a in AXES)
        return f"HybridCommunicateGroup(rank={self.global_rank}, {dims}, coord={self._coord})"


__all__ = ["AXES", "CommunicateTopology", "HybridCommunicateGroup", "ParallelMode"]
