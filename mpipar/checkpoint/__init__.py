"""Distributed checkpoints: save under one layout, load under any other, never lose a step.

    import mpipar as dist
    dist.save_state_dict({"model": model.state_dict(), "step": 100}, "ckpt/step100")
    state = {"model": model.state_dict(), "step": 0}
    dist.load_state_dict(state, "ckpt/step100")     # fills the tensors in place, sets state["step"]

A checkpoint is a directory of safetensors data files (one per writing rank, each holding the
chunks that rank owns; replicas written once) and a ``metadata.json`` written last, recording
every tensor's shape, dtype, mesh, placements and, per chunk, its file, key, global box and
CRC-32C. Loading reads only the chunks overlapping the shards each rank holds, on any mesh,
any placements, any world size, dense or distributed. Saves are atomic (temporary directory,
fsync, rename). ``python -m mpipar.checkpoint PATH`` prints a checkpoint's layout.
``save_training_state`` / ``load_training_state`` save and resume a whole training run
(model, optimizer with ZeRO-sharded states, step, RNG, data position): see ``training.py``.
"""

from mpipar.checkpoint.format import CheckpointError
from mpipar.checkpoint.load import describe_checkpoint, load_state_dict, read_state_dict
from mpipar.checkpoint.save import save_state_dict
from mpipar.checkpoint.stats import ChunkRead, IOStats, record_io
from mpipar.checkpoint.training import (
    RestartInfo,
    ResumedState,
    load_training_state,
    prune_series,
    resolve_checkpoint,
    restart_info,
    resume_target,
    save_training_state,
    series_steps,
    step_path,
    training_state,
)

__all__ = [
    "CheckpointError",
    "ChunkRead",
    "IOStats",
    "RestartInfo",
    "ResumedState",
    "describe_checkpoint",
    "load_state_dict",
    "load_training_state",
    "prune_series",
    "read_state_dict",
    "record_io",
    "resolve_checkpoint",
    "restart_info",
    "resume_target",
    "save_state_dict",
    "save_training_state",
    "series_steps",
    "step_path",
    "training_state",
]
