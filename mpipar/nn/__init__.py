"""``dist.nn``: layers (Paddle's names), initializers and the functional API."""

from mpipar.nn import functional, initializer
from mpipar.nn.layer import Layer, ParamAttr, get_default_dtype, set_default_dtype
from mpipar.nn.layers import (
    GELU,
    ColumnParallelLinear,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerList,
    LayerNorm,
    Linear,
    ReLU,
    RMSNorm,
    RowParallelLinear,
    Sequential,
    SiLU,
    Softmax,
    reshard_axis,
)

__all__ = [
    "GELU",
    "ColumnParallelLinear",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Layer",
    "LayerList",
    "LayerNorm",
    "Linear",
    "ParamAttr",
    "RMSNorm",
    "ReLU",
    "RowParallelLinear",
    "Sequential",
    "SiLU",
    "Softmax",
    "functional",
    "get_default_dtype",
    "initializer",
    "reshard_axis",
    "set_default_dtype",
]
