"""Tensors the ops and gradients make from nothing or from Python values: the layer below them.

``as_tensor`` (Python numbers take the dtype of the tensor they meet), and the ones and zeros
that seed a backward pass or fill a missing gradient. Only ``tensor.py`` below: every op module
may use these without importing another op module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar import _capture_hooks
from mpipar._modes import Mode, execution_mode
from mpipar.backend import current_backend
from mpipar.tensor import Tensor


def as_tensor(x: Any, like: Tensor | None = None) -> Tensor:
    """``x`` as a Tensor; Python numbers take ``like``'s dtype when that keeps them exact."""
    if isinstance(x, Tensor):
        return x
    if (
        like is not None
        and isinstance(x, (int, float, bool, np.number))
        and (
            np.issubdtype(like.dtype, np.floating)
            or (isinstance(x, (int, bool)) and np.issubdtype(like.dtype, np.integer))
        )
    ):
        return Tensor(np.asarray(x, dtype=like.dtype))
    return Tensor(np.asarray(x))


def _pair(x: Any, y: Any) -> tuple[Tensor, Tensor]:
    xt = x if isinstance(x, Tensor) else None
    yt = y if isinstance(y, Tensor) else None
    if xt is not None and yt is not None:  # the usual case: nothing to convert
        return xt, yt
    return as_tensor(x, yt), as_tensor(y, xt)


def ones_like_global(t: Tensor) -> Tensor:
    """Ones with ``t``'s layout (a Partial read as Replicate): the seed of a backward pass."""
    if not t.is_dist and not t.is_abstract:
        return Tensor(np.ones(t.shape, dtype=t.dtype))
    backend = current_backend()
    mode = execution_mode([t], backend)
    spec = t._spec.without_partial() if t._spec is not None else None
    if mode is Mode.ABSTRACT:
        return Tensor.abstract(t.shape, t.dtype, spec)
    assert spec is not None
    if mode is Mode.DENSE:
        return Tensor._from_reference(t.spec, np.ones(t.shape, dtype=t.dtype))
    if (
        _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None
    ):  # a captured step: made on every run
        ranks = list(t._shards)
        made = tr.create(backend.xp.ones, [spec.local_shape(r) for r in ranks], t.dtype)
        return Tensor._from_shards(spec, dict(zip(ranks, made, strict=True)), t.dtype)
    return Tensor._from_shards(
        spec, {r: backend.xp.ones(spec.local_shape(r), dtype=t.dtype) for r in t._shards}, t.dtype
    )


def zeros_like_global(like: Tensor, shape: Sequence[int]) -> Tensor:
    """Zeros of ``shape`` in ``like``'s dtype (dense: it joins any layout as Replicate)."""
    if like.is_abstract:
        return Tensor.abstract(shape, like.dtype)
    return Tensor(np.zeros(tuple(shape), dtype=like.dtype))
