"""Paddle's ``paddle.base`` (formerly ``paddle.fluid``), as far as the seeds use it: the graph
dump of a program.

    from mpipar.base import core
    from mpipar.base.framework import IrGraph
    IrGraph(core.Graph(program.desc), for_test=True).draw(".", "main_program", [])

writes ``main_program.dot`` (and ``.svg``/``.pdf`` where Graphviz's ``dot`` is installed): the
program's ops, tensors with shapes and placements, and the communication mpipar inserted.
"""

from mpipar.base import core, framework

__all__ = ["core", "framework"]
