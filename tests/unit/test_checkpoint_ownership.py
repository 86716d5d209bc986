"""Checkpoints never touch what is not ours, and save only what load accepts.

Each test is one case a hostile-file and new-user probe found: an unrelated
``model.partial-results`` folder deleted by a save's cleanup, ``step-0012`` listed as step 12
but looked up as ``step-12`` (so pruning removed the wrong checkpoint), a save replacing the
symlink it was given, two saves to one path interleaving, values accepted on save that the
loader refused, repeated JSON keys, negative or fractional step counters, bfloat16 without
ml_dtypes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.checkpoint import (
    CheckpointError,
    prune_series,
    read_state_dict,
    resolve_checkpoint,
    save_state_dict,
    series_steps,
)
from mpipar.checkpoint.format import MARKER, METADATA, numpy_dtype
from mpipar.checkpoint.ownership import SaveLock, lock_path, parse_step
from mpipar.untrusted import FileFormatError, parse_json
from simulator import SimBackend


@pytest.fixture(autouse=True)
def _sim() -> Any:
    with dist.use_backend(SimBackend(2)) as backend:
        yield backend


def test_a_users_folder_that_looks_like_a_partial_save_is_never_deleted(tmp_path: Path) -> None:
    mine = tmp_path / "model.partial-results"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    hexname = tmp_path / "model.partial-0123456789abcdef"  # right name, but not marked: not ours
    hexname.mkdir()
    (hexname / "data.bin").write_bytes(b"x")
    save_state_dict({"w": np.arange(4.0)}, str(tmp_path / "model"))
    assert (mine / "notes.txt").read_text() == "precious"
    assert (hexname / "data.bin").read_bytes() == b"x"
    assert (tmp_path / "model" / MARKER).is_file()


def test_a_marked_interrupted_save_is_cleaned_up(tmp_path: Path) -> None:
    stale = tmp_path / "model.partial-00000000000000aa"
    stale.mkdir()
    (stale / MARKER).write_bytes(b"")  # a marker file without our text is not ours
    save_state_dict({"w": np.arange(4.0)}, str(tmp_path / "model"))
    assert stale.exists()
    shutil.copy(tmp_path / "model" / MARKER, stale / MARKER)
    save_state_dict({"w": np.arange(4.0)}, str(tmp_path / "model"))
    assert not stale.exists()


def test_step_folders_are_parsed_by_one_rule(tmp_path: Path) -> None:
    series = tmp_path / "series"
    save_state_dict({"step": 3}, str(series / "step-3"))
    save_state_dict({"step": 12}, str(series / "step-12"))
    os.rename(series / "step-12", series / "step-0012")
    assert parse_step("step-0012") is None and parse_step("step-12") == 12 and parse_step("step-0") == 0
    assert series_steps(series) == [3]
    assert resolve_checkpoint(series) == str(series / "step-3")
    assert prune_series(series, keep_last=1) == []
    assert sorted(os.listdir(series)) == ["step-0012", "step-3"]


def test_pruning_keeps_folders_that_are_not_ours_and_legacy_checkpoints_count(tmp_path: Path) -> None:
    series = tmp_path / "series"
    for k in (1, 2, 3):
        save_state_dict({"step": k}, str(series / f"step-{k}"))
    os.remove(series / "step-1" / MARKER)  # written before the marker existed: still ours by its metadata
    fake = series / "step-0"
    fake.mkdir()
    (fake / METADATA).write_text('{"format": "something else"}')
    (series / "step-9").symlink_to(series / "step-3")
    assert prune_series(series, keep_last=1) == [1, 2]
    assert sorted(os.listdir(series)) == ["step-0", "step-3", "step-9"]


def test_saving_into_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "ck"
    save_state_dict({"step": 1}, str(real))
    link = tmp_path / "latest"
    link.symlink_to(real)
    save_state_dict({"step": 2}, str(link))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert read_state_dict(str(real)) == {"step": 2}


def test_a_second_save_to_the_same_path_is_refused_by_name(tmp_path: Path) -> None:
    target = str(tmp_path / "ck")
    with SaveLock(target), pytest.raises(CheckpointError, match=r"another process is saving to the same path"):
        save_state_dict({"step": 1}, target)
    save_state_dict({"step": 1}, target)  # released: the next one goes through
    assert not os.path.exists(lock_path(target))


def test_a_lock_held_by_a_killed_process_never_blocks(tmp_path: Path) -> None:
    target = str(tmp_path / "ck")
    code = textwrap.dedent(f"""
        import fcntl, os, sys, time
        f = open({lock_path(target)!r}, "a+b")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
        with pytest.raises(CheckpointError, match="another process is saving"):
            save_state_dict({"step": 1}, target)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    save_state_dict({"step": 1}, target)
    assert read_state_dict(target) == {"step": 1}


def test_save_refuses_what_load_would_refuse(tmp_path: Path) -> None:
    deep: Any = 0
    for _ in range(30):  # 30 user levels are 90 JSON levels in the stored structure
        deep = {"a": deep}
    with pytest.raises(ValueError, match=r"cannot be saved as a loadable checkpoint.*levels"):
        save_state_dict({"cfg": deep}, str(tmp_path / "deep"))
    with pytest.raises(ValueError, match=r"cannot be saved as a loadable checkpoint.*digits"):
        save_state_dict({"big": 10**100}, str(tmp_path / "big"))
    assert not os.path.exists(tmp_path / "deep") and not os.path.exists(tmp_path / "big")
    # At the limits, it round-trips.
    ok: Any = 0
    for _ in range(15):
        ok = {"a": ok}
    save_state_dict({"cfg": ok, "big": 10**70}, str(tmp_path / "ok"))
    assert read_state_dict(str(tmp_path / "ok")) == {"cfg": ok, "big": 10**70}


def test_repeated_json_keys_are_refused() -> None:
    with pytest.raises(FileFormatError, match=r"field <key>: 'step' is a key repeated in one JSON object"):
        parse_json(b'{"step": 1, "step": 2}', kind="checkpoint")
    assert parse_json(b'{"a": {"b": 1}, "b": {"b": 2}}', kind="plan") == {"a": {"b": 1}, "b": {"b": 2}}


def _training_checkpoint(tmp_path: Path, step: Any) -> tuple[str, Any, Any]:
    from mpipar.checkpoint import save_training_state

    model = dist.nn.Linear(2, 2)
    opt = dist.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    path = str(tmp_path / "t")
    save_training_state(path, model=model, optimizer=opt, step=1)
    meta = json.loads((Path(path) / METADATA).read_text())
    for pair in meta["state"]["dict"]:
        if pair[0] == "step":
            pair[1] = {"value": json.loads(step)}
    (Path(path) / METADATA).write_text(json.dumps(meta))
    return path, model, opt


@pytest.mark.parametrize("step", ["-1", "2.5", "true", '"3"'])
def test_a_resumed_step_is_a_non_negative_int(tmp_path: Path, step: str) -> None:
    from mpipar.checkpoint import load_training_state

    path, model, opt = _training_checkpoint(tmp_path, step)
    with pytest.raises(CheckpointError, match=r"state\['step'\].*is not a non-negative int"):
        load_training_state(path, model=model, optimizer=opt)


def test_a_negative_batch_counter_is_refused() -> None:
    from mpipar.io import DataLoader

    loader = DataLoader(list(range(8)), batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batches_served must be a non-negative int.*-3"):
        loader.set_state_dict({"batches_served": -3, "epoch": 0})
    with pytest.raises(ValueError, match=r"batches_served must be a non-negative int.*1.5"):
        loader.set_state_dict({"batches_served": 1.5, "epoch": 0})


def test_bfloat16_without_ml_dtypes_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if it were not installed
    with pytest.raises(CheckpointError, match=r"bfloat16.*install ml_dtypes"):
        numpy_dtype("bfloat16")


def test_a_forged_shape_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """metadata.json claims a 2^40-byte tensor whose data is not there: a named refusal, no MemoryError."""
    path = tmp_path / "ck"
    save_state_dict({"w": np.arange(4.0)}, str(path))
    meta = json.loads((path / METADATA).read_text())
    big = 1 << 37
    meta["tensors"]["w"]["shape"] = [big]
    meta["tensors"]["w"]["chunks"][0]["box"] = [[0, big]]
    meta["tensors"]["w"]["chunks"][0]["nbytes"] = 8 * big
    (path / METADATA).write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'w': data file .* has \d+ bytes, but the chunks metadata.json puts in it take 1099511627776",
    ):
        read_state_dict(str(path))
