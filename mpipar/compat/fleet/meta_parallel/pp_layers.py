"""``PipelineLayer``: a model given as a list of layer descriptions, cut into pipeline stages.

    layers = [LayerDesc(Embed, vocab, hidden), *[LayerDesc(Block, hidden) for _ in range(4)],
              LayerDesc(Head, hidden, vocab)]
    model = PipelineLayer(layers, num_stages=hcg.get_pipe_parallel_world_size(), loss_fn=Loss())

Each rank builds only the layers of its own stage (that is the memory saving), so the
descriptions are built lazily. To give every stage the weights one device would have, layer
``i`` is always built with the random generator at the same state, a pure function of the
generator's state when the ``PipelineLayer`` was made and of ``i``; after construction the
generator moves on by one draw whatever the number of stages. A ``Layer`` instance or a
plain function in the list is kept as given (functions have no weights; an instance already
drew its weights where it was made).

``SharedLayerDesc(key, cls, forward_func, shared_weight_attr, *args)`` entries with the same
key are one layer (tied input and output embeddings): one device builds it once and uses it
at every position; each stage holding a position builds it from the random state of the
key's first position (the same weights), and after the backward pass the stages holding it
all-reduce the shared weight's gradient (``allreduce_shared_weight_gradients``), so every
copy takes the step one device takes. Clipping counts the weight on its first stage only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpipar import random as mrandom
from mpipar.compat.collective import all_reduce, new_group
from mpipar.compat.fleet.base import hcg_or_none, resolved_strategy
from mpipar.nn.layer import Layer
from mpipar.recompute import recompute
from mpipar.tensor import Tensor


class LayerDesc:
    """A layer not built yet: ``layer_func(*inputs, **kwargs)`` on the stage that owns it."""

    def __init__(self, layer_func: type[Layer], *inputs: Any, **kwargs: Any) -> None:
        if not (isinstance(layer_func, type) and issubclass(layer_func, Layer)):
            raise TypeError(f"LayerDesc: layer_func must be a dist.nn.Layer subclass, got {layer_func!r}")
        self.layer_func, self.inputs, self.kwargs = layer_func, inputs, kwargs

    def build_layer(self) -> Layer:
        return self.layer_func(*self.inputs, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerDesc({self.layer_func.__name__})"


class SharedLayerDesc(LayerDesc):
    """A layer shared by several positions of the pipeline: ``forward_func(layer, x)`` at each
    (the layer's own ``forward`` when None); ``shared_weight_attr`` names the tied parameter."""

    def __init__(
        self,
        key: str,
        layer_func: type[Layer],
        forward_func: Callable[..., Any] | None = None,
        shared_weight_attr: str = "weight",
        *inputs: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(layer_func, *inputs, **kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"SharedLayerDesc: key must be a non-empty string, got {key!r}")
        self.layer_name, self.forward_func, self.shared_weight_attr = key, forward_func, shared_weight_attr

    def __repr__(self) -> str:
        return f"SharedLayerDesc({self.layer_name!r}, {self.layer_func.__name__})"


def segment_uniform(num_items: int, num_parts: int) -> list[int]:
    """Stage boundaries (Paddle's ``uniform``): equal counts, the later stages taking the remainder."""
    if num_items < num_parts:
        raise ValueError(
            f"PipelineLayer: {num_items} layers cannot fill {num_parts} pipeline stages; give at least one per stage"
        )
    bounds = [0]
    per, extra = divmod(num_items, num_parts)
    for i in range(1, num_parts + 1):
        bounds.append(bounds[-1] + per + (1 if i > num_parts - extra else 0))
    return bounds


class PipelineLayer(Layer):
    """The stage of ``layers`` that this rank runs; ``forward`` runs it, ``loss_fn`` ends the last stage."""

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., Any] | None = None,
        seg_method: str = "uniform",
        recompute_interval: int = 0,
        recompute_ctx: Any = None,
        num_virtual_pipeline_stages: int | None = None,
    ) -> None:
        super().__init__()
        hcg = hcg_or_none()
        pp = hcg.get_pipe_parallel_world_size() if hcg is not None else 1
        if topology is not None:
            pp = topology.get_dim("pipe")
        if num_stages is None:
            num_stages = pp
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineLayer: num_stages = {num_stages!r} must be a positive int")
        if num_stages != pp:
            raise ValueError(
                f"PipelineLayer: num_stages = {num_stages} but the topology's pp_degree is {pp}; "
                "pass num_stages=hcg.get_pipe_parallel_world_size()"
            )
        if num_virtual_pipeline_stages not in (None, 1):
            raise ValueError(
                f"PipelineLayer: num_virtual_pipeline_stages = {num_virtual_pipeline_stages}: interleaved stages are not supported"
            )
        if seg_method != "uniform":
            raise ValueError(f"PipelineLayer: seg_method = {seg_method!r}; only 'uniform' is supported")
        if isinstance(recompute_interval, bool) or not isinstance(recompute_interval, int) or recompute_interval < 0:
            raise ValueError(f"PipelineLayer: recompute_interval = {recompute_interval!r} must be an int >= 0")
        if recompute_interval == 0 and hcg is not None and resolved_strategy("PipelineLayer").recompute:
            recompute_interval = 1  # strategy.recompute: every layer keeps only its input
        items = list(layers)
        for i, item in enumerate(items):
            if not (isinstance(item, LayerDesc | Layer) or callable(item)):
                raise TypeError(
                    f"PipelineLayer: layers[{i}] is {type(item).__name__}; give a LayerDesc, a Layer or a function"
                )
        self.num_stages = num_stages
        self.stage_id = hcg.get_stage_id() if hcg is not None else 0
        self.segment_parts = segment_uniform(len(items), num_stages)
        self._loss_fn = loss_fn
        self._recompute_interval = recompute_interval
        self._start, self._end = self.segment_parts[self.stage_id], self.segment_parts[self.stage_id + 1]
        base = mrandom.get_rng_state()

        def build(desc: LayerDesc, index: int) -> Layer:
            mrandom.set_rng_state({"seed": mrandom.key_for(base["seed"], base["draws"], index), "draws": 0})
            return desc.build_layer()

        first: dict[str, int] = {}
        holders: dict[str, set[int]] = {}
        for i, item in enumerate(items):
            if isinstance(item, SharedLayerDesc):
                first.setdefault(item.layer_name, i)
                holders.setdefault(item.layer_name, set()).add(self.get_stage_from_index(i))
        self.shared_layers: dict[str, Layer] = {}
        self.run_function: list[Callable[..., Any]] = []
        try:
            for i in range(self._start, self._end):
                item = items[i]
                if isinstance(item, SharedLayerDesc):
                    key = item.layer_name
                    if key not in self.shared_layers:
                        self.shared_layers[key] = build(item, first[key])
                        self.add_sublayer(f"shared_{key}", self.shared_layers[key])
                    layer = self.shared_layers[key]
                    fn = item.forward_func
                    self.run_function.append(layer if fn is None else (lambda x, f=fn, m=layer: f(m, x)))
                    continue
                if isinstance(item, LayerDesc):
                    item = build(item, i)
                if isinstance(item, Layer):
                    self.add_sublayer(str(i), item)
                self.run_function.append(item)
        finally:
            mrandom.set_rng_state({"seed": base["seed"], "draws": base["draws"] + 1})
        self._shared: list[tuple[str, Any, Tensor]] = []
        attrs = {item.layer_name: item.shared_weight_attr for item in items if isinstance(item, SharedLayerDesc)}
        for key in sorted(holders):  # every rank makes the groups in the same order
            stages = sorted(holders[key])
            if hcg is None or len(stages) < 2:
                continue
            group = new_group([hcg.get_rank_from_stage(st) for st in stages])
            if key in self.shared_layers:
                weight = getattr(self.shared_layers[key], attrs[key], None)
                if not isinstance(weight, Tensor):
                    raise ValueError(
                        f"SharedLayerDesc {key!r}: the layer has no parameter {attrs[key]!r} (shared_weight_attr)"
                    )
                if self.stage_id != stages[0]:
                    weight.is_firstly_shared = False
                self._shared.append((key, group, weight))

    def allreduce_shared_weight_gradients(self) -> None:
        """Sum the gradients of each shared weight over the stages holding it (each used it on its part)."""
        for _key, group, weight in self._shared:
            g = weight.grad if weight.grad is not None else Tensor(np.zeros(tuple(weight.shape), dtype=weight.dtype))
            g = Tensor(np.array(g.numpy(), copy=True))
            all_reduce(g, group=group)
            weight.grad = g

    def get_stage_from_index(self, layer_idx: int) -> int:
        for stage in range(self.num_stages):
            if self.segment_parts[stage] <= layer_idx < self.segment_parts[stage + 1]:
                return stage
        raise ValueError(f"PipelineLayer: layer index {layer_idx} is outside the {self.segment_parts[-1]} layers")

    def _run(self, start: int, end: int, x: Any) -> Any:
        for fn in self.run_function[start:end]:
            x = fn(*x) if isinstance(x, tuple) else fn(x)
        return x

    def forward(self, input: Any) -> Any:
        n = len(self.run_function)
        if self._recompute_interval == 0:
            return self._run(0, n, input)
        x = input
        for start in range(0, n, self._recompute_interval):
            end = min(n, start + self._recompute_interval)
            x = recompute(lambda t, s=start, e=end: self._run(s, e, t), x)
        return x

    def extra_repr(self) -> str:
        return f"stage {self.stage_id} of {self.num_stages}: layers {self._start}..{self._end - 1}"


__all__ = ["LayerDesc", "PipelineLayer", "SharedLayerDesc", "segment_uniform"]
