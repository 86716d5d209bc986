"""The seeds' parallel APIs: ``shard_layer``, ``shard_optimizer`` (ZeRO 1/2/3), ``shard_dataloader``.

ZeRO through placements (the sharding axis is a data-parallel mesh axis, say ``dp``):

* stage 1: optimizer states live split along ``dp`` (``Shard(d)`` where the parameter is
  Replicate); the update runs on that slice and the new parameter is all-gathered back.
* stage 2: + each parameter's gradient is kept in that split layout, so the data-parallel
  gradient reduction is a reduce_scatter instead of an all_reduce.
* stage 3: + the parameter itself is stored split; an op that uses it gathers it first
  (all_gather), the gathered copy is freed after the op, and backward gathers it again
  instead of keeping it (a saved-tensor note), so only the shard persists.

The split dim of a parameter is the longest dim that no later mesh axis already splits (so
cutting it is a local slice); a parameter with no such dim keeps replicated states.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpipar._modes import Mode, execution_mode
from mpipar.backend import current_backend
from mpipar.distribute import dtensor_from_local, reshard, shard_tensor
from mpipar.io import DataLoader
from mpipar.mesh import ProcessMesh
from mpipar.nn.layer import Layer
from mpipar.ops import dispatch
from mpipar.optimizer.optimizer import Optimizer
from mpipar.placement import Placement, Replicate, Shard, shard_spec_placements
from mpipar.spec import DistSpec
from mpipar.tensor import Tensor


# =============================================================================== shard_layer
def shard_layer(
    layer: Layer,
    process_mesh: ProcessMesh,
    shard_fn: Callable[[str, Layer, ProcessMesh], None] | None = None,
    input_fn: Callable[[Any, ProcessMesh], Any] | None = None,
    output_fn: Callable[[Any, ProcessMesh], Any] | None = None,
) -> Layer:
    """Distribute ``layer``'s parameters: ``shard_fn(name, sublayer, mesh)`` marks what it wants;
    every parameter still dense is then replicated on ``process_mesh``. ``input_fn`` and
    ``output_fn`` become forward hooks (e.g. to mark the input batch ``Shard(0)``)."""
    if not isinstance(process_mesh, ProcessMesh):
        raise TypeError(f"shard_layer needs a dist.ProcessMesh, got {type(process_mesh).__name__}")
    if shard_fn is not None:
        for name, sub in layer.named_sublayers(include_self=True):
            shard_fn(name, sub, process_mesh)
    for name, p in layer.named_parameters():
        if not p.is_dist:
            shard_tensor(p, process_mesh, [Replicate()] * process_mesh.ndim)
        elif any(pl.is_partial() for pl in p.placements or []):
            raise ValueError(
                f"parameter {name!r} is Partial {p.spec.placements_str} on {p.spec.mesh}: a parameter must be "
                "Shard or Replicate (a partial value cannot be updated); reshard it first"
            )
    if input_fn is not None:
        layer.register_forward_pre_hook(lambda lyr, args: input_fn(args, process_mesh))
    if output_fn is not None:
        layer.register_forward_post_hook(lambda lyr, args, out: output_fn(out, process_mesh))
    return layer


# =============================================================================== ZeRO
class _ShardingStage:
    stage = 0

    def __init__(
        self, mesh_dim: str | int = 0, mesh: ProcessMesh | None = None, sharding_mesh_dim: str | int | None = None
    ) -> None:
        self.mesh_dim = sharding_mesh_dim if sharding_mesh_dim is not None else mesh_dim
        self.mesh = mesh

    def layout(self, p: Tensor, spec: DistSpec | None = None) -> DistSpec | None:
        """Where ``p``'s optimizer states live (None: like the parameter)."""
        spec = spec or (p.spec if p.is_dist else None)
        if spec is None:
            return None
        mesh = spec.mesh
        if isinstance(self.mesh_dim, str):
            if self.mesh_dim not in mesh.dim_names:
                return None
            a = mesh.dim_names.index(self.mesh_dim)
        else:
            if not 0 <= self.mesh_dim < mesh.ndim:
                return None
            a = int(self.mesh_dim)
        if not spec.placements[a].is_replicated() or mesh.shape[a] == 1:
            return None
        # Dims split by a later (inner) axis of more than one rank cannot take an outer split locally.
        later = {p.dim for b, p in enumerate(spec.placements) if b > a and isinstance(p, Shard) and mesh.shape[b] > 1}
        local = spec.box_at([0] * mesh.ndim)
        dims = [d for d in range(len(spec.shape)) if d not in later and local[d][1] - local[d][0] >= mesh.shape[a]]
        if not dims:
            return None
        d = max(dims, key=lambda d: (local[d][1] - local[d][0], -d))
        pls: list[Placement] = list(spec.placements)
        pls[a] = Shard(d)
        return spec.with_placements(pls)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mesh_dim!r})"


class ShardingStage1(_ShardingStage):
    """ZeRO-1: optimizer states split along the sharding axis."""

    stage = 1


class ShardingStage2(_ShardingStage):
    """ZeRO-2: + gradients reduce-scattered into the split layout."""

    stage = 2


class ShardingStage3(_ShardingStage):
    """ZeRO-3: + parameters stored split, gathered per use (forward and backward) and freed after."""

    stage = 3


def shard_optimizer(
    optimizer: Optimizer, shard_fn: _ShardingStage | None = None, gradient_accumulation_steps: int = 1
) -> Optimizer:
    """Make ``optimizer`` distribution-aware; with a ``ShardingStageN`` apply ZeRO stage N."""
    if shard_fn is None:
        return optimizer
    if not isinstance(shard_fn, _ShardingStage):
        raise TypeError(f"shard_optimizer: shard_fn must be dist.ShardingStage1/2/3, got {shard_fn!r}")
    layouts: dict[int, DistSpec | None] = {}
    for p in optimizer._parameter_list:
        if not p.is_dist and shard_fn.mesh is not None:
            shard_tensor(p, shard_fn.mesh, [Replicate()] * shard_fn.mesh.ndim)
        if p.is_dist and any(pl.is_partial() for pl in p.placements or []):
            raise ValueError(
                f"shard_optimizer: parameter {p._label()} is Partial {p.spec.placements_str}; parameters must not be Partial"
            )
        layout = shard_fn.layout(p)
        layouts[id(p)] = layout
        if layout is None:
            continue
        if shard_fn.stage >= 2:
            p.grad_placements = list(layout.placements)
        if shard_fn.stage == 3:
            full = p.spec
            shard_tensor(p, layout.mesh, list(layout.placements))  # stored split, in place
            p._compute_spec = full
            dispatch.note_stored_split()
    optimizer._update_layout = lambda p: layouts.get(id(p))
    return optimizer


# =============================================================================== shard_op
def shard_op(
    op: Callable[..., Any],
    process_mesh: ProcessMesh,
    in_shard_specs: Sequence[Sequence[Any] | None] | None = None,
    out_shard_specs: Sequence[Sequence[Any] | None] | None = None,
) -> Callable[..., Any]:
    """Run ``op`` (a function or a Layer) on ``process_mesh`` (seed 003's ``shard_op``).

    Tensor arguments move to the mesh: laid out by ``in_shard_specs`` (Paddle's shard specs:
    per tensor dim a mesh axis name or None) when given, else replicated if they live
    elsewhere. A Layer's parameters still dense or on another mesh move there (replicated) on
    the first call. ``out_shard_specs`` lays the outputs out the same way.
    """

    def placements_of(spec: Sequence[Any], ndim: int) -> list[Placement]:
        return shard_spec_placements(list(spec), process_mesh, ndim, "shard_op")

    def move(t: Any, spec: Sequence[Any] | None) -> Any:
        if not isinstance(t, Tensor):
            return t
        if spec is not None:
            return reshard(t, process_mesh, placements_of(spec, t.ndim))
        if not t.is_dist or not t.spec.mesh.same_layout(process_mesh):
            return reshard(t, process_mesh, [Replicate()] * process_mesh.ndim)
        return t

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if isinstance(op, Layer):
            for p in op.parameters():
                if not p.is_dist or not p.spec.mesh.same_layout(process_mesh):
                    shard_tensor(p, process_mesh, [Replicate()] * process_mesh.ndim)
        specs = list(in_shard_specs) if in_shard_specs is not None else []
        moved = [move(a, specs[i] if i < len(specs) else None) for i, a in enumerate(args)]
        out = op(*moved, **kwargs)
        if out_shard_specs is None:
            return out
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        outs = [move(o, s) for o, s in zip(outs, out_shard_specs, strict=True)]
        return tuple(outs) if isinstance(out, (tuple, list)) else outs[0]

    return wrapped


# =============================================================================== data
def _global_generator_states() -> tuple[Any, ...]:
    """The state of the generators a dataset may draw from without owning one: NumPy's and
    Python's global ones (``np.random.uniform``, ``random.random`` in ``__getitem__``)."""
    state = np.random.get_state(legacy=False)
    inner = state["state"]
    return inner["key"].tobytes(), inner["pos"], state["has_gauss"], state["gauss"], random.getstate()


class ShardDataloader:
    """Batches as distributed tensors: inputs on the first mesh, labels on the last, the batch
    dim split along ``shard_dims``.

    Each process loads only the samples its ranks hold, unless the dataset draws from NumPy's or
    Python's global generator (the seeds' ``np.random.uniform`` in ``__getitem__``): then a
    sample's value depends on the draws before it, and every process loads the whole batch in
    order, as one device does, so that every launch mode sees the same data. The first batch is
    loaded whole and tells which (a dataset with a generator of its own is not seen: seed it by
    index, or it differs per process as it would in Paddle)."""

    def __init__(
        self,
        dataloader: DataLoader,
        meshes: ProcessMesh | Sequence[ProcessMesh],
        input_keys: Any = None,
        shard_dims: Any = None,
        is_dataset_splitted: bool = False,
    ) -> None:
        self.loader = dataloader
        self.meshes = [meshes] if isinstance(meshes, ProcessMesh) else list(meshes)
        if not self.meshes:
            raise ValueError("shard_dataloader needs at least one mesh")
        dims = shard_dims if isinstance(shard_dims, (list, tuple)) else [shard_dims] * len(self.meshes)
        if len(dims) != len(self.meshes):
            raise ValueError(f"shard_dataloader: {len(dims)} shard_dims for {len(self.meshes)} meshes")
        self.shard_dims = dims
        self._meta: list[tuple[tuple[int, ...], Any]] | None = None
        self._stateful: bool | None = None
        """Whether loading moves the global generators (then every process loads whole batches)."""

    def _placements(self, k: int, ndim: int) -> list[Placement]:
        mesh, dim = self.meshes[k], self.shard_dims[k]
        pls: list[Placement] = [Replicate()] * mesh.ndim
        if dim is not None and ndim > 0:
            pls[mesh.axis_index(dim)] = Shard(0)
        return pls

    def _field_mesh(self, i: int, n_fields: int) -> int:
        return 0 if i == 0 or len(self.meshes) == 1 else len(self.meshes) - 1

    def _batches(self) -> Iterator[Tensor | list[Tensor]]:
        backend = current_backend()
        for indices in self.loader.index_batches():
            whole: list[np.ndarray] | None = None
            if self._stateful is not False or execution_mode((), backend) is Mode.DENSE:
                before = _global_generator_states() if self._stateful is None else None
                whole = self.loader.load_indices(indices)
                if before is not None:
                    self._stateful = before != _global_generator_states()
                if self._meta is None:
                    self._meta = [(tuple(a.shape[1:]), a.dtype) for a in whole]
            if execution_mode((), backend) is Mode.DENSE:  # one device: the whole batch
                assert whole is not None
                yield self._batch([self._whole(i, a) for i, a in enumerate(whole)])
                continue
            assert self._meta is not None
            # Which batch rows do the ranks hosted here hold?
            specs = []
            rows: set[int] = set()
            for i, (shape, _dtype) in enumerate(self._meta):
                k = self._field_mesh(i, len(self._meta))
                spec = DistSpec((len(indices), *shape), self.meshes[k], self._placements(k, 1 + len(shape)))
                specs.append(spec)
                for r in backend.hosted_ranks(spec.mesh):
                    s, e = spec.local_box(r)[0]
                    rows.update(range(s, e))
            wanted = sorted(rows)
            if whole is not None:  # loaded whole: keep the rows held here
                loaded = [a[wanted] for a in whole] if wanted else []
            else:
                loaded = self.loader.load_indices([indices[j] for j in wanted]) if wanted else []
            position = {row: j for j, row in enumerate(wanted)}
            out = []
            for i, spec in enumerate(specs):
                dtype = self._meta[i][1]

                def local(
                    rank: int,
                    i: int = i,
                    spec: DistSpec = spec,
                    loaded: list[Any] = loaded,
                    position: dict[int, int] = position,
                    dtype: Any = dtype,
                ) -> np.ndarray:
                    s, e = spec.local_box(rank)[0]
                    if e == s:
                        return np.zeros((0, *spec.shape[1:]), dtype=dtype)
                    return np.ascontiguousarray(loaded[i][[position[row] for row in range(s, e)]])

                out.append(dtensor_from_local(local, spec.mesh, list(spec.placements), shape=spec.shape, dtype=dtype))
            yield self._batch(out)

    def _batch(self, fields: list[Tensor]) -> Tensor | list[Tensor]:
        """One tensor for a single-field dataset (as the wrapped ``DataLoader`` yields), else the list."""
        return fields[0] if self.loader.single_field and len(fields) == 1 else fields

    def _whole(self, i: int, array: np.ndarray) -> Tensor:
        k = self._field_mesh(i, 0)
        return shard_tensor(array, self.meshes[k], self._placements(k, array.ndim))

    def __iter__(self) -> Iterator[Tensor | list[Tensor]]:
        return self._batches()

    def __call__(self) -> Iterator[Tensor | list[Tensor]]:
        return iter(self)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def set_state_dict(self, state: dict[str, int]) -> None:
        self.loader.set_state_dict(state)


def shard_dataloader(
    dataloader: DataLoader,
    meshes: ProcessMesh | Sequence[ProcessMesh],
    input_keys: Any = None,
    shard_dims: Any = None,
    is_dataset_splitted: bool = False,
) -> ShardDataloader:
    """Paddle's ``dist.shard_dataloader``: see ``ShardDataloader``."""
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted)
