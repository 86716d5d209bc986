"""What ``dist.memory_report`` counts as kept for backward (``mpipar.debug.memory.kept_tensors``), which the
estimator shares: a re-gather note holds its shard, a step-less reshard is its source's storage."""

from __future__ import annotations

import numpy as np

import mpipar as dist
from mpipar.autograd import Packed, _topo_order
from mpipar.debug.memory import kept_tensors
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1, dtype="float64")


def _saved(par: GPTParallel | None, batch: int = 4) -> int:
    """Bytes rank 0 keeps for backward (the whole model when dense), each storage once."""
    dist.seed(0)
    model = GPT(CFG, par)
    idx = np.random.default_rng(0).integers(0, CFG.vocab_size, (batch, CFG.block_size))
    x = dist.Tensor(idx)
    if par is not None:
        mesh = par.stage_meshes[0]
        x = dist.shard_tensor(idx, mesh, par.activation(mesh, seq_split=False))
    loss = model.loss(x, x)
    if par is not None:
        return dist.memory_report(model, None, loss).per_rank[0]["activations"]
    seen = {p._sid for p in model.parameters()}
    total = 0
    for node in _topo_order(loss):
        for t in kept_tensors(node):
            if t._sid not in seen:
                seen.add(t._sid)
                total += t.numpy().nbytes
    return total


def test_one_rank_mesh_keeps_what_the_dense_model_keeps() -> None:
    """On a 1 x 1 mesh the row-parallel weights (Shard(0) on a one-rank tp axis) reach their
    matmul through a reshard with no step: the same arrays, not an activation."""
    assert _saved(GPTParallel.from_degrees(1, 1, 1)) == _saved(None)


def test_sequence_parallel_gather_is_kept_as_its_shard() -> None:
    dist.seed(0)
    par = GPTParallel.from_degrees(1, 2, 1, sequence_parallel=True)
    model = GPT(CFG, par)
    mesh = par.stage_meshes[0]
    x = dist.shard_tensor(np.zeros((2, CFG.block_size), dtype=np.int64), mesh, par.activation(mesh, seq_split=False))
    loss = model.loss(x, x)
    notes = [(n, v) for n in _topo_order(loss) for v in n.ctx.inputs if isinstance(v, Packed)]
    assert len(notes) == 8  # per layer: q, k, v (one gathered input) and fc1
    for node, note in notes:
        shard = note.payload[0]
        assert shard in kept_tensors(node)
        assert shard.spec.local_shape(0) == (2, CFG.block_size // 2, CFG.n_embd)
