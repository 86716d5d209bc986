"""``dist.nn.Layer``: Paddle's layer base class -- parameters, sublayers, state dict, modes, hooks.

Parameters are created lazily (``create_parameter``): their values come from a counter-based
initializer, so marking a parameter with ``shard_tensor`` before its first use makes every
rank generate only its own shard, and every layout holds the same values.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpipar import hooks
from mpipar import random as mrandom
from mpipar.distribute import reshard_to
from mpipar.nn.initializer import Constant, Initializer, XavierUniform
from mpipar.tensor import Parameter, Tensor

_default_dtype = [np.dtype(np.float32)]


def set_default_dtype(dtype: Any) -> None:
    """The dtype new parameters get (Paddle's ``paddle.set_default_dtype``)."""
    d = np.dtype(dtype)
    if not np.issubdtype(d, np.floating):
        raise TypeError(f"the default dtype must be a float type, got {d}")
    _default_dtype[0] = d


def get_default_dtype() -> np.dtype:
    return _default_dtype[0]


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """Build layers with ``dtype`` inside the block (a model honouring its config's dtype)."""
    saved = _default_dtype[0]
    set_default_dtype(dtype)
    try:
        yield
    finally:
        _default_dtype[0] = saved


class ParamAttr:
    """Paddle's parameter attributes: name, initializer, trainable, learning-rate multiplier."""

    def __init__(
        self,
        name: str | None = None,
        initializer: Initializer | None = None,
        learning_rate: float = 1.0,
        trainable: bool = True,
        need_clip: bool = True,
    ) -> None:
        self.name, self.initializer, self.learning_rate = name, initializer, learning_rate
        self.trainable, self.need_clip = trainable, need_clip


def parameter_initializer(attr: ParamAttr, is_bias: bool, default: Initializer | None = None) -> Initializer:
    """The initializer a parameter gets: ``attr``'s, else ``default``, else zeros for a bias and
    XavierUniform for a weight (Paddle's rule)."""
    return attr.initializer or default or (Constant(0.0) if is_bias else XavierUniform())


def lazy_parameter(shape: Sequence[int], dtype: Any, box_init: Any, attr: ParamAttr) -> Parameter:
    """A lazy ``Parameter`` drawn box by box by ``box_init``, carrying ``attr``'s trainability,
    name, learning-rate factor and clipping flag."""
    p = Tensor.lazy(shape, dtype, box_init, kind=Parameter)
    assert isinstance(p, Parameter)
    p.stop_gradient = not attr.trainable
    p.name = attr.name
    p.optimize_attr = {"learning_rate": attr.learning_rate}
    p.need_clip = attr.need_clip
    return p


class Layer:
    """Base class of every layer."""

    training: bool

    def __init__(self, name_scope: str | None = None, dtype: Any = None) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_sub_layers", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_pre_hooks", [])
        object.__setattr__(self, "_post_hooks", [])
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_scope_name", name_scope or type(self).__name__.lower())
        object.__setattr__(self, "_dtype", np.dtype(dtype) if dtype is not None else get_default_dtype())

    # ------------------------------------------------------------------ registry
    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if params is None:
            raise RuntimeError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        for registry in (self._parameters, self._sub_layers, self._buffers):
            registry.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
            if value.name is None:
                value.name = name
        elif isinstance(value, Layer):
            self._sub_layers[name] = value
            object.__setattr__(value, "_scope_name", name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for registry in (self._parameters, self._sub_layers, self._buffers):
            registry.pop(name, None)
        object.__delattr__(self, name)

    def create_parameter(
        self,
        shape: Sequence[int],
        attr: ParamAttr | None = None,
        dtype: Any = None,
        is_bias: bool = False,
        default_initializer: Initializer | None = None,
    ) -> Parameter:
        """A new (lazy) parameter: XavierUniform for weights, zeros for biases, unless told."""
        attr = attr if isinstance(attr, ParamAttr) else ParamAttr()
        dt = np.dtype(dtype) if dtype is not None else self._dtype
        box_init = parameter_initializer(attr, is_bias, default_initializer).box_init(mrandom.next_key(), dt)
        return lazy_parameter(shape, dt, box_init, attr)

    def add_parameter(self, name: str, parameter: Parameter) -> Parameter:
        setattr(self, name, parameter)
        return parameter

    def add_sublayer(self, name: str, sublayer: Layer) -> Layer:
        setattr(self, name, sublayer)
        return sublayer

    def register_buffer(self, name: str, tensor: Tensor, persistable: bool = True) -> None:
        object.__setattr__(self, name, tensor)
        self._buffers[name] = tensor

    # ------------------------------------------------------------------ traversal
    def named_sublayers(self, prefix: str = "", include_self: bool = False) -> Iterator[tuple[str, Layer]]:
        if include_self:
            yield prefix, self
        for name, layer in self._sub_layers.items():
            full = f"{prefix}.{name}" if prefix else name
            yield full, layer
            yield from layer.named_sublayers(full)

    def sublayers(self, include_self: bool = False) -> list[Layer]:
        return [layer for _, layer in self.named_sublayers(include_self=include_self)]

    def children(self) -> Iterator[Layer]:
        yield from self._sub_layers.values()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for layer_name, layer in self.named_sublayers(prefix, include_self=True):
            for name, p in layer._parameters.items():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{layer_name}.{name}" if layer_name else name
                if p.name is None or p.name == name:
                    p.name = full  # the full name labels gradients and plans
                yield full, p

    def parameters(self, include_sublayers: bool = True) -> list[Parameter]:
        if not include_sublayers:
            return list(self._parameters.values())
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for layer_name, layer in self.named_sublayers(prefix, include_self=True):
            for name, b in layer._buffers.items():
                yield (f"{layer_name}.{name}" if layer_name else name), b

    def state_dict(self) -> OrderedDict[str, Tensor]:
        out: OrderedDict[str, Tensor] = OrderedDict(self.named_parameters())
        out.update(self.named_buffers())
        return out

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Copy values in place, each into the parameter's own layout."""
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise ValueError(f"set_state_dict: no value for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for key, target in own.items():
            value = state[key]
            if not isinstance(value, Tensor):
                value = Tensor(np.asarray(value, dtype=target.dtype))
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"set_state_dict: {key} has shape {list(value.shape)}, the layer's is {list(target.shape)}"
                )
            moved = reshard_to(value, target.spec) if target.is_dist else Tensor(value.full_tensor())
            target._take_storage(moved)

    load_dict = set_state_dict

    # ------------------------------------------------------------------ modes and calls
    def train(self) -> Layer:
        for layer in self.sublayers(include_self=True):
            object.__setattr__(layer, "training", True)
        return self

    def eval(self) -> Layer:
        for layer in self.sublayers(include_self=True):
            object.__setattr__(layer, "training", False)
        return self

    def register_forward_pre_hook(self, hook: Callable[..., Any]) -> Callable[[], None]:
        self._pre_hooks.append(hook)
        return lambda: self._pre_hooks.remove(hook)

    def register_forward_post_hook(self, hook: Callable[..., Any]) -> Callable[[], None]:
        self._post_hooks.append(hook)
        return lambda: self._post_hooks.remove(hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with hooks.scope(self._scope_name):
            for hook in list(self._pre_hooks):
                out = hook(self, args)
                if out is not None:
                    args = out if isinstance(out, tuple) else (out,)
            result = self.forward(*args, **kwargs)
            for hook in list(self._post_hooks):
                out = hook(self, args, result)
                if out is not None:
                    result = out
        return result

    def clear_gradients(self, set_to_zero: bool = True) -> None:
        for p in self.parameters():
            p.clear_grad()

    def full_name(self) -> str:
        return self._scope_name

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, layer in self._sub_layers.items():
            inner = repr(layer).replace("\n", "\n  ")
            lines.append(f"  ({name}): {inner}")
        return "\n".join(lines) + (")" if len(lines) == 1 else "\n)")
