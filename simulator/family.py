"""Transformer shapes of the GPT and Llama families, counted in closed form.

    shape = preset("llama3-405b")                  # or ModelShape(layers=..., hidden=..., ...)
    shape.parameters                               # 405,853,388,800
    shape.model_flops_per_token                    # forward + backward, no recompute
    stage_layer_counts(126, 16)                    # [7, 8, ..., 8, 7]: lighter first and last stages

A ``ModelShape`` is one decoder-only transformer: ``layers`` blocks of attention and MLP between
an embedding and an output layer. The knobs that separate the families:

* ``kv_heads``: grouped-query attention (Ainslie et al. 2023): ``heads`` query heads share
  ``kv_heads`` key/value heads, so k and v are ``hidden * kv_heads / heads`` wide;
* ``ffn_hidden`` and ``mlp``: GELU's two matrices ``h x f`` and ``f x h`` (``f = 4h`` when not
  given), or SwiGLU's three (gate and up ``h x f``, down ``f x h``);
* ``norm``: ``layernorm`` shapes are GPT's (biases on every linear layer, LayerNorm's scale and
  shift, learned positions, dropout 0.1 as Megatron assumes); ``rmsnorm`` shapes are Llama's
  (no biases, a scale per norm, rotary positions without parameters, no dropout);
* ``untied``: the output layer has its own ``vocab x hidden`` matrix (Llama 3) or reuses the
  embedding's (GPT-3, Megatron's default);
* ``attention``: ``plain`` keeps the ``s x s`` scores for backward (Megatron as Narayanan et al.
  2021 and Korthikanti et al. 2022 ran it); ``fused`` is FlashAttention (Dao 2022): causal
  blocks only, scores never stored, recomputed in backward.

Model FLOPs follow Narayanan et al. 2021, Eq. 3 (the convention MFU is quoted in, also that of
torchtitan, which trained Llama 3): per token, forward ``2`` FLOPs per weight of every layer's
matrices and the output layer, plus ``4 s h`` per layer for the attention scores and their
weighted sum over the whole (non-causal) ``s x s`` matrix; backward twice the forward. What the
devices really execute under each attention and recompute is in ``simulator.family_cost``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from mpipar.pipeline.stages import stage_layer_counts, stage_of_layers

__all__ = [
    "ATTENTIONS",
    "MLPS",
    "NORMS",
    "PRESETS",
    "ModelShape",
    "divisors",
    "preset",
    "stage_layer_counts",
    "stage_of_layers",
]

MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
ATTENTIONS = ("plain", "fused")


@dataclass(frozen=True)
class ModelShape:
    """One transformer of the GPT/Llama family (module docstring); ``micro_batch_size`` sequences
    per micro-batch per data-parallel replica."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 50257
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None``: as many as ``heads``."""
    ffn_hidden: int | None = None
    """The MLP's inner width; ``None``: ``4 * hidden``."""
    mlp: str = "gelu"
    norm: str = "layernorm"
    untied: bool = False
    attention: str = "plain"
    micro_batch_size: int = 1
    dropout: float | None = None
    """``None``: 0.1 for LayerNorm (GPT) shapes, 0 for RMSNorm (Llama) shapes."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch_size"):
            _positive(name, getattr(self, name))
        for name in ("kv_heads", "ffn_hidden"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name, allowed in (("mlp", MLPS), ("norm", NORMS), ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelShape {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv:
            raise ValueError(f"ModelShape heads ({self.heads}) must be divisible by kv_heads ({self.kv})")
        if not isinstance(self.untied, bool):
            raise ValueError(f"ModelShape untied must be a bool, got {self.untied!r}")
        if self.dropout is None:
            object.__setattr__(self, "dropout", 0.1 if self.norm == "layernorm" else 0.0)
        if not isinstance(self.dropout, float | int) or not 0 <= self.dropout < 1:
            raise ValueError(f"ModelShape dropout must be in [0, 1), got {self.dropout!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def dropout_rate(self) -> float:
        """``dropout`` resolved (``__post_init__`` sets it; never ``None`` after)."""
        return float(self.dropout or 0.0)

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): ``kv_heads`` heads of ``head_dim``."""
        return self.kv * self.head_dim

    @property
    def gpt_style(self) -> bool:
        """LayerNorm shapes carry GPT's biases and learned positions (module docstring)."""
        return self.norm == "layernorm"

    @property
    def layer_matrix_weights(self) -> int:
        """Weights in one block's matrices: q and o ``h x h``, k and v ``h x kv_dim``, the MLP's."""
        h, f = self.hidden, self.ffn
        return 2 * h * h + 2 * h * self.kv_dim + (3 if self.mlp == "swiglu" else 2) * h * f

    @property
    def layer_parameters(self) -> int:
        """One block: its matrices, their biases (GPT) and its two norms' scales (and shifts)."""
        h, f = self.hidden, self.ffn
        n = self.layer_matrix_weights + 2 * (2 * h if self.norm == "layernorm" else h)
        if self.gpt_style:
            n += h + 2 * self.kv_dim + h  # q, k, v, o biases
            n += (2 * f if self.mlp == "swiglu" else f) + h  # MLP biases
        return n

    @property
    def embedding_parameters(self) -> int:
        """Token embedding (and learned positions for GPT shapes)."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.gpt_style else 0)

    @property
    def output_parameters(self) -> int:
        """The final norm and, when untied, the output layer's matrix (and its bias on GPT shapes)."""
        h = self.hidden
        n = 2 * h if self.norm == "layernorm" else h
        if self.untied:
            n += self.vocab * h + (self.vocab if self.gpt_style else 0)
        return n

    @property
    def parameters(self) -> int:
        return self.layers * self.layer_parameters + self.embedding_parameters + self.output_parameters

    @property
    def model_flops_per_token(self) -> float:
        """Forward and backward, no recompute (module docstring: Narayanan et al. 2021, Eq. 3)."""
        h, s = self.hidden, self.seq
        forward = self.layers * (2 * self.layer_matrix_weights + 4 * s * h) + 2 * self.vocab * h
        return 3.0 * forward

    def sized(self, micro_batch_size: int) -> ModelShape:
        return replace(self, micro_batch_size=micro_batch_size)

    def describe(self) -> str:
        attn = f"{self.heads} heads" + ("" if self.kv == self.heads else f" ({self.kv} key/value)")
        return (
            f"{self.parameters / 1e9:.2f}B parameters: {self.layers} layers, hidden {self.hidden}, {attn}, "
            f"{self.mlp} {self.ffn}, {self.norm}, {'untied' if self.untied else 'tied'} embeddings, "
            f"{self.attention} attention, seq {self.seq}, vocab {self.vocab}"
        )


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelShape {name} must be a positive int, got {value!r}")


_LLAMA3 = {"vocab": 128256, "seq": 8192, "mlp": "swiglu", "norm": "rmsnorm", "untied": True, "attention": "fused"}
PRESETS: dict[str, ModelShape] = {
    # Brown et al. 2020, Table 2.1 (GPT-3 175B): tied embeddings, 2048 tokens, GPT-2's vocabulary.
    "gpt3-175b": ModelShape(96, 12288, 96, 2048, 50257),
    # Llama 3 model cards and "The Llama 3 Herd of Models" Table 3: 8 key/value heads, SwiGLU,
    # vocabulary 128,256, 8k pre-training context.
    "llama3-8b": ModelShape(32, 4096, 32, kv_heads=8, ffn_hidden=14336, **_LLAMA3),  # type: ignore[arg-type]
    "llama3-70b": ModelShape(80, 8192, 64, kv_heads=8, ffn_hidden=28672, **_LLAMA3),  # type: ignore[arg-type]
    "llama3-405b": ModelShape(126, 16384, 128, kv_heads=8, ffn_hidden=53248, **_LLAMA3),  # type: ignore[arg-type]
}


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"--model: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


SHAPE_FIELDS = tuple(f.name for f in fields(ModelShape))


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
