"""``dist.nn.functional``: Paddle's functional neural-network API on dense and distributed tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar import random as mrandom
from mpipar._modes import Mode, execution_mode
from mpipar.ops.attention import CP_COMM, ring_attention, ring_axis
from mpipar.ops.dispatch import apply
from mpipar.ops.linalg import matmul
from mpipar.ops.manipulation import split, unsqueeze
from mpipar.ops.math import add, as_tensor, cast, divide, mean, multiply, not_equal, sum_
from mpipar.tensor import Tensor


def relu(x: Any, name: str | None = None) -> Tensor:
    return apply("relu", [as_tensor(x)])


def gelu(x: Any, approximate: bool = False, name: str | None = None) -> Tensor:
    return apply("gelu", [as_tensor(x)], {"approximate": bool(approximate)})


def softmax(x: Any, axis: int = -1, dtype: Any = None, name: str | None = None) -> Tensor:
    t = as_tensor(x)
    if dtype is not None:
        t = cast(t, dtype)
    return apply("softmax", [t], {"axis": int(axis)})


def log_softmax(x: Any, axis: int = -1, dtype: Any = None, name: str | None = None) -> Tensor:
    t = as_tensor(x)
    if dtype is not None:
        t = cast(t, dtype)
    return apply("log_softmax", [t], {"axis": int(axis)})


def layer_norm(
    x: Any,
    normalized_shape: int | Sequence[int],
    weight: Any = None,
    bias: Any = None,
    epsilon: float = 1e-5,
    name: str | None = None,
) -> Tensor:
    """Normalise over the trailing ``normalized_shape`` dims (Paddle's signature)."""
    t = as_tensor(x)
    norm = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if list(t.shape[t.ndim - len(norm) :]) != norm:
        raise ValueError(f"layer_norm: normalized_shape {norm} does not match the trailing dims of {t._label()}")
    begin = t.ndim - len(norm)
    w = as_tensor(weight, t) if weight is not None else Tensor(np.ones(norm, dtype=t.dtype))
    b = as_tensor(bias, t) if bias is not None else Tensor(np.zeros(norm, dtype=t.dtype))
    y, _mean, _rstd = apply("layer_norm", [t, w, b], {"begin_norm_axis": begin, "epsilon": float(epsilon)})
    return y


def embedding(
    x: Any, weight: Tensor, padding_idx: int | None = None, sparse: bool = False, name: str | None = None
) -> Tensor:
    ids = as_tensor(x)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"embedding ids must be integers, got {ids.dtype} ({ids._label()})")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return apply("embedding", [ids, weight], {"padding_idx": padding_idx})


def linear(x: Any, weight: Tensor, bias: Tensor | None = None, name: str | None = None) -> Tensor:
    """``x @ weight + bias`` with Paddle's (in_features, out_features) weight."""
    out = matmul(x, weight)
    return add(out, bias) if bias is not None else out


def _label_like(label: Tensor, logits: Tensor, axis: int) -> Tensor:
    if label.ndim == logits.ndim - 1:
        return unsqueeze(label, axis % logits.ndim)
    return label


def softmax_with_cross_entropy(
    logits: Any,
    label: Any,
    soft_label: bool = False,
    ignore_index: int = -100,
    numeric_stable_mode: bool = True,
    return_softmax: bool = False,
    axis: int = -1,
) -> Any:
    if soft_label:
        raise ValueError("softmax_with_cross_entropy: soft labels are not supported; pass class indices")
    lg = as_tensor(logits)
    lb = _label_like(as_tensor(label), lg, axis)
    sm, loss = apply("cross_entropy_with_softmax", [lg, lb], {"axis": int(axis), "ignore_index": int(ignore_index)})
    return (loss, sm) if return_softmax else loss


def cross_entropy(
    input: Any,
    label: Any,
    weight: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    soft_label: bool = False,
    axis: int = -1,
    use_softmax: bool = True,
    name: str | None = None,
) -> Tensor:
    """Paddle's ``cross_entropy`` on logits and class-index labels; ``reduction`` mean/sum/none."""
    if weight is not None:
        raise ValueError("cross_entropy: class weights are not supported")
    if not use_softmax:
        raise ValueError("cross_entropy: use_softmax=False is not supported; pass logits")
    loss = softmax_with_cross_entropy(input, label, soft_label, ignore_index, axis=axis)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return sum_(loss)
    if reduction != "mean":
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if ignore_index < 0:  # class indices are >= 0: no label is ignored, every row counts
        return mean(loss)
    lb = _label_like(as_tensor(label), as_tensor(input), axis)
    valid = sum_(cast(not_equal(lb, ignore_index), loss.dtype))
    return divide(sum_(loss), valid)


def dropout(
    x: Any,
    p: float = 0.5,
    axis: Any = None,
    training: bool = True,
    mode: str = "upscale_in_train",
    name: str | None = None,
) -> Tensor:
    """Zero elements with probability ``p`` and scale the rest by 1/(1-p) (Paddle's default mode).

    The mask depends only on the global element index and the draw number, so it is the
    same on every mesh and in every launch mode.
    """
    t = as_tensor(x)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if axis is not None:
        raise ValueError("dropout: the axis argument is not supported")
    if mode != "upscale_in_train":
        raise ValueError(f"dropout: only mode 'upscale_in_train' is supported, got {mode!r}")
    if not training or p == 0.0:
        return t
    if p == 1.0:
        return multiply(t, 0.0)
    out, _mask = apply("dropout", [t], {"p": float(p), "key": mrandom.next_key()})
    return out


def accuracy(
    input: Any, label: Any, k: int = 1, correct: Any = None, total: Any = None, name: str | None = None
) -> Tensor:
    """Top-k accuracy (``paddle.metric.accuracy``): the fraction of rows whose label is in the top k."""
    pred = as_tensor(input)
    classes = pred.shape[-1] if pred.ndim else 0
    if not 1 <= int(k) <= classes:
        raise ValueError(f"accuracy: k = {k} is outside 1..{classes} (the number of classes of input {pred._label()})")
    lb = _label_like(as_tensor(label), pred, -1)
    return apply("accuracy", [pred, lb], {"k": int(k)})


def silu(x: Any, name: str | None = None) -> Tensor:
    """``x * sigmoid(x)``."""
    return apply("silu", [as_tensor(x)])


def swiglu(x: Any, y: Any = None, name: str | None = None) -> Tensor:
    """``silu(x) * y`` (Paddle's ``swiglu``); with ``y`` None, ``x``'s last dim is split in halves."""
    t = as_tensor(x)
    if y is None:
        n = t.shape[-1]
        if n % 2:
            raise ValueError(f"swiglu: without y the last dim of {t._label()} ({n}) must split in two equal halves")
        t, u = split(t, 2, axis=-1)
        return apply("swiglu", [t, u])
    return apply("swiglu", [t, as_tensor(y, t)])


def rms_norm(
    x: Any, normalized_shape: int | Sequence[int], weight: Any = None, epsilon: float = 1e-6, name: str | None = None
) -> Tensor:
    """``x / sqrt(mean(x^2) + epsilon) * weight`` over the trailing ``normalized_shape`` dims."""
    t = as_tensor(x)
    norm = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if list(t.shape[t.ndim - len(norm) :]) != norm:
        raise ValueError(f"rms_norm: normalized_shape {norm} does not match the trailing dims of {t._label()}")
    w = as_tensor(weight, t) if weight is not None else Tensor(np.ones(norm, dtype=t.dtype))
    y, _rstd = apply("rms_norm", [t, w], {"begin_norm_axis": t.ndim - len(norm), "epsilon": float(epsilon)})
    return y


def _positions(positions: Any, length: int, what: str) -> Tensor:
    if positions is None:
        return Tensor(np.arange(length, dtype=np.int64))
    p = as_tensor(positions)
    if p.ndim != 1 or p.shape[0] != length or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(
            f"{what}: position_ids must be {length} integers (one per sequence position), got {p._label()}"
        )
    return p


def fused_rotary_position_embedding(
    q: Any,
    k: Any = None,
    v: Any = None,
    sin: Any = None,
    cos: Any = None,
    position_ids: Any = None,
    use_neox_rotary_style: bool = True,
    time_major: bool = False,
    rotary_emb_base: float = 10000.0,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Rotary embedding of q, k (and v) of shape (B, S, H, D) at ``position_ids`` (S,) (default
    0..S-1), Paddle's signature; rotate-half style with base ``rotary_emb_base``. ``sin``/``cos``
    tables, the interleaved style and time-major inputs are not supported (a clear error)."""
    if sin is not None or cos is not None or not use_neox_rotary_style or time_major:
        raise ValueError(
            "fused_rotary_position_embedding: only computed angles (sin=cos=None), use_neox_rotary_style=True "
            "and time_major=False are supported"
        )
    out = [None if x is None else rotary_embedding(x, position_ids, rotary_emb_base) for x in (q, k, v)]
    return out[0], out[1], out[2]


def rotary_embedding(x: Any, position_ids: Any = None, theta: float = 10000.0) -> Tensor:
    """Rotary embedding of one (B, S, H, D) tensor at ``position_ids`` (S,) (default 0..S-1)."""
    t = as_tensor(x)
    if t.ndim != 4:
        raise ValueError(f"fused_rotary_position_embedding: {t._label()} must be (batch, seq, heads, head_dim)")
    pos = _positions(position_ids, t.shape[1], "fused_rotary_position_embedding")
    return apply("fused_rotary_position_embedding", [t, pos], {"theta": float(theta)})


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    training: bool = True,
    name: str | None = None,
    *,
    scale: float | None = None,
    positions: Any = None,
    block_size: int = 128,
    cp_comm: str = "allgather",
) -> Tensor:
    """Fused attention (Paddle's signature, (B, S, H, D) layout; key/value may have fewer heads).

    Computed in key blocks of ``block_size`` with an online softmax: no (S, S) tensor is kept,
    and backward recomputes the probabilities (``mpipar/ops/attention.py``). ``positions`` (S,)
    are the global positions of the held sequence for the causal mask (default 0..S-1), for
    sequences held in another order. ``attn_mask`` and dropout are not supported.

    ``cp_comm``: with the query sequence split on a mesh axis (context parallelism), how the
    other ranks' keys and values arrive: ``allgather`` (gathered before the kernel) or ``ring``
    (passed around the axis's ring, one point-to-point send per step, partial results merged
    by their log-sum-exps; ``ring_attention`` in ``mpipar/ops/attention.py``)."""
    if cp_comm not in CP_COMM:
        raise ValueError(f"scaled_dot_product_attention: cp_comm {cp_comm!r} is not one of {', '.join(CP_COMM)}")
    if attn_mask is not None or dropout_p:
        raise ValueError("scaled_dot_product_attention: attn_mask and dropout_p are not supported; use is_causal")
    if block_size < 1:
        raise ValueError(f"scaled_dot_product_attention: block_size must be >= 1, got {block_size}")
    q = as_tensor(query)
    k, v = as_tensor(key, q), as_tensor(value, q)
    ins = [q, k, v]
    if positions is not None:
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"scaled_dot_product_attention: positions need query and key of one length, got {q.shape[1]} and {k.shape[1]}"
            )
        p = _positions(positions, q.shape[1], "scaled_dot_product_attention")
        ins += [p, p]
    attrs = {"is_causal": bool(is_causal), "scale": scale, "block_size": int(block_size)}
    if cp_comm == "ring" and positions is None and execution_mode(ins) is not Mode.DENSE and ring_axis(q) is not None:
        return ring_attention(q, k, v, attrs)
    out, _lse = apply("scaled_dot_product_attention", ins, attrs)
    return out
