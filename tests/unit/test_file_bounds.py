"""Validation work is bounded by the file: the chunk-cover check sorts and sweeps.

A metadata file of 4200 chunks (480 KB) laid out as row slabs beside column slabs made the
old overlap sweep compare every pair (about 30 s for ``describe``); the plane sweep checks
each entering box against its two neighbours only. The sweep is compared with brute force
on generated layouts.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipar.checkpoint import CheckpointError, describe_checkpoint
from mpipar.checkpoint import validate as v
from mpipar.checkpoint.format import METADATA


def _metadata(boxes: list[list[list[int]]], shape: list[int]) -> dict[str, Any]:
    chunks = [
        {
            "file": "rank00000.safetensors",
            "key": f"w#{i}",
            "box": b,
            "nbytes": v.math.prod(e - s for s, e in b),
            "crc32c": 0,
        }
        for i, b in enumerate(boxes)
    ]
    tensor = {"kind": "array", "shape": shape, "dtype": "uint8", "mesh": None, "placements": None}
    return {
        "format": "mpipar.checkpoint",
        "version": 1,
        "checksum": "crc32c",
        "world_size": 1,
        "files": ["rank00000.safetensors"],
        "tensors": {"w": {**tensor, "stored_placements": None, "chunks": chunks}},
        "state": {"dict": [["w", {"array": "w"}]]},
    }


def _rows_beside_columns(n: int) -> list[list[list[int]]]:
    return [[[i, i + 1], [0, n]] for i in range(n)] + [[[0, n], [n + j, n + j + 1]] for j in range(n)]


def test_an_irregular_layout_of_thousands_of_chunks_validates_in_a_sweep(tmp_path: Path) -> None:
    n = 2100  # 2100 x 2102 cut cells: over the painted grid's limit, so the sweep runs
    (tmp_path / METADATA).write_text(json.dumps(_metadata(_rows_beside_columns(n), [n, 2 * n])))
    text = describe_checkpoint(tmp_path)
    assert text.count("\n") == 1 + 2 * n
    boxes = _rows_beside_columns(n)
    boxes[-1] = [[0, n], [n - 1, n]]  # the last column slab moved onto the row slabs' columns
    (tmp_path / METADATA).write_text(json.dumps(_metadata(boxes, [n, 2 * n])))
    with pytest.raises(CheckpointError, match=r"chunks\[4199\]\.box.*overlaps chunks\[0\]\.box"):
        describe_checkpoint(tmp_path)


def _brute(boxes: list[tuple[tuple[int, int], ...]]) -> bool:
    return any(
        all(max(sa, sb) < min(ea, eb) for (sa, ea), (sb, eb) in zip(a, b, strict=True))
        for a, b in itertools.combinations(boxes, 2)
    )


@st.composite
def _layouts(draw: Any) -> list[tuple[tuple[int, int], ...]]:
    ndim = draw(st.integers(2, 3))
    count = draw(st.integers(2, 12))
    boxes = []
    for _ in range(count):
        box = []
        for _ in range(ndim):
            s = draw(st.integers(0, 6))
            box.append((s, s + draw(st.integers(1, 3))))
        boxes.append(tuple(box))
    return boxes


@settings(max_examples=60, deadline=None)
@given(_layouts())
def test_the_sweep_finds_an_overlap_exactly_when_brute_force_does(boxes: list[tuple[tuple[int, int], ...]]) -> None:
    budget = [1 << 20]
    pair = v._find_overlap(list(enumerate(boxes)), 0, len(boxes[0]), budget)
    assert (pair is not None) == _brute(boxes)
    if pair is not None:
        a, b = boxes[pair[0]], boxes[pair[1]]
        assert pair[0] != pair[1] and _brute([a, b])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--mesh", "pp=8", "--micro-batches", "100000000"],
            r"--micro-batches 100000000 x pp 8 x --chunks 1 = 800000000",
        ),
        (["--layers", "100000000"], r"--layers 100000000 = 100000000 layers, over the limit of 65536"),
    ],
)
def test_estimate_bounds_the_products_of_its_counts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each count alone was in range; their products kept ``simulator estimate`` busy for ever."""
    from simulator.estimate import main

    base = {"--layers": "8", "--hidden": "64", "--heads": "4"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    args = [x for kv in base.items() for x in kv]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


# ------------------------------------------------------------------ memory while parsing
_PATTERNS = [
    b"[],",
    b"{},",
    b"[0],",
    b'{"a":1},',
    b'{"":{}},',
    b"[[[]]],",
    b'"ab",',
    b"300,",
    b"1e5,",
    b'"\xf0\x9f\x98\x80",',
]


@pytest.mark.parametrize("unit", _PATTERNS)
def test_memory_bound_is_an_upper_bound_of_parsing(unit: bytes) -> None:
    """``memory_bound`` never under-counts what ``json.loads`` keeps (tracemalloc's peak)."""
    import tracemalloc

    from mpipar.untrusted import memory_bound, parse_json

    data = b"[" + unit * 20000 + b"0]"
    tracemalloc.start()
    try:
        parse_json(data, kind="plan")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= memory_bound(data), (unit, peak / len(data), memory_bound(data) / len(data))


def test_a_plan_made_of_empty_containers_is_refused_before_parsing(tmp_path: Path) -> None:
    """44x its size in memory when parsed; refused by its bracket count, in one linear scan."""
    from mpipar.compile.plan import Plan
    from mpipar.untrusted import MEMORY_FACTOR
    from viz.files import VizFileError, load_document

    data = b'{"format": "mpipar.plan", "tensors": [' + b"[]," * 100000 + b"[]]}"
    with pytest.raises(VizFileError, match=rf"could take more than {MEMORY_FACTOR}x its size in memory"):
        load_document(data, "dense.json")
    (tmp_path / "dense.json").write_bytes(data)
    with pytest.raises(ValueError, match=rf"plan .*dense.json.*more than {MEMORY_FACTOR}x its size"):
        Plan.load(tmp_path / "dense.json")


def test_a_safetensors_header_of_empty_objects_is_refused(tmp_path: Path) -> None:
    import struct

    from mpipar.checkpoint.format import read_header

    body = b'{"k": [' + b"{}," * 50000 + b"{}]}"  # 47x its size when parsed
    path = tmp_path / "rank00000.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with open(path, "rb") as f, pytest.raises(CheckpointError, match="more than 48x its size in memory"):
        read_header(f, str(path))
