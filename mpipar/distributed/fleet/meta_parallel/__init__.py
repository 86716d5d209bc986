"""``fleet.meta_parallel``; the implementation is ``mpipar.compat.fleet.meta_parallel``."""

from mpipar.compat.fleet.meta_parallel import (
    ColumnParallelLinear,
    LayerDesc,
    ParallelCrossEntropy,
    PipelineLayer,
    PipelineParallel,
    RowParallelLinear,
    SharedLayerDesc,
    VocabParallelEmbedding,
)

__all__ = [
    "ColumnParallelLinear",
    "LayerDesc",
    "ParallelCrossEntropy",
    "PipelineLayer",
    "PipelineParallel",
    "RowParallelLinear",
    "SharedLayerDesc",
    "VocabParallelEmbedding",
]
