"""``fleet.distributed_optimizer``: the optimizer step of 4-D hybrid parallelism.

One ``step()`` of ``HybridParallelOptimizer`` on each rank, in this order:

1. gradient merge: with ``k`` merge steps, only every k-th call steps (gradients accumulate
   in between, and ``clear_grad`` keeps them); the merged gradient is averaged over k when
   ``gradient_merge_configs['avg']`` (the default);
2. data parallelism: the sharding group and the data group together read the whole batch,
   each member a different share, so gradients are averaged over both. Sharding stage 1
   all-reduces every gradient over the sharding group; stage 2 reduces each gradient to the
   one member that owns the parameter and the others drop it. Then the data group
   all-reduces what is left (its members own the same parameters). The all-reduces go in
   buckets of ``sharding_configs['segment_broadcast_MB']`` (32 MB by default): consecutive
   gradients flattened into one buffer, one call each;
3. gradient clipping by global norm, with each gradient counted once: the squares of
   model-parallel slices (``is_distributed``) are summed over the model group, replicated
   ones are not (nor a weight tied across stages, but on its first stage); the sums are then added over the sharding group (each member holds its own
   parameters' gradients) and the pipe group (each stage its own layers);
4. the wrapped optimizer updates the parameters this rank owns (all of them without
   sharding; with sharding its optimizer states exist for those only: ZeRO-1/2);
5. sharding: each owner broadcasts its updated parameters over the sharding group.

Ownership (Paddle's partition): parameters in order, each to the member with the fewest
elements so far (the lowest position on ties). ``optimize_offload`` keeps the wrapped
optimizer's states in host memory between steps (``mpipar.offload_optimizer``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpipar import autograd
from mpipar.compat.collective import ReduceOp, all_reduce, broadcast, reduce
from mpipar.compat.fleet.strategy import Resolved
from mpipar.compat.fleet.topology import HybridCommunicateGroup
from mpipar.optimizer.offload import offload_optimizer
from mpipar.optimizer.optimizer import ClipGradByGlobalNorm, Optimizer
from mpipar.tensor import Tensor


def partition_parameters(params: list[Tensor], parts: int) -> list[int]:
    """The owner position in the sharding group of each parameter (greedy by element count)."""
    load = [0] * parts
    owners = []
    for p in params:
        owner = int(np.argmin(load))
        owners.append(owner)
        load[owner] += int(np.prod(p.shape))
    return owners


class HybridParallelOptimizer:
    """Wraps an mpipar optimizer with the reductions, clipping and sharding of the hybrid groups."""

    def __init__(self, optimizer: Optimizer, hcg: HybridCommunicateGroup, strategy: Resolved) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"distributed_optimizer: expected an mpipar optimizer (dist.optimizer.AdamW, ...), got {type(optimizer).__name__}"
            )
        self._inner_opt = optimizer
        self._hcg = hcg
        self._strategy = strategy
        self._params = list(optimizer._parameter_list)
        self._merge_k = strategy.gradient_merge_steps
        self._merge_avg = strategy.gradient_merge_avg
        self._calls = 0
        clip = optimizer._grad_clip
        # Global-norm clipping needs the hybrid groups; it runs here, on reduced gradients.
        self._clip = clip if isinstance(clip, ClipGradByGlobalNorm) else None
        if self._clip is not None:
            optimizer._grad_clip = None
        self._sharding = hcg.get_sharding_parallel_world_size()
        self._stage = strategy.sharding_stage
        group = hcg.get_sharding_parallel_group()
        positions = (
            partition_parameters(self._params, self._sharding) if self._sharding > 1 else [0] * len(self._params)
        )
        self._owner = {id(p): group.ranks[pos] for p, pos in zip(self._params, positions, strict=True)}
        me = hcg.get_global_rank()
        self._owned = [p for p in self._params if self._owner[id(p)] == me]
        optimizer._parameter_list = list(self._owned)  # optimizer states exist for these only
        if strategy.offload:
            offload_optimizer(optimizer)

    # ------------------------------------------------------------------ Paddle's optimizer surface
    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner_opt, name)

    @property
    def inner_opt(self) -> Optimizer:
        return self._inner_opt

    def owner_of(self, p: Tensor) -> int:
        """The global rank that updates ``p`` (this rank's own without sharding)."""
        return self._owner[id(p)]

    def _merge_boundary(self) -> bool:
        return self._calls % self._merge_k == 0

    def clear_grad(self, set_to_zero: bool = True) -> None:
        if not self._merge_boundary():
            return  # gradient merge: keep accumulating until the step that applies them
        for p in self._params:
            p.clear_grad()

    clear_gradients = clear_grad

    def minimize(
        self, loss: Tensor, startup_program: Any = None, parameters: Any = None, no_grad_set: Any = None
    ) -> None:
        loss.backward()
        self.step()

    def state_dict(self) -> dict[str, Any]:
        return self._inner_opt.state_dict()

    def set_state_dict(self, state: dict[str, Any]) -> None:
        self._inner_opt.set_state_dict(state)

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        self._calls += 1
        if not self._merge_boundary():
            return
        with autograd.no_grad():
            if self._merge_k > 1 and self._merge_avg:
                for p in self._params:
                    if p.grad is not None:
                        p.grad = Tensor(p.grad.numpy() / self._merge_k)
            self._reduce_gradients()
            if self._clip is not None:
                self._clip_gradients(self._clip.clip_norm)
        self._inner_opt.step()
        if self._sharding > 1:
            self._broadcast_parameters()

    def _reduce_gradients(self) -> None:
        hcg = self._hcg
        me = hcg.get_global_rank()
        groups = []  # the groups every remaining gradient is averaged over, fused in buckets
        if self._sharding > 1 and self._stage == 1:
            groups.append(hcg.get_sharding_parallel_group())
        if hcg.get_data_parallel_world_size() > 1:
            groups.append(hcg.get_data_parallel_group())
        pending: list[tuple[Tensor, np.ndarray]] = []
        for p in self._params:
            if p.grad is None:
                continue  # unused on every replica alike (they run the same program)
            g = np.array(p.grad.numpy(), copy=True)
            if self._sharding > 1 and self._stage == 2:
                owner = self._owner[id(p)]
                t = Tensor(g)
                reduce(t, dst=owner, op=ReduceOp.SUM, group=hcg.get_sharding_parallel_group())
                if owner != me:
                    p.grad = None  # stage 2: only the owner keeps the gradient
                    continue
                g = t.numpy() / self._sharding
            pending.append((p, g))
        for bucket in self._buckets(pending):
            flat = Tensor(np.concatenate([g.reshape(-1) for _, g in bucket]))
            for group in groups:
                all_reduce(flat, op=ReduceOp.AVG, group=group)
            values, start = flat.numpy(), 0
            for p, g in bucket:
                p.grad = Tensor(values[start : start + g.size].reshape(g.shape))
                start += g.size

    def _buckets(self, pending: list[tuple[Tensor, np.ndarray]]) -> list[list[tuple[Tensor, np.ndarray]]]:
        """Consecutive gradients of one dtype, each bucket closed once it holds ``segment_broadcast_MB``:
        one collective per bucket instead of one per tensor (the sums are the same, element by element)."""
        buckets: list[list[tuple[Tensor, np.ndarray]]] = []
        size = 0
        for p, g in pending:
            if not buckets or size >= self._strategy.bucket_bytes or buckets[-1][0][1].dtype != g.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append((p, g))
            size += g.nbytes
        return buckets

    def _clip_gradients(self, clip_norm: float) -> None:
        hcg = self._hcg
        split_sq, whole_sq = 0.0, 0.0
        for p in self._owned:
            if p.grad is None or not p.need_clip:
                continue
            if not p.is_firstly_shared:
                continue  # a weight tied across stages counts once, on its first stage
            sq = float(np.sum(np.square(p.grad.numpy(), dtype=np.float64)))
            if p.is_distributed:
                split_sq += sq
            else:
                whole_sq += sq
        # Every member makes every call, even with nothing to add, so the groups stay matched.
        total = Tensor(np.array([split_sq], dtype=np.float64))
        if hcg.get_model_parallel_world_size() > 1:
            all_reduce(total, group=hcg.get_model_parallel_group())
        total = Tensor(total.numpy() + whole_sq)
        if self._sharding > 1:
            all_reduce(total, group=hcg.get_sharding_parallel_group())
        if hcg.get_pipe_parallel_world_size() > 1:
            all_reduce(total, group=hcg.get_pipe_parallel_group())
        norm = float(np.sqrt(total.numpy()[0]))
        if norm <= clip_norm:
            return
        factor = clip_norm / norm
        for p in self._owned:
            if p.grad is not None and p.need_clip:
                g = p.grad.numpy()
                p.grad = Tensor((g * factor).astype(g.dtype, copy=False))

    def _broadcast_parameters(self) -> None:
        group = self._hcg.get_sharding_parallel_group()
        for p in self._params:
            broadcast(p, src=self._owner[id(p)], group=group)


__all__ = ["HybridParallelOptimizer", "partition_parameters"]
