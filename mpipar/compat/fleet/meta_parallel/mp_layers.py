"""Paddle fleet's tensor-parallel layers, written with manual collectives (Megatron's way).

Each member of the model-parallel group holds one slice of a weight and computes on
per-rank tensors; the collectives of ``mp_ops`` join the slices:

* ``ColumnParallelLinear``: weight (in, out) split by columns; the input enters through
  ``c_identity`` (its gradient is summed over the group); ``gather_output`` all-gathers the
  output columns, otherwise they stay split for a ``RowParallelLinear``.
* ``RowParallelLinear``: weight split by rows; the input arrives split on its last dim
  (``input_is_parallel``) or is sliced by ``c_split``; the partial products are summed by
  ``mp_allreduce`` before the (replicated) bias.
* ``VocabParallelEmbedding``: the table split by rows (vocabulary ranges); ids outside this
  member's range look up zeros, and ``mp_allreduce`` sums the one hit.
* ``ParallelCrossEntropy``: softmax cross entropy on logits split by vocabulary, without ever
  gathering them: the max, the sum of exponentials and the target logit are all-reduced.

Weights are the slices of the weight the dense layer would create: the same initializer draw
on the global shape, each member generating only its own box, so any mp degree starts from
one device's values. Split weights carry ``is_distributed = True`` (Paddle's mark; gradient
clipping sums their squares over the group).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpipar import random as mrandom
from mpipar.compat.collective import Group, ReduceOp, all_reduce
from mpipar.compat.fleet.base import hcg_or_none
from mpipar.compat.fleet.meta_parallel.mp_ops import c_concat, c_identity, c_split, mp_allreduce
from mpipar.nn import functional as F
from mpipar.nn.layer import Layer, ParamAttr, lazy_parameter, parameter_initializer
from mpipar.ops.manipulation import unsqueeze
from mpipar.ops.math import add, as_tensor, cast, exp, log, multiply, subtract, sum_
from mpipar.tensor import Parameter, Tensor


def _mp_group(mp_group: Group | None, layer: str) -> Group:
    if mp_group is not None:
        if not isinstance(mp_group, Group):
            raise TypeError(f"{layer}: mp_group must be a Group (dist.new_group), got {type(mp_group).__name__}")
        return mp_group
    hcg = hcg_or_none()
    if hcg is None:
        raise ValueError(
            f"{layer}: no model-parallel group; call fleet.init(is_collective=True, strategy=...) first "
            "(or pass mp_group=)"
        )
    return hcg.get_model_parallel_group()


def _split_size(layer: str, what: str, size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(
            f"{layer}: {what} = {size} does not split evenly over the model-parallel group of {parts} ranks "
            f"(mp_degree={parts}); make {what} a multiple of {parts}"
        )
    return size // parts


def split_parameter(
    layer: Layer, shape: list[int], axis: int | None, index: int, parts: int, attr: Any = None, is_bias: bool = False
) -> Parameter:
    """Slice ``index`` of ``parts`` along ``axis`` of the parameter ``layer.create_parameter(shape)``
    would make (``axis=None``: the whole parameter): the same random draw, only this slice's box."""
    attr = attr if isinstance(attr, ParamAttr) else ParamAttr()
    dtype = layer._dtype
    whole = parameter_initializer(attr, is_bias).box_init(mrandom.next_key(), dtype)
    local = list(shape)
    offset = [0] * len(shape)
    if axis is not None:
        local[axis] = shape[axis] // parts
        offset[axis] = index * local[axis]
    full_shape = tuple(shape)

    def box_init(_shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> Any:
        return whole(full_shape, tuple((lo + o, hi + o) for (lo, hi), o in zip(box, offset, strict=True)))

    p = lazy_parameter(local, dtype, box_init, attr)
    p.is_distributed = axis is not None and parts > 1
    p.split_axis = axis
    return p


class ColumnParallelLinear(Layer):
    """``y = x @ W + b`` with W's output columns split over the model-parallel group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight_attr: Any = None,
        has_bias: bool | None = None,
        gather_output: bool = True,
        fuse_matmul_bias: bool = False,
        mp_group: Group | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.group = _mp_group(mp_group, "ColumnParallelLinear")
        n, me = self.group.nranks, self.group.rank
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.output_size_per_partition = _split_size("ColumnParallelLinear", "out_features", out_features, n)
        self.weight = split_parameter(self, [in_features, out_features], 1, me, n, weight_attr)
        self.bias = split_parameter(self, [out_features], 0, me, n, is_bias=True) if has_bias is not False else None

    def forward(self, x: Tensor) -> Tensor:
        x = c_identity(as_tensor(x), self.group)
        out = F.linear(x, self.weight, self.bias)  # (..., out / mp)
        return c_concat(out, self.group) if self.gather_output else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mp={self.group.nranks}"


class RowParallelLinear(Layer):
    """``y = x @ W + b`` with W's input rows split over the model-parallel group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight_attr: Any = None,
        has_bias: bool = True,
        input_is_parallel: bool = False,
        fuse_matmul_bias: bool = False,
        mp_group: Group | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.group = _mp_group(mp_group, "RowParallelLinear")
        n, me = self.group.nranks, self.group.rank
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self.input_size_per_partition = _split_size("RowParallelLinear", "in_features", in_features, n)
        self.weight = split_parameter(self, [in_features, out_features], 0, me, n, weight_attr)
        self.bias = split_parameter(self, [out_features], None, me, n, is_bias=True) if has_bias else None

    def forward(self, x: Tensor) -> Tensor:
        x = as_tensor(x)
        if not self.input_is_parallel:
            x = c_split(x, self.group)  # (..., in / mp)
        out = mp_allreduce(F.linear(x, self.weight), self.group)  # partial sums over the rows, summed
        return add(out, self.bias) if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mp={self.group.nranks}"


class VocabParallelEmbedding(Layer):
    """An embedding table whose rows (vocabulary ids) are split over the model-parallel group."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        weight_attr: Any = None,
        mp_group: Group | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.group = _mp_group(mp_group, "VocabParallelEmbedding")
        n, me = self.group.nranks, self.group.rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = _split_size("VocabParallelEmbedding", "num_embeddings", num_embeddings, n)
        self.vocab_start_index, self.vocab_end_index = me * per, (me + 1) * per
        self.weight = split_parameter(self, [num_embeddings, embedding_dim], 0, me, n, weight_attr)

    def forward(self, x: Any) -> Tensor:
        ids = np.asarray(as_tensor(x).numpy())
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"VocabParallelEmbedding: ids must be integers, got {ids.dtype}")
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bad.any():
            raise ValueError(
                f"VocabParallelEmbedding: id {int(ids[bad].flat[0])} is outside the vocabulary of {self.num_embeddings}"
            )
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = np.where(outside, 0, ids - self.vocab_start_index)
        out = F.embedding(Tensor(local_ids), self.weight)  # (..., embedding_dim)
        if outside.any():
            keep = (~outside).astype(out.dtype)[..., None]
            out = multiply(out, Tensor(keep))  # ids of other members' ranges contribute zeros
        return mp_allreduce(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mp={self.group.nranks}"


class ParallelCrossEntropy(Layer):
    """Softmax cross entropy of logits split by vocabulary over the model-parallel group.

    ``forward(input, label)``: ``input`` (..., vocab / mp) is this member's slice of the
    logits, ``label`` (..., 1) or (...) global class ids; returns the loss per row, (..., 1),
    the same on every member. Rows whose label is ``ignore_index`` get loss 0.
    """

    def __init__(self, mp_group: Group | None = None, name: str | None = None, ignore_index: int = -100) -> None:
        super().__init__()
        self.group = _mp_group(mp_group, "ParallelCrossEntropy")
        self.ignore_index = int(ignore_index)

    def forward(self, input: Tensor, label: Any) -> Tensor:
        logits = as_tensor(input)
        labels = np.asarray(as_tensor(label).numpy())
        if labels.ndim == logits.ndim:
            if labels.shape[-1] != 1:
                raise ValueError(
                    f"ParallelCrossEntropy: label shape {list(labels.shape)} must end in 1 or drop that dim"
                )
            labels = labels[..., 0]
        if labels.shape != tuple(logits.shape[:-1]):
            raise ValueError(
                f"ParallelCrossEntropy: label shape {list(labels.shape)} does not match logits {list(logits.shape)} "
                "without their last (vocabulary) dim"
            )
        per = int(logits.shape[-1])
        start = self.group.rank * per
        vocab = per * self.group.nranks
        valid = labels != self.ignore_index
        if ((labels[valid] < 0) | (labels[valid] >= vocab)).any():
            raise ValueError(
                f"ParallelCrossEntropy: a label is outside the vocabulary of {vocab} (ignore_index={self.ignore_index})"
            )
        # The row max, over the whole vocabulary: only a shift for stability, so no gradient.
        row_max = Tensor(np.max(logits.numpy(), axis=-1, keepdims=True))
        all_reduce(row_max, op=ReduceOp.MAX, group=self.group)
        shifted = subtract(logits, row_max)  # (..., vocab / mp)
        total = mp_allreduce(sum_(exp(shifted), axis=-1), self.group)  # (...): sum of exp over the vocabulary
        mine = valid & (labels >= start) & (labels < start + per)
        onehot = np.zeros(tuple(logits.shape), dtype=logits.dtype)
        rows = np.nonzero(mine)
        onehot[(*rows, labels[rows] - start)] = 1
        target = mp_allreduce(sum_(multiply(shifted, Tensor(onehot)), axis=-1), self.group)  # (...)
        loss = subtract(log(total), target)
        if not valid.all():
            loss = multiply(loss, cast(Tensor(valid), loss.dtype))
        return unsqueeze(loss, -1)


__all__ = [
    "ColumnParallelLinear",
    "ParallelCrossEntropy",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "split_parameter",
]
