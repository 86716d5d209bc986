"""``fleet.DistributedStrategy``: Paddle's switches for hybrid parallel training, validated.

Two spellings of the four degrees are accepted, as Paddle accepts them:

* dygraph: ``strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 2,
  "sharding_degree": 1}`` (keys left out keep 1);
* seed 001's (Paddle's static sharding meta-optimizer): ``strategy.sharding = True`` and the
  degrees inside ``strategy.sharding_configs``, with ``gradient_merge_acc_step`` and
  ``optimize_offload`` beside them.

Every key and value is checked when it is assigned (a typo is an error naming the key, not a
silently ignored switch); ``resolved()`` combines the spellings into one ``Resolved`` record
and refuses contradictions (the same degree given twice with different values).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

DEGREES = ("dp_degree", "pp_degree", "sharding_degree", "mp_degree")
"""The degrees in the topology's axis order: data, pipe, sharding, model (Paddle's order)."""

_HYBRID_KEYS = {**dict.fromkeys(DEGREES, 1), "dp_degree": -1}
"""dp_degree -1 (Paddle's default): the world size divided by the other degrees."""
_SHARDING_KEYS: dict[str, Any] = {
    "sharding_segment_strategy": "segment_broadcast_MB",
    "segment_broadcast_MB": 32.0,
    "segment_anchors": None,
    "sharding_degree": 1,
    "mp_degree": 1,
    "pp_degree": 1,
    "dp_degree": 1,
    "hybrid_dp": False,
    "pp_allreduce_in_optimize": False,
    "gradient_merge_acc_step": 1,
    "optimize_offload": False,
    "offload": False,
    "optimize_cast": False,
    "stage": 1,
}
_PIPELINE_KEYS: dict[str, Any] = {
    "micro_batch_size": 1,
    "accumulate_steps": 1,
    "schedule_mode": "1F1B",
    "p2p_cache_shape": True,
}
_MERGE_KEYS: dict[str, Any] = {"k_steps": 1, "avg": True}
_RECOMPUTE_KEYS: dict[str, Any] = {"checkpoints": [], "enable_offload": False, "checkpoint_shape": []}

SCHEDULES = {"1F1B": "1F1B", "F-then-B": "FThenB", "FThenB": "FThenB"}
"""Paddle's schedule_mode names -> mpipar.pipeline's schedule kinds."""


def _positive_int(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fill = " (or -1: the world size over the other degrees)" if key == "dp_degree" else ""
        raise ValueError(f"{where}[{key!r}] = {value!r}: must be a positive int{fill}")
    return value


def _boolean(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}[{key!r}] = {value!r}: must be True or False")
    return value


def _check_value(where: str, key: str, value: Any) -> Any:
    """One config value, checked by its key's meaning."""
    if key == "dp_degree" and value == -1 and not isinstance(value, bool):
        return value  # fill the world (Paddle's default)
    if key.endswith("_degree") or key in ("micro_batch_size", "accumulate_steps", "gradient_merge_acc_step", "k_steps"):
        return _positive_int(where, key, value)
    if key in ("hybrid_dp", "pp_allreduce_in_optimize", "optimize_offload", "offload", "optimize_cast", "avg",
               "p2p_cache_shape", "enable_offload"):  # fmt: skip
        return _boolean(where, key, value)
    if key == "segment_broadcast_MB":
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{where}[{key!r}] = {value!r}: must be a positive number of megabytes")
        return float(value)
    if key == "stage":
        if value not in (1, 2) or isinstance(value, bool):
            raise ValueError(
                f"{where}['stage'] = {value!r}: fleet shards optimizer states (stage 1) and gradients (stage 2); "
                "for parameters too (stage 3) use dist.shard_optimizer(opt, dist.ShardingStage3(mesh))"
            )
        return value
    if key == "schedule_mode":
        if value not in SCHEDULES:
            raise ValueError(f"{where}['schedule_mode'] = {value!r}: use one of {', '.join(SCHEDULES)}")
        return value
    if key == "sharding_segment_strategy":
        if value not in ("segment_broadcast_MB", "segment_anchors"):
            raise ValueError(f"{where}[{key!r}] = {value!r}: use 'segment_broadcast_MB' or 'segment_anchors'")
        return value
    if key in ("checkpoints", "checkpoint_shape", "segment_anchors"):
        if value is not None and not isinstance(value, list | tuple):
            raise ValueError(f"{where}[{key!r}] = {value!r}: must be a list")
        return None if value is None else list(value)
    raise AssertionError(f"no check for config key {key}")


class _Configs:
    """One ``*_configs`` dict: defaults, the keys the user assigned, checked on assignment."""

    def __init__(self, name: str, defaults: Mapping[str, Any]) -> None:
        self.name = name
        self.defaults = dict(defaults)
        self.values = copy.deepcopy(self.defaults)
        self.assigned: set[str] = set()

    def assign(self, configs: Any) -> None:
        where = f"strategy.{self.name}"
        if not isinstance(configs, Mapping):
            raise TypeError(f"{where} must be a dict of {sorted(self.defaults)}, got {type(configs).__name__}")
        checked = {}
        for key, value in configs.items():
            if key not in self.defaults:
                raise ValueError(f"{where}: unknown key {key!r}; the keys are {', '.join(sorted(self.defaults))}")
            checked[key] = _check_value(where, key, value)
        # Paddle merges an assignment into the current values: keys left out keep theirs.
        self.values.update(checked)
        self.assigned |= set(checked)

    def get(self) -> dict[str, Any]:
        return copy.deepcopy(self.values)


@dataclass(frozen=True)
class Resolved:
    """What the strategy asks for, both spellings combined (``DistributedStrategy.resolved``)."""

    dp_degree: int
    """-1: whatever the world size leaves over the other degrees (``fleet.init`` fills it)."""
    pp_degree: int
    sharding_degree: int
    mp_degree: int
    sharding_stage: int
    offload: bool
    accumulate_steps: int
    micro_batch_size: int
    schedule: str
    gradient_merge_steps: int
    gradient_merge_avg: bool
    recompute: bool
    bucket_bytes: int = 32 << 20
    """Gradients are all-reduced in buckets of about this size (``segment_broadcast_MB``)."""

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        return (self.dp_degree, self.pp_degree, self.sharding_degree, self.mp_degree)


class DistributedStrategy:
    """Paddle's ``fleet.DistributedStrategy``; see the module docstring for the two spellings."""

    _FLAGS: ClassVar[tuple[str, ...]] = ("sharding", "pipeline", "gradient_merge", "recompute")
    _CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {
        "hybrid_configs": _HYBRID_KEYS,
        "sharding_configs": _SHARDING_KEYS,
        "pipeline_configs": _PIPELINE_KEYS,
        "gradient_merge_configs": _MERGE_KEYS,
        "recompute_configs": _RECOMPUTE_KEYS,
    }

    def __init__(self) -> None:
        object.__setattr__(self, "_flags", dict.fromkeys(self._FLAGS, False))
        object.__setattr__(self, "_flags_assigned", set())
        object.__setattr__(self, "_configs", {name: _Configs(name, d) for name, d in self._CONFIGS.items()})

    def __getattr__(self, name: str) -> Any:
        if name in self._FLAGS:
            return self._flags[name]
        if name in self._CONFIGS:
            return self._configs[name].get()
        raise AttributeError(
            f"DistributedStrategy has no attribute {name!r}; fleet supports {', '.join(self._FLAGS)} and "
            f"{', '.join(self._CONFIGS)}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"strategy.{name} = {value!r}: must be True or False")
            self._flags[name] = value
            self._flags_assigned.add(name)
        elif name in self._CONFIGS:
            self._configs[name].assign(value)
        else:
            raise AttributeError(
                f"DistributedStrategy.{name} = {value!r}: not a switch fleet supports; the switches are "
                f"{', '.join(self._FLAGS)} and {', '.join(self._CONFIGS)}"
            )

    def resolved(self) -> Resolved:
        """The degrees and switches, hybrid_configs and sharding_configs combined; contradictions refused."""
        hybrid, sharding = self._configs["hybrid_configs"], self._configs["sharding_configs"]
        degrees: dict[str, int] = {}
        for key in DEGREES:
            from_sharding = self.sharding and key in sharding.assigned
            if key in hybrid.assigned and from_sharding and hybrid.values[key] != sharding.values[key]:
                raise ValueError(
                    f"strategy.hybrid_configs[{key!r}] = {hybrid.values[key]} but strategy.sharding_configs[{key!r}] = "
                    f"{sharding.values[key]}; give the degree once"
                )
            degrees[key] = sharding.values[key] if from_sharding else hybrid.values[key]
        if not self.sharding:
            given = [k for k in DEGREES if k in sharding.assigned and sharding.values[k] != 1]
            if given:
                raise ValueError(
                    f"strategy.sharding_configs[{given[0]!r}] = {sharding.values[given[0]]} but strategy.sharding is False; "
                    "set strategy.sharding = True or give the degrees in strategy.hybrid_configs"
                )
        if not self.pipeline and "pipeline" in self._flags_assigned and degrees["pp_degree"] > 1:
            raise ValueError(
                f"pp_degree = {degrees['pp_degree']} but strategy.pipeline is False; set strategy.pipeline = True"
            )
        merge = self._merge_steps()
        pipe = self._configs["pipeline_configs"].values
        return Resolved(
            **degrees,
            sharding_stage=int(sharding.values["stage"]),
            offload=bool(sharding.values["optimize_offload"] or sharding.values["offload"]),
            accumulate_steps=int(pipe["accumulate_steps"]),
            micro_batch_size=int(pipe["micro_batch_size"]),
            schedule=SCHEDULES[pipe["schedule_mode"]],
            gradient_merge_steps=merge,
            gradient_merge_avg=bool(self._configs["gradient_merge_configs"].values["avg"]),
            recompute=bool(self.recompute),
            bucket_bytes=max(1, int(sharding.values["segment_broadcast_MB"] * (1 << 20))),
        )

    def _merge_steps(self) -> int:
        """Gradient merge: ``gradient_merge_configs['k_steps']`` or seed 001's ``gradient_merge_acc_step``."""
        sharding = self._configs["sharding_configs"]
        from_sharding = sharding.values["gradient_merge_acc_step"] if self.sharding else 1
        from_merge = self._configs["gradient_merge_configs"].values["k_steps"] if self.gradient_merge else 1
        if from_sharding > 1 and from_merge > 1 and from_sharding != from_merge:
            raise ValueError(
                f"strategy.sharding_configs['gradient_merge_acc_step'] = {from_sharding} but "
                f"strategy.gradient_merge_configs['k_steps'] = {from_merge}; give the merge steps once"
            )
        return max(from_sharding, from_merge)

    def __repr__(self) -> str:
        flags = ", ".join(f"{k}={v}" for k, v in self._flags.items())
        configs = ", ".join(f"{n}={c.values}" for n, c in self._configs.items() if c.assigned)
        return f"DistributedStrategy({flags}{', ' if configs else ''}{configs})"


__all__ = ["DEGREES", "SCHEDULES", "DistributedStrategy", "Resolved"]
