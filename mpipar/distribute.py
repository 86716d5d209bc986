"""Building and moving distributed tensors: ``shard_tensor``, ``reshard``, ``dtensor_from_local``.

Above ``tensor.py`` (the storage) and the planner and executor (the move). ``reshard_to`` is
the one internal path to a layout, for callers that already hold the target ``DistSpec``;
``reshard`` is its validating public front (mesh, placements, the tensor named in errors).
Each reshard once: a computed value already resharded to a layout reuses that result while it
is unchanged (``mpipar.tensor.reuse_reshards`` turns it off).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mpipar import _capture_hooks, _tape, comm, hooks
from mpipar._modes import Mode, execution_mode
from mpipar.backend import check_mesh, current_backend
from mpipar.comm import comm_context, current_context, note_reused_reshard
from mpipar.mesh import ProcessMesh
from mpipar.placement import Placement, check_placements, is_shard_spec, shard_spec_placements
from mpipar.reshard.executor import execute_plan, freeze
from mpipar.reshard.planner import plan_reshard
from mpipar.spec import Box, DistSpec, box_relative, box_shape, full_box
from mpipar.tensor import Tensor, _as_array, _reuse_enabled

Array = Any


def _shards_from_global(
    spec: DistSpec, value: np.ndarray | None, init: Callable[[tuple[int, ...], Any], Array] | None = None
) -> dict[int, Array]:
    """The hosted shards of ``spec``: cut out of the global ``value``, or generated box by box by
    ``init`` (a lazy value). No communication; replicas share one array."""
    backend = current_backend()
    xp = backend.xp
    no_partial = spec.without_partial()
    full = tuple((0, n) for n in spec.shape)
    by_box: dict[Any, Array] = {}
    shards = {}
    source = freeze(xp.asarray(value)) if value is not None else None
    for r in backend.hosted_ranks(spec.mesh):
        box = no_partial.boxes[r]
        if box not in by_box:
            if no_partial.zigzag:  # storage order: the box's chunks, each cut from where it lies
                by_box[box] = freeze(_assemble_pieces(no_partial, box, source, init, xp))
            elif source is not None:
                by_box[box] = source[box_relative(box, full)]
            else:
                assert init is not None
                by_box[box] = freeze(xp.asarray(init(tuple(spec.shape), box)))
        shards[r] = by_box[box]
    dtype = source.dtype if source is not None else next(iter(shards.values())).dtype if shards else np.float32
    if no_partial == spec:
        return shards
    # Replicate -> Partial is local: the planner's partial steps split the value exactly.
    return execute_plan(plan_reshard(no_partial, spec), shards, dtype, backend)


def _assemble_pieces(
    spec: DistSpec,
    box: Box,
    source: Array | None,
    init: Callable[[tuple[int, ...], Any], Array] | None,
    xp: Any,
) -> Array:
    """Storage box ``box`` of a zigzag ``spec`` built from the global pieces it holds."""
    pieces = spec.global_pieces(box)
    parts = []
    for _, gbox in pieces:
        if source is not None:
            parts.append(source[box_relative(gbox, full_box(spec.shape))])
        else:
            assert init is not None
            parts.append(xp.asarray(init(tuple(spec.shape), gbox)))
    dtype = parts[0].dtype if parts else (source.dtype if source is not None else np.float32)
    out = xp.empty(box_shape(box), dtype=dtype)
    for (index, _), part in zip(pieces, parts, strict=True):
        out[index] = part
    return out


def _spec_for(
    what: str | Callable[[], str], shape: Sequence[int], mesh: ProcessMesh, placements: list[Placement]
) -> DistSpec:
    """Build a spec, prefixing any error with the tensor it was meant for (``what``, or a
    function giving it, called only on an error)."""
    try:
        return _interned_spec(tuple(shape), mesh, tuple(placements))
    except ValueError as exc:
        raise ValueError(f"{what if isinstance(what, str) else what()}: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _interned_spec(shape: tuple[int, ...], mesh: ProcessMesh, placements: tuple[Placement, ...]) -> DistSpec:
    """One spec object per value: a training step asks for the same few layouts over and over,
    and a shared object keeps its cached boxes and hits the plan cache by identity."""
    return DistSpec(shape, mesh, placements)


def shard_tensor(
    data: Any,
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    dtype: Any = None,
    stop_gradient: bool | None = None,
) -> Tensor:
    """Distribute ``data`` over ``mesh`` with ``placements`` (one per mesh axis).

    ``data`` is a NumPy array, a nested list or a ``Tensor``. ``placements`` may also be
    Paddle's older shard spec, per tensor dim a mesh axis name or None (``[None, "mp"]``). A ``Tensor`` is marked in place
    (and returned): it keeps its identity, so a ``Parameter`` stays a ``Parameter`` and the
    seeds' ``dist.shard_tensor(x, mesh, [dist.Shard(0)])`` without assignment works. A
    distributed tensor is resharded to the new layout. Partial placements split the value so
    that reducing the shards gives it back (sum: the first rank of the axis holds it, the
    others zero; avg, max, min: every rank holds it).
    """
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"shard_tensor mesh must be a dist.ProcessMesh, got {type(mesh).__name__}")
    backend = current_backend()
    check_mesh(mesh, backend)
    if is_shard_spec(placements):  # Paddle's older spelling: [None, "mp"]
        ndim = data.ndim if isinstance(data, Tensor) else np.ndim(data)
        placements = shard_spec_placements(list(placements), mesh, ndim, "shard_tensor")
    pls = check_placements(placements, "shard_tensor placements")
    if isinstance(data, Tensor):
        target = data
        if dtype is not None and np.dtype(dtype) != data.dtype:
            raise ValueError(
                f"shard_tensor marks {data._label()} in place and cannot change its dtype "
                f"{data.dtype} to {np.dtype(dtype)}; cast it first"
            )
        spec = _spec_for(f"shard_tensor of {data._label()}", data.shape, mesh, pls)
        mode = execution_mode([data], backend)
        if mode is Mode.ABSTRACT:
            target._take_init()
            target._take_storage(Tensor.abstract(data.shape, data.dtype, spec))
        elif data._init is not None and mode is Mode.DISTRIBUTED:
            # A lazy value: each hosted rank generates its own shard, never the whole tensor.
            init = data._take_init()
            target._set_dist(spec, _shards_from_global(spec, None, init), data.dtype)
        elif data._grad_fn is not None:
            # A tensor with history: the marked value is a reshard of the old one, on the tape.
            history = data.detach()
            history._set_history(data._grad_fn, data._out_index)
            history.stop_gradient = data.stop_gradient
            moved = reshard(history, mesh, pls)
            target._take_storage(moved)
            target._set_history(moved._grad_fn, moved._out_index)
        elif data.is_dist:
            target._take_storage(reshard(data, mesh, pls))
        elif mode is Mode.DENSE:
            target._take_storage(Tensor._from_reference(spec, data._value))
        else:
            target._set_dist(spec, _shards_from_global(spec, data._value), data.dtype)
    else:
        value = _as_array(data, dtype, copy=True)
        spec = _spec_for(f"shard_tensor of an array of shape {list(value.shape)}", value.shape, mesh, pls)
        mode = execution_mode((), backend)
        if mode is Mode.ABSTRACT:
            target = Tensor.abstract(value.shape, value.dtype, spec)
        elif mode is Mode.DENSE:
            target = Tensor._from_reference(spec, value)
        elif _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
            target = Tensor._from_shards(spec, tr.shard_array(spec, data, dtype), value.dtype)
        else:
            target = Tensor._from_shards(spec, _shards_from_global(spec, value), value.dtype)
    if stop_gradient is not None:
        target.stop_gradient = stop_gradient
    if isinstance(data, Tensor):
        for program in hooks.program_hooks:
            program.on_shard_tensor(target, mesh, pls)
    return target


def reshard(tensor: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> Tensor:
    """A new tensor with ``tensor``'s value laid out as ``placements`` on ``mesh``.

    Same mesh or another one (other processes, other shape), any placements, uneven sizes.
    A dense tensor is distributed (every process holds its value, so no communication).
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"reshard needs a dist tensor, got {type(tensor).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"reshard mesh must be a dist.ProcessMesh, got {type(mesh).__name__}")
    pls = check_placements(placements, "reshard placements")
    return reshard_to(tensor, _spec_for(lambda: f"reshard of {tensor._label()}", tensor.shape, mesh, pls))


def reshard_to(tensor: Tensor, spec: DistSpec) -> Tensor:
    """``tensor`` laid out as ``spec`` (a spec of its global shape): the internal ``reshard``.

    For callers that already hold the target layout (an op's rule, a leaf's gradient layout, a
    saved note): no re-validation and no list of placements rebuilt, the same path otherwise.
    """
    if tuple(spec.shape) != tuple(tensor.shape):
        raise ValueError(f"reshard of {tensor._label()} to {spec}: the target layout is of another global shape")
    dst = _interned_spec(tuple(spec.shape), spec.mesh, tuple(spec.placements))
    backend = current_backend()
    check_mesh(dst.mesh, backend)
    if hooks.stage_runs and tensor.is_dist and not tensor.spec.mesh.same_layout(dst.mesh):
        # A pipeline stage boundary inside a stage-filtered forward (mpipar.pipeline.runner).
        return hooks.stage_runs[-1].boundary(tensor, dst)
    out = _reshard(tensor, dst, backend)
    if hooks.program_hooks and hooks.resharding_for() is None:
        for program in hooks.program_hooks:
            program.on_reshard_call(tensor, dst, out)
    return out


def _reused(tensor: Tensor, dst: DistSpec) -> Tensor | None:
    """The reshard of ``tensor`` to ``dst`` an earlier consumer made, as a new tensor; None if none.

    Valid while the value is unchanged (an in-place update gives a new storage id). The result
    shares the stored shards (read-only) and gets its own reshard node, so gradients reaching
    it flow back to ``tensor`` as a fresh reshard's would.
    """
    cache = tensor._reshards
    entry = cache.get(dst) if cache else None
    if entry is None or entry[0] != tensor._sid:
        return None
    out = entry[1].detach()
    if comm._recorders:  # (only a recorder hears of it: no plan looked up for nobody)
        plan = plan_reshard(tensor.spec, dst)
        if plan.steps:
            note_reused_reshard(plan.src.placements_str, plan.dst.placements_str, tensor.dtype)
    return out


def _reshard(tensor: Tensor, dst: DistSpec, backend: Any) -> Tensor:
    """The reshard itself (``reshard`` minus the pipeline-boundary check).

    Each reshard once: a computed value (an op's output) already resharded to ``dst`` is not
    resharded again while it is unchanged; the earlier result is used (and reported as reused).
    """
    # One big device (``execution_mode`` DENSE: the reference backend, not shape-only) moves
    # nothing, so there is nothing to reuse.
    cacheable = (
        tensor._reshards is not None
        and tensor._spec is not None
        and _reuse_enabled[-1]
        and (backend.shape_only or not backend.reference)
    )
    out: Tensor | None = _reused(tensor, dst) if cacheable else None
    if out is not None:
        out.stop_gradient = tensor.stop_gradient
        if not tensor.stop_gradient and _tape._grad_enabled:
            out._set_history(reshard_node(tensor))
        return out
    out = _reshard_now(tensor, dst, backend)
    if cacheable:
        out._mark_computed()
        assert tensor._reshards is not None
        tensor._reshards[dst] = (tensor._sid, out.detach())
    out.stop_gradient = tensor.stop_gradient
    if not tensor.stop_gradient and _tape._grad_enabled:
        out._set_history(reshard_node(tensor))
    return out


def _reshard_now(tensor: Tensor, dst: DistSpec, backend: Any) -> Tensor:
    """Move the data (or, shape-only, plan the move)."""
    spec = tensor._spec
    if spec is not None and not tensor._abstract and not backend.shape_only and not backend.reference:
        # A distributed value with data (``execution_mode`` DISTRIBUTED), asked first: the
        # usual case, and without building the list ``execution_mode`` takes.
        plan = plan_reshard(spec, dst)
        tr = _capture_hooks.capture_tracer() if _capture_hooks.capture_tracers else None
        if tr is not None:  # a captured step being traced: the plan's execution is an instruction
            out = Tensor._from_shards(dst, tr.reshard(plan, tensor, backend), tensor._dtype)
        else:  # (the plan's shards come frozen)
            shards = execute_plan(plan, tensor._plan_input(plan, backend), tensor._dtype, backend)
            out = Tensor._from_frozen_shards(dst, shards, tensor._dtype)
        if plan.steps and hooks.reshard_hooks:
            for hook in hooks.reshard_hooks:
                hook.on_reshard(tensor, out, plan, current_context())
        return out
    mode = execution_mode([tensor], backend)
    if mode is Mode.ABSTRACT:
        out = Tensor.abstract(tensor.shape, tensor.dtype, dst)
        if tensor.is_dist:
            plan = plan_reshard(tensor.spec, dst)
            if plan.steps:
                for hook in hooks.reshard_hooks:
                    hook.on_reshard(tensor, out, plan, current_context())
    elif mode is Mode.DENSE:
        assert tensor._value is not None
        out = Tensor._from_reference(dst, tensor._value)
    else:  # a dense value cut into shards
        tr = _capture_hooks.capture_tracer() if _capture_hooks.capture_tracers else None
        if tr is not None:  # a captured step being traced: the cut is an instruction
            out = Tensor._from_shards(dst, tr.from_global(dst, tensor), tensor.dtype)
        else:
            out = Tensor._from_shards(dst, _shards_from_global(dst, np.asarray(tensor._value)), tensor.dtype)
    return out


def dtensor_from_local(
    local: Array | Mapping[int, Array] | Callable[[int], Array],
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None = None,
    dtype: Any = None,
) -> Tensor:
    """Assemble a distributed tensor from its local shards, without communication.

    ``local``: the shard of this process's rank (under MPI), a ``{rank: array}`` dict
    covering the hosted ranks, or a function ``rank -> array``. ``shape`` is the global
    shape; when omitted, every Shard is assumed even (local size x ranks). Each shard must
    have exactly the shape the chunking rule gives its rank. ``dtype`` is needed only where
    this process hosts no rank of the mesh and ``local`` is a function (it then cannot be read
    off a shard); every process must agree on it.
    """
    pls = check_placements(placements, "dtensor_from_local placements")
    backend = current_backend()
    check_mesh(mesh, backend)
    hosted = backend.hosted_ranks(mesh)
    if callable(local) and not hasattr(local, "shape"):
        given = {r: local(r) for r in hosted}
    elif isinstance(local, Mapping):
        missing = [r for r in hosted if r not in local]
        if missing:
            raise ValueError(f"dtensor_from_local: no shard given for hosted rank(s) {missing} of {mesh}")
        given = {r: local[r] for r in hosted}
    else:
        # A per-rank program in the simulator gives only its own piece: the other ranks' pieces
        # are in their threads, and the backend assembles them.
        assembled = backend.assemble_locals(mesh, local)
        given = assembled if assembled is not None else {r: local for r in hosted}
    arrays = {r: np.asarray(a) if not hasattr(a, "__cuda_array_interface__") else a for r, a in given.items()}
    if shape is None:
        if not arrays:
            raise ValueError("dtensor_from_local needs shape= when this process hosts no rank of the mesh")
        sample = next(iter(arrays.values()))
        guess = list(sample.shape)
        for a, p in enumerate(pls):
            if p.is_shard():
                guess[p.dim] *= mesh.shape[a]  # type: ignore[attr-defined]
        shape = guess
    spec = DistSpec(shape, mesh, pls)
    want = np.dtype(dtype) if dtype is not None else None
    dtype = None
    for r, a in arrays.items():
        expected = spec.local_shape(r)
        if tuple(a.shape) != expected:
            raise ValueError(
                f"dtensor_from_local: the shard of rank {r} has shape {list(a.shape)}, but global shape "
                f"{list(spec.shape)} with placements {spec.placements_str} on {mesh} gives rank {r} "
                f"a shard of shape {list(expected)} (chunking rule: first n % k chunks one longer)"
            )
        if dtype is None:
            dtype = a.dtype
        elif a.dtype != dtype:
            raise ValueError(f"dtensor_from_local: shards have different dtypes {dtype} and {a.dtype} (rank {r})")
    if want is not None and dtype is not None and dtype != want:
        raise ValueError(f"dtensor_from_local: shards are {dtype} but dtype={want} was given")
    final = want or dtype or getattr(local, "dtype", None)
    if final is None:
        raise ValueError(
            f"dtensor_from_local: this process hosts no rank of {mesh}, so the dtype cannot be read off a shard; "
            "pass dtype= (the same on every process)"
        )
    if execution_mode((), backend) is Mode.DENSE:
        raise ValueError("dtensor_from_local builds from per-rank shards, which --reference mode does not have")
    xp = backend.xp
    return Tensor._from_shards(spec, {r: xp.array(a) for r, a in arrays.items()}, final)


# ======================================================================== the reshard on the tape
def _reshard_grad(ctx: _tape.GradContext, grads: list[Tensor | None]) -> list[Tensor | None]:
    g = grads[0]
    back = ctx.attrs.get("source_spec")
    if g is None or back is None or not g.is_dist or g.spec.mesh.same_layout(back.mesh):
        return [g]  # same mesh: the value is the gradient; consumers reshard as they need
    # Across meshes (a pipeline hand-off) the gradient goes back to the source's mesh.
    with comm_context(f"backward of the hand-off {g.spec.mesh.process_ids} <- {back.mesh.process_ids}"):
        return [reshard_to(g, back.without_partial())]


def reshard_node(source: Tensor) -> _tape.Node:
    """The node of a reshard: its backward passes the gradient through (back to the source's
    mesh when the reshard crossed meshes)."""
    spec = source._spec
    if spec is None:
        ctx = _tape.GradContext(
            "reshard", {"source_spec": None}, [None], [None], [tuple(source.shape)], [source.dtype], [True]
        )
        return _tape.Node("reshard", _reshard_grad, ctx, [source], 1, "", None)
    key = (id(spec), source._dtype)
    parts = _RESHARD_NODE_PARTS.get(key)
    if parts is None or parts[0] is not spec:
        # (the backward replay's key: the gradient passes through, or goes back to ``spec``'s mesh)
        sig = (_reshard_grad, spec, source._dtype)
        parts = (spec, {"source_spec": spec}, [tuple(spec.shape)], [source._dtype], [True], sig)
        if len(_RESHARD_NODE_PARTS) >= 4096:
            _RESHARD_NODE_PARTS.clear()
        _RESHARD_NODE_PARTS[key] = parts
    _, attrs, shapes, dtypes, needs, sig = parts
    ctx = _tape.GradContext("reshard", attrs, [None], [None], shapes, dtypes, needs)
    return _tape.Node("reshard", _reshard_grad, ctx, [source], 1, "", sig)


_RESHARD_NODE_PARTS: dict[tuple[int, Any], tuple[Any, ...]] = {}
"""Per source layout (by identity; the entry holds it) and dtype, what every reshard node of
such a source holds alike: its attributes, shape, dtype and need lists and its replay key. The
engine reassigns such a list, never changes one, and no gradient function writes its
attributes."""


def _regather(payload: tuple[Tensor, DistSpec]) -> Tensor:
    """Gather a ZeRO-3 parameter again for backward, from the note ``(param, spec)`` saved for it."""
    param, spec = payload
    with _tape.no_grad(), comm_context(f"backward: gather {param._label()} stored split (ZeRO-3)"):
        return reshard_to(param, spec)


_tape.regather.append(_regather)
