"""A small GPT written once, laid out by placements for any dp x cp x tp x pp mesh.

The model code is single-device code plus a few marks (``GPTParallel``):

* tensor parallel (Megatron): q/k/v and fc1 column-parallel (weight ``Shard(1)`` on ``tp``),
  the attention and MLP output projections row-parallel (``Shard(0)``), the token embedding
  vocabulary-parallel (``Shard(0)``); one all_reduce after each row-parallel matmul;
* sequence parallel: outside the column/row pairs activations are split along the sequence
  (``Shard(1)`` on ``tp``): an all_gather before each pair and a reduce_scatter after it
  replace the all_reduce (same bytes), and LayerNorm/Dropout run on a slice;
* data parallel: the batch is ``Shard(0)`` on ``dp`` (weights Replicate: the gradient
  reduction falls out of the rules);
* context parallel: the sequence is split on ``cp`` for every op; attention gathers the
  keys and values over ``cp`` (all_gather forward, reduce_scatter of their gradients backward,
  as Llama 3 trained). Causal load balancing: the split is the placement ``ZigzagShard(1)``
  (cp rank r holds chunks r and 2cp-1-r of 2cp chunks), so every rank's queries see the same
  number of keys; tokens are given in their natural order, and the kernels read each token's
  global position off the layout (``Shard(1)`` with ``load_balance=False``);
* pipeline (naive, seed 000 §4.3): blocks are spread over stage meshes and the activation
  is resharded to the next stage's mesh at each boundary;
* recompute ``full`` (each block) or ``selective`` (the attention core: scores, softmax,
  dropout -- Megatron's selective recompute).

Run it with ``examples/gpt.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import cast

import numpy as np

import mpipar as dist
from mpipar.backend import current_backend
from mpipar.mesh import ProcessMesh
from mpipar.nn import functional as F
from mpipar.nn.initializer import Constant, Normal
from mpipar.nn.layer import Layer, ParamAttr, default_dtype
from mpipar.nn.layers import Dropout, Embedding, LayerList, LayerNorm, Linear, reshard_axis
from mpipar.ops.manipulation import getitem
from mpipar.pipeline.stages import stage_of_layers
from mpipar.placement import Placement, Replicate, Shard, ZigzagShard
from mpipar.tensor import Tensor


@functools.lru_cache(maxsize=64)
def _stage_of_layers(n_layer: int, stages: int) -> tuple[int, ...]:
    """Each layer's (virtual) stage for ``stages`` stages (``stage_of_layers``, kept per shape:
    every layer of every forward asks for its stage)."""
    return tuple(stage_of_layers(n_layer, stages))


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    dtype: str = "float32"
    attention: str = "plain"
    """``plain`` (scores, mask, softmax as separate ops: s x s activations) or ``fused``
    (``scaled_dot_product_attention``: blockwise, nothing s x s kept; it applies no dropout to
    the attention probabilities, only to the residual branches)."""


ATTENTION_KINDS = ("plain", "fused")


def check_attention(kind: str, model: str) -> None:
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"{model}: attention {kind!r} is not one of {', '.join(ATTENTION_KINDS)}")


@dataclass
class GPTParallel:
    """Where the model lives: one mesh per pipeline stage, each with ``dp`` and ``tp`` axes (and
    ``cp`` between them when context parallel)."""

    stage_meshes: list[ProcessMesh] = field(default_factory=list)
    dp: str = "dp"
    tp: str = "tp"
    cp: str = "cp"
    load_balance: bool = True
    """Under context parallel, split the sequence load-balanced (``ZigzagShard``), else ``Shard``."""
    cp_comm: str = "allgather"
    """Under context parallel, fused attention's keys and values: ``allgather`` or ``ring``."""
    sequence_parallel: bool = False
    recompute: str = "none"
    chunks: int = 1
    """Virtual stages per pipeline rank (interleaved schedules): stage s lives on mesh s mod pp."""

    @classmethod
    def from_degrees(cls, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, **kwargs: object) -> GPTParallel:
        """Stage s holds ranks ``s*dp*cp*tp .. (s+1)*dp*cp*tp - 1`` as a (dp, tp) mesh, or a
        (dp, cp, tp) mesh when cp > 1 (tp ranks adjacent, then cp, as Megatron orders them)."""
        n = dp * cp * tp
        shape, names = ([dp, cp, tp], ["dp", "cp", "tp"]) if cp > 1 else ([dp, tp], ["dp", "tp"])
        meshes = [ProcessMesh(np.arange(s * n, (s + 1) * n).reshape(shape), dim_names=names) for s in range(pp)]
        return cls(meshes, **kwargs)  # type: ignore[arg-type]

    def axis_size(self, axis: str, mesh: ProcessMesh | None = None) -> int:
        """The degree of mesh axis ``axis`` (1 when the mesh lacks it)."""
        mesh = mesh or (self.stage_meshes[0] if self.stage_meshes else None)
        return mesh.get_dim_size(axis) if mesh is not None and axis in mesh.dim_names else 1

    @property
    def distributed(self) -> bool:
        return bool(self.stage_meshes)

    @property
    def num_stages(self) -> int:
        return len(self.stage_meshes) * self.chunks

    def stage_of_layer(self, i: int, n_layer: int) -> int:
        """The (virtual) stage of layer ``i``: layers in order, split by ``stage_layer_counts``
        (evenly where they divide, else the first and last stages, which also carry the
        embedding and the output layer, lighter), the rule the estimator and the search price."""
        if not self.stage_meshes:
            return 0
        if n_layer < self.num_stages:
            raise ValueError(f"GPT: {n_layer} layers cannot fill {self.num_stages} pipeline stages (pp x chunks)")
        return _stage_of_layers(n_layer, self.num_stages)[i]

    def mesh_of_layer(self, i: int, n_layer: int) -> ProcessMesh:
        return self.stage_meshes[self.stage_of_layer(i, n_layer) % len(self.stage_meshes)]

    def activation(self, mesh: ProcessMesh, seq_split: bool | None = None) -> list[Placement]:
        """The residual stream's layout: batch on dp; the sequence on cp, and on tp under
        sequence parallel."""
        sp = self.sequence_parallel if seq_split is None else seq_split
        pls: list[Placement] = [Replicate()] * mesh.ndim
        if self.dp in mesh.dim_names and mesh.get_dim_size(self.dp) > 1:
            pls[mesh.axis_index(self.dp)] = Shard(0)
        if self.cp in mesh.dim_names and mesh.get_dim_size(self.cp) > 1:
            pls[mesh.axis_index(self.cp)] = ZigzagShard(1) if self.load_balance else Shard(1)
        if sp and self.tp in mesh.dim_names and mesh.get_dim_size(self.tp) > 1:
            pls[mesh.axis_index(self.tp)] = Shard(1)
        return pls

    def weight(self, mesh: ProcessMesh, tp_placement: Placement | None) -> list[Placement]:
        pls: list[Placement] = [Replicate()] * mesh.ndim
        if tp_placement is not None and self.tp in mesh.dim_names:
            pls[mesh.axis_index(self.tp)] = tp_placement
        return pls


def _normal(std: float) -> ParamAttr:
    return ParamAttr(initializer=Normal(0.0, std))


@functools.lru_cache(maxsize=8)
def _causal_mask(size: int, dtype: str) -> np.ndarray:
    """The additive causal mask, one read-only array per size and dtype shared by every block (a
    2048-long float32 mask is 16 MiB: built once, not once per layer and per trace). Under a
    zigzag sequence split the scores' rows are zigzag too, and the add's rule slices the mask's
    rows alike (a local reorder)."""
    mask = np.triu(np.full((size, size), -1e9, dtype=dtype), k=1)
    mask.flags.writeable = False
    return mask


def causal_mask_buffer(size: int, dtype: str) -> Tensor:
    """The mask as a buffer (abstract in shape-only tracing, which never reads its values: that
    spares copying a 2048-long mask per block, 8-16 MiB each)."""
    if current_backend().shape_only:
        return Tensor.abstract((size, size), dtype)
    return Tensor(_causal_mask(size, dtype))


def cp_comm_of(par: GPTParallel | None) -> str:
    return par.cp_comm if par is not None else "allgather"


def plain_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: Layer | None = None) -> Tensor:
    """Causal attention as separate ops on (B, H, T, D): scores, the additive ``mask`` (T, T),
    softmax, dropout, the weighted sum; the (B, H, T, T) scores are activations."""
    t, d = q.shape[2], q.shape[3]
    att = dist.scale(dist.matmul(q, k, transpose_y=True), 1.0 / math.sqrt(d))  # (B, H, T, T)
    att = F.softmax(dist.add(att, mask if t == mask.shape[0] else getitem(mask, (slice(0, t), slice(0, t)))), axis=-1)
    if dropout is not None:
        att = dropout(att)
    return dist.matmul(att, v)  # (B, H, T, D)


def row_parallel_out(layer: Layer, out: Tensor) -> Tensor:
    """A row-parallel matmul's Partial(sum) output to the residual layout (all_reduce, or
    reduce_scatter under sequence parallel)."""
    par, mesh = getattr(layer, "par", None), getattr(layer, "mesh", None)
    if par is not None and mesh is not None:
        return dist.reshard(out, mesh, par.activation(mesh))
    return out


def gather_sequence(layer: Layer, x: Tensor) -> Tensor:
    """Sequence parallel: all_gather the sequence over tp before a column-parallel pair.

    Ops that save the gathered tensor for backward keep the sequence shard instead and gather
    again there (Megatron's sequence parallelism does the same). The cp split stays."""
    par, mesh = getattr(layer, "par", None), getattr(layer, "mesh", None)
    if par is not None and par.sequence_parallel and mesh is not None and par.tp in mesh.dim_names:
        full = reshard_axis(x, mesh, par.tp, Replicate())
        if full.is_dist and x.is_dist:
            full._regather = (x, full.spec)
        return full
    return x


def run_blocks(par: GPTParallel, blocks: LayerList, x: Tensor, n_layer: int) -> Tensor:
    """The residual stream through every block: handed to each block's stage mesh (pipeline),
    recomputed per block under ``recompute="full"``, and onto the last stage at the end."""
    for i, block in enumerate(blocks):
        if par.distributed:
            mesh = par.mesh_of_layer(i, n_layer)
            if not x.spec.mesh.same_layout(mesh):  # pipeline hand-off to the next stage
                x = dist.reshard(x, mesh, par.activation(mesh))
        x = dist.recompute(block, x) if par.recompute == "full" else block(x)
    if par.distributed:
        last = par.stage_meshes[-1]
        if not x.spec.mesh.same_layout(last):
            x = dist.reshard(x, last, par.activation(last))
    return x


def bind_layers(par: GPTParallel, mesh: ProcessMesh, *layers: Layer) -> None:
    """Tell a block's layers their stage mesh and the parallel plan (read in forward)."""
    for layer in layers:
        object.__setattr__(layer, "par", par)
        object.__setattr__(layer, "mesh", mesh)


class CausalSelfAttention(Layer):
    causal_mask: Tensor
    """The additive mask (plain attention only), a buffer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        h = cfg.n_embd
        self.n_head, self.head_dim = cfg.n_head, h // cfg.n_head
        self.q = Linear(h, h, weight_attr=_normal(0.02))
        self.k = Linear(h, h, weight_attr=_normal(0.02))
        self.v = Linear(h, h, weight_attr=_normal(0.02))
        self.proj = Linear(h, h, weight_attr=_normal(0.02 / math.sqrt(2 * cfg.n_layer)))
        self.attn_drop = Dropout(cfg.dropout)
        check_attention(cfg.attention, "GPT")
        self.fused = cfg.attention == "fused"
        if not self.fused:
            self.register_buffer("causal_mask", causal_mask_buffer(cfg.block_size, str(np.dtype(cfg.dtype))))
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def _heads(self, t: Tensor) -> Tensor:
        b, s, _ = t.shape
        t = dist.reshape(t, [b, s, self.n_head, self.head_dim])  # (B, T, nh, hd): fused attention's layout
        return t if self.fused else dist.transpose(t, [0, 2, 1, 3])  # (B, nh, T, hd)

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.fused:  # no attention-probability dropout in the fused kernel (residual dropout stays)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, cp_comm=cp_comm_of(self.par))
        return plain_attention(q, k, v, self.causal_mask, self.attn_drop)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        if self.par is not None and self.par.recompute == "selective":
            y = dist.recompute(self._core, q, k, v)
        else:
            y = self._core(q, k, v)
        if not self.fused:
            y = dist.transpose(y, [0, 2, 1, 3])
        y = dist.reshape(y, [b, s, h])  # (B, T, C)
        out = row_parallel_out(self, dist.matmul(y, self.proj.weight))  # row parallel: Partial(sum) over tp
        return dist.add(out, self.proj.bias)


class MLP(Layer):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        self.fc = Linear(cfg.n_embd, 4 * cfg.n_embd, weight_attr=_normal(0.02))
        self.proj = Linear(4 * cfg.n_embd, cfg.n_embd, weight_attr=_normal(0.02 / math.sqrt(2 * cfg.n_layer)))
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.gelu(self.fc(x), approximate=True)  # (B, T, 4C), split on tp
        return dist.add(row_parallel_out(self, dist.matmul(hidden, self.proj.weight)), self.proj.bias)


class Block(Layer):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        self.ln1 = LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.drop = Dropout(cfg.dropout)
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def forward(self, x: Tensor) -> Tensor:
        x = dist.add(x, self.drop(self.attn(gather_sequence(self, self.ln1(x)))))
        return dist.add(x, self.drop(self.mlp(gather_sequence(self, self.ln2(x)))))


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy of logits (B, T, V) against targets (B, T)."""
    b, t, v = logits.shape
    if logits.is_dist and any(p.is_shard(1) for p in logits.spec.placements):
        # The sequence split (context parallel): (B, T) rows cannot be flattened without gathering
        # them, so the loss runs on (B, T, V) (the vocabulary gathered first: classes stay whole).
        pls = [Replicate() if p.is_shard(2) else p for p in logits.spec.placements]
        return F.cross_entropy(dist.reshard(logits, logits.spec.mesh, pls), dist.unsqueeze(targets, -1))
    flat = dist.reshape(logits, [b * t, v])
    if flat.is_dist and any(p.is_shard(1) for p in flat.spec.placements):
        # Vocabulary-parallel logits: the loss keeps the class axis whole, so hand each rank whole
        # rows instead (one all_to_all of its logits) rather than gathering every logit everywhere.
        pls = [Shard(0) if p.is_shard(1) else p for p in flat.spec.placements]
        flat = dist.reshard(flat, flat.spec.mesh, pls)
    return F.cross_entropy(flat, dist.reshape(targets, [b * t]))


class GPT(Layer):
    def __init__(self, cfg: GPTConfig, par: GPTParallel | None = None) -> None:
        with default_dtype(cfg.dtype):
            self._build(cfg, par)

    def _build(self, cfg: GPTConfig, par: GPTParallel | None) -> None:
        super().__init__(dtype=cfg.dtype)
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, weight_attr=_normal(0.02))
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, weight_attr=_normal(0.01))
        self.drop = Dropout(cfg.dropout)
        self.blocks = LayerList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd)
        self.lm_head = Linear(
            cfg.n_embd, cfg.vocab_size, weight_attr=_normal(0.02), bias_attr=ParamAttr(initializer=Constant(0.0))
        )
        self.par = par or GPTParallel()
        if self.par.distributed:
            self._place()

    # ------------------------------------------------------------------ layout
    def _place(self) -> None:
        par = self.par
        n = self.cfg.n_layer
        first, last = par.stage_meshes[0], par.stage_meshes[-1]
        mark = dist.shard_tensor
        mark(self.wte.weight, first, par.weight(first, Shard(0)))  # vocabulary parallel
        mark(self.wpe.weight, first, par.weight(first, None))
        for i, block in enumerate(self.block_list()):
            mesh = par.mesh_of_layer(i, n)
            bind_layers(par, mesh, block, block.attn, block.mlp)
            for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):  # column parallel
                mark(lin.weight, mesh, par.weight(mesh, Shard(1)))
                mark(lin.bias, mesh, par.weight(mesh, Shard(0)))
            for lin in (block.attn.proj, block.mlp.proj):  # row parallel
                mark(lin.weight, mesh, par.weight(mesh, Shard(0)))
                mark(lin.bias, mesh, par.weight(mesh, None))
            for ln in (block.ln1, block.ln2):
                mark(ln.weight, mesh, par.weight(mesh, None))
                mark(ln.bias, mesh, par.weight(mesh, None))
            if not block.attn.fused:
                mark(block.attn.causal_mask, mesh, par.weight(mesh, None))
        mark(self.ln_f.weight, last, par.weight(last, None))
        mark(self.ln_f.bias, last, par.weight(last, None))
        mark(self.lm_head.weight, last, par.weight(last, Shard(1)))
        mark(self.lm_head.bias, last, par.weight(last, Shard(0)))

    # ------------------------------------------------------------------ forward
    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {self.cfg.block_size}")
        par = self.par
        if par.axis_size(par.cp) > 1 and t != self.cfg.block_size:
            raise ValueError(
                f"GPT: under context parallel the sequence must be block_size {self.cfg.block_size} long, got {t}"
            )
        x = dist.add(self.wte(idx), self.wpe(Tensor(np.arange(t, dtype=np.int64))))  # (B, T, C); Partial over tp
        if par.distributed:
            x = dist.reshard(x, par.stage_meshes[0], par.activation(par.stage_meshes[0]))
        x = self.drop(x)
        x = run_blocks(par, self.blocks, x, self.cfg.n_layer)
        x = self.ln_f(x)
        if par.distributed and par.sequence_parallel:
            x = dist.reshard(x, par.stage_meshes[-1], par.activation(par.stage_meshes[-1], seq_split=False))
        return self.lm_head(x)  # (B, T, V); the vocabulary on tp (column parallel, as Megatron's output layer)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        return gpt_loss(self.forward(idx), targets)

    def block_list(self) -> list[Block]:
        """The transformer blocks, typed."""
        return [cast(Block, b) for b in self.blocks]

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.parameters())
