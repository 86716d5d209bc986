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
    """The module (numpy or cupy) that owns ``array``. CuPy's arrays are asked first: the CI
    stand-in for CuPy (``tests/nccl_standin``) makes its "device" arrays a NumPy subclass, and
    they must take CuPy's paths as real device arrays do."""
    if type(array).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    return np


def to_numpy(array: Any) -> np.ndarray:
    """A host NumPy array for ``array`` (a device copy for CuPy arrays)."""
    if type(array) is np.ndarray:
        return array
    get = getattr(array, "get", None)
    return np.asarray(get() if callable(get) else array)


def extreme(x: Any, op: str, axis: Any, keepdims: bool, initial: Any) -> Any:
    """``max``/``min`` (``op``) of ``x`` over ``axis`` with ``initial`` as the identity, on the
    array's own module: an empty shard (more ranks than elements) gives ``initial``. CuPy's
    ``max``/``min`` take no ``initial``; there the empty case is built by hand (any non-empty
    reduction already includes its identity, so it is the plain reduction)."""
    xp = array_module(x)
    fn = xp.max if op == "max" else xp.min
    if xp is np:
        return fn(x, axis=axis, keepdims=keepdims, initial=initial)
    if x.size:
        return fn(x, axis=axis, keepdims=keepdims)
    shape = np.max(np.empty(x.shape, dtype=np.float32), axis=axis, keepdims=keepdims, initial=0.0).shape
    return xp.full(shape, initial, dtype=x.dtype)
