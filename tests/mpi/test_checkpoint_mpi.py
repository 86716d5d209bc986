"""Checkpoints under mpiexec: saved by 8 processes (dp2 x tp2 x pp2), loaded by 8, 4, 3 and 1.

Two states: a table of tensors shaped like a GPT's (ZeRO moments, a Partial gradient) and a
real one, ``tests/gpt_training_state.py`` (a GPT on from_degrees(2, 2, 2) after two AdamW steps
under ZeRO-2), restored with ``load_training_state`` into the GPT built under each target layout.

The same child script runs under MPI and under ``python -m simulator -n N``; it prints a
SHA-256 of every value it holds after loading, which must equal the digests of the state it
saved (computed by the same script). MPI and the simulator must also write byte-identical
chunks (same layout, same CRCs). Each MPI rank checks that it read exactly the chunks
overlapping its own shards. Failure paths: ranks passing different state dicts are refused
on every rank (no hang); a write failing on one rank fails the save on all and keeps the
previous checkpoint.

Run: ``.venv/bin/python -m pytest -q -m mpi tests/mpi/test_checkpoint_mpi.py``
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any

import pytest
from processes import run, run_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

CHILD = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np
    import mpipar as dist
    from mpipar.checkpoint import record_io
    from mpipar.checkpoint import save as save_module
    from mpipar.spec import box_intersect
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # the tests run this from the repository
    import gpt_training_state

    R, S = dist.Replicate, dist.Shard

    TABLE = [  # (group, name, shape, stage, placements on the stage's dp x tp mesh, dtype)
        ("model", "embedding.weight", (50, 12), 0, "RS(0)", np.float64),
        ("model", "blocks.0.ln.weight", (12,), 0, "RR", np.float64),
        ("model", "blocks.0.qkv.weight", (12, 36), 0, "RS(1)", np.float64),
        ("model", "blocks.0.proj.weight", (12, 12), 0, "RS(0)", np.float64),
        ("model", "blocks.1.fc1.weight", (12, 47), 1, "RS(1)", np.float64),
        ("model", "blocks.1.fc1.bias", (47,), 1, "RS(0)", np.float32),
        ("model", "blocks.1.fc2.weight", (47, 12), 1, "RS(0)", np.float64),
        ("model", "head.weight", (12, 50), 1, "RS(1)", np.float64),
        ("optimizer", "embedding.weight.moment1", (50, 12), 0, "S(0)S(0)", np.float64),  # ZeRO
        ("optimizer", "blocks.1.fc1.weight.moment2", (12, 47), 1, "S(0)S(1)", np.float32),
        ("optimizer", "head.weight.grad", (12, 50), 1, "P(sum)S(1)", np.float64),  # reduced at save
    ]

    def build():
        rng = np.random.default_rng(0)
        stages = [dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"]),
                  dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "tp"])]
        state = {"model": {}, "optimizer": {}}
        for group, name, shape, stage, pls, dtype in TABLE:
            value = rng.standard_normal(shape).astype(dtype)
            state[group][name] = dist.shard_tensor(value, stages[stage], dist.parse_placements(pls))
        state.update(step=41, rng=np.random.default_rng(7).bit_generator.state, loader={"epoch": 2, "position": [3, 17]})
        return state

    def flat(state, prefix=""):
        out = {}
        items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else None
        if items is None:
            return {prefix[:-1]: state}
        for k, v in items:
            out.update(flat(v, f"{prefix}{k}."))
        return out

    def digests(state):
        out = {}
        for k, v in flat(state).items():  # full_tensor is a collective: same order on every rank
            if isinstance(v, dist.Tensor):
                a = v.full_tensor()
                out[k] = f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()
            else:
                out[k] = json.dumps(v, sort_keys=True)
        return out

    def target(layout):
        world = dist.get_world_size()
        if layout == "tp4xdp2":
            mesh, tp = dist.ProcessMesh(np.arange(8).reshape(4, 2).T.tolist(), dim_names=["dp", "tp"]), 1
        elif layout == "dense":
            mesh, tp = None, 0
        else:
            mesh, tp = dist.ProcessMesh(list(range(world))[::-1], dim_names=["tp"]), 0
        state = {"model": {}, "optimizer": {}, "step": None, "rng": None, "loader": None}
        for group, name, shape, _, _, dtype in TABLE:
            junk = np.full(shape, -7, dtype=dtype)
            if mesh is None:
                state[group][name] = dist.to_tensor(junk)
                continue
            pls = [R()] * mesh.ndim
            if len(shape):
                pls[tp] = S(len(shape) - 1)
            state[group][name] = dist.shard_tensor(junk, mesh, pls)
        return state

    def check_io(io, state, path):
        with open(path + "/metadata.json") as f:
            meta = json.load(f)
        rank = dist.get_rank()
        need = set()
        for name, t in flat(state).items():
            if not isinstance(t, dist.Tensor):
                continue
            if t.is_dist and rank not in t.process_mesh.process_ids:
                continue
            box = t.spec.local_box(rank) if t.is_dist else tuple((0, n) for n in t.shape)
            for c in meta["tensors"][name]["chunks"]:
                if box_intersect(box, tuple(map(tuple, c["box"]))) is not None:
                    need.add((name, c["key"]))
        got = io.chunks_read_by(rank)
        assert got == need, (rank, sorted(got ^ need))
        files = {c["file"] for n, t in meta["tensors"].items() for c in t["chunks"] if (n, c["key"]) in need}
        assert set(io.files_opened) == files, (rank, io.files_opened, files)
        print(f"IO-OK {rank}", flush=True)

    # The real GPT training state (tests/gpt_training_state.py), saved beside the table's.
    GPT_TARGET = {("tp4xdp2", 8): "tp4xdp2", ("tp", 4): "4 ranks", ("tp", 3): "3 ranks", ("tp", 1): "1 rank",
                  ("dense", 1): "1 rank, dense"}

    def gpt_digests(state):
        return {"gpt." + k: v for k, v in digests(state).items()}

    mode, path = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    if mode == "expect":
        print("DIGESTS " + json.dumps(digests(build()) | gpt_digests(gpt_training_state.trained_state())))
    elif mode == "save":
        dist.save_state_dict(build(), path)
        dist.save_state_dict(gpt_training_state.trained_state(), path + "-gpt")
    elif mode == "load":
        state = target(sys.argv[3])
        with record_io() as io:
            dist.load_state_dict(state, path)
        check_io(io, state, path)
        d = digests(state)
        label = GPT_TARGET[(sys.argv[3], dist.get_world_size())]
        d |= gpt_digests(gpt_training_state.load_into(label, path + "-gpt")[0])
        if dist.get_rank() == 0:
            print("DIGESTS " + json.dumps(d), flush=True)
    elif mode == "disagree":
        extra = {"only_on_rank_1": 1} if dist.get_rank() == 1 else {}
        try:
            dist.save_state_dict({"w": np.arange(3.0), **extra}, path)
        except ValueError as exc:
            print(f"REFUSED {dist.get_rank()}: {exc}", flush=True)
    elif mode == "fail":
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        dist.save_state_dict({"w": dist.shard_tensor(np.arange(6.0), mesh, [S(0)])}, path)
        def fail(file):
            if dist.get_rank() == 1:
                raise OSError("disk full on rank 1")
        save_module.after_file_written.append(fail)
        try:
            dist.save_state_dict({"w": dist.shard_tensor(np.arange(6.0) + 1, mesh, [S(0)])}, path)
        except Exception as exc:
            print(f"FAILED {dist.get_rank()}: {type(exc).__name__}: {exc}", flush=True)
        save_module.after_file_written.remove(fail)
        w = dist.shard_tensor(np.zeros(6), mesh, [R()])
        dist.load_state_dict({"w": w}, path)
        print(f"KEPT {dist.get_rank()} {w.full_tensor().tolist()}", flush=True)
    """
)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "MPIPAR_BACKEND"} | {"MPIPAR_TIMEOUT": "60"}


def _mpi(script: Any, n: int, *args: str) -> str:
    proc = run([MPIEXEC, "-n", str(n), sys.executable, str(script), *args], env=_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _sim(script: Any, n: int, *args: str) -> str:
    proc = run_python("-m", "simulator", "-n", str(n), str(script), *args, env=_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _digests(out: str) -> dict[str, str]:
    lines = [line.split("DIGESTS ", 1)[1] for line in out.splitlines() if "DIGESTS " in line]
    assert len(lines) == 1, out
    return json.loads(lines[0])


@pytest.mark.mpi
def test_saved_by_8_processes_loaded_by_8_4_3_and_1(tmp_path: Any) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    expected = _digests(_sim(script, 8, "expect"))
    mpi_ck, sim_ck = str(tmp_path / "mpi"), str(tmp_path / "sim")
    _mpi(script, 8, "save", mpi_ck)
    _sim(script, 8, "save", sim_ck)
    with open(os.path.join(mpi_ck, "metadata.json")) as f:
        mpi_meta = json.load(f)
    with open(os.path.join(sim_ck, "metadata.json")) as f:
        sim_meta = json.load(f)
    assert mpi_meta["tensors"] == sim_meta["tensors"]  # same chunks, same bytes (CRCs), same files
    assert mpi_meta["files"] == sim_meta["files"] and len(mpi_meta["files"]) == 8

    for n, layout in [(8, "tp4xdp2"), (4, "tp"), (3, "tp"), (1, "tp"), (1, "dense")]:
        out = _mpi(script, n, "load", mpi_ck, layout)
        assert sorted(line for line in out.splitlines() if "IO-OK" in line) == sorted(
            (f"[rank {r}] " if r else "") + f"IO-OK {r}" for r in range(n)
        ), out
        assert _digests(out) == expected, (n, layout)
    assert _digests(_sim(script, 3, "load", mpi_ck, "tp")) == expected
    assert _digests(_mpi(script, 3, "load", sim_ck, "tp")) == expected
    assert any(k.startswith("gpt.optimizer.") and k.endswith(".moment2") for k in expected)
    with (
        open(os.path.join(mpi_ck + "-gpt", "metadata.json")) as f,
        open(os.path.join(sim_ck + "-gpt", "metadata.json")) as g,
    ):
        assert json.load(f)["tensors"] == json.load(g)["tensors"]  # MPI trained and saved the simulator's bytes


@pytest.mark.mpi
def test_failures_on_one_rank_fail_the_save_on_every_rank(tmp_path: Any) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = _mpi(script, 2, "disagree", str(tmp_path / "a"))
    assert "REFUSED 0: checkpoint save" in out and "REFUSED 1: checkpoint save" in out, out
    assert "ranks [1] pass a state dict whose names" in out
    assert not os.path.exists(tmp_path / "a")
    out = _mpi(script, 2, "fail", str(tmp_path / "b"))
    assert (
        "FAILED 0: CheckpointError: checkpoint save to" in out
        and "failed on rank 1: OSError: disk full on rank 1" in out
    ), out
    assert "FAILED 1: OSError: disk full on rank 1" in out, out
    assert "KEPT 0 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out and "KEPT 1 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out, out
    assert sorted(os.listdir(tmp_path)) == ["b", "child.py"]
