"""Reverse-mode autograd: a tape of op nodes whose backward is written in distributed ops.

Every differentiable op call records a ``Node`` holding what its gradient function needs.
``backward(loss)`` walks the nodes in reverse topological order and calls their gradient
functions, which are ordinary mpipar ops: gradients are distributed tensors whose layouts
are inferred by the same rules and resharded by the same planner as the forward pass. A
leaf's gradient is resharded to the leaf's own placements (or to ``leaf.grad_placements``
when an optimizer asks for another layout, as ZeRO-2 does) -- that reshard is where data
parallelism's all-reduce comes from.

Gradients are values of the *global* tensor: the gradient of a Partial tensor is the
gradient of its reduced value, so a reshard's backward is the identity (no communication;
the consumer's rule reshards as it needs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpipar import _capture_hooks, _tape, backward_replay, hooks, overlap
from mpipar._tape import (  # noqa: F401  (re-exported: the tape's names are importable from here as before)
    GradContext,
    Node,
    Packed,
    _unpacked,
    enable_grad,
    is_grad_enabled,
    no_grad,
    pack_saved,
    saved_tensors_hooks,
    set_grad_enabled,
    set_grad_mode,
    topo_order,
)
from mpipar.comm import comm_context
from mpipar.distribute import reshard, reshard_to
from mpipar.ops import math as M
from mpipar.placement import Replicate
from mpipar.tensor import Tensor


def _merge_order(nodes: list[Node]) -> list[Node]:
    """One topological order (parents first) of the union of several roots' graphs."""
    index = {id(n): n for n in nodes}
    order: list[Node] = []
    state: dict[int, int] = {}
    for start in nodes:
        if id(start) in state:
            continue
        stack: list[tuple[Node, bool]] = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                state[id(node)] = 2
                order.append(node)
                continue
            if state.get(id(node)):
                continue
            state[id(node)] = 1
            stack.append((node, True))
            for p in node.parents:
                if (
                    p is not None
                    and p._grad_fn is not None
                    and id(p._grad_fn) in index
                    and not state.get(id(p._grad_fn))
                ):
                    stack.append((p._grad_fn, False))
    return order


_topo_order = topo_order
"""(the engine's order, by its older name: ``mpipar.debug.memory`` and the simulator read it)"""


def backward(root: Tensor, grad: Tensor | None = None, retain_graph: bool = False) -> None:
    """Accumulate d(root)/d(leaf) into ``leaf.grad`` for every leaf that wants a gradient."""
    with hooks.phase("backward"):
        _backward(root, grad, retain_graph)


def _backward(root: Tensor, grad: Tensor | None, retain_graph: bool) -> None:
    if root.stop_gradient:
        raise ValueError(
            f"backward() on {root._label()} that does not require grad (stop_gradient=True): no input "
            "it depends on is trainable, or it was computed under no_grad"
        )
    run_backward([root], [grad], retain_graph)


@dataclass(eq=False)
class DeferredWeights:
    """Weight-gradient work set aside by ``run_backward(..., defer=...)`` (zero-bubble ``W``)."""

    items: list[tuple[Node, list[Any], list[int]]] = field(default_factory=list)

    def run(self) -> None:
        """Compute and accumulate the deferred gradients, then free the nodes."""
        with no_grad():
            for node, out_grads, indices in self.items:
                saved = list(node.ctx.needs_grad)
                node.ctx.needs_grad = [i in indices for i in range(len(saved))]
                try:
                    in_grads = node.grad_fn(node.ctx, out_grads)
                finally:
                    node.ctx.needs_grad = saved
                for i in indices:
                    g = in_grads[i] if i < len(in_grads) else None
                    parent = node.parents[i]
                    if g is not None and parent is not None:
                        _accumulate_leaf(parent, g)
                node.release()
        self.items = []


def run_backward(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    retain_graph: bool = False,
    defer: Callable[[Tensor], bool] | None = None,
) -> DeferredWeights:
    """Backpropagate ``grads`` (None: ones) from several roots at once (recompute uses this).

    ``defer(leaf)`` true for a leaf (the weights) sets its gradient aside: this pass computes
    only the other gradients (zero-bubble ``B``) and returns the rest as ``DeferredWeights``
    (``W``), keeping the nodes it needs.
    """
    depth = getattr(_backward_depth, "n", 0)
    if depth == 0:  # not a pass run inside another's backward (recompute's)
        for hook in hooks.backward_hooks:
            hook.on_backward(roots)
    _backward_depth.n = depth + 1
    try:
        return _run_backward_once(roots, grads, retain_graph, defer)
    finally:
        _backward_depth.n = depth


_backward_depth = threading.local()
"""``.n``: backward passes running now in this thread (recompute runs one inside another's
backward; the simulator's per-rank programs are threads, each with its own passes)."""


def _run_backward_once(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    retain_graph: bool,
    defer: Callable[[Tensor], bool] | None,
) -> DeferredWeights:
    session = overlap.begin_backward()  # None unless overlap_grad_reduction() is on (outermost pass)
    try:
        deferred = _run_backward(roots, grads, retain_graph, defer)
    except BaseException:
        overlap.end_backward(session, _finish_leaf, failed=True)
        raise
    overlap.end_backward(session, _finish_leaf)  # waits for the gradient buckets still in flight
    return deferred


def _run_backward(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    retain_graph: bool,
    defer: Callable[[Tensor], bool] | None,
) -> DeferredWeights:
    r = backward_replay.eligible(roots, grads, defer)
    if r is None:
        return _run_backward_eager(roots, grads, retain_graph, defer, None, None)

    # A pass that may be replayed (``mpipar.backward_replay``): its order is worked out once,
    # for the graph's key and for the eager pass that records it when there is no program yet.
    def eager(order: list[Node] | None, rec: backward_replay.Recorder | None) -> None:
        _run_backward_eager(roots, grads, retain_graph, None, order, rec)

    with no_grad():
        backward_replay.run(roots[0], r, retain_graph, eager, _accumulate_leaf)
    return DeferredWeights()


def _run_backward_eager(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    retain_graph: bool,
    defer: Callable[[Tensor], bool] | None,
    order_given: list[Node] | None,
    rec: backward_replay.Recorder | None,
) -> DeferredWeights:
    """The pass through the gradient functions; ``rec`` (with ``order_given``, one root's order)
    hears each leaf's gradient and each node released, for a replay's recording."""
    deferred = DeferredWeights()
    with no_grad():
        seeds: list[tuple[Tensor, Tensor]] = []
        for root, grad in zip(roots, grads, strict=True):
            if root.stop_gradient:
                continue
            if grad is None:
                grad = M.ones_like_global(root)
            elif not isinstance(grad, Tensor):
                grad = Tensor(grad, dtype=root.dtype)
            if tuple(grad.shape) != tuple(root.shape):
                raise ValueError(f"backward: grad of shape {list(grad.shape)} does not match {root._label()}")
            seeds.append((root, grad))
        if order_given is not None:
            order = order_given
        elif len(seeds) == 1:  # one root's order is already topological (merging would keep it)
            order = _topo_order(seeds[0][0])
        else:
            order = []
            seen: set[int] = set()
            for root, _ in seeds:
                for node in _topo_order(root):
                    if id(node) not in seen:
                        seen.add(id(node))
                        order.append(node)
            order = _merge_order(order)
        # Each node's output gradients, made when the first one reaches it: a node none reaches
        # has no entry (and is skipped), and no list is made for it.
        pending: dict[int, list[Tensor | None]] = {}
        for root, grad in seeds:
            fn = root._grad_fn
            if fn is None:
                _accumulate_leaf(root, grad)
                continue
            slot = pending.get(id(fn))
            if slot is None:
                slot = pending[id(fn)] = [None] * fn.num_outputs
            i = root._out_index
            slot[i] = grad if slot[i] is None else M.add(slot[i], grad)
        for node in reversed(order):
            out_grads = pending.pop(id(node), None)
            if out_grads is None:  # no gradient reached this node
                continue
            if _tape.packed_made[0] and any(isinstance(v, Packed) for v in (*node.ctx.inputs, *node.ctx.outputs)):
                node.ctx.inputs = _unpacked(node.ctx.inputs)
                node.ctx.outputs = _unpacked(node.ctx.outputs)
            weights = []
            if defer is not None:
                weights = [
                    i
                    for i, p in enumerate(node.parents)
                    if p is not None and p._grad_fn is None and not p.stop_gradient and defer(p)
                ]
            if weights:
                saved = list(node.ctx.needs_grad)
                node.ctx.needs_grad = [n and i not in weights for i, n in enumerate(saved)]
                try:
                    in_grads = node.grad_fn(node.ctx, out_grads) if any(node.ctx.needs_grad) else [None] * len(saved)
                finally:
                    node.ctx.needs_grad = saved
                deferred.items.append((node, out_grads, weights))
            else:
                in_grads = node.grad_fn(node.ctx, out_grads)
            for i, (parent, g) in enumerate(zip(node.parents, in_grads, strict=False)):
                if parent is None or g is None or parent.stop_gradient or (weights and i in weights):
                    continue
                fn = parent._grad_fn
                if fn is None:
                    if rec is None:
                        _accumulate_leaf(parent, g)
                        continue
                    rec.leaf(node, i, g)
                    rec.pause()  # the leaf's reduction, cast and hooks are not the recording's
                    try:
                        _accumulate_leaf(parent, g)
                    finally:
                        rec.resume()
                    continue
                key = id(fn)
                slot = pending.get(key)
                if slot is None:  # the first gradient to reach ``fn``
                    if fn.num_outputs == 1:
                        pending[key] = [g]
                        continue
                    slot = pending[key] = [None] * fn.num_outputs
                j = parent._out_index
                slot[j] = g if slot[j] is None else M.add(slot[j], g)
            if rec is not None:  # where a replay releases it (unless its caller retains the graph)
                rec.released(node)
            if not retain_graph and not weights:
                node.release()
    return deferred


def _accumulate_leaf(leaf: Tensor, g: Tensor) -> None:
    session = overlap.current_session()
    spec = leaf._spec
    if (
        spec is not None
        and g._spec is spec._without_partial  # already in the leaf's gradient layout (specs are interned) ...
        and not leaf.grad_placements  # ... which is that one
        and (session is None or id(leaf) not in session.waiting)  # (else it goes in behind a bucketed one)
    ):
        # Nothing to reduce or bucket (the usual tensor-parallel case): what the session and
        # ``_grad_to_layout`` would both decide, without asking them.
        _finish_leaf(leaf, g)
        return
    if session is not None and session.offer(leaf, g, _grad_to_layout):
        return  # its reduction is bucketed; the session finishes the leaf when it completes
    _finish_leaf(leaf, _grad_to_layout(leaf, g))


def _grad_to_layout(leaf: Tensor, g: Tensor) -> Tensor:
    """``g`` resharded to the layout ``leaf`` keeps its gradient in (the data-parallel reduction)."""
    if leaf.is_dist:
        target = leaf.grad_spec()
        # A leaf standing in for a recomputed block's input lets its gradient keep the layout the
        # block's backward gave it (Partial too), exactly as the block's ordinary backward would.
        keep_layout = leaf._grad_any_layout and g.is_dist
        if not keep_layout and (not g.is_dist or g.spec != target):
            with comm_context(f"gradient of {leaf._label()} to its layout {target.placements_str}"):
                g = reshard_to(g, target)
    elif g.is_dist:  # a dense leaf used in a distributed computation: its gradient is dense
        mesh = g.spec.mesh
        with comm_context(f"gradient of dense {leaf._label()}"):
            g = reshard(g, mesh, [Replicate()] * mesh.ndim)  # the reduction, as a planned reshard
        g = Tensor.abstract(g.shape, g.dtype) if g.is_abstract else Tensor(g.full_tensor())
    return g


def _finish_leaf(leaf: Tensor, g: Tensor) -> None:
    """Cast ``g`` (already in the leaf's gradient layout), run the leaf's hooks, accumulate."""
    # Cast after the reshard: a Partial gradient is reduced in its own precision first.
    if g._dtype != leaf._dtype:  # (the fields, not the ``dtype`` properties: every leaf of every pass)
        g = M.cast(g, leaf.dtype)
    for hook in leaf._grad_hooks:
        out = hook(g)
        if out is not None:
            g = out
    if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
        tr.note_leaf(leaf)  # a captured step being traced: a gradient held from before is read
    leaf.grad = g if leaf.grad is None else M.add(leaf.grad, g)


def _tensor_backward(self: Tensor, grad_tensor: Any = None, retain_graph: bool = False) -> None:
    """Accumulate gradients of this tensor into every leaf that requires one."""
    backward(self, grad_tensor, retain_graph)


# Installed from here, as ``mpipar.ops.tensor_methods`` installs the operators: ``tensor.py``
# sits below the ops this engine runs, so it cannot call the engine itself.
setattr(Tensor, "backward", _tensor_backward)  # noqa: B010  (Tensor declares no backward: a type checker refuses the plain assignment)
