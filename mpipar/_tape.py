"""The tape: grad mode, the nodes ops record, and what a node saves of its tensors.

The bottom of autograd, below ``tensor.py`` and the ops: it imports nothing of mpipar, so
anything may record onto it. Walking it backwards (the engine, written in ops) lives in
``mpipar.autograd``, above the ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from mpipar.spec import DistSpec
    from mpipar.tensor import Tensor

_grad_enabled = True

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    return _grad_enabled


def set_grad_mode(enabled: bool) -> None:
    """Set grad mode outright, not for a block: for code that saves and restores the process's
    state around a switch (the simulator's per-rank threads taking turns)."""
    global _grad_enabled
    _grad_enabled = enabled


class _GradMode(contextlib.ContextDecorator):
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        global _grad_enabled
        self._saved.append(_grad_enabled)
        _grad_enabled = self.enabled

    def __exit__(self, *exc: object) -> None:
        global _grad_enabled
        _grad_enabled = self._saved.pop()


def no_grad(func: F | None = None) -> Any:
    """Context manager (``with dist.no_grad():``) or decorator: record no tape."""
    mode = _GradMode(False)
    return mode(func) if func is not None else mode


def enable_grad() -> _GradMode:
    return _GradMode(True)


@contextlib.contextmanager
def set_grad_enabled(mode: bool) -> Iterator[None]:
    with _GradMode(mode):
        yield


_saved_hooks: list[tuple[Callable[[Any], Any], Callable[[Any], Any]]] = []


@contextlib.contextmanager
def saved_tensors_hooks(pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> Iterator[None]:
    """Ops recorded inside save ``pack(t)`` instead of ``t``; backward uses ``unpack(saved)``.

    ZeRO-3 packs a gathered parameter as a note to gather it again, so the full weight is not
    held between forward and backward.
    """
    _saved_hooks.append((pack, unpack))
    try:
        yield
    finally:
        _saved_hooks.pop()


packed_made = [False]
"""Set once any ``Packed`` is made: until then backward need not look for any in the nodes."""


class Packed:
    """A saved value replaced by a pack hook, with the unpack function to get it back."""

    __slots__ = ("payload", "unpack")

    def __init__(self, payload: Any, unpack: Callable[[Any], Tensor]) -> None:
        packed_made[0] = True
        self.payload = payload
        self.unpack = unpack


regather: list[Callable[[tuple[Tensor, DistSpec]], Tensor]] = []
"""How a ZeRO-3 note ``(param, spec)`` is gathered again: a reshard, which lives above this
module, so ``mpipar.distribute`` registers it here when it loads."""


def pack_saved(t: Tensor) -> Any:
    """What a node keeps of ``t``: the tensor itself, or what the innermost pack hook makes.

    A parameter gathered from split storage (ZeRO-3) is kept as a note to gather it again.
    """
    note = t._regather
    if note is None and not _saved_hooks:  # the usual case, first
        return t.detach()
    if note is not None:
        return Packed(note, regather[-1])
    pack, unpack = _saved_hooks[-1]
    out = pack(t)
    return out.detach() if out is t else Packed(out, unpack)


def _unpacked(values: list[Any]) -> list[Any]:
    return [v.unpack(v.payload) if isinstance(v, Packed) else v for v in values]


class GradContext:
    """What a gradient function sees: saved forward tensors (detached), attributes, metadata.

    A plain slotted class rather than a dataclass: every recorded op makes one, and a slotted
    instance is built with one small ``__init__`` and no per-instance dict.
    """

    __slots__ = ("attrs", "input_dtypes", "input_shapes", "input_specs", "inputs", "needs_grad", "op", "outputs")

    def __init__(
        self,
        op: str,
        attrs: dict[str, Any],
        inputs: list[Tensor | None],
        outputs: list[Tensor | None],
        input_shapes: list[tuple[int, ...]],
        input_dtypes: list[Any],
        needs_grad: list[bool],
        input_specs: list[Any] | None = None,
    ) -> None:
        self.op = op
        self.attrs = attrs
        self.inputs = inputs
        """Forward inputs as the kernel saw them (after the rule's reshard); None if not saved."""
        self.outputs = outputs
        self.input_shapes = input_shapes
        self.input_dtypes = input_dtypes
        self.needs_grad = needs_grad
        self.input_specs = input_specs
        """Each input's layout as the kernel saw it (a ``DistSpec``; None for dense); None if not recorded."""

    def __repr__(self) -> str:
        return f"GradContext(op={self.op!r}, attrs={self.attrs!r}, needs_grad={self.needs_grad!r})"


class Node:
    """One recorded op call (slotted, as ``GradContext``: one per recorded op)."""

    __slots__ = ("__weakref__", "ctx", "grad_fn", "name", "num_outputs", "op", "parents", "sig")

    def __init__(
        self,
        op: str,
        grad_fn: Callable[[GradContext, list[Tensor | None]], Sequence[Tensor | None]],
        ctx: GradContext,
        parents: list[Tensor | None],
        num_outputs: int = 1,
        name: str = "",
        sig: Any = None,
    ) -> None:
        self.op = op
        self.grad_fn = grad_fn
        self.ctx = ctx
        self.parents = parents
        """The tensors gradients flow to, one per (flattened) input; None where none is needed."""
        self.num_outputs = num_outputs
        self.name = name
        self.sig = sig
        """What a backward replay's graph key holds of this node (``mpipar.backward_replay``);
        None: its gradient function is never replayed."""

    def __repr__(self) -> str:
        return f"Node(op={self.op!r}, num_outputs={self.num_outputs})"

    def release(self) -> None:
        """Drop saved tensors (after backward without retain_graph)."""
        ctx = self.ctx
        ctx.inputs = [None] * len(ctx.inputs)
        ctx.outputs = [None] * len(ctx.outputs)

    def saved_tensors(self) -> list[Tensor]:
        return [t for t in (*self.ctx.inputs, *self.ctx.outputs) if t is not None]


def topo_order(root: Tensor) -> list[Node]:
    """The nodes ``root`` depends on, parents before children: the order the backward engine
    walks in reverse (a depth-first post-order from ``root``'s node, parents in input order)."""
    order: list[Node] = []
    seen: set[Node] = set()  # nodes compare and hash by identity
    stack: list[tuple[Node, bool]] = []
    if root._grad_fn is not None:
        stack.append((root._grad_fn, False))
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for p in node.parents:
            if p is not None:
                fn = p._grad_fn
                if fn is not None and fn not in seen:
                    stack.append((fn, False))
    return order
