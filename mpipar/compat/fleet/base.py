"""``fleet.init`` and the state it leaves: the strategy and this rank's communicate groups.

The state is kept per rank, not per process: under ``python -m simulator -n N`` every
virtual rank runs the script in its own thread of one process, and each must see its own
coordinate and groups (``mpipar.backend.current_backend().rank`` names the running rank).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mpipar.backend import current_backend
from mpipar.compat.collective import barrier
from mpipar.compat.fleet.strategy import DistributedStrategy, Resolved
from mpipar.compat.fleet.topology import AXES, CommunicateTopology, HybridCommunicateGroup


@dataclass
class _State:
    strategy: DistributedStrategy
    resolved: Resolved
    hcg: HybridCommunicateGroup
    explicit: bool = True
    """Whether ``fleet.init`` was given the strategy (else it is the default, which
    ``distributed_optimizer(opt, strategy=...)`` may replace, as in Paddle's static spelling)."""


_states: dict[int, _State] = {}


def _rank() -> int:
    return int(current_backend().rank)


def init(
    role_maker: Any = None,
    is_collective: bool = False,
    strategy: DistributedStrategy | None = None,
    log_level: Any = "INFO",
) -> None:
    """Build the 4-D topology of ``strategy`` over the world (without one: data parallel over all ranks).

    Calling it again (seed 001 calls ``fleet.init`` before it fills in the strategy) rebuilds
    the groups from the new strategy; every rank must make the same calls, as in Paddle.
    """
    if not is_collective:
        raise ValueError(
            "fleet.init(is_collective=False) asks for parameter-server training, which mpipar does not do; "
            "pass is_collective=True"
        )
    explicit = strategy is not None
    if strategy is None:
        strategy = DistributedStrategy()
    if not isinstance(strategy, DistributedStrategy):
        raise TypeError(f"fleet.init: strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}")
    resolved = complete(strategy.resolved())
    topology = CommunicateTopology(AXES, resolved.degrees)
    _states[_rank()] = _State(strategy, resolved, HybridCommunicateGroup(topology, _rank()), explicit)


def strategy_was_given() -> bool:
    """Did ``fleet.init`` get its strategy from the caller (rather than the default)?"""
    return _state("fleet").explicit


def complete(resolved: Resolved) -> Resolved:
    """``resolved`` with dp_degree -1 filled from the world size, checked against the world size."""
    world = int(current_backend().world_size)
    names = ("dp_degree", "pp_degree", "sharding_degree", "mp_degree")
    if resolved.dp_degree == -1:
        others = resolved.pp_degree * resolved.sharding_degree * resolved.mp_degree
        if world % others:
            factors = " * ".join(f"{k}({v})" for k, v in zip(names[1:], resolved.degrees[1:], strict=True))
            raise ValueError(
                f"fleet.init: world size {world} is not a multiple of {factors} = {others}, so dp_degree cannot "
                "fill the rest; change the degrees or the number of ranks launched"
            )
        resolved = dataclasses.replace(resolved, dp_degree=world // others)
    product = 1
    for d in resolved.degrees:
        product *= d
    if product != world:
        factors = " * ".join(f"{k}({v})" for k, v in zip(names, resolved.degrees, strict=True))
        raise ValueError(
            f"fleet.init: {factors} = {product} != world size {world}; make the degrees' product the number of "
            f"ranks launched (mpiexec -n {product} or python -m simulator -n {product})"
        )
    return resolved


def _state(call: str) -> _State:
    state = _states.get(_rank())
    if state is None:
        raise ValueError(f"{call}: call fleet.init(is_collective=True, strategy=...) first")
    return state


def hcg_or_none() -> HybridCommunicateGroup | None:
    state = _states.get(_rank())
    return None if state is None else state.hcg


def get_hybrid_communicate_group() -> HybridCommunicateGroup:
    return _state("fleet.get_hybrid_communicate_group").hcg


def resolved_strategy(call: str) -> Resolved:
    """The strategy ``fleet.init`` was given, both spellings combined."""
    return _state(call).resolved


def worker_index() -> int:
    return _rank()


def worker_num() -> int:
    return int(current_backend().world_size)


def is_first_worker() -> bool:
    return _rank() == 0


def barrier_worker() -> None:
    barrier()


__all__ = [
    "barrier_worker",
    "get_hybrid_communicate_group",
    "hcg_or_none",
    "init",
    "is_first_worker",
    "resolved_strategy",
    "strategy_was_given",
    "worker_index",
    "worker_num",
]
