"""Deterministic randomness over global indices: the same values on any mesh, in any launch mode.

Every random draw (parameter init, dropout mask, data shuffle) is a pure function of
``(seed, draw number, global element index)``: a rank computes only the elements of its own
shard, never the full tensor, and gets exactly the values one big device would. The draw
number advances by one per random call; every process of an SPMD program makes the same
calls in the same order, so all agree on it.

The generator is SplitMix64 over a counter (a well-tested 64-bit mixer), giving uniforms
with 53 random bits; normals come from Box-Muller on two independent uniforms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar.spec import Box

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

_state = {"seed": 0, "draws": 0}


def seed(value: int) -> None:
    """Reset the generator (Paddle's ``paddle.seed``)."""
    _state["seed"] = int(value) & 0xFFFFFFFFFFFFFFFF
    _state["draws"] = 0


def get_rng_state() -> dict[str, int]:
    """The generator state, JSON-able (checkpoints store it)."""
    return dict(_state)


def set_rng_state(state: dict[str, int]) -> None:
    _state["seed"] = int(state["seed"])
    _state["draws"] = int(state["draws"])


def next_key() -> int:
    """A fresh 64-bit key for one random call (advances the draw counter)."""
    key = key_at(_state["draws"])
    _state["draws"] += 1
    return key


def key_at(draw: int) -> int:
    """The key the ``draw``-th random call after ``seed()`` gets."""
    return _mix_scalar((_state["seed"] * 0x9E3779B97F4A7C15 + int(draw) + 1) & 0xFFFFFFFFFFFFFFFF)


def draws() -> int:
    """How many random calls were made since ``seed()``."""
    return _state["draws"]


def key_for(*values: int) -> int:
    """A key that is a pure function of ``values`` (no draw counter): step-indexed sampling."""
    z = 0x853C49E6748FEA9B
    for v in values:
        z = _mix_scalar((z ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF)
    return z


def _mix_scalar(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def global_indices(shape: Sequence[int], box: Box) -> np.ndarray:
    """Row-major flat indices (uint64) of the elements of ``box`` inside a tensor of ``shape``."""
    idx = np.zeros([e - s for s, e in box], dtype=np.uint64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        s, e = box[d]
        view = [1] * len(shape)
        view[d] = e - s
        idx += (np.arange(s, e, dtype=np.uint64) * np.uint64(stride)).reshape(view)
        stride *= int(shape[d])
    return idx


def uniform_box(key: int, shape: Sequence[int], box: Box, stream: int = 0) -> np.ndarray:
    """Uniform [0, 1) float64 values of the elements of ``box`` (one draw of a ``shape`` tensor)."""
    with np.errstate(over="ignore"):
        base = np.uint64(_mix_scalar((key + stream * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF))
        bits = _mix(global_indices(shape, box) * _GOLDEN + base)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def normal_box(key: int, shape: Sequence[int], box: Box, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    """Normal values of the elements of ``box`` (Box-Muller on two independent streams)."""
    u1 = uniform_box(key, shape, box, stream=1)
    u2 = uniform_box(key, shape, box, stream=2)
    z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
    return mean + std * z


def permutation(key: int, n: int) -> np.ndarray:
    """A permutation of ``range(n)`` (data shuffling): argsort of per-index uniforms."""
    keys = uniform_box(key, (n,), ((0, n),))
    return np.argsort(keys, kind="stable")


def describe() -> dict[str, Any]:
    return {"generator": "splitmix64 over (seed, draw, global index)", **_state}
