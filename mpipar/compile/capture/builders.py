"""What each call site records: a kernel, a reshard, a dense tensor cut into shards, fresh arrays,
an optimizer update and its step count, each run now and bound into an instruction for every
later run; ``StepTracer`` is the tracer the call sites talk to."""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from mpipar import comm
from mpipar.backend import current_backend
from mpipar.compile.capture.instructions import Array, Refused, Stale
from mpipar.compile.capture.sources import ArgSource, GradSource, StateSource
from mpipar.compile.capture.tracer import Tracer, meta_override
from mpipar.distribute import _shards_from_global
from mpipar.optimizer.optimizer import _param_lr
from mpipar.optimizer.sgd_momentum_adam import SGD
from mpipar.placement import Replicate
from mpipar.reshard.executor import _RUNNERS, execute_plan, freeze
from mpipar.spmd.rules.common import norm_axes
from mpipar.tensor import _as_array


def _kernel1_fn(kernel: Callable[..., Any], ctx: Any, attrs: dict[str, Any], dt: Any, *arrays: Array) -> Array:
    """``_kernel_fn`` of a one-output op on NumPy arrays: the same normalisation, fewer steps."""
    arr = kernel(ctx, *arrays, **attrs)
    if type(arr) is not np.ndarray:
        if not isinstance(arr, np.generic):
            return freeze(arr if arr.dtype == dt else arr.astype(dt))
        arr = np.asarray(arr)
    if arr.dtype != dt:
        arr = arr.astype(dt)
    arr.setflags(False)
    return arr


def _kernel_fn(op: Any, ctx: Any, attrs: dict[str, Any], dtypes: Sequence[Any], multi: bool, *arrays: Array) -> Any:
    """An op's kernel on local arrays, normalised as ``dispatch._run_dist`` does (0-d, dtype, read-only)."""

    result = op.kernel(ctx, *arrays, **attrs)
    got = list(result) if multi else [result]
    for j, (arr, dt) in enumerate(zip(got, dtypes, strict=True)):
        if isinstance(arr, np.generic):
            arr = np.asarray(arr)
        if arr.dtype != dt:
            arr = arr.astype(dt)
        got[j] = freeze(arr)
    return tuple(got) if multi else got[0]


def _dense_kernel_fn(
    op: Any, ctx: Any, attrs: dict[str, Any], dtypes: Sequence[Any], multi: bool, *arrays: Array
) -> Any:
    """An op's kernel on whole arrays, normalised as ``dispatch._run_dense`` does."""

    result = op.kernel(ctx, *arrays, **attrs)
    got = list(result) if multi else [result]
    for j, (arr, dt) in enumerate(zip(got, dtypes, strict=True)):
        arr = (
            np.asarray(arr, dtype=dt)
            if isinstance(arr, (np.ndarray, np.generic, int, float, bool))
            else arr.astype(dt, copy=False)
        )
        got[j] = freeze(arr)
    return tuple(got) if multi else got[0]


def record_kernel(
    tr: Tracer,
    op: Any,
    ctx: Any,
    attrs: dict[str, Any],
    dtypes: Sequence[Any],
    used: Sequence[Any],
    r: int | None,
    arrays: Sequence[Array],
    got: Sequence[Array],
    dense: bool = False,
    raw: Any = None,
) -> None:
    """Record one kernel call of ``_run_dist`` (``dense``: ``_run_dense``) that produced ``got``
    (``raw``: what the kernel itself returned)."""
    multi = bool(op.multi_output)
    # A kernel that gave a NumPy array of the output dtype needs no normalising: the same input
    # layouts and dtypes (checked on every run) give it again. The program's intermediates need
    # not be read-only (nothing but the program sees them); what it hands out is frozen.
    bare = not dense and not multi and type(raw) is np.ndarray and got[0] is raw
    fn: Callable[..., Any]
    if bare:
        fn = partial(op.kernel, ctx, **attrs)
    elif dense:
        fn = partial(_dense_kernel_fn, op, ctx, attrs, tuple(dtypes), multi)
    elif not multi:
        fn = partial(_kernel1_fn, op.kernel, ctx, attrs, dtypes[0])
    else:
        fn = partial(_kernel_fn, op, ctx, attrs, tuple(dtypes), multi)
    if not dense and not multi:
        fn = _specialized(op, ctx, attrs, arrays, got[0], dtypes[0], bare) or fn
    key = ("kernel", dense, bare, op.kernel, ctx, attrs, tuple(dtypes))
    n = len(tr.instrs)
    tr.record(fn, key, [(a, u, r) for a, u in zip(arrays, used, strict=True)], tuple(got) if multi else got[0], multi)
    if len(tr.instrs) > n and builtin_kernel(op):
        tr.pure.add(n)


def builtin_kernel(op: Any) -> bool:
    """An op whose kernel is mpipar's own: a function of its inputs, attributes and context only
    (a user's kernel may read state the capture cannot see, so it is never folded)."""
    return getattr(op.kernel, "__module__", "").startswith("mpipar.ops.")


_BINARY = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "divide": operator.truediv}
"""mpipar's elementwise kernels that are ``x + y`` (etc.) on NumPy arrays: called as the operator."""


def _specialized(
    op: Any, ctx: Any, attrs: dict[str, Any], arrays: Sequence[Array], out: Array, dt: Any, bare: bool
) -> Callable[..., Array] | None:
    """A cheaper call giving the same array as ``op``'s kernel on these NumPy inputs (shapes and
    dtypes fixed by the trace): what the kernel works out from its context on every call (the
    local output shape, the reduced axes, the global count of a mean) worked out once, and the
    same NumPy call made. Only mpipar's own kernels, on NumPy; None for anything else. The
    validation run checks the result bit for bit like any other instruction."""
    if ctx.xp is not np or not builtin_kernel(op) or any(type(a) is not np.ndarray for a in arrays):
        return None
    name = getattr(op.kernel, "__name__", "")
    if bare and op.name in _BINARY and name == "<lambda>" and len(arrays) == 2:
        return _BINARY[op.name]
    if bare and name == "_to_local_shape" and len(arrays) == 1:
        return operator.methodcaller("reshape", tuple(out.shape))
    if bare and name == "_expand_kernel" and len(arrays) == 1:
        return partial(np.broadcast_to, shape=tuple(out.shape))
    if bare and name == "_matmul_kernel" and len(arrays) == 2:
        tx, ty = bool(attrs.get("trans_x", False)), bool(attrs.get("trans_y", False))
        return np.matmul if not (tx or ty) else partial(_matmul_fn, tx, ty)
    if name in ("_sum_kernel", "_mean_kernel") and len(arrays) == 1:
        axes = norm_axes(attrs.get("axis"), len(ctx.in_shape(0)), "reduction")  # as the kernels' ``_red_axes``
        keep = attrs.get("keepdim", False)
        if name == "_sum_kernel":
            return partial(np.add.reduce, axis=axes, dtype=None, out=None, keepdims=keep) if bare else None
        x = arrays[0]
        if not np.issubdtype(x.dtype, np.floating):
            return None
        count = x.dtype.type(math.prod(ctx.in_shape(0)[a] for a in axes))  # the kernel's global count
        return partial(_mean_fn, axes, keep, count, np.dtype(dt))
    return None


def _matmul_fn(tx: bool, ty: bool, x: Array, y: Array) -> Array:
    return np.matmul(x.swapaxes(-1, -2) if tx else x, y.swapaxes(-1, -2) if ty else y)


def _mean_fn(axes: tuple[int, ...], keep: bool, count: Any, dt: Any, x: Array) -> Array:
    """``_mean_kernel`` of a floating array with its count worked out, normalised as ``_kernel1_fn``."""
    arr = np.add.reduce(x, axis=axes, dtype=None, out=None, keepdims=keep) / count
    if type(arr) is not np.ndarray:
        arr = np.asarray(arr)
    if arr.dtype != dt:
        arr = arr.astype(dt)
    arr.setflags(False)
    return arr


def _plan_fn(
    plan: Any, ranks: tuple[int, ...], out_ranks: tuple[int, ...], dtype: Any, backend: Any, label: str, *arrays: Array
) -> tuple[Array, ...]:

    if comm.recording():  # observers hear the collectives with their reason
        with comm.comm_context(label):
            res = execute_plan(plan, dict(zip(ranks, arrays, strict=True)), dtype, backend)
    else:
        res = execute_plan(plan, dict(zip(ranks, arrays, strict=True)), dtype, backend)
    return tuple(res[r] for r in out_ranks)


def reshard(tr: Tracer, plan: Any, tensor: Any, backend: Any) -> dict[int, Array]:
    """``execute_plan`` of ``tensor``'s shards, run now and recorded."""

    if not plan.steps:  # nothing moves: the shards come back as they are, nothing to record ...
        try:  # ... but they are named after the tensor they come from (a root, or made earlier)
            for r, a in tensor._shards.items():
                tr.slot_of(a, tensor, r)
        except Refused as exc:
            tr.refuse(str(exc))
        return execute_plan(plan, tensor._shards, tensor._dtype, backend)
    ranks = tuple(tensor._shards)
    tr.depth += 1
    try:
        res = execute_plan(plan, tensor._shards, tensor._dtype, backend)
    finally:
        tr.depth -= 1
    out_ranks = tuple(res)
    label = comm.current_context()
    key = ("reshard", plan, ranks, out_ranks, tensor._dtype, backend)
    one = _one_step_fn(plan, ranks, out_ranks, tensor, backend, label)
    if one is not None:  # one rank in, the same one out: a one-output instruction
        tr.record(one, key, [(tensor._shards[ranks[0]], tensor, ranks[0])], res[ranks[0]], False)
        return res
    fn = partial(_plan_fn, plan, ranks, out_ranks, tensor._dtype, backend, label)
    tr.record(fn, key, [(tensor._shards[r], tensor, r) for r in ranks], tuple(res[r] for r in out_ranks), True)
    return res


def _one_step_fn(
    plan: Any, ranks: tuple[int, ...], out_ranks: tuple[int, ...], tensor: Any, backend: Any, label: str
) -> Callable[[Array], Array] | None:
    """A one-step plan on the one rank this process hosts (MPI), bound for the program: the
    step's runner called straight (``execute_plan``'s loop, dict and context are for many
    steps and observers), and an all-reduce bound to the communicator's lowest layer
    (``bound_all_reduce``: the whole-buffer gather and the group-order fold) where it has one.
    Observers make either take ``execute_plan`` as eager does, so they hear the call and its reason."""
    if len(plan.steps) != 1 or len(ranks) != 1 or out_ranks != ranks:
        return None
    (step,) = plan.steps
    rank, a = ranks[0], tensor._shards[ranks[0]]
    general = partial(_plan_fn, plan, ranks, out_ranks, tensor._dtype, backend, label)
    if step.kind == "all_reduce" and type(a) is np.ndarray:
        # The bound all-reduce gathers into a host buffer kept from step to step: NumPy shards
        # only. Device shards (NCCL) keep the general path, whose data moves through NCCL.
        bind = getattr(backend.comm, "bound_all_reduce", None)
        groups = step.groups_with(rank)
        bound = (
            bind(groups[0], tuple(a.shape), a.dtype, step.reduce_type or "sum")
            if bind is not None and len(groups) == 1
            else None
        )
        if bound is not None:
            return partial(_bound_fn, bound, general)
    if (
        step.kind == "partial"
        and type(a) is np.ndarray
        and isinstance(step.src.placements[step.axes[0]], Replicate)
        and (step.reduce_type or "sum") == "sum"
    ):
        # Replicate -> Partial(sum): one rank of the axis keeps its value, the others hold zeros,
        # the same zeros on every step (read-only on NumPy, so one array serves them all).
        if step.src.mesh.coordinate(rank)[step.axes[0]] == 0:
            return partial(_kept_fn, general)
        return partial(_zeros_fn, freeze(backend.xp.zeros_like(a)), general)
    return partial(_step_fn, _RUNNERS[step.kind], step, rank, np.dtype(tensor._dtype), backend, general)


def _kept_fn(general: Callable[..., tuple[Array, ...]], a: Array) -> Array:
    if comm.recording():
        return general(a)[0]
    return freeze(a)


def _zeros_fn(zeros: Array, general: Callable[..., tuple[Array, ...]], a: Array) -> Array:
    if comm.recording():
        return general(a)[0]
    return zeros


def _bound_fn(bound: Callable[[Array], Array], general: Callable[..., tuple[Array, ...]], a: Array) -> Array:
    if comm.recording():
        return general(a)[0]
    return freeze(bound(a))


def _step_fn(
    run: Callable[..., dict[int, Array]],
    step: Any,
    rank: int,
    dtype: Any,
    backend: Any,
    general: Callable[..., tuple[Array, ...]],
    a: Array,
) -> Array:
    if comm.recording():
        return general(a)[0]
    return freeze(run(step, {rank: a}, dtype, backend)[rank])


def _from_global_fn(dst: Any, out_ranks: tuple[int, ...], value: Array) -> tuple[Array, ...]:
    res = _shards_from_global(dst, np.asarray(value))
    return tuple(res[r] for r in out_ranks)


def from_global(tr: Tracer, dst: Any, tensor: Any) -> dict[int, Array]:
    """A dense tensor cut into ``dst``'s hosted shards, run now and recorded."""
    value = np.asarray(tensor._value)
    res = _shards_from_global(dst, value)
    out_ranks = tuple(res)
    fn = partial(_from_global_fn, dst, out_ranks)
    tr.record(fn, ("from_global", dst, out_ranks), [(value, tensor, None)], tuple(res[r] for r in out_ranks), True)
    return res


def _fill_fn(make: Callable[..., Array], shapes: tuple[tuple[int, ...], ...], dtype: Any) -> tuple[Array, ...]:
    return tuple(make(s, dtype=dtype) for s in shapes)


def create(tr: Tracer, make: Callable[..., Array], shapes: Sequence[tuple[int, ...]], dtype: Any) -> tuple[Array, ...]:
    """Fresh arrays (ones, zeros) made now and on every run."""
    fn = partial(_fill_fn, make, tuple(map(tuple, shapes)), dtype)
    res = fn()
    n = len(tr.instrs)
    tr.record(fn, ("create", make, tuple(map(tuple, shapes)), np.dtype(dtype)), [], res, True)
    if len(tr.instrs) > n:
        tr.pure.add(n)
    return res


def _update_fn(
    opt_ref: weakref.ref[Any],
    p_ref: weakref.ref[Any],
    pid: int,
    names: tuple[str, ...],
    cdt: Any,
    decay: Any,
    *arrays: Array,
) -> tuple[Array, ...]:
    """The optimizer's update of one shard, its learning rate and step count read live."""
    opt, p = opt_ref(), p_ref()
    if opt is None or p is None:
        raise Stale
    meta = meta_override.get((id(opt), pid)) if meta_override else None
    if meta is None:
        meta = opt._states[pid]
    lr = _param_lr(p, opt.get_lr())
    if decay is not None:
        opt._decay_this = decay
    src, g = arrays[0], arrays[1]
    new_p, new_states = opt._update(src, g.astype(cdt, copy=False), dict(zip(names, arrays[2:], strict=True)), lr, meta)
    return (new_p, *[new_states[n] for n in names])


def _sgd_fn(opt_ref: weakref.ref[Any], p_ref: weakref.ref[Any], cdt: Any, src: Array, g: Array) -> tuple[Array]:
    """``_update_fn`` of plain SGD: no states, no decay flag, no step count read (fewer lookups)."""
    opt, p = opt_ref(), p_ref()
    if opt is None or p is None:
        raise Stale
    lr = _param_lr(p, opt.get_lr())
    return (opt._update(src, g.astype(cdt, copy=False), {}, lr, None)[0],)


def update(
    tr: Tracer, opt: Any, p: Any, lr: float, src: Any, gv: Any, state: dict[str, Any], r: int, cdt: Any
) -> tuple[Array, dict[str, Array]]:
    """``opt._update`` of ``p``'s shard on rank ``r``, run now and recorded."""
    names = tuple(opt.state_names)
    live = _param_lr(p, opt.get_lr())
    if live != lr:
        tr.refuse(f"{type(opt).__name__} updates {p._label()} with a learning rate its get_lr() does not give")
    decay = getattr(opt, "_decay_this", None)
    tr.updated[(id(opt), id(p))] = (opt, p)
    if type(opt)._update is SGD._update and not names and decay is None:
        fn = partial(_sgd_fn, weakref.ref(opt), weakref.ref(p), cdt)
    else:
        fn = partial(_update_fn, weakref.ref(opt), weakref.ref(p), id(p), names, cdt, decay)
    grad_src = GradSource(p, r) if gv is p.grad else gv
    inputs = [(src._shards[r], src, r), (gv._shards[r], grad_src, r)]
    inputs += [(state[n]._shards[r], StateSource(opt, id(p), n, r), r) for n in names]
    key = ("update", type(opt)._update, opt, id(p), names, np.dtype(cdt), decay, type(opt).get_lr)
    res = tr.call(fn, key, inputs, True)
    if tr.instrs and tr.instrs[-1].fn is fn:
        tr.updates[len(tr.instrs) - 1] = (id(opt), id(p))
        if opt.updates_in_place and len(src._shards) == 1 and src is p:
            tr.in_place.append((len(tr.instrs) - 1, p, r))
    return res[0], dict(zip(names, res[1:], strict=True))


def _bump_fn(opt_ref: weakref.ref[Any], pid: int) -> None:
    opt = opt_ref()
    if opt is None:
        raise Stale
    state = opt._states[pid]
    state["step"] = state.get("step", 0) + 1


def bump_step(tr: Tracer, opt: Any, p: Any) -> None:
    """The optimizer just counted a step of ``p``: count it on every run too."""
    tr.effect(partial(_bump_fn, weakref.ref(opt), id(p)), ("step", opt, id(p)))
    tr.bumps[len(tr.instrs) - 1] = (id(opt), id(p))


def _shard_array_fn(spec: Any, dtype: Any, out_ranks: tuple[int, ...], data: Array) -> tuple[Array, ...]:
    res = _shards_from_global(spec, _as_array(data, dtype, copy=True))
    return tuple(res[r] for r in out_ranks)


def shard_array(tr: Tracer, spec: Any, data: Any, dtype: Any) -> dict[int, Array]:
    """``shard_tensor`` of an array (a step argument, read live on every run; another array is
    a constant by identity), run now and recorded."""
    i = tr.arg_index.get(id(data))
    ranks = tuple(current_hosted(spec))
    fn = partial(_shard_array_fn, spec, dtype, ranks)
    source = ArgSource(i, "array") if i is not None else None
    res = tr.call(
        fn, ("shard_array", spec, None if dtype is None else np.dtype(dtype), ranks), [(data, source, None)], True
    )
    return dict(zip(ranks, res, strict=True))


def current_hosted(spec: Any) -> tuple[int, ...]:
    return tuple(current_backend().hosted_ranks(spec.mesh))


class StepTracer(Tracer):
    """The tracer the call sites talk to (``_capture_hooks.CaptureTracer``: dispatch, distribute, creation
    and the optimizer live below this package and reach it through ``mpipar._capture_hooks``); each
    entry point is the builder of the same name above, bound as a method."""

    record_kernel = record_kernel
    reshard = reshard
    from_global = from_global
    shard_array = shard_array
    create = create
    update = update
    bump_step = bump_step
