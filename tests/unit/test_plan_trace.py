"""Plans: tracing records ops, rule decisions and reshards; JSON round trips; shape-only tracing."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mpipar as dist
from mpipar.compile.plan import Plan, PlanFormatError
from mpipar.compile.trace import trace
from simulator import ShapeOnlyBackend

F = dist.nn.functional


def _tp_mlp_step(abstract: bool) -> Plan:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])

    def make(shape: tuple[int, ...], name: str, trainable: bool) -> dist.Tensor:
        if abstract:
            t = dist.Tensor.abstract(shape, np.float64)
        else:
            t = dist.Tensor(np.random.default_rng(len(name)).standard_normal(shape))
        t.stop_gradient = not trainable
        t.name = name
        return t

    x = dist.shard_tensor(make((8, 16), "x", False), mesh, [dist.Shard(0), dist.Replicate()])
    w0 = dist.shard_tensor(make((16, 32), "w0", True), mesh, [dist.Replicate(), dist.Shard(1)])
    w1 = dist.shard_tensor(make((32, 16), "w1", True), mesh, [dist.Replicate(), dist.Shard(0)])
    with trace({"what": "tp mlp"}) as rec:
        rec.mark(w0, "parameter", "w0")
        rec.mark(w1, "parameter", "w1")
        loss = dist.mean(F.relu(dist.matmul(F.relu(dist.matmul(x, w0)), w1)))
        loss.backward()
    return rec.plan()


def test_trace_records_ops_rules_and_reshards() -> None:
    plan = _tp_mlp_step(abstract=False)
    assert plan.comm_counts("forward") == {"all_reduce": 1}
    assert plan.comm_counts("backward") == {"all_reduce": 2}  # dp gradient of w0 and w1
    relu_with_reshard = [o for o in plan.ops if o.reshards]
    assert relu_with_reshard[0].op == "relu" and relu_with_reshard[0].input_placements == ("S(0)P(sum)",)
    assert plan.reshards[relu_with_reshard[0].reshards[0]].op == relu_with_reshard[0].index
    matmul0 = plan.ops[0]
    assert matmul0.op == "matmul" and "split index n" in matmul0.decision and matmul0.output_placements == ("S(0)S(1)",)
    comm_in_backward = [
        r for r in plan.reshards if r.phase == "backward" and any(s.kind == "all_reduce" for s in r.steps)
    ]
    assert len(comm_in_backward) == 2 and all("gradient of" in r.reason for r in comm_in_backward)
    assert all(r.op is None for r in comm_in_backward)  # leaf accumulation, not an op's input
    w0 = next(t for t in plan.tensors if t.name == "w0")
    assert w0.kind == "parameter" and w0.local_shapes == ((16, 16),) * 4
    assert "forward   all_reduce x1" in plan.summary()


def test_json_round_trip_is_lossless(tmp_path: object) -> None:
    plan = _tp_mlp_step(abstract=False)
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    with open(path) as f:
        assert json.load(f)["format"] == "mpipar.plan"


def test_shape_only_traces_the_same_plan() -> None:
    data = _tp_mlp_step(abstract=False)
    with dist.use_backend(ShapeOnlyBackend()):
        shapes = _tp_mlp_step(abstract=True)

    def strip(p):
        return (
            [(o.op, o.input_placements, o.required_placements, o.output_placements) for o in p.ops],
            [(r.src, r.dst, r.bytes_per_rank, r.phase) for r in p.reshards],
        )

    assert strip(shapes) == strip(data)


def test_shape_only_tensors_refuse_values() -> None:
    with dist.use_backend(ShapeOnlyBackend()):
        mesh = dist.ProcessMesh(np.arange(1024).reshape(32, 32))
        t = dist.shard_tensor(np.zeros((4, 4)), mesh, [dist.Shard(0), dist.Replicate()])
        assert t.is_abstract and t.spec.local_shape(1023) == (0, 4)
        with pytest.raises(ValueError, match="shape-only mode"):
            t.full_tensor()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(format="mpipar.timeline"), "format"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d["meshes"][0].update(shape=[3, 3]), "meshes[0]"),
        (lambda d: d["tensors"][0].update(kind="weights"), "tensors[0].kind"),
        (lambda d: d["tensors"][0].update(mesh=7), "tensors[0].mesh"),
        (lambda d: d["ops"][0].update(inputs=[999]), "ops[0].inputs[0]"),
        (lambda d: d["ops"][0].update(phase="sideways"), "ops[0].phase"),
        (lambda d: d["reshards"][0]["steps"][0].update(kind="teleport"), "reshards[0].steps[0].kind"),
        (lambda d: d["reshards"][0].update(bytes_per_rank=-3), "reshards[0].bytes_per_rank"),
        (lambda d: d.update(ops="none"), "ops"),
    ],
)
def test_malformed_plans_name_the_field(mutate: object, field: str) -> None:
    data = _tp_mlp_step(abstract=False).to_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(PlanFormatError) as err:
        Plan.from_dict(data)
    assert err.value.field == field


def test_truncated_plan_file_is_refused(tmp_path: object) -> None:
    path = f"{tmp_path}/p.json"
    text = json.dumps(_tp_mlp_step(abstract=False).to_dict())
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.load(path)


@pytest.mark.parametrize("shape_only", [False, True])
def test_mpipar_plan_command_writes_a_loadable_plan(tmp_path: object, shape_only: bool) -> None:
    import os
    import subprocess
    import sys

    from conftest import REPO, VENV_BIN

    out = f"{tmp_path}/plan.json"
    cmd = [
        os.path.join(VENV_BIN, "mpipar"),
        "plan",
        "-o",
        out,
        "-n",
        "8",
        *(["--shape-only"] if shape_only else []),
        "examples/gpt.py",
        "--tiny",
        "--mesh",
        "dp=2,tp=2,pp=2",
        "--schedule",
        "1F1B",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = Plan.load(out)
    assert plan.pipeline is not None and plan.pipeline["schedule"]["kind"] == "1F1B"
    assert len(plan.pipeline["stages"]) == 2 and plan.pipeline["num_microbatches"] == 2
    assert plan.comm_counts("forward").get("transfer") == 1
    assert plan.meta["shape_only"] is shape_only
    eager = subprocess.run(
        [sys.executable, "-m", "mpipar.cli", "plan", "-o", out, "examples/paddle_auto/dp.py", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert eager.returncode == 0, eager.stderr[-3000:]
    plan = Plan.load(out)
    assert plan.comm_counts("backward") == {"all_reduce": 2}  # the data-parallel gradients of w0 and w1
    assert sum(t.kind == "optimizer_state" for t in plan.tensors) == 4  # AdamW: two moments each
