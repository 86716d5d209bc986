"""Paddle's ``paddle.metric``: ``accuracy`` (one batch) and ``Accuracy`` (accumulated over batches).

    acc_top1 = paddle.metric.accuracy(input=out, label=label, k=1)
    m = paddle.metric.Accuracy(topk=(1, 5))
    m.update(m.compute(out, label)); m.accumulate()     # [top-1, top-5] so far

``accuracy`` is the ``accuracy`` op of ``mpipar.nn.functional`` (dense or distributed inputs).
``Accuracy`` is bookkeeping across batches: it reads the values (``full_tensor`` for a
distributed tensor, so under MPI every rank takes part, as for ``float(loss)``) and counts with
NumPy.
A sample counts as correct for top-k when its label is among the k highest scores; ties go to
the lower class index, as a stable sort orders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar.nn import functional
from mpipar.tensor import Tensor


def _values(x: Any, what: str) -> np.ndarray:
    if isinstance(x, Tensor):
        return np.asarray(x.full_tensor())
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"paddle.metric: {what} must be a Tensor or an array, got {type(x).__name__}") from exc


def _labels(label: Any, n: int) -> np.ndarray:
    lab = _values(label, "label")
    if lab.ndim == 2 and lab.shape[1] == 1:
        lab = lab[:, 0]
    if lab.ndim != 1 or lab.shape[0] != n or not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(
            f"paddle.metric: label must be integer class ids of shape [{n}] or [{n}, 1], got {lab.dtype}{list(lab.shape)}"
        )
    return lab


def _topk_correct(pred: np.ndarray, lab: np.ndarray, maxk: int) -> np.ndarray:
    """[N, maxk] 0/1: whether the j-th best class of sample i is its label."""
    if pred.ndim != 2:
        raise ValueError(f"paddle.metric: input must be scores of shape [N, classes], got {list(pred.shape)}")
    if not 1 <= maxk <= pred.shape[1]:
        raise ValueError(f"paddle.metric: k = {maxk} is outside 1..{pred.shape[1]} (the number of classes)")
    order = np.argsort(-pred, axis=1, kind="stable")[:, :maxk]
    return (order == lab[:, None]).astype(np.float32)


def accuracy(input: Any, label: Any, k: int = 1, correct: Any = None, total: Any = None, name: Any = None) -> Tensor:
    """Fraction of the batch whose label is among the top ``k`` scores: ``paddle.nn.functional``'s
    ``accuracy`` op, so a distributed batch is reduced by its rule (no gather of the scores)."""
    if correct is not None or total is not None:
        raise ValueError("paddle.metric.accuracy: correct= and total= (static-graph outputs) are not supported")
    classes = int(input.shape[-1]) if getattr(input, "shape", None) else 0
    if not 1 <= int(k) <= classes:
        raise ValueError(f"paddle.metric: k = {k} is outside 1..{classes} (the number of classes)")
    return functional.accuracy(input, label, k=int(k))


class Accuracy:
    """Top-k accuracies accumulated over batches: ``compute`` -> ``update`` -> ``accumulate``."""

    def __init__(self, topk: int | Sequence[int] = (1,), name: str | None = None) -> None:
        self.topk = (int(topk),) if isinstance(topk, int) else tuple(int(k) for k in topk)
        if not self.topk or any(k < 1 for k in self.topk):
            raise ValueError(f"paddle.metric.Accuracy: topk must be positive integers, got {topk!r}")
        self.maxk = max(self.topk)
        self._name = [name or f"acc_top{k}" for k in self.topk] if name is None or isinstance(name, str) else name
        self.reset()

    def compute(self, pred: Any, label: Any, *args: Any) -> Tensor:
        """The [N, maxk] correctness matrix of one batch (what ``update`` takes)."""
        p = _values(pred, "pred")
        return Tensor(_topk_correct(p, _labels(label, p.shape[0]), self.maxk))

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
