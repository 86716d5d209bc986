"""``fleet.meta_parallel``: tensor-parallel layers (manual collectives) and pipeline layers."""

from mpipar.compat.fleet.meta_parallel.mp_layers import (
    ColumnParallelLinear,
    ParallelCrossEntropy,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mpipar.compat.fleet.meta_parallel.pipeline_parallel import PipelineParallel
from mpipar.compat.fleet.meta_parallel.pp_layers import LayerDesc, PipelineLayer, SharedLayerDesc

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
