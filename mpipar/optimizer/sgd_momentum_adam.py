"""SGD, Momentum (with L2 weight decay, as the primer uses), Adam and AdamW (Paddle's formulas).

Each takes ``multi_precision=True`` (float32 master weights and states for 16-bit parameters;
see ``optimizer.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from mpipar.optimizer.lr import LRScheduler
from mpipar.optimizer.optimizer import L1Decay, L2Decay, Optimizer, regularized
from mpipar.tensor import Tensor

Array = Any


class SGD(Optimizer):
    updates_in_place = True

    def _update(
        self, p: Array, g: Array, states: dict[str, Array], lr: float, meta: dict[str, Any]
    ) -> tuple[Array, dict[str, Array]]:
        t = p.dtype.type
        if self.regularization is not None:
            g = regularized(self.regularization, p, g)
        if type(p) is np.ndarray and p.flags.writeable:  # only the parameter holds it (``_unfreeze_if_alone``)
            step = t(lr) * g
            p -= step  # the same rounding as p - t(lr) * g (the operator: no keyword to parse)
            return p, {}
        return p - t(lr) * g, {}


class Momentum(Optimizer):
    """``v = mu v + g (+ coeff p)``; ``p -= lr v`` (or the Nesterov form)."""

    state_names = ("velocity",)

    def __init__(
        self,
        learning_rate: float | LRScheduler = 0.001,
        momentum: float = 0.9,
        parameters: Iterable[Tensor] | None = None,
        use_nesterov: bool = False,
        weight_decay: float | L1Decay | L2Decay | None = None,
        grad_clip: Any = None,
        multi_precision: bool = False,
        rescale_grad: float = 1.0,
        name: str | None = None,
    ) -> None:
        super().__init__(learning_rate, parameters, weight_decay, grad_clip, name, multi_precision=multi_precision)
        self.momentum, self.use_nesterov, self.rescale_grad = momentum, use_nesterov, rescale_grad

    def _update(
        self, p: Array, g: Array, states: dict[str, Array], lr: float, meta: dict[str, Any]
    ) -> tuple[Array, dict[str, Array]]:
        t = p.dtype.type
        if self.rescale_grad != 1.0:
            g = g * t(self.rescale_grad)
        g = regularized(self.regularization, p, g)
        v = t(self.momentum) * states["velocity"] + g
        step = g + t(self.momentum) * v if self.use_nesterov else v
        return p - t(lr) * step, {"velocity": v}


class Adam(Optimizer):
    """Adam with Paddle's bias correction: ``p -= lr_t m / (sqrt(v) + eps sqrt(1 - b2^t))``."""

    state_names = ("moment1", "moment2")

    def __init__(
        self,
        learning_rate: float | LRScheduler = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        parameters: Iterable[Tensor] | None = None,
        weight_decay: float | L1Decay | L2Decay | None = None,
        grad_clip: Any = None,
        lazy_mode: bool = False,
        multi_precision: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(learning_rate, parameters, weight_decay, grad_clip, name, multi_precision=multi_precision)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def _decoupled(self, p: Array, lr: float, meta: dict[str, Any]) -> Array:
        return p

    def _update(
        self, p: Array, g: Array, states: dict[str, Array], lr: float, meta: dict[str, Any]
    ) -> tuple[Array, dict[str, Array]]:
        t = p.dtype.type
        if not isinstance(self, AdamW):  # AdamW decays the weights themselves (_decoupled)
            g = regularized(self.regularization, p, g)
        step = meta["step"] + 1
        p = self._decoupled(p, lr, meta)
        m = t(self.beta1) * states["moment1"] + t(1 - self.beta1) * g
        v = t(self.beta2) * states["moment2"] + t(1 - self.beta2) * g * g
        b1p, b2p = self.beta1**step, self.beta2**step
        lr_t = lr * math.sqrt(1 - b2p) / (1 - b1p)
        new_p = p - t(lr_t) * m / (v ** t(0.5) + t(self.epsilon * math.sqrt(1 - b2p)))
        return new_p, {"moment1": m, "moment2": v}


class AdamW(Adam):
    """Adam with decoupled weight decay ``p *= 1 - lr * coeff`` (Paddle's AdamW)."""

    def __init__(
        self,
        learning_rate: float | LRScheduler = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        parameters: Iterable[Tensor] | None = None,
        weight_decay: float = 0.01,
        lr_ratio: Callable[[Tensor], float] | None = None,
        apply_decay_param_fun: Callable[[str], bool] | None = None,
        grad_clip: Any = None,
        lazy_mode: bool = False,
        multi_precision: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(
            learning_rate, beta1, beta2, epsilon, parameters, None, grad_clip, lazy_mode, multi_precision, name
        )
        self.coeff = float(weight_decay.coeff if isinstance(weight_decay, L2Decay) else weight_decay)
        self.apply_decay_param_fun = apply_decay_param_fun
        self._decay_this = True
        """Whether the parameter being updated decays: ``_step_param`` sets it per parameter
        (``apply_decay_param_fun``), ``_decoupled`` reads it inside the same update."""

    def _step_param(self, p: Tensor, g: Tensor, lr: float) -> None:
        self._decay_this = self.apply_decay_param_fun is None or self.apply_decay_param_fun(p.name or "")
        super()._step_param(p, g, lr)

    def _decoupled(self, p: Array, lr: float, meta: dict[str, Any]) -> Array:
        if not self.coeff or not self._decay_this:
            return p
        return p * p.dtype.type(1.0 - lr * self.coeff)
