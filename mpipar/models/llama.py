"""Llama (Llama 3's architecture) written once, laid out by placements for any dp x cp x tp x pp mesh.

The blocks: RMSNorm, rotary positions (``fused_rotary_position_embedding``), grouped-query
attention (``num_key_value_heads`` key/value heads shared by groups of query heads), a SwiGLU
MLP of its own width (``intermediate_size``), and an untied output layer; no biases. Attention
is fused (``scaled_dot_product_attention``, blockwise, nothing s x s kept) or plain.

The layout is GPT's (``GPTParallel``, shared pieces from ``mpipar/models/gpt.py``): tensor
parallel q/k/v and gate/up column-parallel, o/down row-parallel, the embedding
vocabulary-parallel and the output layer column-parallel over the vocabulary; key/value
projections split over tp only when tp divides the key/value heads, else replicated (each rank
reads the heads its query heads use); sequence parallel outside the column/row pairs; context
parallel (the sequence on ``cp``, keys and values gathered in attention, split ``ZigzagShard`` for
causal balance); the pipeline by stage meshes.

``LLAMA3_CONFIGS`` holds the published shapes (Llama 3 8B, 70B, 405B; Meta's model cards and
the Llama 3 paper, Table 3); ``LLAMA_TEST_CONFIGS`` small ones. ``load_hf_llama`` reads weights
in the Hugging Face safetensors layout into any mesh. Run it with ``examples/llama.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

import mpipar as dist
from mpipar.mesh import ProcessMesh
from mpipar.models.gpt import (
    GPTParallel,
    bind_layers,
    causal_mask_buffer,
    check_attention,
    cp_comm_of,
    gather_sequence,
    gpt_loss,
    plain_attention,
    row_parallel_out,
    run_blocks,
)
from mpipar.nn import functional as F
from mpipar.nn.initializer import Normal
from mpipar.nn.layer import Layer, ParamAttr, default_dtype
from mpipar.nn.layers import Embedding, LayerList, Linear, RMSNorm
from mpipar.placement import Shard
from mpipar.tensor import Tensor

LlamaParallel = GPTParallel
"""The Llama's layout is the GPT's (same axes, same marks)."""

llama_loss = gpt_loss


@dataclass(frozen=True)
class LlamaConfig:
    """Hugging Face's ``LlamaConfig`` field names."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32
    """The sequence length trained on (``block_size`` of the GPT)."""
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    attention: str = "fused"
    initializer_range: float = 0.02
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_attention(self.attention, "Llama")
        h, nh, nkv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if nh < 1 or nkv < 1 or h % nh or nh % nkv or (h // nh) % 2:
            raise ValueError(
                f"Llama: hidden_size {h}, {nh} attention heads and {nkv} key/value heads: the heads must divide "
                "the hidden size into an even head_dim, and the key/value heads the attention heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameters counted from the shapes (embedding and output layer untied)."""
        h, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = h * h * 2 + 2 * h * self.num_key_value_heads * d  # q, o; k, v
        block = attn + 3 * h * f + 2 * h
        return 2 * v * h + self.num_hidden_layers * block + h


def _llama3(hidden: int, ffn: int, layers: int, heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        attention="fused",
    )


LLAMA3_CONFIGS: dict[str, LlamaConfig] = {
    "llama3-8b": _llama3(4096, 14336, 32, 32),
    "llama3-70b": _llama3(8192, 28672, 80, 64),
    "llama3-405b": _llama3(16384, 53248, 126, 128),
}
"""The published Llama 3 shapes (sequence 8192, as pre-trained before long-context training)."""

LLAMA_TEST_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    ),
    "small": LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64,
    ),
}  # fmt: skip


def llama_config(name: str, **overrides: object) -> LlamaConfig:
    """A named config (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``tiny``, ``small``)."""
    known = {**LLAMA3_CONFIGS, **LLAMA_TEST_CONFIGS}
    if name not in known:
        raise ValueError(f"unknown Llama config {name!r}; known: {', '.join(known)}")
    return replace(known[name], **overrides)  # type: ignore[arg-type]


def _normal(std: float) -> ParamAttr:
    return ParamAttr(initializer=Normal(0.0, std))


class LlamaAttention(Layer):
    causal_mask: Tensor
    """The additive mask (plain attention only), a buffer."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_head, self.n_kv, self.head_dim, self.theta = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
            cfg.rope_theta,
        )
        std = cfg.initializer_range
        self.q_proj = Linear(h, self.n_head * d, weight_attr=_normal(std), bias_attr=False)
        self.k_proj = Linear(h, self.n_kv * d, weight_attr=_normal(std), bias_attr=False)
        self.v_proj = Linear(h, self.n_kv * d, weight_attr=_normal(std), bias_attr=False)
        self.o_proj = Linear(
            self.n_head * d, h, weight_attr=_normal(std / math.sqrt(2 * cfg.num_hidden_layers)), bias_attr=False
        )
        self.fused = cfg.attention == "fused"
        if not self.fused:
            self.register_buffer(
                "causal_mask", causal_mask_buffer(cfg.max_position_embeddings, str(np.dtype(cfg.dtype)))
            )
        self.rope_positions: Tensor | None = None
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, cp_comm=cp_comm_of(self.par))
        b, t, h, d = q.shape
        hk = k.shape[2]
        qt = dist.transpose(q, [0, 2, 1, 3])  # (B, H, T, D)
        kt, vt = dist.transpose(k, [0, 2, 1, 3]), dist.transpose(v, [0, 2, 1, 3])  # (B, Hkv, T, D)
        if hk != h:  # each key/value head serves h/hk query heads: (B, Hkv, g, T, D) -> (B, H, T, D)
            kt = dist.reshape(dist.expand(dist.unsqueeze(kt, 2), [b, hk, h // hk, t, d]), [b, h, t, d])
            vt = dist.reshape(dist.expand(dist.unsqueeze(vt, 2), [b, hk, h // hk, t, d]), [b, h, t, d])
        return dist.transpose(plain_attention(qt, kt, vt, self.causal_mask), [0, 2, 1, 3])

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = dist.reshape(self.q_proj(x), [b, s, self.n_head, self.head_dim])  # (B, T, H, D)
        k = dist.reshape(self.k_proj(x), [b, s, self.n_kv, self.head_dim])  # (B, T, Hkv, D)
        v = dist.reshape(self.v_proj(x), [b, s, self.n_kv, self.head_dim])
        q = F.rotary_embedding(q, self.rope_positions, self.theta)
        k = F.rotary_embedding(k, self.rope_positions, self.theta)
        if self.par is not None and self.par.recompute == "selective":
            y = dist.recompute(self._core, q, k, v)
        else:
            y = self._core(q, k, v)
        y = dist.reshape(y, [b, s, self.n_head * self.head_dim])  # (B, T, C)
        return row_parallel_out(self, dist.matmul(y, self.o_proj.weight))  # row parallel: Partial(sum) over tp


class LlamaMLP(Layer):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        h, f, std = cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range
        self.gate_proj = Linear(h, f, weight_attr=_normal(std), bias_attr=False)
        self.up_proj = Linear(h, f, weight_attr=_normal(std), bias_attr=False)
        self.down_proj = Linear(f, h, weight_attr=_normal(std / math.sqrt(2 * cfg.num_hidden_layers)), bias_attr=False)
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.swiglu(self.gate_proj(x), self.up_proj(x))  # (B, T, F), split on tp
        return row_parallel_out(self, dist.matmul(hidden, self.down_proj.weight))


class LlamaDecoderLayer(Layer):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def forward(self, x: Tensor) -> Tensor:
        x = dist.add(x, self.self_attn(gather_sequence(self, self.input_layernorm(x))))
        return dist.add(x, self.mlp(gather_sequence(self, self.post_attention_layernorm(x))))


class Llama(Layer):
    def __init__(self, cfg: LlamaConfig, par: GPTParallel | None = None) -> None:
        with default_dtype(cfg.dtype):
            self._build(cfg, par)

    def _build(self, cfg: LlamaConfig, par: GPTParallel | None) -> None:
        super().__init__(dtype=cfg.dtype)
        self.cfg = cfg
        std = cfg.initializer_range
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, weight_attr=_normal(std))
        self.layers = LayerList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, weight_attr=_normal(std), bias_attr=False)
        self.par = par or GPTParallel()
        if self.par.distributed:
            self._place()

    # ------------------------------------------------------------------ layout
    def _place(self) -> None:
        par, cfg = self.par, self.cfg
        n = cfg.num_hidden_layers
        first, last = par.stage_meshes[0], par.stage_meshes[-1]
        mark = dist.shard_tensor
        mark(self.embed_tokens.weight, first, par.weight(first, Shard(0)))  # vocabulary parallel
        for i, layer in enumerate(self.layer_list()):
            mesh = par.mesh_of_layer(i, n)
            attn = layer.self_attn
            bind_layers(par, mesh, layer, attn, layer.mlp)
            # Key/value heads split over tp only when tp divides them; else each rank keeps them all.
            kv = Shard(1) if attn.n_kv % par.axis_size(par.tp, mesh) == 0 else None
            for lin, pl in (
                (attn.q_proj, Shard(1)), (attn.k_proj, kv), (attn.v_proj, kv), (layer.mlp.gate_proj, Shard(1)),
                (layer.mlp.up_proj, Shard(1)), (attn.o_proj, Shard(0)), (layer.mlp.down_proj, Shard(0)),
            ):  # fmt: skip
                mark(lin.weight, mesh, par.weight(mesh, pl))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                mark(norm.weight, mesh, par.weight(mesh, None))
            if not attn.fused:
                mark(attn.causal_mask, mesh, par.weight(mesh, None))
        mark(self.norm.weight, last, par.weight(last, None))
        mark(self.lm_head.weight, last, par.weight(last, Shard(1)))  # column parallel over the vocabulary

    # ------------------------------------------------------------------ forward
    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        t = idx.shape[1]
        cfg, par = self.cfg, self.par
        if t > cfg.max_position_embeddings:
            raise ValueError(
                f"Llama: sequence length {t} exceeds max_position_embeddings {cfg.max_position_embeddings}"
            )
        if par.axis_size(par.cp) > 1 and t != cfg.max_position_embeddings:
            raise ValueError(
                f"Llama: under context parallel the sequence must be max_position_embeddings "
                f"{cfg.max_position_embeddings} long, got {t}"
            )
        rope_positions = Tensor(np.arange(t, dtype=np.int64))  # laid out like the sequence by the rule
        for layer in self.layer_list():
            layer.self_attn.rope_positions = rope_positions
        x = self.embed_tokens(idx)  # (B, T, C); Partial over tp (vocabulary parallel)
        if par.distributed:
            x = dist.reshard(x, par.stage_meshes[0], par.activation(par.stage_meshes[0]))
        x = run_blocks(par, self.layers, x, cfg.num_hidden_layers)
        x = self.norm(x)
        if par.distributed and par.sequence_parallel:
            x = dist.reshard(x, par.stage_meshes[-1], par.activation(par.stage_meshes[-1], seq_split=False))
        return self.lm_head(x)  # (B, T, V); the vocabulary on tp

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        return gpt_loss(self.forward(idx), targets)

    def layer_list(self) -> list[LlamaDecoderLayer]:
        """The decoder layers, typed."""
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.parameters())


# ---------------------------------------------------------------------- Hugging Face weights
_HF_LAYER = {
    "self_attn.q_proj.weight": ("self_attn.q_proj.weight", True),
    "self_attn.k_proj.weight": ("self_attn.k_proj.weight", True),
    "self_attn.v_proj.weight": ("self_attn.v_proj.weight", True),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", True),
    "mlp.gate_proj.weight": ("mlp.gate_proj.weight", True),
    "mlp.up_proj.weight": ("mlp.up_proj.weight", True),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", True),
    "input_layernorm.weight": ("input_layernorm.weight", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", False),
}
"""HF name under ``model.layers.N.`` -> (our name under ``layers.N.``, stored transposed: HF keeps
linear weights as (out, in), ours are (in, out))."""


def hf_name_map(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """Every HF tensor name of a Llama of this config -> (our parameter name, transposed)."""
    out = {
        "model.embed_tokens.weight": ("embed_tokens.weight", False),
        "model.norm.weight": ("norm.weight", False),
        "lm_head.weight": ("lm_head.weight", True),
    }
    for i in range(cfg.num_hidden_layers):
        for hf, (ours, transposed) in _HF_LAYER.items():
            out[f"model.layers.{i}.{hf}"] = (f"layers.{i}.{ours}", transposed)
    return out


def hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights under HF names and layouts (global values; a collective under MPI)."""
    params = dict(model.named_parameters())
    return {
        hf: (params[ours].full_tensor().T if transposed else params[ours].full_tensor()).copy()
        for hf, (ours, transposed) in hf_name_map(model.cfg).items()
    }


def _safetensors_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"load_hf_llama: no .safetensors file in directory {path!r}")
        return files
    if not os.path.isfile(path):
        raise ValueError(f"load_hf_llama: {path!r} is neither a .safetensors file nor a directory of them")
    return [path]


def load_hf_llama(model: Llama, path: str) -> None:
    """Load weights saved in the Hugging Face Llama safetensors layout (a file, or a directory of
    shards) into ``model``, whatever its mesh: each parameter is read whole, checked against the
    config's shape, converted to the model's dtype and placed into its layout.

    The file is untrusted: a tensor name outside the layout, a missing one, a wrong shape or a
    non-float dtype is a ValueError naming it; each tensor's shape is checked before its data
    is read, so a hostile header cannot make it read more than the model's own size."""
    try:
        from safetensors import safe_open  # the optional dependency of this loader only
    except ImportError as exc:  # pragma: no cover - safetensors is a dev dependency
        raise ValueError("load_hf_llama needs the 'safetensors' package (pip install safetensors)") from exc
    names = hf_name_map(model.cfg)
    params = dict(model.named_parameters())
    state: dict[str, np.ndarray] = {}
    for file in _safetensors_files(path):
        try:
            handle = safe_open(file, framework="numpy")
        except Exception as exc:  # the library raises its own error types on a bad header
            raise ValueError(f"load_hf_llama: {file!r} is not a readable safetensors file: {exc}") from None
        with handle as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                if key not in names:
                    raise ValueError(
                        f"load_hf_llama: {file!r} holds tensor {key!r}, which a Llama of {model.cfg.num_hidden_layers} "
                        "layers does not have (rotary tables and tied weights are not expected either)"
                    )
                if key in state:
                    raise ValueError(f"load_hf_llama: tensor {key!r} appears twice (again in {file!r})")
                ours, transposed = names[key]
                want = tuple(params[ours].shape)
                want = want[::-1] if transposed else want
                got = tuple(f.get_slice(key).get_shape())
                if got != want:
                    raise ValueError(
                        f"load_hf_llama: {key!r} in {file!r} has shape {list(got)}; the config needs {list(want)}"
                    )
                value = f.get_tensor(key)
                if not np.issubdtype(value.dtype, np.floating):
                    raise ValueError(
                        f"load_hf_llama: {key!r} in {file!r} has dtype {value.dtype}; weights must be floats"
                    )
                state[key] = value
    missing = [k for k in names if k not in state]
    if missing:
        raise ValueError(f"load_hf_llama: {path!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    own = model.state_dict()
    values: dict[str, object] = dict(own)  # buffers (masks) keep their values
    for hf, (ours, transposed) in names.items():
        arr = state[hf].T if transposed else state[hf]
        values[ours] = np.ascontiguousarray(arr, dtype=own[ours].dtype)
    model.set_state_dict(values)
