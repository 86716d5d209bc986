"""Keep freed memory mapped in the process that hosts every rank (glibc's malloc only).

The simulator holds all ranks' buffers in one process, so a data-parallel step on 8 virtual
ranks allocates eight weight-sized gradients where one device allocates one, and frees them
together once they are summed. glibc serves a 16 MB array from the heap only after one such
array was freed (its mmap threshold adapts upwards), and it hands the heap's top back to the
system whenever more than twice that threshold lies free there: the eight freed gradients
(128 MB) go back every step, and the next step faults their pages in afresh, each zeroed by
the kernel. Measured in ``benchmarks/dispatch_overhead.py``: about a tenth of the data-parallel MLP step on 8 ranks.
Serving arrays up to ``max_array_bytes`` from the heap from the start, and keeping up to
``keep_bytes`` of freed memory there, makes the next step reuse the same pages.

Only where memory comes from changes: no array's values, and so no result, can differ. The
price is that the process returns freed memory to the system later (at most ``keep_bytes``
above the live data stays mapped), as allocators with caches (PyTorch's, jemalloc) also do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (<malloc.h>)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses a larger threshold on 64-bit systems

_applied: list[tuple[int, int]] = []  # the settings made so far, in order


def _glibc() -> Any | None:
    """The C library when it is glibc (``mallopt``'s meaning is glibc's), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): leave malloc alone
        return None
    version.restype = ctypes.c_char_p
    return libc if version() else None


def keep_freed_memory(max_array_bytes: int = MMAP_THRESHOLD_MAX, keep_bytes: int = 1 << 30) -> bool:
    """Serve allocations up to ``max_array_bytes`` from the heap and keep up to ``keep_bytes`` of
    freed heap mapped, process-wide from now on. Returns whether it took effect (glibc only).
    Idempotent: a second call with the same values does nothing."""
    for name, value, high in (
        ("max_array_bytes", max_array_bytes, MMAP_THRESHOLD_MAX),
        ("keep_bytes", keep_bytes, 2**31 - 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= high:
            raise ValueError(f"keep_freed_memory: {name} must be an int in 1..{high}, got {value!r}")
    if (max_array_bytes, keep_bytes) in _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    # Both: with only the mmap threshold raised, freeing the arrays at the heap's top would hand
    # their pages back to the system (glibc trims above 128 KiB by default) just the same.
    ok = bool(libc.mallopt(M_TRIM_THRESHOLD, keep_bytes)) and bool(libc.mallopt(M_MMAP_THRESHOLD, max_array_bytes))
    if ok:
        _applied.append((max_array_bytes, keep_bytes))
    return ok
