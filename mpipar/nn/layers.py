"""Common layers with Paddle's signatures: Linear, Embedding, LayerNorm, Dropout, activations,
containers, CrossEntropyLoss, and the tensor-parallel linears of the primer's manual style."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from mpipar.distribute import reshard, shard_tensor
from mpipar.mesh import ProcessMesh
from mpipar.nn import functional as F
from mpipar.nn.initializer import Constant
from mpipar.nn.layer import Layer, ParamAttr
from mpipar.ops.linalg import matmul
from mpipar.ops.math import add
from mpipar.placement import Placement, Replicate, Shard
from mpipar.tensor import Tensor


class Linear(Layer):
    """``y = x @ weight + bias`` with Paddle's (in_features, out_features) weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight_attr: ParamAttr | None = None,
        bias_attr: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter([in_features, out_features], attr=weight_attr)
        self.bias = None if bias_attr is False else self.create_parameter([out_features], attr=bias_attr, is_bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(Layer):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        sparse: bool = False,
        weight_attr: ParamAttr | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.weight = self.create_parameter([num_embeddings, embedding_dim], attr=weight_attr)

    def forward(self, x: Tensor) -> Tensor:
        return F.embedding(x, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _ones_attr(weight_attr: Any) -> ParamAttr:
    """A norm's scale: the given ParamAttr (initialised to ones unless it says otherwise), or ones."""
    attr = weight_attr if isinstance(weight_attr, ParamAttr) else ParamAttr(initializer=Constant(1.0))
    if attr.initializer is None:
        attr.initializer = Constant(1.0)
    return attr


class LayerNorm(Layer):
    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        epsilon: float = 1e-5,
        weight_attr: Any = None,
        bias_attr: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
        self.epsilon = epsilon
        w_attr = _ones_attr(weight_attr)
        self.weight = None if weight_attr is False else self.create_parameter(self.normalized_shape, attr=w_attr)
        self.bias = (
            None if bias_attr is False else self.create_parameter(self.normalized_shape, attr=bias_attr, is_bias=True)
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.epsilon)

    def extra_repr(self) -> str:
        return f"normalized_shape={self.normalized_shape}, epsilon={self.epsilon}"


class RMSNorm(Layer):
    """``x / sqrt(mean(x^2) + epsilon) * weight`` over the trailing dims (Llama's norm: no
    centring, no bias)."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        epsilon: float = 1e-6,
        weight_attr: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
        self.epsilon = epsilon
        self.weight = self.create_parameter(self.normalized_shape, attr=_ones_attr(weight_attr))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.epsilon)

    def extra_repr(self) -> str:
        return f"normalized_shape={self.normalized_shape}, epsilon={self.epsilon}"


class SiLU(Layer):
    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Dropout(Layer):
    def __init__(
        self, p: float = 0.5, axis: Any = None, mode: str = "upscale_in_train", name: str | None = None
    ) -> None:
        super().__init__()
        self.p, self.axis, self.mode = p, axis, mode

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.axis, self.training, self.mode)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ReLU(Layer):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class GELU(Layer):
    def __init__(self, approximate: bool = False, name: str | None = None) -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)


class Softmax(Layer):
    def __init__(self, axis: int = -1, name: str | None = None) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, self.axis)


class Sequential(Layer):
    def __init__(self, *layers: Layer) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_sublayer(str(i), layer)

    def forward(self, x: Any) -> Any:
        for layer in self._sub_layers.values():
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Layer:
        return list(self._sub_layers.values())[i]

    def __len__(self) -> int:
        return len(self._sub_layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._sub_layers.values())


class LayerList(Layer):
    def __init__(self, sublayers: Iterable[Layer] | None = None) -> None:
        super().__init__()
        for layer in sublayers or []:
            self.append(layer)

    def append(self, layer: Layer) -> LayerList:
        self.add_sublayer(str(len(self._sub_layers)), layer)
        return self

    def __getitem__(self, i: int) -> Layer:
        return list(self._sub_layers.values())[i]

    def __len__(self) -> int:
        return len(self._sub_layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._sub_layers.values())


class CrossEntropyLoss(Layer):
    def __init__(
        self,
        weight: Any = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        soft_label: bool = False,
        axis: int = -1,
        use_softmax: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.soft_label, self.axis = ignore_index, reduction, soft_label, axis
        self.weight = weight

    def forward(self, input: Tensor, label: Tensor) -> Tensor:
        return F.cross_entropy(input, label, self.weight, self.ignore_index, self.reduction, self.soft_label, self.axis)


# ------------------------------------------------------------------ manual tensor parallelism
def _axis_placements(mesh: ProcessMesh, axis: str | int, placement: Placement) -> list[Placement]:
    """``placement`` on ``axis``, Replicate on every other axis (a weight's layout)."""
    a = mesh.axis_index(axis)
    return [placement if i == a else Replicate() for i in range(mesh.ndim)]


def reshard_axis(t: Tensor, mesh: ProcessMesh, axis: str | int, placement: Placement) -> Tensor:
    """Change ``t``'s placement on one mesh axis only (others, e.g. data parallel, stay)."""
    a = mesh.axis_index(axis)
    current = t.placements if t.is_dist and t.spec.mesh.same_layout(mesh) else [Replicate()] * mesh.ndim
    return reshard(t, mesh, [placement if i == a else p for i, p in enumerate(current)])


class ColumnParallelLinear(Layer):
    """Megatron's column-parallel linear, written with placements.

    The weight (in, out) is ``Shard(1)`` on mesh axis ``axis``, the bias ``Shard(0)``: each
    rank computes a slice of the output columns. ``gather_output`` reshards the output to
    Replicate (an all_gather); otherwise it stays split for a following RowParallelLinear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: ProcessMesh,
        axis: str | int = 0,
        weight_attr: Any = None,
        has_bias: bool = True,
        gather_output: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.axis, self.gather_output = mesh, axis, gather_output
        self.weight = shard_tensor(
            self.create_parameter([in_features, out_features], attr=weight_attr),
            mesh,
            _axis_placements(mesh, axis, Shard(1)),
        )
        self.bias = (
            shard_tensor(
                self.create_parameter([out_features], is_bias=True), mesh, _axis_placements(mesh, axis, Shard(0))
            )
            if has_bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            out = reshard_axis(out, self.mesh, self.axis, Replicate())
        return out


class RowParallelLinear(Layer):
    """Megatron's row-parallel linear, written with placements.

    The weight (in, out) is ``Shard(0)`` on mesh axis ``axis``: each rank multiplies its
    slice of the input features and the output is Partial(sum), reduced to Replicate (one
    all_reduce) before the replicated bias is added. ``input_is_parallel`` says the input
    already arrives split on its last dim (from a ColumnParallelLinear); otherwise the rule
    slices it locally.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: ProcessMesh,
        axis: str | int = 0,
        weight_attr: Any = None,
        has_bias: bool = True,
        input_is_parallel: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.axis, self.input_is_parallel = mesh, axis, input_is_parallel
        self.weight = shard_tensor(
            self.create_parameter([in_features, out_features], attr=weight_attr),
            mesh,
            _axis_placements(mesh, axis, Shard(0)),
        )
        self.bias = (
            shard_tensor(
                self.create_parameter([out_features], is_bias=True), mesh, _axis_placements(mesh, axis, Replicate())
            )
            if has_bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = matmul(x, self.weight)
        out = reshard_axis(out, self.mesh, self.axis, Replicate())
        return add(out, self.bias) if self.bias is not None else out
