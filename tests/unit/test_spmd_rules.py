"""SPMD rules: the query API with Paddle's names, the rule checker, and op error messages."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

import mpipar as dist
from mpipar.ops import OpDef, apply, register_op
from mpipar.spmd import EinsumSpec, register_rule


def test_missing_rule_names_the_op_and_how_to_register() -> None:
    register_op(OpDef("twice_no_rule", lambda c, x, **_: 2 * x, None))
    mesh = dist.ProcessMesh([0, 1])
    x = dist.shard_tensor(np.ones(4), mesh, [dist.Shard(0)])
    with pytest.raises(
        KeyError,
        match=r"no SPMD rule is registered for op 'twice_no_rule'.*register_rule\('twice_no_rule'\).*replicate_only=True",
    ):
        apply("twice_no_rule", [x])
    register_op(OpDef("twice_replicated", lambda c, x, **_: 2 * x, None, replicate_only=True))
    with dist.CommDebugMode() as comm:
        y = apply("twice_replicated", [x])
    assert comm.counts() == {"all_gather": 1} and y.placements == [dist.Replicate()]
    np.testing.assert_array_equal(y.full_tensor(), np.full(4, 2.0))


def test_shape_mismatch_and_two_meshes_name_both_tensors() -> None:
    m0, m1 = dist.ProcessMesh([0, 1], dim_names=["x"]), dist.ProcessMesh([2, 3], dim_names=["x"])
    a = dist.shard_tensor(np.ones((4, 3)), m0, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((5, 2)), m0, [dist.Replicate()])
    with pytest.raises(ValueError, match=r"matmul: .*contraction sizes differ.*\[4, 3\].*S\(0\).*\[5, 2\].*R"):
        dist.matmul(a, b)
    c = dist.shard_tensor(np.ones((4, 3)), m1, [dist.Shard(0)])
    with pytest.raises(
        ValueError,
        match=r"add: inputs live on different meshes: .*\[4, 3\]@mesh\[x=2\]\[0, 1\]:S\(0\).*\[4, 3\]@mesh\[x=2\]\[2, 3\]:S\(0\).*dist.reshard",
    ):
        dist.add(a, c)
    with pytest.raises(ValueError, match=r"add: .*shapes do not broadcast.*\[4, 3\].*\[5, 2\]"):
        dist.add(a, b)


def test_rule_checker_catches_a_wrong_rule() -> None:
    """A relu rule that (wrongly) lets Partial through must be reported."""
    from simulator.check_rules import check_op

    register_rule("bad_relu")(lambda specs, **a: EinsumSpec(("ab",), ("ab",), (0,), True, op="bad_relu"))
    op = register_op(
        OpDef(
            "bad_relu", lambda c, x, **_: np.maximum(x, 0), None, sample=lambda r: [([r.standard_normal((4, 6))], {})]
        )
    )
    report = check_op(op, np.random.default_rng(0), trials=8)
    assert report.wrong, "the checker accepted a rule that keeps Partial through relu"


def test_rule_checker_passes_on_every_registered_rule() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "simulator.check_rules", "--trials", "6"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 wrong, 0 missing" in out.stdout


def test_infer_forward_api_with_paddle_names() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    x = dist.DistSpec.from_dims_mapping([8, 16], mesh, [0, -1])
    w = dist.DistSpec.from_dims_mapping([16, 12], mesh, [-1, 1])
    res = dist.spmd.infer_forward("matmul", [x, w], trans_x=False, trans_y=False)
    assert [s.dims_mapping for s in res.inputs] == [[0, -1], [-1, 1]]
    assert res.outputs[0].dims_mapping == [0, 1]
    cat = dist.spmd.infer_forward("concat", [[x, x]], axis=0)
    assert len(cat.inputs) == 1 and len(cat.inputs[0]) == 2
    assert cat.outputs[0].shape == (16, 16)
    back = dist.spmd.infer_backward(
        "matmul",
        [x, w],
        [dist.DistSpec(np.zeros(2, int).tolist() and [8, 12], mesh, [dist.Partial(), dist.Replicate()])],
    )
    assert back.inputs[0].placements[0] == dist.Shard(1) and back.inputs[1].placements[0] == dist.Shard(0)
    # split on the softmax axis: answered with the nearest layout softmax produces (tests/unit/test_spmd_nearest.py)
    near = dist.spmd.infer_backward(
        "softmax", [x], [dist.DistSpec([8, 16], mesh, [dist.Replicate(), dist.Shard(1)])], axis=-1
    )
    assert list(near.outputs[0].placements) == [dist.Replicate(), dist.Replicate()] and "must stay whole" in near.reason
