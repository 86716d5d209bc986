"""Recompute (activation checkpointing): keep a block's inputs, not its activations.

    y = dist.recompute(block, x)          # Paddle's fleet.utils.recompute

The block runs without recording a tape; one node remembers its inputs. In backward the
block runs again with the tape on -- with the random state of the first run, so dropout
masks are the same -- and its local graph is backpropagated: gradients reach the block's
parameters directly and the block's inputs through the node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpipar import autograd
from mpipar import random as mrandom
from mpipar.tensor import Tensor


def recompute(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not autograd.is_grad_enabled():
        return function(*args, **kwargs)
    rng_state = mrandom.get_rng_state()
    with autograd.no_grad():
        result = function(*args, **kwargs)
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
    inputs: list[Tensor] = [args[i] for i in tensor_pos]

    def grad_fn(ctx: autograd.GradContext, grads: list[Any]) -> list[Any]:
        now = mrandom.get_rng_state()
        mrandom.set_rng_state(rng_state)
        detached = []
        for t in inputs:
            d = t.detach()
            d.stop_gradient = t.stop_gradient
            # The gradient leaves in whatever layout it has (Partial too), as it would without
            # recompute: the caller's tape reduces it where the ordinary backward would.
            d._grad_any_layout = True
            detached.append(d)
        new_args = list(args)
        for i, d in zip(tensor_pos, detached, strict=True):
            new_args[i] = d
        try:
            with autograd.enable_grad():
                again = function(*new_args, **kwargs)
        finally:
            mrandom.set_rng_state(now)
        again_outs = list(again) if isinstance(again, (tuple, list)) else [again]
        pairs = [(o, g) for o, g in zip(again_outs, grads, strict=True) if g is not None and isinstance(o, Tensor)]
        autograd.run_backward([o for o, _ in pairs], [g for _, g in pairs])
        return [d.grad for d in detached]

    ctx = autograd.GradContext(
        "recompute",
        {},
        [t.detach() for t in inputs],
        [None] * len(outs),
        [tuple(t.shape) for t in inputs],
        [t.dtype for t in inputs],
        [not t.stop_gradient for t in inputs],
    )
    node = autograd.Node("recompute", grad_fn, ctx, [t if not t.stop_gradient else None for t in inputs], len(outs))
    for j, o in enumerate(outs):
        if isinstance(o, Tensor) and o.dtype.kind == "f":
            o._set_history(node, j)
            o.stop_gradient = False
    return result
