"""Fuzzing the checkpoint loader with mutations of a really saved checkpoint.

A checkpoint saved from a 2x2 simulator mesh (a sharded float64 matrix, a tp-sharded float32
vector, a dense int32 array, a NumPy scalar, plain values; several chunks per data file) is
copied for every case and mutated: metadata.json or a data file truncated or a byte flipped;
a JSON field of metadata.json retyped, renested or deleted; a chunk's file renamed (absolute,
``..``, a symlink out, a directory, a FIFO); two chunks' boxes swapped; a dtype or shape changed.
Each case loads under a timeout and must end in one of two ways:

* a named error: ``CheckpointError`` / ``FileFormatError`` (never TypeError, KeyError,
  IndexError, OSError, RecursionError, UnicodeDecodeError, struct.error ...);
* a load whose arrays equal the originals bit for bit. Only mutations of metadata.json's plain
  values (a step counter, a state key) may change what loads: those bytes carry no checksum
  (CRC-32C guards chunk data), so there every loaded array must still be one of the originals.

and no path outside the checkpoint directory may be opened (``open`` audit events).

Default: 1000 cases (about 6 s here; CI budget 40 s). Long run:
``MPIPAR_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q -m fuzz tests/fuzz/test_fuzz_checkpoint.py``
(``-m fuzz`` alone runs 20000, about 4 minutes here).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar.checkpoint import read_state_dict
from mpipar.checkpoint.format import METADATA
from mpipar.untrusted import FileFormatError
from simulator import SimBackend

_PRISTINE: dict[str, Any] = {}
_PACKAGE = os.path.dirname(os.path.realpath(dist.__file__))
_OPENED: list[str] = []
_RECORDING = [False]
_OUTCOMES: Counter[tuple[str, str]] = Counter()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _RECORDING[0] and event == "open" and isinstance(args[0], str | bytes):
        _OPENED.append(os.fsdecode(args[0]))


def _pristine() -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The saved checkpoint (made once), its metadata and the values read back from it."""
    if not _PRISTINE:
        base = tempfile.mkdtemp(prefix="mpipar-fuzz-")
        ck = os.path.join(base, "ck")
        rng = np.random.default_rng(20)
        with dist.use_backend(SimBackend()):
            mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
            state = {
                "w": dist.shard_tensor(rng.standard_normal((8, 6)), mesh, [dist.Shard(0), dist.Shard(1)]),
                "b": dist.shard_tensor(
                    rng.standard_normal(6).astype(np.float32), mesh, [dist.Replicate(), dist.Shard(0)]
                ),
                "e": rng.integers(-9, 9, (3, 4)).astype(np.int32),
                "s": np.float64(2.5),
                "step": 7,
                "sched": {"lr": 0.1, "milestones": [3, 5]},
            }
            dist.save_state_dict(state, ck, piece_bytes=48)
        with open(os.path.join(ck, METADATA)) as f:
            meta = json.load(f)
        _PRISTINE.update(ck=ck, meta=meta, values=read_state_dict(ck), files=sorted(meta["files"]))
        # A valid data file of ours outside the directory: loading it would look right.
        shutil.copy(os.path.join(ck, meta["files"][0]), os.path.join(base, "outside.safetensors"))
        sys.addaudithook(_audit)
    return _PRISTINE["ck"], _PRISTINE["meta"], _PRISTINE["values"]


def _json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _json_paths(v, (*prefix, i))
    return out


_REPLACEMENTS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["", ".", "..", "x", "w#0", "float64", "bfloat16", "object", "nan", "dist", "dict"]),
    st.just([]),
    st.just({}),
    st.just([[0, 1]]),
    st.just([[-1, 2], [0, 2]]),
)
_BAD_NAMES = [
    "/etc/passwd",
    "../outside.safetensors",
    "./rank00000.safetensors",
    ".",
    "",
    "..",
    "a/../../x",
    "rank00000.safetensors/..",
    "missing.safetensors",
    "link_out",
    "subdir",
    "fifo",
    "\x00x",
    5,
    None,
    "meta_link_out",
]


@st.composite
def mutations(draw: st.DrawFn) -> dict[str, Any]:
    _, meta, _ = _pristine()
    kind = draw(
        st.sampled_from(["meta_bytes", "data_bytes", "json", "path", "swap_boxes", "swap_chunks", "dtype_shape"])
    )
    # Read whole (read_state_dict), or loaded in place into tensors on another mesh (load_state_dict:
    # chunks cut into several shards go through the memory-mapped path).
    m: dict[str, Any] = {"kind": kind, "target": draw(st.sampled_from(["read", "load"]))}
    if kind in ("meta_bytes", "data_bytes"):
        m["file"] = METADATA if kind == "meta_bytes" else draw(st.sampled_from(_PRISTINE["files"]))
        m["op"] = draw(st.sampled_from(["truncate", "flip", "flip_header"]))
        m["at"] = draw(st.floats(0, 1, exclude_max=True))
        m["bit"] = draw(st.integers(0, 7))
    elif kind == "json":
        paths = [p for p in _json_paths(meta) if p]
        m["path"] = draw(st.sampled_from(paths))
        m["op"] = draw(st.sampled_from(["replace", "wrap_list", "wrap_dict", "delete"]))
        m["value"] = draw(_REPLACEMENTS)
    else:
        names = sorted(meta["tensors"])
        m["tensor"] = draw(st.sampled_from(names))
        n = len(meta["tensors"][m["tensor"]]["chunks"])
        m["i"], m["j"] = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        if kind == "path":
            m["name"] = draw(st.sampled_from(_BAD_NAMES))
            m["replace_file"] = draw(st.sampled_from([None, "fifo", "dir", "link_out"]))
        if kind == "dtype_shape":
            m["dtype"] = draw(st.sampled_from([None, "float32", "float64", "int64", "complex64", "bfloat16", "uint8"]))
            m["shape"] = draw(st.one_of(st.none(), st.lists(st.integers(0, 10), max_size=3)))
    return m


def _apply(ck: str, m: dict[str, Any]) -> bool:
    """Mutate the copy at ``ck``; return whether only unprotected plain values may have changed."""
    base = os.path.dirname(ck)
    meta_path = os.path.join(ck, METADATA)
    with open(meta_path) as f:
        meta = json.load(f)
    kind = m["kind"]
    if kind in ("meta_bytes", "data_bytes"):
        path = os.path.join(ck, m["file"])
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        limit = (
            len(raw)
            if m["op"] != "flip_header" or kind == "meta_bytes"
            else min(len(raw), 8 + int.from_bytes(raw[:8], "little"))
        )
        at = int(m["at"] * limit)
        if m["op"] == "truncate":
            raw = raw[:at]
        else:
            raw[at] ^= 1 << m["bit"]
        with open(path, "wb") as f:
            f.write(raw)
        return kind == "meta_bytes"
    if kind == "json":
        *parents, last = m["path"]
        node = meta
        for p in parents:
            node = node[p]
        if m["op"] == "delete":
            if isinstance(node, dict):
                del node[last]
            else:
                node.pop(last)
        else:
            value = {"replace": m["value"], "wrap_list": [node[last]], "wrap_dict": {"x": node[last]}}[m["op"]]
            node[last] = value
        relaxed = m["path"][0] == "state"
    else:
        t = meta["tensors"][m["tensor"]]
        chunks = t["chunks"]
        relaxed = False
        if kind == "swap_boxes":
            chunks[m["i"]]["box"], chunks[m["j"]]["box"] = chunks[m["j"]]["box"], chunks[m["i"]]["box"]
        elif kind == "swap_chunks":  # a reordering: must load the same values
            chunks[m["i"]], chunks[m["j"]] = chunks[m["j"]], chunks[m["i"]]
        elif kind == "dtype_shape":
            if m["dtype"] is not None:
                t["dtype"] = m["dtype"]
            if m["shape"] is not None:
                t["shape"] = m["shape"]
        else:
            special = m["replace_file"] or m["name"]
            if special == "fifo" and hasattr(os, "mkfifo"):
                os.mkfifo(os.path.join(ck, "fifo"))
            elif special == "subdir" or special == "dir":
                os.mkdir(os.path.join(ck, "subdir"))
            elif special == "link_out":
                os.symlink(os.path.join(base, "outside.safetensors"), os.path.join(ck, "link_out"))
            if m["replace_file"] is not None:
                # The chunk's real file replaced by a FIFO, a directory or a link out.
                target = os.path.join(ck, chunks[m["i"]]["file"])
                os.remove(target)
                src = {"fifo": "fifo", "dir": "subdir", "link_out": "link_out"}[m["replace_file"]]
                if os.path.lexists(os.path.join(ck, src)):
                    os.rename(os.path.join(ck, src), target)
            else:
                chunks[m["i"]]["file"] = m["name"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    if kind == "path" and m["name"] == "meta_link_out" and m["replace_file"] is None:
        # metadata.json itself a link to (an intact copy of) itself outside the directory.
        chunks[m["i"]]["file"] = _PRISTINE["meta"]["tensors"][m["tensor"]]["chunks"][m["i"]]["file"]
        with open(os.path.join(base, "outside_meta.json"), "w") as f:
            json.dump(meta, f)
        os.remove(meta_path)
        os.symlink(os.path.join(base, "outside_meta.json"), meta_path)
    return relaxed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or isinstance(a, np.generic):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _arrays(value: Any) -> list[np.ndarray]:
    if isinstance(value, np.ndarray | np.generic):
        return [np.asarray(value)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays(v)]
    return []


def _target_state() -> dict[str, Any]:
    """Where load_state_dict puts the values: ``w`` column-sharded over 4 ranks, ``b`` dense."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    return {
        "w": dist.shard_tensor(np.zeros((8, 6)), mesh, [dist.Shard(1)]),
        "b": dist.Tensor(np.zeros(6, dtype=np.float32)),
        "e": np.zeros((3, 4), dtype=np.int32),
        "s": np.float64(0.0),
        "step": 0,
        "sched": {"lr": 0.0, "milestones": [0, 0]},
    }


def _loaded_values(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after load_state_dict as read_state_dict gives it: tensors as global arrays."""
    w = state["w"]
    columns = [np.asarray(w.local_tensor(r)) for r in w.spec.mesh.process_ids]
    return {**state, "w": np.concatenate(columns, axis=1), "b": np.asarray(state["b"].local_tensor())}


def _load_under_timeout(ck: str, timeout: float, target: str = "read") -> tuple[str, Any]:
    out: dict[str, Any] = {}
    state = _target_state() if target == "load" else None

    def run() -> None:
        try:
            if state is None:
                out["value"] = read_state_dict(ck)
            else:
                dist.load_state_dict(state, ck)
                out["value"] = _loaded_values(state)
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    _OPENED.clear()
    _RECORDING[0] = True
    worker.start()
    worker.join(timeout)
    _RECORDING[0] = False
    if worker.is_alive():
        return "hang", None
    return ("error", out["error"]) if "error" in out else ("value", out["value"])


def check_case(m: dict[str, Any]) -> None:
    pristine, _, original = _pristine()
    work = tempfile.mkdtemp(prefix="mpipar-fuzz-case-")
    try:
        ck = os.path.join(work, "ck")
        shutil.copytree(pristine, ck)
        shutil.copy(os.path.join(os.path.dirname(pristine), "outside.safetensors"), work)
        relaxed = _apply(ck, m)
        outcome, result = _load_under_timeout(ck, 20.0, m["target"])
        _OUTCOMES[(m["kind"], outcome)] += 1
        _OUTCOMES[(m["target"], outcome)] += 1
        assert outcome != "hang", f"load hung on mutation {m}"
        root = os.path.realpath(ck)
        outside = [
            p
            for p in _OPENED
            if os.path.commonpath([root, os.path.realpath(p)]) != root
            and not (os.path.realpath(p).startswith(_PACKAGE + os.sep) and p.endswith((".py", ".pyc")))
        ]
        assert not outside, f"mutation {m} opened {outside} outside the checkpoint"
        if outcome == "error":
            assert isinstance(result, FileFormatError), f"mutation {m} raised {type(result).__name__}: {result}"
            assert str(result)
        elif relaxed:
            originals = {a.tobytes() + str(a.dtype).encode() + str(a.shape).encode() for a in _arrays(original)}
            for a in _arrays(result):
                assert a.tobytes() + str(a.dtype).encode() + str(a.shape).encode() in originals, (
                    f"mutation {m} loaded an array that is none of the saved ones"
                )
        else:
            assert _same(result, original), f"mutation {m} loaded values that differ from the saved ones"
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.fuzz
def test_fuzz_checkpoint_loader(request: pytest.FixtureRequest) -> None:
    long_run = "fuzz" in (request.config.getoption("markexpr") or "")
    examples = int(os.environ.get("MPIPAR_FUZZ_EXAMPLES", 20000 if long_run else 1000))

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(mutations())
    def case(m: dict[str, Any]) -> None:
        check_case(m)

    _OUTCOMES.clear()
    case()
    print(f"checkpoint fuzz: {sum(_OUTCOMES.values()) // 2} cases:", dict(sorted(_OUTCOMES.items())))
    # The cases reached both ends: refusals and loads of the original values.
    assert {o for _, o in _OUTCOMES} == {"error", "value"}


def test_fuzz_sees_an_outside_open() -> None:
    """The audit check itself works: a read of the outside copy is recorded as outside."""
    ck, _, _ = _pristine()
    outside = os.path.join(os.path.dirname(ck), "outside.safetensors")
    _OPENED.clear()
    _RECORDING[0] = True
    with open(outside, "rb"):
        pass
    _RECORDING[0] = False
    assert outside in _OPENED
