"""Rules of the neural-network ops: softmax, layer_norm, embedding, cross entropy, accuracy.

* softmax / log_softmax: the softmax axis must stay whole (its normalisation spans it).
* layer_norm: the normalised dims must stay whole; batch dims may be split (sequence
  parallel), which makes the weight and bias gradients Partial(sum).
* embedding: ids "ab", table "vh" -> "abh". Splitting the vocabulary v is a contraction
  (one-hot(ids) @ table): ranks look up the ids in their row range and the output is
  Partial(sum) -- the vocabulary-parallel embedding. Splitting h shards the output.
* cross_entropy_with_softmax: the class axis stays whole; batch dims may be split.
"""

from __future__ import annotations

from mpipar.spec import DistSpec
from mpipar.spmd.einsum import EinsumSpec
from mpipar.spmd.registry import register_rule
from mpipar.spmd.rules.common import LOWER, norm_axis


@register_rule("softmax")
def softmax_rule(specs: list[DistSpec], axis: int = -1, **_: object) -> EinsumSpec:
    (x,) = specs
    letters = LOWER[: x.ndim]
    a = norm_axis(axis, x.ndim, "softmax")
    return EinsumSpec((letters,), (letters,), no_shard=frozenset(letters[a]) if x.ndim else frozenset(), op="softmax")


@register_rule("log_softmax")
def log_softmax_rule(specs: list[DistSpec], axis: int = -1, **_: object) -> EinsumSpec:
    es = softmax_rule(specs, axis)
    return EinsumSpec(es.inputs, es.outputs, no_shard=es.no_shard, op="log_softmax")


@register_rule("softmax_grad")
def softmax_grad_rule(specs: list[DistSpec], axis: int = -1, **_: object) -> EinsumSpec:
    y = specs[0]
    letters = LOWER[: y.ndim]
    a = norm_axis(axis, y.ndim, "softmax_grad")
    # dx = y * (dy - sum(dy * y)): linear in dy.
    return EinsumSpec((letters, letters), (letters,), (1,), True, no_shard=frozenset(letters[a]), op="softmax_grad")


def norm_letters(x: DistSpec, begin_norm_axis: int, op: str = "layer_norm") -> tuple[str, str, str]:
    """All letters of a normalised tensor, its batch letters and its normalised letters."""
    b = norm_axis(begin_norm_axis, x.ndim, op, "begin_norm_axis")
    letters = LOWER[: x.ndim]
    return letters, letters[:b], letters[b:]


@register_rule("layer_norm")
def layer_norm_rule(specs: list[DistSpec], begin_norm_axis: int = -1, **_: object) -> EinsumSpec:
    x = specs[0]
    letters, batch, normed = norm_letters(x, begin_norm_axis)
    ins = (letters, normed, normed)[: len(specs)]
    return EinsumSpec(ins, (letters, batch, batch), no_shard=frozenset(normed), op="layer_norm")


@register_rule("layer_norm_grad")
def layer_norm_grad_rule(specs: list[DistSpec], begin_norm_axis: int = -1, **_: object) -> EinsumSpec:
    # inputs: x, weight, mean, rstd, dy  ->  dx, dweight, dbias
    letters, batch, normed = norm_letters(specs[0], begin_norm_axis)
    return EinsumSpec(
        (letters, normed, batch, batch, letters),
        (letters, normed, normed),
        linear_in=(4,),
        no_shard=frozenset(normed),
        contraction="sum",
        op="layer_norm_grad",
    )


@register_rule("embedding")
def embedding_rule(specs: list[DistSpec], **_: object) -> EinsumSpec:
    ids, table = specs
    if table.ndim != 2:
        raise ValueError(f"embedding: the table must be 2-d (vocab, hidden), got {table}")
    letters = LOWER[: ids.ndim]
    return EinsumSpec(
        (letters, "vh"), (letters + "h",), linear_in=(1,), jointly=False, contraction="sum", op="embedding"
    )


@register_rule("embedding_grad")
def embedding_grad_rule(specs: list[DistSpec], num_embeddings: int = 0, **_: object) -> EinsumSpec:
    ids = specs[0]
    letters = LOWER[: ids.ndim]
    # dtable[v, h] = sum over positions with id v of dout[pos, h]: positions are contracted.
    return EinsumSpec(
        (letters, letters + "h"),
        ("vh",),
        linear_in=(1,),
        jointly=False,
        contraction="sum",
        sizes={"v": int(num_embeddings)},
        op="embedding_grad",
    )


def _ce_letters(logits: DistSpec, axis: int) -> tuple[str, str, str]:
    a = norm_axis(axis, logits.ndim, "cross_entropy_with_softmax")
    letters = LOWER[: logits.ndim]
    label = letters[:a] + "K" + letters[a + 1 :]
    return letters, label, letters[a]


@register_rule("cross_entropy_with_softmax")
def cross_entropy_rule(specs: list[DistSpec], axis: int = -1, **_: object) -> EinsumSpec:
    logits = specs[0]
    letters, label_l, cls = _ce_letters(logits, axis)
    # outputs: softmax (like logits), loss (like the label: size 1 on the class axis)
    return EinsumSpec(
        (letters, label_l), (letters, label_l), no_shard=frozenset({cls, "K"}), op="cross_entropy_with_softmax"
    )


@register_rule("cross_entropy_with_softmax_grad")
def cross_entropy_grad_rule(specs: list[DistSpec], axis: int = -1, **_: object) -> EinsumSpec:
    softmax = specs[1]
    letters, label_l, cls = _ce_letters(softmax, axis)
    return EinsumSpec(
        (label_l, letters, label_l),
        (letters,),
        linear_in=(2,),
        no_shard=frozenset({cls, "K"}),
        op="cross_entropy_with_softmax_grad",
    )


@register_rule("accuracy")
def accuracy_rule(specs: list[DistSpec], k: int = 1, **_: object) -> EinsumSpec:
    pred = specs[0]
    letters, label_l, cls = _ce_letters(pred, -1)
    # The fraction of rows whose label is in the top k: rows are contracted (Partial(sum)).
    return EinsumSpec((letters, label_l), ("",), no_shard=frozenset({cls, "K"}), contraction="sum", op="accuracy")
