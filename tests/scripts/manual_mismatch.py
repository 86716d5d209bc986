"""A manual program with a bug, for the simulator's reports (tests/unit/test_manual.py).

Default: rank 1 calls all_gather where the others call all_reduce. ``--deadlock``: rank 0
waits for a message rank 2 never sends, while the others wait in a barrier.
"""

import sys

import numpy as np

import mpipar as dist

rank = dist.get_rank()
t = dist.to_tensor(np.ones(4, "float32"))
if "--deadlock" in sys.argv:
    if rank == 0:
        dist.recv(t, src=2)
    dist.barrier()
elif rank == 1:
    dist.all_gather([], t)
else:
    dist.all_reduce(t)
