"""``paddle.base.core`` as the seeds use it: ``core.Graph(program.desc)``."""

from __future__ import annotations

from typing import Any

from mpipar.compat.unsupported import unsupported
from mpipar.compile.plan import Plan
from mpipar.compile.program import CPUPlace, CUDAPlace, ProgramDesc


class Graph:
    """The graph of a program's desc (``program.desc``): what ``IrGraph`` draws."""

    def __init__(self, desc: Any) -> None:
        if not isinstance(desc, ProgramDesc):
            raise TypeError(
                f"core.Graph needs a program's .desc (a static.Program, or an Engine's main_program), "
                f"got {type(desc).__name__}"
            )
        self.desc = desc

    def plan(self) -> Plan:
        return self.desc.plan()


def is_compiled_with_cuda() -> bool:
    """True where CuPy can reach a GPU (mpipar's NCCL backend), as Paddle's answers for its build."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


Scope = unsupported("paddle.base.core.Scope", "mpipar programs keep values in their tensors; there is no scope")

__all__ = ["CPUPlace", "CUDAPlace", "Graph", "Scope", "is_compiled_with_cuda"]
