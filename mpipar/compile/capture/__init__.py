"""A captured step: the training step as a flat program of local array work, run without ``fn``.

    train_step = dist.compile_step(step, capture=True)
    for x in loader():
        loss = train_step(x)          # the first two or three calls trace eagerly; later ones run the program

``compile_step(fn, capture=True)`` traces ``fn`` at the level of local arrays: every kernel call
on local shards (``ops.dispatch``), every reshard's execution on the communicator
(``distribute._reshard_now``), the seed of backward (``ops.creation.ones_like_global``), the
optimizer's per-shard update (``Optimizer._step_param``) and its step counters. Each call
becomes one pre-bound instruction over numbered slots. Once two consecutive traced calls of
the same layout key give the same program instruction by instruction (same functions, the
same non-array arguments, the same tensors read by identity) and a validation run of that
program from a copy of the step's starting state reproduces the eager call bit for bit, later
calls run the program instead of ``fn``: no per-op Python (rules, tape, autograd engine,
optimizer loop), only the kernels and collectives on the step's data, so results stay
bit-identical to eager. The program then puts its results back where eager leaves them: the
parameters' storage, ``.grad`` (None after ``clear_grad``), the optimizer's states and step
counts, and returns Tensors built from its outputs.

Semantics, as ``jax.jit``'s: Python side effects inside ``fn`` (prints, appends, counters)
run only on traced calls; ``fn`` must return Tensors (in tuples, lists, dicts) or None; the
returned Tensors of a captured call carry no autograd history; Python values among the
arguments are part of the program's key (static arguments). Values that legitimately
change between steps are read live by the instruction on every run: the learning rate
(``get_lr()``, an ``LRScheduler`` included), each parameter's ``optimize_attr`` multiplier and
the optimizer's step counts (Adam's bias correction).

Fail closed: a step the program cannot reproduce is never captured. ``.capture_refused``
says why, and such a step keeps running eagerly (with the per-op decisions replayed). Refused:
a step that reads a tensor's value in Python (``float(loss)``, ``.numpy()``, ``.item()``,
``full_tensor()``, ``local_tensor()``: control flow on data), returns anything but Tensors,
draws a new random key per call (dropout: its attribute differs between the two traces), uses
an array made by code the capture does not see (it shows up as a different array each call),
communicates outside a reshard (a tripwire on the communicator), runs under observers (plan
tracing, timelines, pipeline stage runs), or whose validation run differs in any bit. A
captured program is checked on every call (the layout key, every tensor it reads still alive
and laid out as traced, every gradient and optimizer state present as traced, no observer) and
falls back to tracing when a check fails. Under MPI every traced call ends with the ranks
agreeing (a small all-reduce) on whether to validate and capture, so all take the same path.

The package, bottom to top: ``instructions`` (the records: ``Instruction`` and its ``Kind``,
the run form ``Step`` and its ``RunKind``), ``sources`` (where a program reads the arrays it
does not make), ``results`` (where it puts its results back), ``tracer`` (recording one eager
call, describing its results, the validation run), ``passes`` (folding, repeats, moved-up and
in-place updates, last uses), ``program`` (``Program``: the checks and the run loop),
``builders`` (what each call site records, and ``StepTracer``, the tracer the call sites talk
to), ``agreement`` (observers, and the ranks agreeing on the path).
"""

from mpipar.compile.capture.agreement import agree, observed
from mpipar.compile.capture.builders import StepTracer, builtin_kernel
from mpipar.compile.capture.instructions import Instruction, Kind, Refused, RunKind, Stale, Step
from mpipar.compile.capture.passes import write_in_place
from mpipar.compile.capture.program import Program
from mpipar.compile.capture.tracer import MAX_TRACES, Tracer, Tripwire

__all__ = [
    "MAX_TRACES",
    "Instruction",
    "Kind",
    "Program",
    "Refused",
    "RunKind",
    "Stale",
    "Step",
    "StepTracer",
    "Tracer",
    "Tripwire",
    "agree",
    "builtin_kernel",
    "observed",
    "write_in_place",
]
