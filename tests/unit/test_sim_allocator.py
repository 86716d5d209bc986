"""``simulator.allocator``: freed memory kept for reuse in the simulator's process, no value changed.

The setting is process-wide and cannot be undone, so what it changes is observed in fresh
interpreters: one with ``SimBackend(reuse_freed_memory=False)`` (glibc's defaults), one with it on.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from simulator import SimBackend
from simulator.allocator import MMAP_THRESHOLD_MAX, _glibc, keep_freed_memory

# A fresh interpreter: the freed bytes glibc's heap still holds after eight 16 MiB arrays (one
# step's weight gradients on 8 ranks) were freed, and the data-parallel MLP step's gradients on
# 8 virtual ranks, as hex digests of their bytes.
_PROBE = r"""
import ctypes, hashlib, json, sys
import numpy as np
import mpipar as dist
from simulator import SimBackend

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
dist.set_backend(SimBackend(8, reuse_freed_memory=sys.argv[1] == "on"))
np.ones(4 << 20, np.float32)  # one 16 MiB array freed: glibc's adaptive threshold has its turn
arrays = [np.ones(4 << 20, np.float32) for _ in range(8)]  # 8 ranks' weight gradients
del arrays
kept = libc.mallinfo2().fordblks  # freed bytes the heap still holds for the next step

rng = np.random.default_rng(0)
mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
x = dist.shard_tensor(rng.standard_normal((256, 256)).astype(np.float32), mesh, [dist.Shard(0)])
w0 = dist.shard_tensor(dist.Parameter(rng.standard_normal((256, 1024)).astype(np.float32)), mesh, [dist.Replicate()])
w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((1024, 256)).astype(np.float32)), mesh, [dist.Replicate()])
for _ in range(2):  # the second step runs on memory the first one freed
    w0.clear_grad()
    w1.clear_grad()
    dist.mean(dist.matmul(dist.nn.functional.relu(dist.matmul(x, w0)), w1)).backward()
digests = [hashlib.sha256(w.grad.full_tensor().tobytes()).hexdigest() for w in (w0, w1)]
print(json.dumps({"kept": kept, "grads": digests}))
"""


def _probe(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    libc = _glibc()
    return libc is not None and hasattr(libc, "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 only: elsewhere the allocator is left alone")
def test_freed_gradients_stay_in_the_heap_and_the_gradients_are_the_same() -> None:
    off, on = _probe("off"), _probe("on")
    assert isinstance(off["kept"], int) and isinstance(on["kept"], int)
    assert off["kept"] < 32 << 20, off  # glibc's defaults hand the pages back: the next step faults afresh
    assert on["kept"] >= 8 * (16 << 20), on  # all eight wait in the heap for the next step
    assert on["grads"] == off["grads"]  # bit for bit


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_array_bytes": 0}, "max_array_bytes"),
        ({"max_array_bytes": MMAP_THRESHOLD_MAX + 1}, "max_array_bytes"),
        ({"keep_bytes": -5}, "keep_bytes"),
        ({"keep_bytes": 2**31}, "keep_bytes"),
        ({"keep_bytes": True}, "keep_bytes"),
        ({"max_array_bytes": 1.5}, "max_array_bytes"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be an int in 1\.\.\d+, got"):
        keep_freed_memory(**kwargs)  # type: ignore[arg-type]


def test_glibc_detection_agrees_with_the_c_library() -> None:
    # On glibc the version call exists; _glibc() must find it exactly there.
    try:
        has = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    except OSError:
        has = False
    assert (_glibc() is not None) == has


def test_the_switch_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"reuse_freed_memory must be True or False, got 'no'"):
        SimBackend(2, reuse_freed_memory="no")  # type: ignore[arg-type]
