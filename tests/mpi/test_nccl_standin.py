"""The NCCL backend's code run in CI through a stand-in for CuPy and NCCL (``tests/nccl_standin``:
NumPy arrays, recorded streams, NCCL's calls carried over MPI), which also checks the backend's
discipline. The communicator's cases and the seed examples under ``MPIPAR_BACKEND=nccl`` give
the MPI backend's results bit for bit. No GPU is involved: the stand-in is used only here."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conftest import REPO
from mpi_scripts.kernels_on_device import compare
from mpi_scripts.launch import mpirun

STANDIN = os.path.join(REPO, "tests", "nccl_standin")
NCCL_ENV = {"MPIPAR_BACKEND": "nccl", "PYTHONPATH": STANDIN}


@pytest.mark.mpi
def test_communicator_cases_under_nccl_match_the_simulator_bit_for_bit() -> None:
    run = mpirun(4, "tests/mpi_scripts/comm_cases.py", "--cases", "60", "--seed", "23", env=NCCL_ENV, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert run.lines_of(0)[-1] == "ok 60 cases on 4 ranks"


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "ranks"), [("paddle_auto/tp", 4), ("paddle_auto/dp", 4), ("basics/reshard", 4), ("paddle_auto/pp", 8)]
)
def test_seed_example_under_nccl_prints_what_the_mpi_backend_prints(script: str, ranks: int) -> None:
    path = f"examples/{script}.py"
    ref = mpirun(ranks, path, env={"MPIPAR_BACKEND": "mpi"}, timeout=300)
    assert ref.returncode == 0, ref.output[-4000:]
    run = mpirun(ranks, "tests/mpi_scripts/nccl_standin_run.py", path, env=NCCL_ENV, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    lines = run.output.splitlines()
    report = [line for line in lines if "standin backend=" in line]
    assert len(report) == ranks and all("backend=nccl standin=True" in r and "open_groups=0" in r for r in report)
    assert all("calls=0" not in r for r in report)  # NCCL's calls really carried the data
    # Ranks print concurrently, so lines of different ranks interleave differently from run to
    # run: compare each rank's own lines, in its order.
    assert _by_rank([line for line in lines if "standin backend=" not in line]) == _by_rank(ref.output.splitlines())


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_captured_steps_under_nccl_match_eager_and_the_mpi_backend(ranks: int) -> None:
    """``compile_step(step, capture=True)`` under the NCCL backend (``capture_step.py``: the TP MLP
    with SGD and AdamW, a DP MLP, and ``to_static(..., capture=True)`` on a Linear MLP): each
    captured step equals its eager twin bit for bit, with the same collectives heard and as many
    NCCL calls carried when nothing listens (the MPI backend's bound all-reduce, MPI on host
    memory, must stay off); every rank's losses equal the MPI backend's run of the same
    script, ``repr`` for ``repr``."""
    args = ("--steps", "8", "--print-losses")
    threads = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    ref = mpirun(
        ranks, "tests/mpi_scripts/capture_step.py", *args, env={"MPIPAR_BACKEND": "mpi", **threads}, timeout=300
    )
    assert ref.returncode == 0, ref.output[-4000:]
    run = mpirun(
        ranks,
        "tests/mpi_scripts/nccl_standin_run.py",
        "tests/mpi_scripts/capture_step.py",
        *args,
        env={**NCCL_ENV, **threads},
        timeout=300,
    )
    assert run.returncode == 0, run.output[-4000:]
    for r in range(ranks):
        lines = run.lines_of(r)
        for case in ("tp-sgd", "tp-adamw", "dp-sgd", "static"):
            assert any(line.startswith(f"ok {case} captured ") and line != f"ok {case} captured 0" for line in lines), (
                run.output[-3000:]
            )
        (report,) = [line for line in lines if line.startswith("standin backend=")]
        assert "backend=nccl standin=True" in report and "open_groups=0" in report and " calls=0 " not in report, report
        losses = [line for line in lines if line.startswith("loss ")]
        assert len(losses) == 4 * 8
        assert losses == [line for line in ref.lines_of(r) if line.startswith("loss ")]


@pytest.mark.mpi
def test_gpt_under_nccl_prints_the_mpi_backends_losses() -> None:
    """gpt.py's model (embedding, softmax attention, cross entropy: kernels the seed examples do
    not reach) trains under the stand-in with the MPI backend's losses, bit for bit. The stand-in
    refuses what CuPy refuses (``max(initial=...)``, a scatter-add into host memory), which the
    first run on a real GPU (README) found in these kernels."""
    args = ("examples/gpt.py", "--tiny", "--steps", "3", "--sample", "0", "--mesh", "dp=1,tp=2")
    ref = mpirun(2, *args, env={"MPIPAR_BACKEND": "mpi"}, timeout=300)
    assert ref.returncode == 0, ref.output[-4000:]
    run = mpirun(2, "tests/mpi_scripts/nccl_standin_run.py", *args, env=NCCL_ENV, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert sum("backend=nccl standin=True" in line for line in run.output.splitlines()) == 2
    losses = [line for line in run.output.splitlines() if " loss " in line]
    assert len(losses) == 3 and losses == [line for line in ref.output.splitlines() if " loss " in line]


@pytest.mark.mpi
def test_every_kernel_under_the_standin_equals_the_mpi_backend(tmp_path: Path) -> None:
    """Every registered op's forward and backward on device arrays (``kernels_on_device.py``,
    what the H200 run compared within 1e-9) equals the MPI backend's bit for bit under the
    stand-in, which refuses what CuPy refuses: a host array beside device ones (the dropout mask
    the GPU run found), ``max(initial=...)``, a scatter into host memory."""
    script = "tests/mpi_scripts/kernels_on_device.py"
    ref = mpirun(2, script, "--out", str(tmp_path / "mpi.npz"), env={"MPIPAR_BACKEND": "mpi"}, timeout=300)
    assert ref.returncode == 0, ref.output[-4000:]
    run = mpirun(
        2,
        "tests/mpi_scripts/nccl_standin_run.py",
        script,
        "--out",
        str(tmp_path / "nccl.npz"),
        env=NCCL_ENV,
        timeout=300,
    )
    assert run.returncode == 0, run.output[-4000:]
    assert "0 failing samples" in run.output, run.output[-4000:]
    with np.load(tmp_path / "mpi.npz") as saved:
        assert len(saved.files) > 200  # every op with samples, outputs and gradients
    assert compare(str(tmp_path / "mpi.npz"), str(tmp_path / "nccl.npz"), 0.0) == []


def test_nccl_unique_id_round_trips_in_both_cupy_forms() -> None:
    """CuPy 14 hands NCCL's unique id out (and takes it back) as 128 bytes, earlier CuPy as a
    tuple of signed chars; the root broadcasts it with a byte saying which (the first GPU run
    found CuPy 14's bytes refused)."""
    from mpipar.runtime.nccl import NCCL_UNIQUE_ID_BYTES, pack_unique_id, unpack_unique_id

    raw = bytes((7 * i + 200) % 256 for i in range(NCCL_UNIQUE_ID_BYTES))
    packed = pack_unique_id(raw)
    assert packed.dtype == np.int8 and packed.shape == (NCCL_UNIQUE_ID_BYTES + 1,)
    assert unpack_unique_id(packed) == raw
    chars = tuple((i % 256) - 128 for i in range(NCCL_UNIQUE_ID_BYTES))
    assert unpack_unique_id(pack_unique_id(chars)) == chars
    with pytest.raises(RuntimeError, match="expected 128 bytes"):
        pack_unique_id(raw[:100])
    with pytest.raises(RuntimeError, match="signed chars"):
        pack_unique_id(tuple([300] * NCCL_UNIQUE_ID_BYTES))


def _by_rank(lines: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in lines:
        rank = line.split("]", 1)[0] if line.startswith("[rank ") else ""
        out.setdefault(rank, []).append(line)
    return out


# ---------------------------------------------------------------------------- the discipline checks
def _standin() -> ModuleType:
    """A fresh copy of the stand-in module in this process, under its own name (not ``cupy``)."""
    name = f"cupy_standin_{len([m for m in sys.modules if m.startswith('cupy_standin_')])}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(STANDIN, "cupy", "__init__.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _one_member(cp: ModuleType) -> object:
    return cp.cuda.nccl.NcclCommunicator(1, cp.cuda.nccl.get_unique_id(), 0)


def test_reading_a_buffer_an_nccl_call_wrote_needs_the_stream_synchronised() -> None:
    cp = _standin()
    stream = cp.cuda.Stream(non_blocking=True)
    comm = _one_member(cp)
    send = cp.asarray(np.arange(4, dtype=np.uint8))
    recv = cp.empty(4, dtype=np.uint8)
    comm.allGather(send.data.ptr, recv.data.ptr, 4, cp.cuda.nccl.NCCL_UINT8, stream.ptr)
    for read in (lambda: cp.asnumpy(recv), lambda: recv.get(), lambda: recv + 1, lambda: recv[1:]):
        with pytest.raises(cp.DisciplineError, match="before that stream is synchronised"):
            read()
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(recv), np.arange(4))


def test_non_contiguous_buffers_and_overruns_are_refused() -> None:
    cp = _standin()
    a = cp.asarray(np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(cp.DisciplineError, match="non-contiguous"):
        _ = a[:, 1].data
    stream = cp.cuda.Stream()
    comm = _one_member(cp)
    row = a[0]
    with pytest.raises(cp.DisciplineError, match="not inside any buffer"):
        comm.allGather(row.data.ptr, row.data.ptr + 2, 4, cp.cuda.nccl.NCCL_UINT8, stream.ptr)


def test_group_calls_must_pair_and_one_communicator_per_group() -> None:
    cp = _standin()
    with pytest.raises(cp.DisciplineError, match="without a matching groupStart"):
        cp.cuda.nccl.groupEnd()
    cp.cuda.nccl.groupStart()
    cp.cuda.nccl.groupEnd()
    _one_member(cp)
    with pytest.raises(cp.DisciplineError, match="a second NCCL communicator"):
        _one_member(cp)
