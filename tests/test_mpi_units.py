"""Pieces of the MPI runtime that need no launcher: settings, signatures, output, print_once."""

from __future__ import annotations

import io

import pytest

import mpipar as dist
from mpipar.runtime.faults import check_from_env, compare_signatures, signature, timeout_from_env
from mpipar.runtime.log import LinePrefixer


def test_timeout_setting() -> None:
    assert timeout_from_env({}) == 300.0
    assert timeout_from_env({"MPIPAR_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match=f"MPIPAR_TIMEOUT must be a positive number of seconds, got '{bad}'"):
            timeout_from_env({"MPIPAR_TIMEOUT": bad})


def test_check_setting() -> None:
    assert not check_from_env({})
    assert check_from_env({"MPIPAR_CHECK_COLLECTIVES": "1"}) and check_from_env({"MPIPAR_CHECK_COLLECTIVES": "on"})
    assert not check_from_env({"MPIPAR_CHECK_COLLECTIVES": "0"})
    with pytest.raises(ValueError, match="MPIPAR_CHECK_COLLECTIVES must be 1 or 0"):
        check_from_env({"MPIPAR_CHECK_COLLECTIVES": "maybe"})


def test_matching_signatures_pass() -> None:
    sig = signature("all_reduce", dtype="float64", reduce_type="sum", shape=(4, 3))
    assert compare_signatures((0, 1, 2), [sig, sig, sig], 1) is None


def test_different_ops_name_every_rank() -> None:
    ar = signature("all_reduce", dtype="float64", reduce_type="sum", shape=(4, 3))
    ag = signature("all_gather", dtype="float64", shapes=[(2, 3), (2, 3)])
    msg = compare_signatures((3, 1, 0), [ar, ag, ar], 7)
    assert msg is not None
    assert "group [3, 1, 0] (call #7 on this group)" in msg
    assert "ranks [3, 0] issued all_reduce(sum) of float64[4, 3]" in msg
    assert "rank 1 issued all_gather of float64 pieces [[2, 3], [2, 3]]" in msg


def test_same_op_other_dtype_or_root() -> None:
    a = signature("broadcast", dtype="float64", shape=(2,), root=1)
    b = signature("broadcast", dtype="float32", shape=(2,), root=1)
    msg = compare_signatures((0, 1), [a, b], 2)
    assert msg is not None and "rank 0 issued broadcast of float64[2] (root 1)" in msg and "float32[2]" in msg
    c = signature("reduce", dtype="float64", reduce_type="max", shape=(2,), root=0)
    d = signature("reduce", dtype="float64", reduce_type="max", shape=(2,), root=1)
    msg = compare_signatures((0, 1), [c, d], 3)
    assert msg is not None and "(root 0)" in msg and "(root 1)" in msg


def test_all_to_all_layout_disagreement() -> None:
    a = signature("all_to_all", dtype="int64", sends=[(1,), (2,)], recvs=[(1,), (3,)])
    b = signature("all_to_all", dtype="int64", sends=[(3,), (0,)], recvs=[(2,), (0,)])
    assert compare_signatures((0, 1), [a, b], 1) is None
    b_wrong = signature("all_to_all", dtype="int64", sends=[(4,), (0,)], recvs=[(2,), (0,)])
    msg = compare_signatures((0, 1), [a, b_wrong], 1)
    assert msg is not None and "rank 1 sends a piece of shape [4] to rank 0, which expects [3]" in msg


def test_line_prefixer_writes_whole_prefixed_lines() -> None:
    sink = io.StringIO()
    out = LinePrefixer(sink, "[rank 3] ")  # type: ignore[arg-type]
    out.write("a")
    assert sink.getvalue() == ""  # a partial line waits for its end
    out.write("b\nc\nd")
    assert sink.getvalue() == "[rank 3] ab\n[rank 3] c\n"
    out.flush()
    assert sink.getvalue() == "[rank 3] ab\n[rank 3] c\n[rank 3] d"
    print("x", "y", file=out)
    assert sink.getvalue().endswith("[rank 3] x y\n")


def test_print_once_prints_in_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    dist.print_once("step", 1, "loss", 0.5)
    assert capsys.readouterr().out == "step 1 loss 0.5\n"
