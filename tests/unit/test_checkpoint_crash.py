"""A save killed with SIGKILL halfway: the previous checkpoint still loads, the partial one is refused.

A child process saves step 1, then starts saving step 2 with a hook that announces each
data file as it becomes durable and sleeps; the test kills it (signal 9) at the first one
(the simulator's process has written all four files by then, the metadata not yet), so no
cleanup code runs. Both an overwrite of the same path and a save to a new path are killed.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_checkpoint_crash.py``
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.checkpoint import CheckpointError, read_state_dict

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import mpipar as dist
    from mpipar.checkpoint import save as save_module

    first, second = sys.argv[1], sys.argv[2]
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])

    def state(step):
        w = np.arange(48.0).reshape(8, 6) * step
        return {"w": dist.shard_tensor(w, mesh, [dist.Shard(0), dist.Shard(1)]),
                "emb": dist.shard_tensor(np.full((5, 3), float(step)), mesh, [dist.Replicate(), dist.Shard(0)]),
                "step": step}

    dist.save_state_dict(state(1), first)

    def pause(path):
        print("WROTE", path, flush=True)
        time.sleep(120)

    save_module.after_file_written.append(pause)
    dist.save_state_dict(state(2), second)
    print("NOT KILLED", flush=True)
    """
)


def _kill_mid_save(tmp_path: Any, first: str, second: str) -> str:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != "MPIPAR_BACKEND"}
    proc = subprocess.Popen(
        [sys.executable, str(script), first, second],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("WROTE "), (line, proc.stderr.read() if proc.stderr else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return line.split(" ", 1)[1].strip()


def _expect_step1(path: str) -> None:
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    state: dict[str, Any] = {
        "w": dist.shard_tensor(np.zeros((8, 6)), mesh, [dist.Shard(1)]),
        "emb": dist.to_tensor(np.zeros((5, 3))),
        "step": 0,
    }
    dist.load_state_dict(state, path)
    assert state["step"] == 1
    np.testing.assert_array_equal(state["w"].full_tensor(), np.arange(48.0).reshape(8, 6))
    np.testing.assert_array_equal(state["emb"].full_tensor(), np.ones((5, 3)))


def test_killed_while_overwriting(tmp_path: Any) -> None:
    ck = str(tmp_path / "ck")
    written = _kill_mid_save(tmp_path, ck, ck)
    partial = os.path.dirname(written)
    assert os.path.basename(partial).startswith("ck.partial-")
    # The killed save's lock file stays behind, unlocked (the kernel released its flock).
    assert sorted(os.listdir(tmp_path)) == [".ck.mpipar-lock", "child.py", "ck", os.path.basename(partial)]
    _expect_step1(ck)  # the previous checkpoint is intact
    with pytest.raises(
        CheckpointError,
        match=r"incomplete checkpoint .*ck\.partial-.*: it has no metadata.json .* interrupted \(4 data file",
    ):
        dist.load_state_dict({"step": 0}, partial)
    # The next save to the same path is not blocked by the dead save's lock, clears the debris
    # (the partial directory carries our marker) and succeeds.
    dist.save_state_dict({"step": 3}, ck)
    assert sorted(os.listdir(tmp_path)) == ["child.py", "ck"]
    assert read_state_dict(ck) == {"step": 3}


def test_killed_while_saving_to_a_new_path(tmp_path: Any) -> None:
    first, second = str(tmp_path / "step1"), str(tmp_path / "step2")
    _kill_mid_save(tmp_path, first, second)
    _expect_step1(first)
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint at .*step2: a save into it was interrupted and left the incomplete .*step2\.partial-",
    ):
        dist.load_state_dict({"step": 0}, second)


def test_killed_between_the_two_renames_points_at_both_copies(tmp_path: Any) -> None:
    """The window between moving the old checkpoint aside and renaming the new one into place."""
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"step": 1}, ck)
    dist.save_state_dict({"step": 2}, str(tmp_path / "new"))
    os.rename(ck, ck + ".replaced-00000000000000ab")
    os.rename(str(tmp_path / "new"), ck + ".partial-00000000000000ab")
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint at .*ck: a save replacing it was interrupted between its two renames; the previous "
        r"checkpoint is intact at .*ck\.replaced-00000000000000ab and the new, complete one at .*ck\.partial-00000000000000ab",
    ):
        dist.load_state_dict({"step": 0}, ck)
    assert read_state_dict(ck + ".replaced-00000000000000ab") == {"step": 1}
    os.rename(ck + ".replaced-00000000000000ab", str(tmp_path / "old"))
    with pytest.raises(
        CheckpointError,
        match=r"wrote everything but was interrupted before its final rename; the complete checkpoint is at .*ck\.partial-",
    ):
        dist.load_state_dict({"step": 0}, ck)
