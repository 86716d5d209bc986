"""Paddle's ``paddle.metric``: ``accuracy`` (one batch, an op) and ``Accuracy`` (accumulated).

    acc_top1 = paddle.metric.accuracy(input=out, label=label, k=1)   # a tensor, in eager and static
    m = paddle.metric.Accuracy(topk=(1, 5))
    m.update(m.compute(out, label)); m.accumulate()                 # [top-1, top-5] so far

``accuracy`` is the ``accuracy`` op (``mpipar.nn.functional.accuracy``): it runs on
distributed tensors and is recorded into static programs like any op. ``Accuracy`` is
bookkeeping: it reads values (``numpy()``, a collective under MPI: every rank takes part).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar.nn.functional import accuracy
from mpipar.tensor import Tensor


def _values(x: Any, what: str) -> np.ndarray:
    return np.asarray(x.numpy()) if isinstance(x, Tensor) else np.asarray(x)


class Accuracy:
    """Top-k accuracies accumulated over batches: ``compute`` -> ``update`` -> ``accumulate``."""

    def __init__(self, topk: int | Sequence[int] = (1,), name: str | Sequence[str] | None = None) -> None:
        self.topk = (int(topk),) if isinstance(topk, int) else tuple(int(k) for k in topk)
        if not self.topk or any(k < 1 for k in self.topk):
            raise ValueError(f"paddle.metric.Accuracy: topk must be positive integers, got {topk!r}")
        self.maxk = max(self.topk)
        if name is None:
            self._name = [f"acc_top{k}" for k in self.topk]
        else:
            self._name = [name] if isinstance(name, str) else list(name)
        self.reset()

    def compute(self, pred: Any, label: Any, *args: Any) -> Tensor:
        """The [N, maxk] 0/1 matrix: is the j-th best class of sample i its label (ties: lower class first)."""
        p = _values(pred, "pred")
        lab = _values(label, "label")
        if lab.ndim == 2 and lab.shape[1] == 1:
            lab = lab[:, 0]
        if p.ndim != 2 or lab.shape != (p.shape[0],) or not np.issubdtype(lab.dtype, np.integer):
            raise ValueError(
                f"Accuracy.compute: pred must be [N, classes] scores and label N integer ids, got pred "
                f"{list(p.shape)} and label {lab.dtype}{list(lab.shape)}"
            )
        if self.maxk > p.shape[1]:
            raise ValueError(f"Accuracy: topk {self.maxk} exceeds the {p.shape[1]} classes")
        order = np.argsort(-p, axis=1, kind="stable")[:, : self.maxk]
        return Tensor((order == lab[:, None]).astype(np.float32))

    def update(self, correct: Any, *args: Any) -> float | list[float]:
        """Add a batch's ``compute`` result; returns that batch's accuracies."""
        hits = _values(correct, "correct")
        if hits.ndim != 2 or hits.shape[1] < self.maxk:
            raise ValueError(f"Accuracy.update: expected compute()'s [N, {self.maxk}] matrix, got {list(hits.shape)}")
        n = hits.shape[0]
        batch = []
        for i, k in enumerate(self.topk):
            c = float(hits[:, :k].sum())
            self.total[i] += c
            self.count[i] += n
            batch.append(c / n if n else 0.0)
        return batch[0] if len(batch) == 1 else batch

    def reset(self) -> None:
        self.total = [0.0] * len(self.topk)
        self.count = [0] * len(self.topk)

    def accumulate(self) -> float | list[float]:
        res = [t / c if c else 0.0 for t, c in zip(self.total, self.count, strict=True)]
        return res[0] if len(res) == 1 else res

    def name(self) -> list[str]:
        return list(self._name)


__all__ = ["Accuracy", "accuracy"]
