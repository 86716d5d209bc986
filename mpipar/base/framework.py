"""``paddle.base.framework`` as the seeds use it: ``IrGraph(graph, for_test=...).draw(dir, name, [])``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpipar.base.core import Graph
from mpipar.compile.program import Program, default_main_program, default_startup_program, program_guard
from mpipar.compile.program_view import to_dot, write_graph
from mpipar.tensor import Tensor as Variable


class IrGraph:
    """A drawable program graph. ``for_test`` is accepted (the graph drawn is the program as
    recorded, with its update when it has one)."""

    def __init__(self, graph: Graph, for_test: bool = False) -> None:
        if not isinstance(graph, Graph):
            raise TypeError(f"IrGraph needs a base.core.Graph(program.desc), got {type(graph).__name__}")
        self.graph = graph
        self._for_test = bool(for_test)

    def is_test(self) -> bool:
        return self._for_test

    def to_dot(self) -> str:
        d = self.graph.desc
        return to_dot(d.plan(), title=d.title, serial=d.serial, rank=d.rank, dynamic=d.dynamic)

    def draw(
        self, save_path: str, name: str, marked_nodes: Sequence[Any] | None = None, remove_ctr_var: bool = True
    ) -> list[str]:
        """Write ``<save_path>/<name>.dot`` and, where Graphviz's ``dot`` exists, ``.svg`` and
        ``.pdf``; returns the paths written. ``marked_nodes`` and ``remove_ctr_var`` are accepted."""
        return write_graph(self.to_dot(), save_path, name)


__all__ = ["IrGraph", "Program", "Variable", "default_main_program", "default_startup_program", "program_guard"]
