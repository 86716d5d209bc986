"""Paddle's ``paddle.regularizer``: weight decay given to an optimizer's ``weight_decay=``."""

from mpipar.optimizer.optimizer import L2Decay

__all__ = ["L2Decay"]
