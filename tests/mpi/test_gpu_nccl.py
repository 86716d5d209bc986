"""The NCCL backend. Needs CUDA and CuPy (the ``gpu`` extra): skipped without them, except the
check that asking for it without a GPU fails at once with a clear message.

Not run on a GPU in this project's CI (its machines have none); see README "Running on MPI".
"""

from __future__ import annotations

import pytest
from mpi_scripts.launch import mpirun

from mpipar._xp import cuda_usable


def _gpu_count() -> int:
    if not cuda_usable():
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


GPUS = _gpu_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device and CuPy (pip install -e '.[gpu]')")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL needs one GPU per rank: at least 2 GPUs")


@pytest.mark.mpi
@pytest.mark.skipif(GPUS > 0, reason="CUDA is usable here: the refusal path does not apply")
def test_nccl_backend_without_cuda_fails_fast_with_a_clear_message() -> None:
    run = mpirun(4, "examples/basics/reshard.py", env={"MPIPAR_BACKEND": "nccl"}, timeout=60)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert run.output.count("RuntimeError: the nccl backend needs CuPy with NCCL and a CUDA device") == 1, run.output
    assert "pip install -e '.[gpu]'" in run.output


@pytest.mark.gpu
@pytest.mark.mpi
@needs_gpu
def test_nccl_is_chosen_and_reshards_round_trip() -> None:
    run = mpirun(GPUS, "tests/mpi_scripts/nccl_smoke.py", timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert run.lines_of(0)[-1] == f"ok nccl {GPUS} ranks"


@pytest.mark.gpu
@pytest.mark.mpi
@needs_two_gpus
def test_nccl_communicator_matches_simulator_bit_for_bit() -> None:
    run = mpirun(
        GPUS,
        "tests/mpi_scripts/comm_cases.py",
        "--cases",
        "150",
        "--seed",
        "23",
        env={"MPIPAR_BACKEND": "nccl"},
        timeout=600,
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.lines_of(0)[-1] == f"ok 150 cases on {GPUS} ranks"
