"""A checkpoint from elsewhere can neither read outside its directory nor load wrong values;
each case below is reproduced.

1. chunk ``file`` names leading outside the directory (absolute, ``..``, a symlink out);
2. chunk boxes swapped, negative, outside the shape, overlapping;
3. a chunk file that is a FIFO (under a timeout, so a regression fails instead of hanging);
4. commit edge cases: the previous checkpoint cannot be removed; leftovers of a commit killed
   between its two renames;
5. malformed ``metadata.json``: named ``CheckpointError``s giving file, field and value.

Each test fails on a loader that trusts the file. Run: ``.venv/bin/python -m pytest -q tests/unit/test_checkpoint_hostile.py``
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.checkpoint import CheckpointError, read_state_dict
from mpipar.checkpoint import save as save_module
from mpipar.checkpoint.format import METADATA
from mpipar.untrusted import FileFormatError

W = np.arange(24.0).reshape(4, 6)
V = np.arange(5, dtype=np.int32)


def _save(tmp_path: Any) -> str:
    """A checkpoint of a 2x2-mesh tensor (4 chunks in 4 files) and a dense array."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"w": dist.shard_tensor(W, mesh, [dist.Shard(0), dist.Shard(1)]), "v": V, "step": 3}, ck)
    return ck


def _meta(ck: str) -> dict[str, Any]:
    with open(os.path.join(ck, METADATA)) as f:
        return json.load(f)


def _edit(ck: str, change: Callable[[dict[str, Any]], None]) -> None:
    path = os.path.join(ck, METADATA)
    with open(path) as f:
        meta = json.load(f)
    change(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def _load(ck: str, timeout: float = 20.0) -> dict[str, Any]:
    """``read_state_dict`` in a thread: a load that blocks fails the test instead of hanging it."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = read_state_dict(ck)
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        pytest.fail(f"loading {ck} hung for {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Every path opened (``open`` audit event) while the test runs."""
    paths: list[str] = []
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event == "open" and isinstance(args[0], str | bytes):
            paths.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)  # cannot be removed: switched off after the test
    yield paths
    active[0] = False


_PACKAGE = os.path.dirname(os.path.realpath(dist.__file__))


def _outside(ck: str, paths: list[str]) -> list[str]:
    """The paths opened outside ``ck``, except mpipar's own modules (imported lazily by a load)."""
    root = os.path.realpath(ck)
    return [
        p
        for p in paths
        if os.path.commonpath([root, os.path.realpath(p)]) != root
        and not (os.path.realpath(p).startswith(_PACKAGE + os.sep) and p.endswith((".py", ".pyc")))
    ]


# ============================================================ 1. path traversal
def test_absolute_chunk_file_is_refused_without_opening_it(tmp_path: Any, opened: list[str]) -> None:
    ck = _save(tmp_path)
    _edit(ck, lambda m: m["tensors"]["w"]["chunks"][0].update(file="/etc/passwd"))
    opened.clear()
    with pytest.raises(
        CheckpointError,
        match=r"metadata\.json: field tensors\['w'\]\.chunks\[0\]\.file: '/etc/passwd' "
        r"is not a plain relative file name",
    ) as info:
        _load(ck)
    assert "header" not in str(info.value)
    assert _outside(ck, opened) == []


def test_dotdot_to_a_valid_foreign_safetensors_file_is_refused(tmp_path: Any, opened: list[str]) -> None:
    """A real data file of ours, with the right key, placed outside the directory: it would load."""
    ck = _save(tmp_path)
    meta = _meta(ck)
    chunk = meta["tensors"]["w"]["chunks"][0]
    shutil.copy(os.path.join(ck, chunk["file"]), tmp_path / "evil.safetensors")
    _edit(ck, lambda m: m["tensors"]["w"]["chunks"][0].update(file="../evil.safetensors"))
    opened.clear()
    with pytest.raises(CheckpointError, match=r"chunks\[0\]\.file: '\.\./evil\.safetensors' is not a plain relative"):
        _load(ck)
    assert _outside(ck, opened) == []


def test_symlink_out_of_the_directory_is_refused(tmp_path: Any, opened: list[str]) -> None:
    ck = _save(tmp_path)
    meta = _meta(ck)
    fname = meta["tensors"]["w"]["chunks"][0]["file"]
    shutil.move(os.path.join(ck, fname), tmp_path / "moved.safetensors")
    os.symlink(tmp_path / "moved.safetensors", os.path.join(ck, fname))
    opened.clear()
    with pytest.raises(CheckpointError, match=rf"field files\[\d\]: '{fname}' leads outside the directory"):
        _load(ck)
    assert _outside(ck, opened) == []


# ============================================================ 2. chunk boxes
def test_swapped_boxes_are_refused(tmp_path: Any) -> None:
    ck = _save(tmp_path)

    def swap(m: dict[str, Any]) -> None:
        c = m["tensors"]["w"]["chunks"]
        c[0]["box"], c[1]["box"] = c[1]["box"], c[0]["box"]

    _edit(ck, swap)
    with pytest.raises(
        CheckpointError,
        match=r"chunk 'w#0' in data file .* holds box \[\[0, 2\], \[0, 3\]\], but "
        r"metadata\.json places it at \[\[0, 2\], \[3, 6\]\]",
    ):
        _load(ck)


@pytest.mark.parametrize(
    ("box", "message"),
    [
        ([[-1, 1], [0, 3]], r"chunks\[0\]\.box\[0\]: \[-1, 1\] is not a range \[start, stop\] with 0 <= start"),
        ([[0, 2], [0, 7]], r"chunks\[0\]\.box\[1\]: \[0, 7\] is not a range .* stop <= 6"),
        (
            [[0, 2], [1, 4]],
            r"chunks\[1\]\.box: \[\[0, 2\], \[3, 6\]\] overlaps chunks\[0\]\.box \[\[0, 2\], \[1, 4\]\]",
        ),
        ([[0, 2]], r"chunks\[0\]\.box: \[\[0, 2\]\] has 1 ranges for a tensor of 2 dimensions"),
        ([[0, 1], [0, 3]], r"nbytes: 48 is not 24"),
    ],
)
def test_bad_boxes_are_refused(tmp_path: Any, box: list[list[int]], message: str) -> None:
    ck = _save(tmp_path)
    _edit(ck, lambda m: m["tensors"]["w"]["chunks"][0].update(box=box))
    with pytest.raises(CheckpointError, match=message):
        _load(ck)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("placements", "S(7)S(1)", r"tensors\['w'\]\.placements: 'S\(7\)S\(1\)' shards dim 7 of a 2-d tensor"),
        ("placements", "S(0)", r"placements: 'S\(0\)' has 1 placement\(s\) for a mesh of 2 axes"),
        ("placements", "P(max)P(sum)", r"mixes Partial reduce types"),
        ("placements", "RZ(1)", r"placements: 'RZ\(1\)' splits dim 1 of size 6 zigzag over 2 ranks"),
        ("placements", "S(1)Z(1)", r"splits dim 1 on mesh axis 0 outside its zigzag split"),
        ("stored_placements", "X", r"stored_placements: 'X' is not a placement list"),
        (
            "mesh",
            {"shape": [2, 2], "process_ids": [0, 0, 2, 3], "dim_names": ["dp", "tp"]},
            r"process_ids: .* repeats a rank",
        ),
        ("mesh", {"shape": [3, 2], "process_ids": [0, 1, 2, 3], "dim_names": ["dp", "tp"]}, r"is not 6 ranks"),
        (
            "mesh",
            {"shape": [1 << 20, 1 << 20], "process_ids": [0], "dim_names": ["dp", "tp"]},
            r"more than 16777216 ranks",
        ),
        ("mesh", {"shape": [2, 2], "process_ids": [0, 1, 2, 3], "dim_names": ["dp", "dp"]}, r"dim_names: .* distinct"),
        ("mesh", {"shape": [2, 0], "process_ids": [], "dim_names": ["dp", "tp"]}, r"mesh\.shape\[1\]: 0 is not an int"),
    ],
)
def test_described_layouts_must_be_possible(tmp_path: Any, field: str, value: Any, message: str) -> None:
    """The source mesh and placements only describe the layout (values come from the boxes), but
    a checkpoint describing a layout mpipar could not have made is refused as DistSpec would."""
    ck = _save(tmp_path)
    _edit(ck, lambda m: m["tensors"]["w"].update({field: value}))
    with pytest.raises(CheckpointError, match=message):
        _load(ck)


def test_chunks_missing_or_doubled_are_refused(tmp_path: Any) -> None:
    ck = _save(tmp_path)
    _edit(ck, lambda m: m["tensors"]["w"]["chunks"].pop())
    with pytest.raises(
        CheckpointError,
        match=r"tensors\['w'\]\.chunks: '3 chunks' hold 18 elements, but the tensor "
        r"of shape \[4, 6\] has 24",
    ):
        _load(ck)
    ck2 = _save(tmp_path / "b")
    _edit(ck2, lambda m: m["tensors"]["w"]["chunks"].append(dict(m["tensors"]["w"]["chunks"][0])))
    with pytest.raises(CheckpointError, match=r"chunks\[4\]\.key: 'w#0' in rank\d+\.safetensors is also the key"):
        _load(ck2)


# ============================================================ 3. FIFO
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_chunk_file_is_refused_not_waited_on(tmp_path: Any) -> None:
    ck = _save(tmp_path)
    meta = _meta(ck)
    fname = meta["tensors"]["w"]["chunks"][0]["file"]
    os.remove(os.path.join(ck, fname))
    os.mkfifo(os.path.join(ck, fname))
    with pytest.raises(CheckpointError, match=rf"{fname}.* is a FIFO, not a regular file"):
        _load(ck, timeout=10)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_metadata_is_refused_not_waited_on(tmp_path: Any) -> None:
    ck = _save(tmp_path)
    os.remove(os.path.join(ck, METADATA))
    os.mkfifo(os.path.join(ck, METADATA))
    with pytest.raises(CheckpointError, match=r"metadata\.json.* is a FIFO"):
        _load(ck, timeout=10)


# ============================================================ 4. commit
def test_previous_checkpoint_that_cannot_be_removed_does_not_fail_the_save(tmp_path: Any, monkeypatch: Any) -> None:
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"step": 1}, ck)
    real = shutil.rmtree

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if ".replaced-" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(save_module.shutil, "rmtree", refuse)
    with pytest.warns(
        RuntimeWarning, match=r"checkpoint .*ck is in place, but its leftover .*ck\.replaced-.* could not be removed"
    ):
        dist.save_state_dict({"step": 2}, ck)
    assert read_state_dict(ck) == {"step": 2}
    monkeypatch.undo()
    dist.save_state_dict({"step": 3}, ck)  # the next save removes the leftover
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert read_state_dict(ck) == {"step": 3}


def _killed_between_renames(tmp_path: Any) -> str:
    """What a save killed between its two renames leaves, with the user having renamed the new one in place."""
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"step": 1}, ck)
    os.rename(ck, ck + ".replaced-00000000000000ab")
    dist.save_state_dict({"step": 2}, ck)
    return ck


def test_leftover_of_a_commit_killed_between_renames_is_removed_by_the_next_save(tmp_path: Any) -> None:
    ck = _killed_between_renames(tmp_path)
    # The save above already had a complete checkpoint in place, so it removed the leftover.
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    os.mkdir(ck + ".replaced-00000000000000cd")  # not ours (no metadata of ours): kept
    (tmp_path / "ck.replaced-00000000000000ef").mkdir()
    shutil.copytree(ck, ck + ".partial-0000000000000012")  # a complete leftover of ours: removed
    dist.save_state_dict({"step": 4}, ck)
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.replaced-00000000000000cd", "ck.replaced-00000000000000ef"]


def test_leftover_of_a_commit_killed_between_renames_is_removed_by_the_next_load(tmp_path: Any) -> None:
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"step": 1}, ck)
    shutil.copytree(ck, ck + ".replaced-00000000000000ab")
    os.symlink(ck, ck + ".replaced-00000000000000cd")  # a link, even to ours: kept
    state = {"step": 0}
    dist.load_state_dict(state, ck)
    assert state == {"step": 1}
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.replaced-00000000000000cd"]


# ============================================================ 5. malformed metadata
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["tensors"]["w"].update(chunks="x"), r"tensors\['w'\]\.chunks: 'x' is not a list of chunks"),
        (lambda m: m["tensors"]["w"]["chunks"][0].update(file=5), r"chunks\[0\]\.file: 5 is not a file name"),
        (
            lambda m: m["tensors"]["w"]["chunks"][0].pop("crc32c"),
            r"chunks\[0\]\.crc32c: None is not an int in \[0, 4294967295\]",
        ),
        (
            lambda m: m["tensors"]["w"]["chunks"][0].update(file="."),
            r"chunks\[0\]\.file: '\.' is not a plain relative file name",
        ),
        (
            lambda m: m["tensors"]["w"].update(dtype="object"),
            r"tensors\['w'\]\.dtype: 'object' is not a dtype a checkpoint stores",
        ),
        (lambda m: m["tensors"]["w"].update(shape=[4, -6]), r"tensors\['w'\]\.shape\[1\]: -6 is not an int"),
        (lambda m: m["tensors"].pop("v"), r"state\['v'\]\.array: 'v' names no tensor"),
        (lambda m: m.update(tensors=[]), r"tensors: \[\] is not an object"),
        (
            lambda m: m["state"]["dict"].append(["x", {"pickle": 1}]),
            r"state\['x'\]: 'pickle' is not a known structure node",
        ),
        (
            lambda m: m["state"]["dict"].append([["k"], {"value": 1}]),
            r"state\.dict\[3\]: \[\['k'\], .* is not a \[key, node\] pair",
        ),
    ],
)
def test_malformed_metadata_gives_named_errors(
    tmp_path: Any, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    ck = _save(tmp_path)
    _edit(ck, change)
    with pytest.raises(CheckpointError, match=r"checkpoint .*ck/metadata\.json: field .*" + message) as info:
        _load(ck)
    assert isinstance(info.value, FileFormatError) and info.value.source.endswith(METADATA)


def test_metadata_not_json_or_too_deep_gives_named_errors(tmp_path: Any) -> None:
    ck = _save(tmp_path)
    path = os.path.join(ck, METADATA)
    with open(path, "wb") as f:
        f.write(b'{"format": "mpipar.checkpoint", "x": "\xff"}')
    with pytest.raises(CheckpointError, match=r"metadata\.json: field <file>: .* is not UTF-8"):
        _load(ck)
    with open(path, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"metadata\.json.*nests JSON more than"):
        _load(ck)
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(CheckpointError, match=r"metadata\.json: .* is a directory"):
        _load(ck)


def test_data_file_header_is_checked_as_untrusted(tmp_path: Any) -> None:
    """A data file whose header lies about a chunk's shape, or is not JSON, is refused by name."""
    ck = _save(tmp_path)
    fname = _meta(ck)["tensors"]["v"]["chunks"][0]["file"]
    path = os.path.join(ck, fname)
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["v#0"]["shape"] = [6]
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (n - len(body))
    assert len(body) == n
    with open(path, "wb") as f:
        f.write(raw[:8] + body + raw[8 + n :])
    with pytest.raises(
        CheckpointError,
        match=rf"{fname}: field \(safetensors header\) 'v#0'\.data_offsets: .* span 20 bytes, "
        r"but I32\[6\] takes 24",
    ):
        _load(ck)
    with open(path, "wb") as f:
        f.write(raw[:8] + b"\xfe" * n + raw[8 + n :])
    with pytest.raises(CheckpointError, match=rf"{fname}: field <file>: .* is not UTF-8"):
        _load(ck)


def test_valid_checkpoint_still_loads_bit_for_bit(tmp_path: Any, opened: list[str]) -> None:
    ck = _save(tmp_path)
    opened.clear()
    out = _load(ck)
    assert out["w"].tobytes() == W.tobytes() and out["v"].tobytes() == V.tobytes() and out["step"] == 3
    assert _outside(ck, opened) == []


@pytest.mark.parametrize("grid_cells", [0, 1 << 22])
def test_cover_check_by_sweep_and_by_grid(tmp_path: Any, monkeypatch: Any, grid_cells: int) -> None:
    """Both paths of the cover check (the cut grid, and the sweep for layouts whose grid is too large)."""
    from mpipar.checkpoint import validate

    monkeypatch.setattr(validate, "_GRID_CELLS", grid_cells)
    ck = _save(tmp_path)
    assert _load(ck)["w"].tobytes() == W.tobytes()

    def overlap(m: dict[str, Any]) -> None:
        c = m["tensors"]["w"]["chunks"]
        c[3]["box"] = [[1, 3], [2, 5]]  # volume kept (6 elements), overlapping chunks 0, 1 and 2
        c[3]["nbytes"] = 48

    _edit(ck, overlap)
    with pytest.raises(CheckpointError, match=r"chunks\[3\]\.box: \[\[1, 3\], \[2, 5\]\] overlaps chunks\[\d\]\.box"):
        _load(ck)


def test_metadata_symlinked_out_of_the_directory_is_not_read(tmp_path: Any, opened: list[str]) -> None:
    """Same class as item 1, for metadata.json itself: a link to another checkpoint's metadata."""
    ck = _save(tmp_path)
    other = _save(tmp_path / "other")
    os.remove(os.path.join(ck, METADATA))
    os.symlink(os.path.join(other, METADATA), os.path.join(ck, METADATA))
    opened.clear()
    with pytest.raises(CheckpointError, match=r"metadata\.json' leads outside the directory"):
        _load(ck)
    assert _outside(ck, opened) == []


def test_chunk_file_symlinked_inside_the_directory_still_loads(tmp_path: Any) -> None:
    """Links that stay inside are not refused (a copy tool may dedupe files with them)."""
    ck = _save(tmp_path)
    fname = _meta(ck)["tensors"]["w"]["chunks"][0]["file"]
    os.rename(os.path.join(ck, fname), os.path.join(ck, "real.bin"))
    os.symlink("real.bin", os.path.join(ck, fname))
    assert _load(ck)["w"].tobytes() == W.tobytes()


def test_data_files_without_recorded_boxes_still_load(tmp_path: Any) -> None:
    """Checkpoints written before data files recorded their boxes keep loading (same values)."""
    ck = _save(tmp_path)
    for fname in _meta(ck)["files"]:
        path = os.path.join(ck, fname)
        with open(path, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        del header["__metadata__"]["mpipar.boxes"]
        body = json.dumps(header, separators=(",", ":")).encode()
        with open(path, "wb") as f:
            f.write(raw[:8] + body + b" " * (n - len(body)) + raw[8 + n :])
    out = _load(ck)
    assert out["w"].tobytes() == W.tobytes() and out["v"].tobytes() == V.tobytes()


def test_the_describe_cli_refuses_a_hostile_checkpoint_on_one_line(tmp_path: Any) -> None:
    """``python -m mpipar.checkpoint``: a sound checkpoint is described (exit 0); a refused one is
    bad input like every CLI's (exit 2, one line naming the file), never a traceback."""
    import subprocess

    ck = _save(tmp_path)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

    def describe(path: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "mpipar.checkpoint", path]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)

    good = describe(ck)
    assert good.returncode == 0 and "w" in good.stdout, good.stderr
    _edit(ck, lambda m: m["tensors"]["w"]["chunks"][0].update(file="/etc/passwd"))
    for path in (ck, str(tmp_path / "missing")):
        bad = describe(path)
        assert bad.returncode == 2, (bad.returncode, bad.stderr)
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert path in bad.stderr, bad.stderr
