"""A small GPT written once, laid out by placements for any dp x tp x pp mesh.

The model code is single-device code plus a few marks (``GPTParallel``):

* tensor parallel (Megatron): q/k/v and fc1 column-parallel (weight ``Shard(1)`` on ``tp``),
  the attention and MLP output projections row-parallel (``Shard(0)``), the token embedding
  vocabulary-parallel (``Shard(0)``); one all_reduce after each row-parallel matmul;
* sequence parallel: outside the column/row pairs activations are split along the sequence
  (``Shard(1)`` on ``tp``): an all_gather before each pair and a reduce_scatter after it
  replace the all_reduce (same bytes), and LayerNorm/Dropout run on a slice;
* data parallel: the batch is ``Shard(0)`` on ``dp`` (weights Replicate: the gradient
  reduction falls out of the rules);
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

import numpy as np

import mpipar as dist
from mpipar.backend import current_backend
from mpipar.mesh import ProcessMesh
from mpipar.nn import functional as F
from mpipar.nn.initializer import Constant, Normal
from mpipar.nn.layer import Layer, ParamAttr, default_dtype
from mpipar.nn.layers import Dropout, Embedding, LayerList, LayerNorm, Linear, reshard_axis
from mpipar.placement import Placement, Replicate, Shard
from mpipar.tensor import Tensor


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    dtype: str = "float32"


@dataclass
class GPTParallel:
    """Where the GPT lives: one mesh per pipeline stage, each with ``dp`` and ``tp`` axes."""

    stage_meshes: list[ProcessMesh] = field(default_factory=list)
    dp: str = "dp"
    tp: str = "tp"
    sequence_parallel: bool = False
    recompute: str = "none"
    chunks: int = 1
    """Virtual stages per pipeline rank (interleaved schedules): stage s lives on mesh s mod pp."""

    @classmethod
    def from_degrees(cls, dp: int = 1, tp: int = 1, pp: int = 1, **kwargs: object) -> GPTParallel:
        """Stage s holds ranks ``s*dp*tp .. (s+1)*dp*tp - 1`` as a (dp, tp) mesh."""
        n = dp * tp
        meshes = [ProcessMesh(np.arange(s * n, (s + 1) * n).reshape(dp, tp), dim_names=["dp", "tp"]) for s in range(pp)]
        return cls(meshes, **kwargs)  # type: ignore[arg-type]

    @property
    def distributed(self) -> bool:
        return bool(self.stage_meshes)

    @property
    def num_stages(self) -> int:
        return len(self.stage_meshes) * self.chunks

    def stage_of_layer(self, i: int, n_layer: int) -> int:
        """The (virtual) stage of layer ``i``: layers split evenly, in order."""
        if n_layer < self.num_stages:
            raise ValueError(f"GPT: {n_layer} layers cannot fill {self.num_stages} pipeline stages (pp x chunks)")
        return i * self.num_stages // n_layer if self.stage_meshes else 0

    def mesh_of_layer(self, i: int, n_layer: int) -> ProcessMesh:
        return self.stage_meshes[self.stage_of_layer(i, n_layer) % len(self.stage_meshes)]

    def activation(self, mesh: ProcessMesh, seq_split: bool | None = None) -> list[Placement]:
        """The residual stream's layout: batch on dp; the sequence on tp under sequence parallel."""
        sp = self.sequence_parallel if seq_split is None else seq_split
        pls: list[Placement] = [Replicate()] * mesh.ndim
        if self.dp in mesh.dim_names and mesh.get_dim_size(self.dp) > 1:
            pls[mesh.axis_index(self.dp)] = Shard(0)
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
    """The additive causal mask, one read-only array per size and dtype shared by every block
    (a 2048-long float32 mask is 16 MiB: built once, not once per layer and per trace)."""
    mask = np.triu(np.full((size, size), -1e9, dtype=dtype), k=1)
    mask.flags.writeable = False
    return mask


class CausalSelfAttention(Layer):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(dtype=cfg.dtype)
        h = cfg.n_embd
        self.n_head, self.head_dim = cfg.n_head, h // cfg.n_head
        self.q = Linear(h, h, weight_attr=_normal(0.02))
        self.k = Linear(h, h, weight_attr=_normal(0.02))
        self.v = Linear(h, h, weight_attr=_normal(0.02))
        self.proj = Linear(h, h, weight_attr=_normal(0.02 / math.sqrt(2 * cfg.n_layer)))
        self.attn_drop = Dropout(cfg.dropout)
        # Shape-only tracing never reads the mask's values: an abstract buffer of its shape spares
        # copying a 2048-long mask per block (8-16 MiB each, a tenth of a search's trace time).
        n, dtype = cfg.block_size, str(np.dtype(cfg.dtype))
        mask = Tensor.abstract((n, n), dtype) if current_backend().shape_only else Tensor(_causal_mask(n, dtype))
        self.register_buffer("causal_mask", mask)
        self.par: GPTParallel | None = None
        self.mesh: ProcessMesh | None = None

    def _heads(self, t: Tensor) -> Tensor:
        b, s, _ = t.shape
        return dist.transpose(dist.reshape(t, [b, s, self.n_head, self.head_dim]), [0, 2, 1, 3])  # (B, nh, T, hd)

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t = q.shape[2]
        att = dist.scale(dist.matmul(q, k, transpose_y=True), 1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        mask = self.causal_mask if t == self.causal_mask.shape[0] else self.causal_mask[:t, :t]
        att = self.attn_drop(F.softmax(dist.add(att, mask), axis=-1))
        return dist.matmul(att, v)  # (B, nh, T, hd)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        if self.par is not None and self.par.recompute == "selective":
            y = dist.recompute(self._core, q, k, v)
        else:
            y = self._core(q, k, v)
        y = dist.reshape(dist.transpose(y, [0, 2, 1, 3]), [b, s, h])  # (B, T, C)
        out = dist.matmul(y, self.proj.weight)  # row parallel: Partial(sum) over tp
        if self.par is not None and self.mesh is not None:
            out = dist.reshard(out, self.mesh, self.par.activation(self.mesh))  # all_reduce / reduce_scatter
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
        out = dist.matmul(hidden, self.proj.weight)
        if self.par is not None and self.mesh is not None:
            out = dist.reshard(out, self.mesh, self.par.activation(self.mesh))
        return dist.add(out, self.proj.bias)


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

    def _gather_seq(self, x: Tensor) -> Tensor:
        """Sequence parallel: all_gather the sequence before a column-parallel pair.

        Ops that save the gathered tensor for backward keep the sequence shard instead and
        gather again there (Megatron's sequence parallelism does the same).
        """
        if (
            self.par is not None
            and self.par.sequence_parallel
            and self.mesh is not None
            and self.par.tp in self.mesh.dim_names
        ):
            full = reshard_axis(x, self.mesh, self.par.tp, Replicate())
            if full.is_dist and x.is_dist:
                full._regather = (x, full.spec)
            return full
        return x

    def forward(self, x: Tensor) -> Tensor:
        x = dist.add(x, self.drop(self.attn(self._gather_seq(self.ln1(x)))))
        return dist.add(x, self.drop(self.mlp(self._gather_seq(self.ln2(x)))))


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy of logits (B, T, V) against targets (B, T)."""
    b, t, v = logits.shape
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
        for i, block in enumerate(self.blocks):
            mesh = par.mesh_of_layer(i, n)
            for layer in (block, block.attn, block.mlp):
                object.__setattr__(layer, "par", par)
                object.__setattr__(layer, "mesh", mesh)
            for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):  # column parallel
                mark(lin.weight, mesh, par.weight(mesh, Shard(1)))
                mark(lin.bias, mesh, par.weight(mesh, Shard(0)))
            for lin in (block.attn.proj, block.mlp.proj):  # row parallel
                mark(lin.weight, mesh, par.weight(mesh, Shard(0)))
                mark(lin.bias, mesh, par.weight(mesh, None))
            for ln in (block.ln1, block.ln2):
                mark(ln.weight, mesh, par.weight(mesh, None))
                mark(ln.bias, mesh, par.weight(mesh, None))
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
        pos = Tensor(np.arange(t, dtype=np.int64))
        x = dist.add(self.wte(idx), self.wpe(pos))  # (B, T, C); Partial over tp (vocab parallel)
        if par.distributed:
            x = dist.reshard(x, par.stage_meshes[0], par.activation(par.stage_meshes[0]))
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            if par.distributed:
                mesh = par.mesh_of_layer(i, self.cfg.n_layer)
                if not x.spec.mesh.same_layout(mesh):  # pipeline hand-off to the next stage
                    x = dist.reshard(x, mesh, par.activation(mesh))
            x = dist.recompute(block, x) if par.recompute == "full" else block(x)
        if par.distributed:
            last = par.stage_meshes[-1]
            if not x.spec.mesh.same_layout(last):
                x = dist.reshard(x, last, par.activation(last))
        x = self.ln_f(x)
        if par.distributed and par.sequence_parallel:
            x = dist.reshard(x, par.stage_meshes[-1], par.activation(par.stage_meshes[-1], seq_split=False))
        return self.lm_head(x)  # (B, T, V); the vocabulary on tp (column parallel, as Megatron's output layer)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        return gpt_loss(self.forward(idx), targets)

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.parameters())
