"""Dispatch: rule -> reshard -> local kernel on each hosted rank -> outputs with the rule's layouts.

Every op is written once as an ``OpDef``: a local kernel on NumPy/CuPy arrays, an SPMD rule
name, an output dtype function and a gradient function written in mpipar ops. ``apply``
runs it:

1. dense inputs (and Python numbers) join a distributed computation as Replicate;
2. the rule (cached per input layouts) names the layouts the op needs; inputs are
   resharded, each reshard labelled with the op and rule that asked for it;
3. the kernel runs once per hosted rank on the local shards. Kernels depend only on their
   input arrays and the global boxes of inputs and outputs (``KernelContext``), never on the
   rank: replicas with the same arrays and boxes compute once in the simulator;
4. outputs get the rule's layouts; a tape node is recorded when gradients are wanted.

Without any distributed input (or under ``--reference``, where every tensor is one dense
array) the kernel runs once on whole arrays: the one-big-device oracle runs the same kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from mpipar import _capture_hooks, _tape, hooks
from mpipar import backend as _backend
from mpipar._deferred import DeferredShards, Product
from mpipar._modes import Mode, execution_mode
from mpipar.backend import current_backend
from mpipar.comm import comm_context
from mpipar.distribute import _reshard, reshard_to
from mpipar.mesh import ProcessMesh
from mpipar.placement import Partial, Replicate
from mpipar.reshard.executor import freeze
from mpipar.spec import Box, DistSpec, box_shape, full_box, interned
from mpipar.spmd import registry as spmd
from mpipar.tensor import Tensor, reshards_made, reuse_enabled

Array = Any


@dataclass
class KernelContext:
    """What a kernel may know besides its local arrays: global layouts and its boxes."""

    in_specs: Sequence[DistSpec]
    out_specs: Sequence[DistSpec]
    in_boxes: Sequence[Box]
    out_boxes: Sequence[Box]
    xp: Any = np

    def in_shape(self, i: int) -> tuple[int, ...]:
        """Global shape of input ``i``."""
        return self.in_specs[i].shape

    def out_global_shape(self, i: int = 0) -> tuple[int, ...]:
        return self.out_specs[i].shape

    def out_local_shape(self, i: int = 0) -> tuple[int, ...]:
        return box_shape(self.out_boxes[i])

    def positions(self, i: int, dim: int) -> np.ndarray:
        """Global positions along ``dim`` of input ``i``'s local elements (its box's range, or
        the chunks a zigzag split holds)."""
        return self.in_specs[i].positions(self.in_boxes[i], dim)


@dataclass(frozen=True)
class OpDef:
    name: str
    kernel: Callable[..., Any]
    """``kernel(ctx, *local_arrays, **attrs)`` -> array, or tuple of arrays (several outputs)."""
    grad: Callable[[_tape.GradContext, list[Any]], Sequence[Any]] | None = None
    num_outputs: int | Callable[[dict[str, Any]], int] = 1
    """A count, or a function of the attributes (split)."""
    rule: str | None = None
    """SPMD rule name (defaults to ``name``); None together with ``replicate_only``."""
    replicate_only: bool = False
    """Run on fully replicated inputs (no rule): correct for any op, never parallel."""
    dtype: Callable[[Sequence[Any], dict[str, Any]], Sequence[Any]] | None = None
    """Output dtypes from input dtypes and attrs (default: NumPy's result type of the inputs)."""
    save_inputs: tuple[int, ...] | None = None
    """Inputs the gradient needs (None: all)."""
    save_outputs: tuple[int, ...] = ()
    differentiable: tuple[int, ...] | None = None
    """Inputs that may receive a gradient (None: all)."""
    nondiff_outputs: tuple[int, ...] = ()
    """Outputs that carry no gradient (layer_norm's saved mean and rstd)."""
    rule_attrs: tuple[str, ...] | None = None
    """Attributes the rule depends on (None: all)."""
    list_input: bool = False
    """The first argument is a list of tensors (concat)."""
    sample: Callable[[np.random.Generator], list[tuple[list[Any], dict[str, Any]]]] | None = None
    """Example inputs for the rule checker: ``[(inputs, attrs), ...]``."""
    volatile_attrs: tuple[str, ...] = ()
    """Attributes that change on every call and decide neither the rule nor the dtypes (dropout's
    random key): left out of the decision cache's key and the replay's check."""
    grad_attrs: tuple[str, ...] | None = None
    """The attributes the gradient function reads (None: any of them). A backward replay's key
    holds only these beside the decision (``_node_sig``): dropout's gradient reads ``p`` and the
    mask it saved, never the key, so its graphs repeat from step to step."""
    all_pieces: Callable[[list[list[Any]], dict[str, Any]], list[Any] | None] | None = None
    """``all_pieces(pieces, attrs)``: the kernel's results for several ranks' inputs at once, in
    one process hosting them (the simulator), where one call is faster and gives the same bits
    as a call per rank (matmul: one GEMM on the stacked rows); None to decline."""
    product_sum: Callable[[Sequence[Any]], Any] | None = None
    """``product_sum(products)``: the rank-ordered sum of several ranks' outputs
    (``mpipar._deferred.Product``: their input arrays and attributes) without writing each,
    bit for bit what summing the written outputs gives, or None to decline. Set on ops whose
    kernel is a product (matmul): a Partial(sum) output is then deferred in a process hosting
    several ranks, and its all-reduce sums the products in cache."""
    cost_attrs: tuple[str, ...] = ()
    """Attributes the cost model reads beside the shapes, recorded into plans (each one of
    ``mpipar.compile.plan.OP_ATTRS``): fused attention's ``is_causal`` and ``block_size``."""

    @cached_property
    def rule_name(self) -> str:
        return self.rule or self.name

    @cached_property
    def multi_output(self) -> bool:
        """Returns a tuple (even of one tensor, for split into one section)."""
        # Cached: dispatch asks twice per op call, and the op definition never changes.
        return callable(self.num_outputs) or self.num_outputs > 1

    @cached_property
    def attrs_in_key(self) -> int:
        """What of a call's attributes its decision key holds (``decision_attrs``): 0 none,
        1 all of them, 2 some (computed per call)."""
        if self.dtype is None and self.rule_attrs is not None:
            return 2 if self.rule_attrs else 0
        return 2 if self.volatile_attrs else 1

    @cached_property
    def replayable_grad(self) -> bool:
        """Is the gradient one of mpipar's own (``mpipar.ops``, ``mpipar.nn``), running no code of
        the user's, so that a backward replay may run its kernels without it
        (``mpipar.backward_replay``)? A user-registered op's gradient is always called."""
        module = getattr(self.grad, "__module__", None) or ""
        return module.startswith(("mpipar.ops.", "mpipar.nn."))

    @cached_property
    def simple(self) -> bool:
        """One output from a rule, no list input: the calls ``apply``'s short path may take."""
        return not self.list_input and not self.multi_output and not self.replicate_only

    def n_out(self, attrs: dict[str, Any]) -> int:
        return self.num_outputs(attrs) if callable(self.num_outputs) else self.num_outputs

    def out_dtypes(self, in_dtypes: Sequence[Any], attrs: dict[str, Any]) -> list[np.dtype]:
        if self.dtype is not None:
            return [np.dtype(d) for d in self.dtype(in_dtypes, attrs)]
        return [np.result_type(*in_dtypes)] * self.n_out(attrs)


_OPS: dict[str, OpDef] = {}


def register_op(op: OpDef) -> OpDef:
    _OPS[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered ops: {sorted(_OPS)}") from None


def registered_ops() -> list[OpDef]:
    return [_OPS[k] for k in sorted(_OPS)]


_DENSE_MESH: ProcessMesh | None = None


def _dense_mesh() -> ProcessMesh:
    """A one-rank mesh the dense path uses to ask rules for output shapes."""
    global _DENSE_MESH
    if _DENSE_MESH is None:
        _DENSE_MESH = ProcessMesh([0], ["dense"])
    return _DENSE_MESH


def _label(t: Tensor) -> str:
    if t.is_dist:
        return f"{t._label()} {t.spec}"
    return f"dense {t._label()}"


def _flatten(op: OpDef, inputs: Sequence[Any]) -> tuple[list[Tensor], list[Any] | None]:
    """Flatten list inputs; return flat tensors and the nesting to give the rule (None: no
    input is a list, the rule gets the specs as they are)."""
    if not op.list_input:
        return list(inputs), None
    flat: list[Tensor] = []
    nest: list[Any] = []
    for i, x in enumerate(inputs):
        if op.list_input and i == 0:
            items = list(x)
            flat.extend(items)
            nest.append(len(items))
        else:
            flat.append(x)
            nest.append(None)
    return flat, nest


def _nest(specs: Sequence[DistSpec], nest: Sequence[Any] | None) -> list[Any]:
    if nest is None:
        return list(specs)
    out: list[Any] = []
    i = 0
    for n in nest:
        if n is None:
            out.append(specs[i])
            i += 1
        else:
            out.append(list(specs[i : i + n]))
            i += n
    return out


def _reuse_info(flat: list[Tensor]) -> spmd.Reuse | None:
    """For the conflict policy: which inputs hold the same value, and the layouts each value was
    already resharded to this step (free to use again); None when there is nothing to reuse."""
    n = len(flat)
    if n == 1:  # unary ops, decided without a loop
        if not flat[0]._reshards:
            return None
    elif n == 2:  # binary ops
        a, b = flat
        if not a._reshards and not b._reshards and (a._spec is None or b._spec is None or a._sid != b._sid):
            return None
    for t in flat:  # decided without building sets where nothing was resharded (every op asks)
        if t._reshards:
            break
    else:
        sids = [t._sid for t in flat if t._spec is not None]
        if len(set(sids)) == len(sids):
            return None
    info: list[tuple[int, frozenset[DistSpec]]] = []
    first: dict[int, int] = {}
    reusable = False
    for i, t in enumerate(flat):
        if not t.is_dist:
            info.append((i, frozenset()))
            continue
        group = first.setdefault(t._sid, i)
        made = reshards_made(t)
        reusable = reusable or group != i or bool(made)
        info.append((group, made))
    return tuple(info) if reusable else None


def _infer(
    op: OpDef,
    specs: list[DistSpec],
    nest: list[Any] | None,
    attrs: dict[str, Any],
    flat: list[Tensor],
    reuse: bool = False,
) -> spmd.SpmdResult:
    rattrs = attrs if op.rule_attrs is None else {k: attrs[k] for k in op.rule_attrs if k in attrs}
    try:
        if reuse and reuse_enabled():
            return spmd.infer_forward_reusing(op.rule_name, _nest(specs, nest), _reuse_info(flat), **rattrs)
        return spmd.infer_forward(op.rule_name, _nest(specs, nest), **rattrs)
    except ValueError as exc:
        who = "; ".join(f"input {i}: {_label(t)}" for i, t in enumerate(flat))
        raise ValueError(f"{op.name}: {exc} [{who}]") from None


def apply(name: str, inputs: Sequence[Any], attrs: dict[str, Any] | None = None) -> Any:
    """Run op ``name`` on ``inputs`` (Tensors, or a list of Tensors for list ops)."""
    if attrs is None:
        attrs = {}
    op = _OPS.get(name)
    # The short path: what every op call of an eager step under MPI is, once its layouts were
    # decided. One or two distributed inputs already in the layout the cached decision wants
    # (neither stored split by ZeRO-3), this process hosting one rank of the mesh, one output,
    # and nothing listening (no hooks, pipeline stage, captured step or replay). The same
    # kernel, checks, output and tape node as the general path below, without its per-call
    # lists and branches (``docs/performance.md``, "Eager step steadiness"). Anything else
    # takes the general path.
    backend = _backend._current
    if (
        op is not None
        and op.simple
        and not hooks.op_start_hooks
        and not hooks.op_hooks
        and not hooks.program_hooks
        and not hooks.stage_runs
        and not _capture_hooks.capture_tracers
        and not _replaying
        and backend is _decisions_backend[0]
        and not backend.shape_only  # type: ignore[union-attr]
        and not backend.reference  # type: ignore[union-attr]
    ):
        n = len(inputs)
        key: tuple[Any, ...] | None = None
        b = None
        attrs_key = _attrs_key(op, attrs)
        if n == 2:
            a, b = inputs
            if (
                isinstance(a, Tensor)
                and isinstance(b, Tensor)
                and (sa := a._spec) is not None
                and (sb := b._spec) is not None
                and not a._reshards
                and not b._reshards
                and not a._abstract
                and not b._abstract
                and a._compute_spec is None  # neither stored split (ZeRO-3: gathered first)
                and b._compute_spec is None
            ):
                # ``_decision_key`` for two distributed inputs, nothing resharded yet: ``_reuse_info``
                # is None for two values, and for one value twice (``x * x``) the same constant.
                reuse = None if a._sid != b._sid or not reuse_enabled() else _ONE_VALUE_TWICE
                key = (name, id(sa), id(sb), a._dtype, b._dtype, attrs_key, reuse)
        elif n == 1:
            a = inputs[0]
            if (
                isinstance(a, Tensor)
                and (sa := a._spec) is not None
                and not a._reshards
                and not a._abstract
                and a._compute_spec is None
            ):
                key = (name, id(sa), a._dtype, attrs_key)
        if key is not None:
            # ``key`` names the specs by identity: hashing it calls no spec's ``__hash__``
            # (Python code; the two specs of a binary op cost more than the rest of the key).
            # Its entry holds the specs themselves, so no other spec can take their ids while
            # it lasts; in ``_DECISIONS``, so that it goes whenever the decisions go.
            try:
                known: Any = _DECISIONS.get(key)  # type: ignore[call-overload]
                if known is not None and known[0] is sa and (b is None or known[1] is sb):
                    decision = known[-1]
                else:  # (an identity key not seen yet: the key the general path caches under)
                    if b is None:
                        decision = _DECISIONS.get((name, (sa,), (a._dtype,), attrs_key, None, None))
                    else:
                        decision = _DECISIONS.get((name, (sa, sb), (a._dtype, b._dtype), attrs_key, reuse, None))
                    if decision is not None:
                        _DECISIONS[key] = (sa, decision) if b is None else (sa, sb, decision)  # type: ignore[assignment]
            except TypeError:  # an attribute that cannot be hashed: the general path decides
                decision = None
            if decision is not None and (one := decision.one_rank) is not None:
                r, shape, ctx, dt, spec = one
                ua, ub = a, b  # the inputs as the kernel takes them
                if decision.moves:  # an input to reshard first, as ``_run_dist`` does (reused where made)
                    used = _moved_inputs(op, decision, [a] if b is None else [a, b], backend)
                    ua, ub = used[0], (None if b is None else used[1])
                if ub is None:
                    arr = op.kernel(ctx, ua._shards[r], **attrs)
                else:
                    arr = op.kernel(ctx, ua._shards[r], ub._shards[r], **attrs)
                if type(arr) is np.ndarray and arr.dtype is dt and arr.shape == shape:  # ``output_array``'s usual case
                    arr.setflags(False)  # type: ignore[call-arg]  # positional: ``executor.freeze``
                else:
                    arr = output_array(op, decision, r, 0, arr, dt, shape)
                out = Tensor._op_output(spec, dt, {r: arr})
                if op.grad is not None and _tape._grad_enabled:  # (no lists to build under no_grad)
                    _record_short(op, decision, attrs, a, b, ua, ub, out)
                return out
    return _apply(name, inputs, attrs)


_ONE_VALUE_TWICE: tuple[tuple[int, frozenset[DistSpec]], ...] = ((0, frozenset()), (0, frozenset()))
"""``_reuse_info`` of a binary op whose two inputs are one value not resharded yet."""


def _apply(name: str, inputs: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """``apply``'s general path: every kind of call."""
    for start_hook in hooks.op_start_hooks:
        start_hook.on_op_start(name)
    op = _OPS.get(name) or get_op(name)
    if op.list_input:
        flat, nest = _flatten(op, inputs)
    else:
        flat, nest = list(inputs), None
    # One pass over the inputs: their types, which are distributed, whether any is abstract
    # (``execution_mode``'s question, asked here rather than in another pass).
    dist_inputs: list[Tensor] = []
    abstract = False
    for t in flat:
        if not isinstance(t, Tensor):
            i = next(i for i, u in enumerate(flat) if u is t)
            raise TypeError(f"{name}: input {i} must be a Tensor, got {type(t).__name__}")
        if t._spec is not None:
            dist_inputs.append(t)
        if t._abstract:
            abstract = True
    backend = current_backend()
    gathered: list[Tensor] = []
    original = flat
    if hooks.stage_runs or stored_split_seen[0]:  # a pipeline stage run, or ZeRO-3 parameters
        # ZeRO-3 may swap gathered parameters into ``flat``; hooks see the inputs as given.
        original = list(flat) if stored_split_seen[0] else flat
        stage_run = hooks.stage_runs[-1] if hooks.stage_runs else None
        first_dist = dist_inputs[0] if dist_inputs else None
        # Inside a pipeline stage run, ops of the other stages only run their rule (no data, no comm).
        inactive = (
            stage_run is not None and first_dist is not None and not stage_run.op_is_real(first_dist.spec.mesh, op.name)
        )
        if stage_run is not None and first_dist is not None:
            stage_run.note_inputs(flat, first_dist.spec.mesh)
        swapped = False
        if not inactive:
            gathered, swapped = _gather_stored_split(op, flat)
        if swapped:  # ZeRO-3 put gathered parameters in ``flat``
            dist_inputs = [t for t in flat if t.is_dist]
        mode = Mode.ABSTRACT if inactive else execution_mode(flat, backend)
    elif abstract or backend.shape_only:
        mode = Mode.ABSTRACT
    else:
        mode = Mode.DENSE if backend.reference else Mode.DISTRIBUTED
    result: spmd.SpmdResult | None = None
    decided: Decision | None = None
    if mode is Mode.ABSTRACT:
        outs, used, result = _run_abstract(op, flat, nest, attrs, dist_inputs)
    elif mode is Mode.DENSE or not dist_inputs:  # one device, or a dense op: whole values
        outs = _run_dense(op, flat, nest, attrs, dist_inputs)
        used = flat
    else:
        outs, used, decided = _run_dist(op, flat, nest, attrs, dist_inputs, backend)
        result = decided.res
    _record(op, flat, used, outs, attrs, decided)
    for hook in hooks.op_hooks:
        hook.on_op(op, original, used, outs, result, attrs)
    for g in gathered:  # ZeRO-3: the gathered copy is freed after use; backward gathers again
        g._drop_shards()
    result_value = tuple(outs) if op.multi_output else outs[0]
    for program in hooks.program_hooks:
        program.on_apply(name, inputs, attrs, result_value)
    return result_value


def _run_abstract(
    op: OpDef, flat: list[Tensor], nest: list[Any] | None, attrs: dict[str, Any], dist_inputs: list[Tensor]
) -> tuple[list[Tensor], list[Tensor], spmd.SpmdResult | None]:
    """Shape-only: the rule gives every layout and shape; no kernel runs, reshards are planned."""
    if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
        tr.refuse("the step runs in shape-only mode")
    if op.replicate_only:
        raise ValueError(
            f"{op.name} is replicate-only: its output shapes are unknown without running it, so it cannot be traced in shape-only mode; give it a rule"
        )
    dtypes = op.out_dtypes([t.dtype for t in flat], attrs)
    if not dist_inputs:
        mesh = _dense_mesh()
        specs = [DistSpec(t.shape, mesh, [Replicate()]) for t in flat]
        res = _infer(op, specs, nest, attrs, flat)
        return [Tensor.abstract(s.shape, dt) for s, dt in zip(res.outputs, dtypes, strict=True)], flat, None
    mesh = dist_inputs[0].spec.mesh
    replicated = [Replicate()] * mesh.ndim
    specs = [t.spec if t.is_dist else DistSpec(t.shape, mesh, replicated) for t in flat]
    res = _infer(op, specs, nest, attrs, flat, reuse=True)
    used = []
    for i, (t, have, want) in enumerate(zip(flat, specs, res.flat_inputs(), strict=True)):
        if t.is_dist and have == want:
            used.append(t)
            continue
        if not t.is_abstract:  # plan the reshard only: never move a real tensor's data here
            shadow = Tensor.abstract(t.shape, t.dtype, t.spec if t.is_dist else None)
            shadow.stop_gradient = t.stop_gradient
            t = shadow
        with comm_context(f"{op.name} input {i}: rule {res.rule}: {res.reason}"), hooks.op_inputs(op.name):
            used.append(_reshard_input(t, want))
    outs = [Tensor.abstract(s.shape, dt, s) for s, dt in zip(res.outputs, dtypes, strict=True)]
    for t in outs:
        t._mark_computed()
    return outs, used, res


def _run_dense(
    op: OpDef, flat: list[Tensor], nest: list[Any] | None, attrs: dict[str, Any], dist_inputs: list[Tensor]
) -> list[Tensor]:
    mesh = _dense_mesh()
    specs = [DistSpec(t.shape, mesh, [Replicate()]) for t in flat]
    arrays = [t._value for t in flat]
    out_specs = None if op.replicate_only else list(_infer(op, specs, nest, attrs, flat).outputs)
    boxes = [full_box(t.shape) for t in flat]
    ctx = KernelContext(specs, out_specs or [], boxes, [full_box(s.shape) for s in out_specs or []])
    result = op.kernel(ctx, *arrays, **attrs)
    results = list(result) if op.multi_output else [result]
    dtypes = op.out_dtypes([t.dtype for t in flat], attrs)
    tr = _capture_hooks.capture_tracer() if _capture_hooks.capture_tracers else None
    if tr is not None and dist_inputs:
        tr.refuse("the step runs as one big device (--reference)")
        tr = None
    outs = []
    frozen = []
    for arr, dt in zip(results, dtypes, strict=True):
        arr = (
            np.asarray(arr, dtype=dt)
            if isinstance(arr, (np.ndarray, np.generic, int, float, bool))
            else arr.astype(dt, copy=False)
        )
        frozen.append(freeze(arr))
        if dist_inputs:  # --reference: keep a distributed label so scripts can ask for it
            ref_mesh = dist_inputs[0].spec.mesh
            outs.append(Tensor._from_reference(DistSpec(arr.shape, ref_mesh, [Replicate()] * ref_mesh.ndim), arr))
        else:
            outs.append(Tensor._dense_output(arr))
    if tr is not None:
        tr.record_kernel(
            op, ctx, attrs, dtypes, flat, None, arrays, frozen if op.multi_output else frozen[0], dense=True
        )
    return outs


@dataclass(eq=False)
class Decision:
    """Everything ``_run_dist`` derives from an op call's layouts, attributes and dtypes.

    A pure function of its key (``_decision_key``): the rule's answer, the specs each input
    must be resharded to, the output specs and dtypes, and per hosted rank the input and
    output boxes with the kernel context built from them. Cached (``_DECISIONS``) and replayed
    (``mpipar.replay``), so that a training step asks each rule, builds each spec and each box
    list once, not on every step. Results never depend on whether a decision was cached.
    """

    res: spmd.SpmdResult | None
    need: list[DistSpec]
    out_specs: list[DistSpec] | None
    """None for replicate-only ops: their output shapes come from the kernel."""
    rule_label: str
    dtypes: list[np.dtype]
    reshard: tuple[bool, ...]
    """Per flat input: must it be resharded to ``need[i]``? (dense inputs always are)"""
    ranks: tuple[tuple[int, tuple[tuple[int, ...], ...], KernelContext], ...]
    """Per hosted rank: its id, its outputs' local shapes and its kernel context (one object for
    ranks with the same boxes, so that replicas holding the same arrays compute once)."""
    move_contexts: list[tuple[comm_context, Any]] | None = None
    """Per input, what its reshard runs inside: its communication context and the op's
    ``hooks.op_inputs`` (made on the first call that moves one; both hold no state of a use,
    so one pair serves every call)."""
    tapes: dict[Any, Any] | None = None
    """``apply``'s short path: per pattern of the inputs' ``stop_gradient``, what the tape node of
    a call with this decision holds that does not depend on the call's values (``_record_short``)."""

    @cached_property
    def one_rank(self) -> tuple[int, tuple[int, ...], KernelContext, np.dtype, DistSpec] | None:
        """For ``apply``'s short path, when this process hosts one rank of the op's mesh and the
        op has one output: the rank, its output's local shape, the kernel context, the output's
        dtype and spec; else None (asked on every call: worked out once)."""
        if len(self.ranks) != 1 or self.out_specs is None or len(self.out_specs) != 1:
            return None
        r, shapes, ctx = self.ranks[0]
        return (r, shapes[0], ctx, self.dtypes[0], self.out_specs[0])

    @cached_property
    def moves(self) -> bool:
        """Whether some input is resharded first (``True in reshard``, worked out once)."""
        return True in self.reshard


_DECISIONS: dict[tuple[Any, ...], Decision] = {}


class StepPlayer(Protocol):
    """A compiled step being recorded or replayed (``mpipar.compile.replay.StepPlayer``, above the ops):
    it hands dispatch each call's recorded ``Decision`` by position, or records a new one."""

    def next(
        self, op: OpDef, flat: list[Tensor], attrs: dict[str, Any], reuse: Any, backend: Any
    ) -> Decision | None: ...

    def record(
        self, op: OpDef, flat: list[Tensor], attrs: dict[str, Any], reuse: Any, decision: Decision, backend: Any
    ) -> None: ...


_replaying: list[StepPlayer] = []
"""The step being replayed or recorded, innermost last."""
_DECISIONS_MAX = 8192
_decisions_backend: list[Any] = [object()]
"""The backend the cached decisions were made on (at first a stand-in no backend is, so that
``apply``'s short path never takes "no backend yet" for "decided on this one")."""


_SCALAR_TYPES = frozenset({int, float, bool, str, type(None)})
_INT_ONLY = frozenset({int})


def _frozen(value: Any) -> Any:
    """A hashable stand-in for an attribute value; scalars keep their type (``1``, ``1.0`` and
    ``True`` are equal keys in Python but may give other output dtypes)."""
    kind = type(value)
    if kind in _SCALAR_TYPES:  # most attributes: decided without an isinstance chain
        return (kind, value)
    if (kind is tuple or kind is list) and _INT_ONLY.issuperset(map(type, value)):
        # Axes and shapes: ints only, kept as they are (the third item marks this form: the
        # general one below holds a pair per item, so the two never compare equal).
        return (kind, tuple(value), int)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    return (type(value), value)


def decision_attrs(op: OpDef, attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes an op call's decision depends on: those its rule reads when its output
    dtypes come from the inputs alone (``scale``'s factor is a value, not a layout: a clipping
    coefficient changes every step), else all but the volatile ones."""
    if op.dtype is None and op.rule_attrs is not None:
        return {k: attrs[k] for k in op.rule_attrs if k in attrs} if op.rule_attrs else {}
    if not op.volatile_attrs:
        return attrs
    return {k: v for k, v in attrs.items() if k not in op.volatile_attrs}


def _attrs_key(op: OpDef, attrs: dict[str, Any]) -> tuple[Any, ...]:
    """The attributes' part of a decision key: ``freeze_attrs(decision_attrs(op, attrs))``,
    without the selection where the op's kind already says the answer (``OpDef.attrs_in_key``)."""
    if not attrs or (kind := op.attrs_in_key) == 0:
        return ()
    return freeze_attrs(attrs) if kind == 1 else freeze_attrs(decision_attrs(op, attrs))


def freeze_attrs(attrs: dict[str, Any]) -> tuple[Any, ...]:
    if not attrs:
        return ()
    # Scalars only (most calls): the items as they are beside their types, made by C calls
    # alone. (Never equal to the general form below: its first item is a pair of a name and a
    # value, this one's a tuple of pairs.)
    types = tuple(map(type, attrs.values()))
    if _SCALAR_TYPES.issuperset(types):
        return (tuple(attrs.items()), types)
    return tuple([(k, (kind, v) if (kind := type(v)) in _SCALAR_TYPES else _frozen(v)) for k, v in attrs.items()])


def _decision_key(
    op: OpDef,
    flat: list[Tensor],
    nest: list[Any] | None,
    attrs: dict[str, Any],
    reuse: spmd.Reuse | None,
    mesh: ProcessMesh,
) -> tuple[Any, ...] | None:
    """What a decision depends on: the op, each input's spec (dense: shape, on the op's mesh),
    dtypes, the attributes and what was already resharded; None when the attributes are not
    hashable (such a call is decided afresh). The key is hashed by the cache's lookup
    (``cached_decision``), which also finds an unhashable one."""
    try:
        frozen = _attrs_key(op, attrs)
    except TypeError:
        return None
    n = len(flat)
    if n == 2 and nest is None:  # binary ops, the most common: the same key, built without loops
        a, b = flat
        return (
            op.name,
            (
                a._spec if a._spec is not None else (a._shape, mesh),
                b._spec if b._spec is not None else (b._shape, mesh),
            ),
            (a._dtype, b._dtype),
            frozen,
            reuse,
            None,
        )
    if n == 1 and nest is None:
        a = flat[0]
        return (op.name, (a._spec if a._spec is not None else (a._shape, mesh),), (a._dtype,), frozen, reuse, None)
    return (
        op.name,
        tuple([t._spec if t._spec is not None else (t._shape, mesh) for t in flat]),
        tuple([t._dtype for t in flat]),
        frozen,
        reuse,
        tuple(nest) if nest is not None else None,
    )


def cached_decision(key: tuple[Any, ...] | None, backend: Any) -> Decision | None:
    """The decision made earlier for ``key`` on ``backend`` (decisions hold hosted ranks)."""
    if _decisions_backend[0] is not backend:
        _DECISIONS.clear()
        _decisions_backend[0] = backend
        return None
    return _DECISIONS.get(key) if key is not None else None


def _hashable(key: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """``key``, or None when some part of it cannot be hashed (a call decided afresh)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _decide(
    op: OpDef, flat: list[Tensor], nest: list[Any] | None, attrs: dict[str, Any], mesh: ProcessMesh, backend: Any
) -> Decision:
    replicated = [Replicate()] * mesh.ndim
    specs = [t.spec if t.is_dist else DistSpec(t.shape, mesh, replicated) for t in flat]
    res: spmd.SpmdResult | None = None
    if op.replicate_only:
        need = [DistSpec(t.shape, mesh, replicated) for t in flat]
        out_specs = None
        rule_label = "replicate-only"
    else:
        res = _infer(op, specs, nest, attrs, flat, reuse=True)
        need = [interned(s) for s in res.flat_inputs()]
        out_specs = [interned(s) for s in res.outputs]
        rule_label = f"rule {res.rule}: {res.reason}"
    reshard_flags = tuple(not (t.is_dist and have == want) for t, have, want in zip(flat, specs, need, strict=True))
    ranks = []
    contexts: dict[tuple[Any, ...], KernelContext] = {}
    for r in backend.hosted_ranks(mesh):
        in_boxes = tuple(s.boxes[r] for s in need)
        out_boxes = tuple(s.boxes[r] for s in out_specs) if out_specs is not None else ()
        ctx = contexts.get((in_boxes, out_boxes))
        if ctx is None:
            ctx = contexts[(in_boxes, out_boxes)] = KernelContext(
                need, out_specs or [], list(in_boxes), list(out_boxes), backend.xp
            )
        ranks.append((r, tuple(box_shape(b) for b in out_boxes), ctx))
    dtypes = op.out_dtypes([t.dtype for t in flat], attrs)
    return Decision(res, need, out_specs, rule_label, dtypes, reshard_flags, tuple(ranks))


def _run_dist(
    op: OpDef,
    flat: list[Tensor],
    nest: list[Any] | None,
    attrs: dict[str, Any],
    dist_inputs: list[Tensor],
    backend: Any,
) -> tuple[list[Tensor], list[Tensor], Decision]:
    mesh = dist_inputs[0]._spec.mesh  # type: ignore[union-attr]
    reuse = _reuse_info(flat) if reuse_enabled() else None
    player = _replaying[-1] if _replaying else None
    decision = player.next(op, flat, attrs, reuse, backend) if player is not None else None
    if decision is None:
        key = _decision_key(op, flat, nest, attrs, reuse, mesh)
        try:
            if _decisions_backend[0] is backend and key is not None:  # ``cached_decision``, inline
                decision = _DECISIONS.get(key)
            else:
                decision = cached_decision(key, backend)
        except TypeError:  # an attribute that cannot be hashed: decided afresh
            key = decision = None
        if decision is None:
            key = _hashable(key)
            for t in dist_inputs[1:]:
                if not t.spec.mesh.same_layout(mesh):
                    raise ValueError(
                        f"{op.name}: inputs live on different meshes: {_label(dist_inputs[0])} and {_label(t)}; "
                        "move one with dist.reshard(tensor, mesh, placements) first"
                    )
            decision = _decide(op, flat, nest, attrs, mesh, backend)
            if key is not None:
                if len(_DECISIONS) >= _DECISIONS_MAX:
                    _DECISIONS.clear()
                _DECISIONS[key] = decision
        if player is not None:
            player.record(op, flat, attrs, reuse, decision, backend)
    # the usual case: every input already in the layout the rule wants
    used = _moved_inputs(op, decision, flat, backend) if decision.moves else flat
    if decision.out_specs is None:
        return _replicate_only_outputs(op, used, attrs, decision, mesh), used, decision
    # Several hosted ranks (the simulator): a product's Partial output may be deferred. (Under
    # MPI a process hosts one rank of the mesh, or none when the op is another stage's.)
    if len(decision.ranks) > 1 and op.product_sum is not None and _defers(op, decision):
        return [_deferred_output(op, decision, used, attrs)], used, decision
    out_specs = decision.out_specs
    if len(decision.ranks) == 1 and not _capture_hooks.capture_tracers:  # one hosted rank (MPI)
        if not op.multi_output:  # most ops: ``_one_rank_outputs`` for one output, inline
            r, shapes, ctx = decision.ranks[0]
            n_in = len(used)
            if n_in == 2:  # spelled out for the usual arities: no list built per call
                arr = op.kernel(ctx, used[0]._shards[r], used[1]._shards[r], **attrs)
            elif n_in == 1:
                arr = op.kernel(ctx, used[0]._shards[r], **attrs)
            else:
                arr = op.kernel(ctx, *[u._shards[r] for u in used], **attrs)
            _wrong_count(op, decision, [arr])
            dt = decision.dtypes[0]
            out = Tensor._op_output(out_specs[0], dt, {r: output_array(op, decision, r, 0, arr, dt, shapes[0])})
            return [out], used, decision
        per_rank = _one_rank_outputs(op, decision, attrs, None, used)
    else:
        per_rank = _kernel_outputs(op, decision, attrs, None, used)
    if len(out_specs) == 1:  # most ops
        return (
            [Tensor._op_output(out_specs[0], decision.dtypes[0], {r: got[0] for r, got in per_rank.items()})],
            used,
            decision,
        )
    outs = []
    for j, (spec, dt) in enumerate(zip(out_specs, decision.dtypes, strict=True)):
        outs.append(Tensor._op_output(spec, dt, {r: got[j] for r, got in per_rank.items()}))
    return outs, used, decision


def _moved_inputs(op: OpDef, decision: Decision, flat: list[Tensor], backend: Any) -> list[Tensor]:
    """The inputs as the op's kernel takes them: each one the decision moves resharded to the
    layout it needs (a value resharded before is reused: ``distribute._reshard``)."""
    need = decision.need
    contexts = decision.move_contexts
    if contexts is None:
        contexts = decision.move_contexts = [
            (comm_context(f"{op.name} input {i}: {decision.rule_label}"), hooks.op_inputs(op.name))
            for i in range(len(need))
        ]
    used = []
    for i, (t, move) in enumerate(zip(flat, decision.reshard, strict=True)):
        if not move:
            used.append(t)
            continue
        label, inputs_of = contexts[i]
        with label, inputs_of:
            used.append(_reshard_input(t, need[i], backend))
    return used


def _kernel_outputs(
    op: OpDef,
    decision: Decision,
    attrs: dict[str, Any],
    inputs: dict[int, list[Any]] | None,
    used: list[Tensor],
) -> dict[int, list[Any]]:
    """Each hosted rank's outputs from its input arrays (``inputs``, else the shards of
    ``used``), normalised to the decision's dtypes, checked against its shapes and frozen.
    Replicas holding the same arrays with the same boxes share one context: the kernel runs
    once per distinct piece. Deferred shards (``inputs`` given: computed after their op's
    call) are recorded by no captured step's trace.

    Where the op computes several pieces at once (``OpDef.all_pieces``: one stacked GEMM), it
    does, unless a captured step is being traced (it records one instruction per piece)."""
    if len(decision.ranks) == 1 and not _capture_hooks.capture_tracers:
        return _one_rank_outputs(op, decision, attrs, inputs, used)
    memo: dict[tuple[Any, ...], list[Any]] = {}
    per_rank: dict[int, list[Any]] = {}
    multi = op.multi_output
    dtypes = decision.dtypes
    alone = len(decision.ranks) == 1  # one hosted rank (MPI): nothing to share, no key to build
    together = calls = None
    if len(decision.ranks) > 1 and op.all_pieces is not None and not _capture_hooks.capture_tracers:
        calls, together = _all_pieces(op, decision, inputs, used, attrs)
    for i, (r, shapes, ctx) in enumerate(decision.ranks):
        if calls is None:
            arrays = [u._shards[r] for u in used] if inputs is None else inputs[r]
            key = () if alone else (tuple(map(id, arrays)), id(ctx))
        else:
            arrays, key = calls[i]
        got = None if alone else memo.get(key)
        if got is None:
            result = op.kernel(ctx, *arrays, **attrs) if together is None else together[key]
            got = list(result) if multi else [result]
            for j, (arr, dt, shape) in enumerate(zip(got, dtypes, shapes, strict=True)):
                got[j] = output_array(op, decision, r, j, arr, dt, shape)
            memo[key] = got
            if (
                _capture_hooks.capture_tracers and inputs is None
            ):  # a captured step being traced: this kernel call is an instruction
                tr = _capture_hooks.capture_tracer()
                if tr is not None:
                    tr.record_kernel(op, ctx, attrs, dtypes, used, r, arrays, got, raw=result)
        per_rank[r] = got
    return per_rank


def output_array(
    op: OpDef, decision: Decision | None, r: int, j: int, arr: Any, dt: np.dtype, shape: tuple[int, ...]
) -> Any:
    """Output ``j`` of the kernel on rank ``r`` as an op output holds it: a NumPy 0-d scalar
    made an array, cast to the decision's dtype, its shape checked against the rule's, frozen.
    (A replayed backward pass, ``mpipar.backward_replay``, keeps its kernels' outputs so too,
    with no decision at hand: its error then names no layout.)"""
    if type(arr) is not np.ndarray and isinstance(arr, np.generic):  # NumPy reductions to 0-d return scalars
        arr = np.asarray(arr)
    if arr.dtype is not dt and arr.dtype != dt:
        arr = arr.astype(dt)
    if arr.shape != shape:
        layout = "" if decision is None else f" ({decision.out_specs[j]})"  # type: ignore[index]
        raise AssertionError(
            f"kernel of {op.name} returned output {j} of shape {list(arr.shape)} on rank {r}; the rule "
            f"{op.rule_name} says {list(shape)}{layout}"
        )
    if type(arr) is np.ndarray:  # ``freeze`` for the usual NumPy output, without its call
        arr.setflags(False)  # type: ignore[call-arg]  # positional: ``executor.freeze``
        return arr
    return freeze(arr)


def _wrong_count(op: OpDef, decision: Decision, got: list[Any]) -> None:
    """Raise for a kernel that returned another number of outputs than its rule names."""
    shapes = decision.ranks[0][1]
    if len(got) != len(shapes):
        raise ValueError(f"kernel of {op.name} returned {len(got)} outputs; the rule says {len(shapes)}")


def _one_rank_outputs(
    op: OpDef, decision: Decision, attrs: dict[str, Any], inputs: dict[int, list[Any]] | None, used: list[Tensor]
) -> dict[int, list[Any]]:
    """``_kernel_outputs`` for a process hosting one rank of the op's mesh (under MPI, every
    op), with no captured step being traced: the kernel runs once, with nothing to share."""
    r, shapes, ctx = decision.ranks[0]
    arrays = [u._shards[r] for u in used] if inputs is None else inputs[r]
    result = op.kernel(ctx, *arrays, **attrs)
    got = list(result) if op.multi_output else [result]
    _wrong_count(op, decision, got)
    for j, dt in enumerate(decision.dtypes):
        got[j] = output_array(op, decision, r, j, got[j], dt, shapes[j])
    return {r: got}


_DEFER_ELEMENTS = 1 << 16
"""Outputs smaller than this per rank are written as usual: deferring costs a few tens of
microseconds, about what writing and re-reading 64 Ki elements per rank costs."""


def _all_pieces(
    op: OpDef, decision: Decision, inputs: dict[int, list[Any]] | None, used: list[Tensor], attrs: dict[str, Any]
) -> tuple[list[tuple[list[Any], tuple[Any, ...]]], dict[tuple[Any, ...], Any] | None]:
    """Each rank's input arrays and piece key (as ``_kernel_outputs`` builds them), and the
    kernel's result per distinct piece from one ``op.all_pieces`` call, or None (declined, or
    one piece only)."""
    calls = []
    pieces: dict[tuple[Any, ...], list[Any]] = {}
    for r, _, ctx in decision.ranks:
        arrays = [u._shards[r] for u in used] if inputs is None else inputs[r]
        key = (tuple(map(id, arrays)), id(ctx))
        calls.append((arrays, key))
        pieces.setdefault(key, arrays)
    if len(pieces) < 2:
        return calls, None
    results = op.all_pieces(list(pieces.values()), attrs)  # type: ignore[misc]
    return calls, None if results is None else dict(zip(pieces, results, strict=True))


def _defers(op: OpDef, decision: Decision) -> bool:
    """Defer this call's output (``mpipar._deferred``)? Its one output is a Partial sum, which
    is usually all-reduced next, large enough to be worth it, and no captured step is being
    traced (it records kernels)."""
    if op.multi_output or _capture_hooks.capture_tracers or decision.out_specs is None:
        return False
    if math.prod(decision.ranks[0][1][0]) < _DEFER_ELEMENTS:
        return False
    return any(isinstance(p, Partial) and p.reduce_type == "sum" for p in decision.out_specs[0].placements)


def _deferred_output(op: OpDef, decision: Decision, used: list[Tensor], attrs: dict[str, Any]) -> Tensor:
    """The output tensor with its shards deferred: the operands are taken now (arrays are
    values), the kernel runs when the shards are first asked for, and each rank's ``Product``
    lets a communicator sum them without writing them."""
    inputs = {r: [u._shards[r] for u in used] for r, _, _ in decision.ranks}
    deferred = DeferredShards(
        lambda: {r: got[0] for r, got in _kernel_outputs(op, decision, attrs, inputs, []).items()}
    )
    assert op.product_sum is not None
    dtype = decision.dtypes[0]
    deferred.products = {
        r: Product(tuple(inputs[r]), attrs, shapes[0], dtype, op.product_sum, deferred, r)
        for r, shapes, _ in decision.ranks
    }
    return Tensor._deferred_output(decision.out_specs[0], dtype, deferred)  # type: ignore[index]


def _replicate_only_outputs(
    op: OpDef, used: list[Tensor], attrs: dict[str, Any], decision: Decision, mesh: ProcessMesh
) -> list[Tensor]:
    """A replicate-only op's outputs: replicated, with the shapes its kernel returns."""
    if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
        tr.refuse(f"{op.name} is replicate-only (its output shapes come from running it)")
    per_rank: dict[int, list[Any]] = {}
    for r, _, ctx in decision.ranks:
        result = op.kernel(ctx, *[u._shards[r] for u in used], **attrs)
        per_rank[r] = list(result) if op.multi_output else [result]
    sample = next(iter(per_rank.values()), None)
    if sample is None:
        raise ValueError(f"{op.name} is replicate-only and this process hosts no rank of {mesh}; give it a rule")
    replicated = [Replicate()] * mesh.ndim
    outs = []
    for j, dt in enumerate(decision.dtypes):
        spec = DistSpec(np.shape(sample[j]), mesh, replicated)
        shards = {}
        for r, rank_out in per_rank.items():
            arr = np.asarray(rank_out[j]) if isinstance(rank_out[j], np.generic) else rank_out[j]
            shards[r] = arr.astype(dt) if arr.dtype != dt else arr
        out = Tensor._from_shards(spec, shards, dt)
        out._mark_computed()
        outs.append(out)
    return outs


stored_split_seen = [False]
"""Set (``note_stored_split``) once any parameter is stored split (ZeRO-3): until then no op
call needs to look at its inputs for a compute layout."""


def note_stored_split() -> None:
    """A parameter now has a ``_compute_spec`` (``shard_optimizer`` at stage 3)."""
    stored_split_seen[0] = True


def _gather_stored_split(op: OpDef, flat: list[Tensor]) -> tuple[list[Tensor], bool]:
    """Replace parameters stored split (ZeRO-3) by their gathered compute layout, in place in
    ``flat``; return the gathered copies to free after the op, and whether any was replaced."""
    if not stored_split_seen[0]:
        return [], False
    gathered: list[Tensor] = []
    memo: dict[int, Tensor] = {}
    for i, t in enumerate(flat):
        full = t._compute_spec
        if full is None or not t.is_dist or t.spec == full:
            continue
        if id(t) not in memo:
            with comm_context(f"{op.name}: gather {t._label()} stored split (ZeRO-3)"):
                g = reshard_to(t, full)
            g._regather = (t, full)
            memo[id(t)] = g
            if g._shards:
                gathered.append(g)
        flat[i] = memo[id(t)]
    return gathered, bool(memo)


def _reshard_input(t: Tensor, want: DistSpec, backend: Any = None) -> Tensor:
    """Reshard an op input (``reshard_to`` records an identity-backward node when grads flow).

    With ``backend`` (the distributed path, whose inputs were checked to share the op's mesh, so
    no pipeline boundary is crossed) the target spec goes straight to the reshard: it is already
    a checked spec, and rebuilding it from placements on every call is pure overhead."""
    if backend is None or (hooks.stage_runs and t.is_dist):
        return reshard_to(t, want)
    return _reshard(t, want, backend)


def _record(
    op: OpDef,
    flat: list[Tensor],
    used: list[Tensor],
    outs: list[Tensor],
    attrs: dict[str, Any],
    decision: Decision | None = None,
) -> None:
    """Put the op call on the tape (a ``Node``) when grad mode is on and an input needs a gradient.

    Every op call of an eager training step comes through here, so the usual shapes of call (one
    or two inputs, every input differentiable, one output) are spelled out without loops."""
    n = len(flat)
    if op.grad is None or not _tape._grad_enabled:
        needs = None
    elif n == 2 and op.differentiable is None:
        a, b = flat
        needs = [not a.stop_gradient, not b.stop_gradient]
    elif n == 1 and op.differentiable is None:
        needs = [not flat[0].stop_gradient]
    elif op.differentiable is None:
        needs = [not t.stop_gradient for t in flat]
    else:
        diff = op.differentiable
        needs = [i in diff and not t.stop_gradient for i, t in enumerate(flat)]
    if needs is None or True not in needs:
        for t in outs:
            t.stop_gradient = True
        return
    _record_node(op, flat, used, outs, attrs, needs, decision)


def _record_short(
    op: OpDef,
    decision: Decision,
    attrs: dict[str, Any],
    a: Tensor,
    b: Tensor | None,
    ua: Tensor,
    ub: Tensor | None,
    out: Tensor,
) -> None:
    """``_record`` for ``apply``'s short path (inputs ``a`` and ``b``, or ``a`` alone, as the
    kernel took them ``ua`` and ``ub``; one output ``out``).

    Which inputs need a gradient, their shapes, dtypes and layouts, what is saved and the
    node's replay key follow from the decision, the op and the inputs' ``stop_gradient``, so
    the first such call records as ``_record`` does and keeps what its node holds of them
    (``Decision.tapes``); later calls build their node from that, with their own saved tensors,
    parents and attributes. Not where saved-tensor hooks are set, an input is a ZeRO-3 gathered
    copy, or the node's key would hold attributes the decision leaves out."""
    sg = a.stop_gradient if b is None else (a.stop_gradient, b.stop_gradient)
    tapes = decision.tapes
    plain = not _tape._saved_hooks and ua._regather is None and (ub is None or ub._regather is None)
    tape = tapes.get(sg) if tapes is not None and plain and (not attrs or op.attrs_in_key == 1) else None
    if tape is None or tape[0] is not op:
        flat = [a] if b is None else [a, b]
        used = [ua] if ub is None else [ua, ub]
        _record(op, flat, used, [out], attrs, decision)
        if plain and (not attrs or op.attrs_in_key == 1):
            if decision.tapes is None:
                decision.tapes = {}
            decision.tapes[sg] = _tape_of(op, out)
        return
    if len(tape) == 1:  # no input needs a gradient: no node (the output's stop_gradient stays True)
        return
    _, name, grad, shapes, dtypes, needs, specs, sig, save_a, save_b, save_out, parent_a, parent_b, out_stop = tape
    if ub is None:
        inputs = [ua.detach() if save_a else None]
        parents = [ua if parent_a else None]
    else:
        inputs = [ua.detach() if save_a else None, ub.detach() if save_b else None]
        parents = [ua if parent_a else None, ub if parent_b else None]
    ctx = _tape.GradContext(name, attrs, inputs, [out.detach() if save_out else None], shapes, dtypes, needs, specs)
    out.stop_gradient = out_stop
    out._set_history(_tape.Node(name, grad, ctx, parents, 1, "", sig), 0)


def _tape_of(op: OpDef, out: Tensor) -> tuple[Any, ...]:
    """What ``_record_short`` keeps of the node ``_record`` just made for ``out`` (one output,
    one or two inputs, no saved-tensor hook): all but its saved tensors, parents and attributes.
    Its shape, dtype, layout and need lists are shared by every later node made from it: the
    engine reassigns such a list, never changes one."""
    node = out._grad_fn
    if node is None:
        return (op,)
    ctx = node.ctx
    saved = [t is not None for t in ctx.inputs] + [False]
    parents = [p is not None for p in node.parents] + [False]
    return (
        op,
        node.op,
        node.grad_fn,
        ctx.input_shapes,
        ctx.input_dtypes,
        ctx.needs_grad,
        ctx.input_specs,
        node.sig,
        saved[0],
        saved[1],
        ctx.outputs[0] is not None,
        parents[0],
        parents[1],
        out.stop_gradient,
    )


def _node_sig(op: OpDef, attrs: dict[str, Any], needs: list[bool], decision: Decision | None) -> Any:
    """What a backward replay's graph key holds of this node (``mpipar.backward_replay``): the
    cached decision (one object per op, layouts, dtypes and decided attributes), which inputs
    need a gradient and the attributes the decision leaves out that the gradient reads
    (``OpDef.grad_attrs``); None when not replayable."""
    if decision is None or not op.replayable_grad:
        return None
    if op.attrs_in_key == 1 or not attrs:
        return (decision, *needs)
    if op.grad_attrs is not None:
        attrs = {k: attrs[k] for k in op.grad_attrs if k in attrs}
    try:
        frozen = freeze_attrs(attrs)
        hash(frozen)
    except TypeError:
        return None
    return (decision, *needs, frozen)


def _record_node(
    op: OpDef,
    flat: list[Tensor],
    used: list[Tensor],
    outs: list[Tensor],
    attrs: dict[str, Any],
    needs: list[bool],
    decision: Decision | None = None,
) -> None:
    """The tape node of an op call some input of which needs a gradient (``needs``, per input)."""
    n = len(flat)
    pack = _tape.pack_saved
    saved_in = op.save_inputs
    # ``pack_saved``'s usual case (no pack hook, no ZeRO-3 note) inline: the input detached.
    plain = not _tape._saved_hooks
    inputs: list[Any]
    if n == 2:
        a, b = flat
        ua, ub = used
        shapes = [tuple(a._shape), tuple(b._shape)]
        dtypes = [a._dtype, b._dtype]
        specs = [ua._spec, ub._spec]  # None for a dense input
        parents = [ua if needs[0] else None, ub if needs[1] else None]
        if saved_in is None:  # every input saved
            if plain and ua._regather is None and ub._regather is None:
                inputs = [ua.detach(), ub.detach()]
            else:
                inputs = [pack(ua), pack(ub)]
        else:
            inputs = [pack(ua) if 0 in saved_in else None, pack(ub) if 1 in saved_in else None]
    elif n == 1:
        a = flat[0]
        ua = used[0]
        shapes = [tuple(a._shape)]
        dtypes = [a._dtype]
        specs = [ua._spec]
        parents = [ua if needs[0] else None]
        if saved_in is not None and 0 not in saved_in:
            inputs = [None]
        elif plain and ua._regather is None:
            inputs = [ua.detach()]
        else:
            inputs = [pack(ua)]
    else:
        shapes = [tuple(t._shape) for t in flat]
        dtypes = [t._dtype for t in flat]
        specs = [u._spec for u in used]
        parents = [u if need else None for u, need in zip(used, needs, strict=True)]
        if saved_in is None:
            inputs = [pack(u) for u in used]
        else:
            inputs = [pack(u) if i in saved_in else None for i, u in enumerate(used)]
    save_out = op.save_outputs
    if not save_out:
        outputs: list[Tensor | None] = [None] * len(outs)
    else:
        outputs = [pack(t) if j in save_out else None for j, t in enumerate(outs)]
    ctx = _tape.GradContext(op.name, attrs, inputs, outputs, shapes, dtypes, needs, specs)
    node = _tape.Node(op.name, op.grad, ctx, parents, len(outs), "", _node_sig(op, attrs, needs, decision))  # type: ignore[arg-type]
    if len(outs) == 1:
        out = outs[0]
        out.stop_gradient = 0 in op.nondiff_outputs
        out._set_history(node, 0)
        return
    nondiff = op.nondiff_outputs
    for j, t in enumerate(outs):
        t.stop_gradient = j in nondiff
        t._set_history(node, j)
