"""``dist.optimizer``: Paddle's optimizers and learning-rate schedules on distributed parameters."""

from mpipar.optimizer import lr
from mpipar.optimizer.offload import OffloadConfig, offload_optimizer
from mpipar.optimizer.optimizer import ClipGradByGlobalNorm, L1Decay, L2Decay, Optimizer
from mpipar.optimizer.sgd_momentum_adam import SGD, Adam, AdamW, Momentum

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "ClipGradByGlobalNorm",
    "L1Decay",
    "L2Decay",
    "Momentum",
    "OffloadConfig",
    "Optimizer",
    "lr",
    "offload_optimizer",
]
