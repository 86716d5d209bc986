"""The array namespace: NumPy, or CuPy where CUDA is usable. Never import cupy at module top.

``import cupy`` succeeds on machines without a GPU and fails only on first use, so the NCCL
backend is gated on ``cuda_usable()``, which actually asks the driver.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np


@lru_cache(maxsize=1)
def cuda_usable() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.is_available()) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # any import or driver failure means: no usable GPU
        return False


def array_module(array: Any) -> Any:
    """The module (numpy or cupy) that owns ``array``."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return np
    mod = type(array).__module__.split(".", 1)[0]
    if mod == "cupy":
        import cupy

        return cupy
    return np


def to_numpy(array: Any) -> np.ndarray:
    """A host NumPy array for ``array`` (a device copy for CuPy arrays)."""
    if isinstance(array, np.ndarray):
        return array
    get = getattr(array, "get", None)
    return np.asarray(get() if callable(get) else array)
