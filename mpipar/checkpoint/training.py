"""Save and resume a training run: everything a resumed run needs to continue bit for bit.

    from mpipar.checkpoint import load_training_state, resolve_checkpoint, save_training_state
    save_training_state(f"ckpt/step-{k}", model=model, optimizer=opt, step=k, loader=loader)
    ...                                                   # later, on any mesh, any world size
    resumed = load_training_state(resolve_checkpoint("ckpt"), model=model, optimizer=opt, loader=loader)
    for step in range(resumed.step, steps): ...

A training checkpoint is an ordinary checkpoint (``save_state_dict``) of::

    model       model.state_dict(): parameters and buffers, each in its own layout
    optimizer   optimizer.state_dict(): per-parameter states in the layout the optimizer keeps
                them in (split along dp under ZeRO), per-parameter step counts, the LR schedule
    step        steps completed: the resumed run starts at this step index
    rng         mpipar.random's generator state (dropout masks continue the same stream)
    loader      the data loader's position (batches served), or None
    extra       anything JSON-able the script adds (``examples/gpt.py``: its configuration)

Loading fills the model's parameters in place and the optimizer's states in the layout *this*
run keeps them in (another mesh, world size or ZeRO stage), before the optimizer has taken a
step; each rank reads only the chunks overlapping its own shards. A series of checkpoints is a
directory of ``step-<k>`` checkpoints; ``resolve_checkpoint`` picks its latest complete one.

Restarts: ``mpipar launch --max-restarts K`` relaunches a failed run and tells the script so
through the environment (``restart_info`` reads it; ``resume_target`` turns it into the
checkpoint to load)::

    MPIPAR_RESTART_ATTEMPT   0 on the first attempt, k on the k-th restart
    MPIPAR_MAX_RESTARTS      K
    MPIPAR_RESUME_FROM       on a restart: the latest complete checkpoint the launcher found
                             (unset when there was none yet: the restart starts from scratch)

    resume = resume_target(args.resume, args.save_dir)   # None: start from step 0
    if resume:
        resumed = load_training_state(resume, model=model, optimizer=opt, loader=loader)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar._modes import Mode, execution_mode
from mpipar.backend import current_backend
from mpipar.checkpoint.coord import Coordinator
from mpipar.checkpoint.format import METADATA, CheckpointError, describe_missing
from mpipar.checkpoint.layout import decode_value
from mpipar.checkpoint.load import load_state_dict
from mpipar.checkpoint.ownership import is_checkpoint_ours, parse_step, step_name
from mpipar.checkpoint.save import save_state_dict
from mpipar.checkpoint.validate import load_metadata
from mpipar.env import env_int, env_text
from mpipar.optimizer.lr import LRScheduler
from mpipar.optimizer.optimizer import MASTER
from mpipar.random import get_rng_state, set_rng_state
from mpipar.runtime.heartbeat import note_resume
from mpipar.spec import DistSpec
from mpipar.tensor import Tensor

_ARRAY_KINDS = ("dist", "dense", "array", "scalar")

RESTART_ATTEMPT_ENV = "MPIPAR_RESTART_ATTEMPT"
MAX_RESTARTS_ENV = "MPIPAR_MAX_RESTARTS"
RESUME_FROM_ENV = "MPIPAR_RESUME_FROM"


@dataclass(frozen=True)
class RestartInfo:
    """What the launcher says about this attempt (``restart_info``)."""

    attempt: int
    """0 on the first attempt (or without a launcher), k on the k-th restart."""
    max_restarts: int
    resume_from: str | None
    """The checkpoint the launcher chose for this restart, or None."""

    @property
    def is_restart(self) -> bool:
        return self.attempt > 0


def restart_info(env: Mapping[str, str] | None = None) -> RestartInfo:
    """``MPIPAR_RESTART_ATTEMPT``, ``MPIPAR_MAX_RESTARTS`` and ``MPIPAR_RESUME_FROM`` (module doc)."""
    numbers = [env_int(name, 0, maximum=10**9 - 1, env=env) for name in (RESTART_ATTEMPT_ENV, MAX_RESTARTS_ENV)]
    return RestartInfo(numbers[0], numbers[1], env_text(RESUME_FROM_ENV, env))


def resume_target(
    resume: str | os.PathLike[str] | None, save_dir: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None
) -> str | None:
    """The checkpoint a script should start from, or None to start from step 0.

    On a launcher's restart: ``MPIPAR_RESUME_FROM``, else the latest complete checkpoint in
    ``save_dir`` (the script's ``--save-dir``), else ``resume``; otherwise ``resume`` (the
    script's ``--resume``, a checkpoint or a series), resolved. A restart before any
    checkpoint was saved starts from scratch, as the first attempt did (with ``resume``).
    """
    info = restart_info(env)
    if info.is_restart:
        if info.resume_from is not None:
            return resolve_checkpoint(info.resume_from)
        if save_dir is not None and series_steps(save_dir):
            return resolve_checkpoint(save_dir)
    return resolve_checkpoint(resume) if resume is not None else None


@dataclass(frozen=True)
class ResumedState:
    """What ``load_training_state`` restored besides the tensors."""

    path: str
    step: int
    """Steps completed when the checkpoint was saved: the index of the next step to run."""
    extra: Any


def step_path(directory: str | os.PathLike[str], step: int) -> str:
    """Where the checkpoint after ``step`` completed steps goes in a series."""
    if isinstance(step, np.integer):
        step = int(step)
    return os.path.join(os.fspath(directory), step_name(step))


def series_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The step counts of the complete checkpoints (with their metadata) in a series, ascending."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    steps = []
    for entry in os.listdir(directory):
        step = parse_step(entry)  # the one parser: the folder listed is the folder step_path names
        if step is not None and os.path.exists(os.path.join(directory, entry, METADATA)):
            steps.append(step)
    return sorted(steps)


def resolve_checkpoint(path: str | os.PathLike[str]) -> str:
    """``path`` itself when it is a checkpoint, else the latest complete ``step-<k>`` inside it.

    Interrupted saves (``step-<k>.partial-*``, no metadata) are never picked. Raises a
    ``CheckpointError`` saying what ``path`` holds when there is nothing to resume from.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(os.path.join(path, METADATA)):
        return path
    steps = series_steps(path)
    if steps:
        return step_path(path, steps[-1])
    if os.path.isdir(path) and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise CheckpointError(
            f"nothing to resume from at {path}: it is neither a checkpoint (no {METADATA}) nor a directory of "
            "complete step-<k> checkpoints"
        )
    raise CheckpointError(describe_missing(path))


def prune_series(directory: str | os.PathLike[str], keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` complete checkpoints of a series (rank 0 deletes;
    call it on every rank after a save). Returns the step counts deleted.

    Only checkpoints mpipar wrote go (``ownership.is_checkpoint_ours``: our marker, or a
    well-formed mpipar metadata.json); a link or a folder of someone else's is never removed,
    and does not count towards ``keep_last``."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"prune_series keep_last must be an int >= 1, got {keep_last!r}")
    ours = [s for s in series_steps(directory) if is_checkpoint_ours(step_path(directory, s))]
    old = ours[:-keep_last]
    if current_backend().rank == 0:
        for step in old:
            shutil.rmtree(step_path(directory, step))
    return old


# ============================================================================ save
def training_state(*, model: Any, optimizer: Any, step: int, loader: Any = None, extra: Any = None) -> dict[str, Any]:
    """The state dict ``save_training_state`` writes (see the module doc)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"training state: step must be a non-negative int (steps completed), got {step!r}")
    return {
        "model": dict(model.state_dict()),
        "optimizer": optimizer.state_dict(),
        "step": int(step),
        "rng": get_rng_state(),
        "loader": loader.state_dict() if loader is not None else None,
        "extra": extra,
    }


def save_training_state(
    path: str | os.PathLike[str], *, model: Any, optimizer: Any, step: int, loader: Any = None, extra: Any = None
) -> None:
    """Save model, optimizer, ``step`` (steps completed), RNG and loader position to ``path``,
    atomically (a collective: every process calls it)."""
    save_state_dict(training_state(model=model, optimizer=optimizer, step=step, loader=loader, extra=extra), path)


# ============================================================================ load
def load_training_state(
    path: str | os.PathLike[str], *, model: Any, optimizer: Any, loader: Any = None
) -> ResumedState:
    """Restore a ``save_training_state`` checkpoint into this run's model, optimizer and loader,
    and the RNG state (a collective). Call it after ``shard_optimizer`` and before the first
    step: the optimizer's states are read straight into the layout it keeps them in."""
    root = os.path.abspath(os.fspath(path))
    what = f"resume from {root}"
    coord = Coordinator(current_backend(), what)
    error: BaseException | None = None
    target: dict[str, Any] = {}
    try:
        meta = load_metadata(root)
        target = _target(root, meta, model, optimizer, loader is not None)
    except Exception as exc:
        error = exc
    coord.raise_if_failed(error, what)
    load_state_dict(target, root)
    step = target["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            field_path="state['step']",
            value=step,
            problem="is not a non-negative int (the count of steps completed)",
            source=os.path.join(root, METADATA),
        )
    optimizer.set_state_dict(target["optimizer"])
    set_rng_state(target["rng"])
    if loader is not None:
        loader.set_state_dict(target["loader"])
    note_resume(step)  # the launcher's summary names the step each attempt resumed from
    return ResumedState(root, step, target["extra"])


def _target(root: str, meta: dict[str, Any], model: Any, optimizer: Any, want_loader: bool) -> dict[str, Any]:
    """The state dict to load into: this run's tensors, placeholders in the optimizer's layouts."""
    top = _dict_node(meta["state"])
    missing = [k for k in ("model", "optimizer", "step", "rng", "loader") if k not in top]
    if missing:
        raise CheckpointError(
            f"checkpoint {root} is not a training checkpoint: it has no {missing} entries; "
            "save one with save_training_state"
        )
    if want_loader and top["loader"] == {"value": None}:
        raise CheckpointError(f"checkpoint {root} holds no data-loader position (saved without loader=)")

    model_state = dict(model.state_dict())
    saved_model = set(_dict_node(top["model"]))
    extra = sorted(saved_model - set(model_state))
    if extra:
        raise CheckpointError(
            f"checkpoint {root} holds model entries this model does not have: {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}; it was saved from another model"
        )

    opt_node = _dict_node(top["optimizer"])
    steps = decode_value(opt_node["steps"]) if "steps" in opt_node else {}
    params = {p.name or f"param_{i}": p for i, p in enumerate(optimizer._parameter_list)}
    unknown = sorted(set(steps) - set(params))
    if unknown:
        raise CheckpointError(
            f"checkpoint {root} holds optimizer state for parameters this optimizer does not have: {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}"
        )
    stored_tensors = {k for k, node in opt_node.items() if next(iter(node)) in _ARRAY_KINDS}
    opt_target: dict[str, Any] = {"steps": None}
    for name in steps:
        p = params[name]
        layout = optimizer.layout_of(p)
        # Under multi_precision a 16-bit parameter's states are float32, with a float32 master copy.
        dtype = optimizer.state_dtype(p)
        keys = list(optimizer.state_names)
        if optimizer.uses_master_weight(p) and f"{name}.{MASTER}" in stored_tensors:
            keys.append(MASTER)
        for n in keys:
            opt_target[f"{name}.{n}"] = _placeholder(tuple(p.shape), dtype, layout)
    stray = sorted(stored_tensors - set(opt_target))
    if stray:
        raise CheckpointError(
            f"checkpoint {root} holds optimizer tensors {stray[:5]}{' ...' if len(stray) > 5 else ''} that this "
            f"optimizer does not keep ({type(optimizer).__name__}: {list(optimizer.state_names)} per parameter"
            f"{', and a master copy of 16-bit ones' if optimizer._multi_precision else ''}); it was saved by another "
            "optimizer or with other settings (multi_precision)"
        )
    if "LR_Scheduler" in opt_node:
        opt_target["LR_Scheduler"] = None
    elif isinstance(getattr(optimizer, "_learning_rate", None), LRScheduler):
        raise CheckpointError(
            f"checkpoint {root} holds no learning-rate schedule, but this optimizer follows "
            f"{type(optimizer._learning_rate).__name__}; resume with the constant rate it was saved with"
        )
    return {"model": model_state, "optimizer": opt_target, "step": None, "rng": None, "loader": None, "extra": None}


def _dict_node(node: dict[str, Any]) -> dict[str, Any]:
    if "dict" not in node:
        raise CheckpointError(f"expected a dict in the checkpoint's state structure, found a {next(iter(node))}")
    return {k: v for k, v in node["dict"]}


def _placeholder(shape: tuple[int, ...], dtype: np.dtype, layout: DistSpec | None) -> Tensor:
    """A tensor in ``layout`` for the load to fill (its zeros, calloc'ed, are never read)."""
    backend = current_backend()
    if layout is None:
        return Tensor(np.zeros(shape, dtype=dtype))
    if execution_mode((), backend) is Mode.DENSE:
        return Tensor._from_reference(layout, np.zeros(shape, dtype=dtype))
    shards = {r: np.zeros(layout.local_shape(r), dtype=dtype) for r in backend.hosted_ranks(layout.mesh)}
    return Tensor._from_shards(layout, shards, dtype)
