"""Other frameworks' spellings, built on mpipar's own API.

* ``mpipar.compat.collective``: Paddle's manual collectives (``dist.all_reduce``, ``new_group``, ...).
* ``mpipar.compat.fleet``: Paddle's ``fleet`` hybrid parallelism (public as ``mpipar.distributed.fleet``).
* ``mpipar.compat.oneflow``: OneFlow's global tensors and SBP (public as ``mpipar.oneflow``).

Users import the public front doors (``import mpipar.distributed as dist``, ``from mpipar import
oneflow as flow``); these modules hold the implementations.
"""
