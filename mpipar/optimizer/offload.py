"""Optimizer offload: states (and optionally float32 master weights) kept in host memory.

    opt = dist.offload_optimizer(opt)                       # moments live on the host
    opt = dist.offload_optimizer(opt, master_weight=True)   # the master copies too
    opt.offload.moved                                       # {rank: {"to_device": bytes, "to_host": bytes}}

Seed 001's ``sharding_configs["offload"]``: between steps the offloaded states sit in host
memory; each update moves a parameter's states to the device, updates there and moves the new
states back. Under the NCCL backend the device arrays are CuPy, so the moves are
``xp.asarray`` (host -> device) and ``xp.asnumpy`` (device -> host). On the CPU backends
(simulator, MPI) device and host are one memory: the move is a no-op, but the bytes each rank
would move are counted the same way, so ``memory_report`` and the accounting read the same in
every launch mode. The update's arithmetic is unchanged: offload moves arrays, never values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpipar.backend import current_backend
from mpipar.tensor import Tensor

MASTER = "master_weight"


@dataclass
class OffloadConfig:
    """What an optimizer keeps on the host, and the bytes moved so far per rank."""

    master_weight: bool = False
    moved: dict[int, dict[str, int]] = field(default_factory=dict)

    def offloads(self, state_name: str) -> bool:
        """Whether the state ``state_name`` (``exp_avg``, ``master_weight``, ...) lives on the host."""
        return state_name != MASTER or self.master_weight

    def count(self, t: Tensor, direction: str, ranks: Iterable[int]) -> None:
        """Add the bytes each rank moves for ``t`` (its local shard; a dense tensor on every rank)."""
        itemsize = np.dtype(t.dtype).itemsize
        if t.is_dist:
            sizes = {r: int(np.prod(t.spec.local_shape(r), dtype=np.int64)) * itemsize for r in t.spec.mesh.process_ids}
        else:
            n = int(np.prod(t.shape, dtype=np.int64)) * itemsize
            sizes = dict.fromkeys(ranks, n)
        for r, n in sizes.items():
            per = self.moved.setdefault(r, {"to_device": 0, "to_host": 0})
            per[direction] += n


def _convert(t: Tensor, convert: Callable[[Any], Any]) -> Tensor:
    """``t`` with every local array passed through ``convert`` (replicas sharing an array share its copy)."""
    if t.is_abstract:
        return t
    if not t.is_dist:
        return Tensor(convert(t._value))
    copies: dict[int, Any] = {}
    shards: dict[int, Any] = {}
    for r, a in t._shards.items():
        if id(a) not in copies:
            copies[id(a)] = convert(a)
        shards[r] = copies[id(a)]
    return Tensor._from_shards(t.spec, shards, t.dtype)


def move_states(
    state: dict[str, Any],
    names: Iterable[str],
    config: OffloadConfig,
    direction: str,
    ranks: Iterable[int],
    xp: Any = None,
) -> None:
    """Move the offloaded ``names`` of one parameter's ``state`` in ``direction`` (``to_device``/``to_host``).

    ``xp`` is the device's array module (the backend's by default). With NumPy there is one
    memory and the arrays stay as they are; with CuPy (or any module with ``asnumpy``) the
    arrays are copied across. Either way the bytes are counted.
    """
    if direction not in ("to_device", "to_host"):
        raise ValueError(f"move_states: direction {direction!r} is neither 'to_device' nor 'to_host'")
    xp = current_backend().xp if xp is None else xp
    ranks = tuple(ranks)
    for name in names:
        if name not in state or not config.offloads(name):
            continue
        t = state[name]
        config.count(t, direction, ranks)
        if xp is np:
            continue  # host and device are one memory: nothing to copy
        state[name] = _convert(t, xp.asarray if direction == "to_device" else xp.asnumpy)


def offload_optimizer(optimizer: Any, master_weight: bool = False) -> Any:
    """Keep ``optimizer``'s states (and with ``master_weight=True`` its float32 master copies) on the host."""
    if not hasattr(optimizer, "_states") or not hasattr(optimizer, "state_names"):
        raise TypeError(
            f"offload_optimizer: {type(optimizer).__name__} is not an mpipar optimizer (e.g. dist.optimizer.AdamW)"
        )
    if not isinstance(master_weight, bool):
        raise TypeError(f"offload_optimizer: master_weight must be True or False, got {master_weight!r}")
    optimizer.offload = OffloadConfig(master_weight=master_weight)
    return optimizer
