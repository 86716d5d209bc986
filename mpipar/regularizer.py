"""Paddle's ``paddle.regularizer``: weight decay given to an optimizer's ``weight_decay=``.

    opt = paddle.optimizer.Momentum(..., weight_decay=paddle.regularizer.L2Decay(1e-4))

``L2Decay(c)`` adds ``c * p`` and ``L1Decay(c)`` adds ``c * sign(p)`` to each parameter's
gradient before the update, on each shard (the penalty is elementwise, so it needs no
communication and a distributed update stays bit-for-bit the dense one). ``AdamW`` keeps its
own decoupled decay, as in Paddle.
"""

from mpipar.optimizer.optimizer import L1Decay, L2Decay

__all__ = ["L1Decay", "L2Decay"]
