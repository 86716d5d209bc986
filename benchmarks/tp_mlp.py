"""The MLP training step the runtime benchmarks time (``tp_mlp_vs_mpi4py.py``, ``replay_overhead.py``,
``runtime_vs_torch.py`` through the first): ``relu(x @ w1 + b1) @ w2 + b2``, loss ``mean(z * z)``,
backward, one optimizer step. The layouts (tensor or data parallel) are the caller's: the same
code is what mpipar turns into each plan.
"""

from __future__ import annotations

from collections.abc import Callable

import mpipar as dist


def sgd_step_tensor(
    x: dist.Tensor, w1: dist.Tensor, b1: dist.Tensor, w2: dist.Tensor, b2: dist.Tensor, opt: dist.optimizer.Optimizer
) -> Callable[[], dist.Tensor]:
    """One training step on these tensors returning the loss Tensor (what ``compile_step(capture=True)``
    captures: a step that reads no value in Python); the caller converts it with ``float()``."""
    relu = dist.nn.functional.relu

    def step() -> dist.Tensor:
        h = relu(dist.add(dist.matmul(x, w1), b1))
        z = dist.add(dist.matmul(h, w2), b2)
        loss = dist.mean(dist.multiply(z, z))
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    return step


def sgd_step(
    x: dist.Tensor, w1: dist.Tensor, b1: dist.Tensor, w2: dist.Tensor, b2: dist.Tensor, opt: dist.optimizer.Optimizer
) -> Callable[[], float]:
    """The same step returning the loss as a float (read inside the step, as a user's loop does)."""
    inner = sgd_step_tensor(x, w1, b1, w2, b2, opt)

    def step() -> float:
        return float(inner().full_tensor())

    return step
