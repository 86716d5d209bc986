"""The compiler: a train step traced into a plan, compiled, captured and replayed.

* ``mpipar.compile.trace``: ``PlanRecorder``, which records ops, rule decisions and reshards.
* ``mpipar.compile.plan``: the ``Plan`` value and its versioned JSON (``mpipar.plan`` files).
* ``mpipar.compile.to_static``: ``to_static`` / ``DistModel`` / ``Strategy`` (public as ``dist.to_static``).
* ``mpipar.compile.replay``: ``compile_step``, a step recorded once and replayed.
* ``mpipar.compile.capture``: captured steps, a program of local array work with its passes.
* ``mpipar.compile.plan_script``: the plan of a user's script (``mpipar plan SCRIPT``).

The public names live on ``mpipar`` (``dist.to_static``, ``dist.compile_step``); import the
submodules for the rest.
"""
