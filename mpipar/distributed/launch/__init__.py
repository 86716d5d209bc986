"""``paddle.distributed.launch`` spelled for mpipar: ``python -m mpipar.distributed.launch``.

    python -m mpipar.distributed.launch --gpus=0,1 --log_dir logs train.py

Paddle's flags (``--devices``/``--gpus``, ``--nproc_per_node``, ``--ips``, ``--log_dir``,
``--max_restart``) on mpipar's launcher (``mpipar launch``; ``docs/launching.md``).
"""

from mpipar.launch import paddle_main as main

__all__ = ["main"]
