"""Parameter initializers: counter-based, so every layout of a parameter gets the same values.

An initializer is called with a draw key (taken when the parameter is created) and returns
a function ``(shape, box) -> array`` giving any box of the tensor. Marking a parameter with
``shard_tensor`` before its first use makes each rank generate only its own shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpipar import random as mrandom

BoxInit = Callable[[tuple[int, ...], Any], np.ndarray]


def _fans(shape: Sequence[int]) -> tuple[int, int]:
    """Paddle's convention: a (in, out) weight has fan_in = in, fan_out = out."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[0] * receptive, shape[1] * receptive


class Initializer:
    def box_init(self, key: int, dtype: Any) -> BoxInit:
        raise NotImplementedError

    def __call__(self, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """The whole value (for direct use outside layers)."""
        shape = tuple(int(n) for n in shape)
        return self.box_init(mrandom.next_key(), dtype)(shape, tuple((0, n) for n in shape))


class Constant(Initializer):
    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def box_init(self, key: int, dtype: Any) -> BoxInit:
        return lambda shape, box: np.full([e - s for s, e in box], self.value, dtype=dtype)


class Normal(Initializer):
    def __init__(self, mean: float = 0.0, std: float = 1.0) -> None:
        self.mean, self.std = mean, std

    def box_init(self, key: int, dtype: Any) -> BoxInit:
        return lambda shape, box: mrandom.normal_box(key, shape, box, self.mean, self.std).astype(dtype)


class TruncatedNormal(Normal):
    """Normal values folded into [mean - 2 std, mean + 2 std] (deterministically, per element)."""

    def box_init(self, key: int, dtype: Any) -> BoxInit:
        def init(shape: tuple[int, ...], box: Any) -> np.ndarray:
            z = mrandom.normal_box(key, shape, box)
            z = np.where(np.abs(z) > 2, np.fmod(z, 2), z)
            return (self.mean + self.std * z).astype(dtype)

        return init


class Uniform(Initializer):
    def __init__(self, low: float = -1.0, high: float = 1.0) -> None:
        self.low, self.high = low, high

    def box_init(self, key: int, dtype: Any) -> BoxInit:
        return lambda shape, box: (self.low + (self.high - self.low) * mrandom.uniform_box(key, shape, box)).astype(
            dtype
        )


class XavierUniform(Initializer):
    def box_init(self, key: int, dtype: Any) -> BoxInit:
        def init(shape: tuple[int, ...], box: Any) -> np.ndarray:
            fan_in, fan_out = _fans(shape)
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            return (-limit + 2 * limit * mrandom.uniform_box(key, shape, box)).astype(dtype)

        return init


class XavierNormal(Initializer):
    def box_init(self, key: int, dtype: Any) -> BoxInit:
        def init(shape: tuple[int, ...], box: Any) -> np.ndarray:
            fan_in, fan_out = _fans(shape)
            return mrandom.normal_box(key, shape, box, 0.0, math.sqrt(2.0 / (fan_in + fan_out))).astype(dtype)

        return init


class KaimingUniform(Initializer):
    def box_init(self, key: int, dtype: Any) -> BoxInit:
        def init(shape: tuple[int, ...], box: Any) -> np.ndarray:
            fan_in, _ = _fans(shape)
            limit = math.sqrt(6.0 / max(fan_in, 1))
            return (-limit + 2 * limit * mrandom.uniform_box(key, shape, box)).astype(dtype)

        return init
