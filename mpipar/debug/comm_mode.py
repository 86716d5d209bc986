"""CommDebugMode: record every communication step run inside a ``with`` block.

    with dist.CommDebugMode() as comm:
        y = dist.reshard(x, mesh, [dist.Replicate()])
    comm.counts()        # {'all_gather': 1}
    comm.events[0].ranks # (0, 1, 2, 3)

One event per collective call on one rank group (a point-to-point transfer is one ``send``
event with ``ranks == (src, dst)``); sizes are one member's local buffers. In the simulator
a collective over a 2x4 mesh's rows is 2 calls (one per group); under MPI each process
records the calls it takes part in.

A reshard a consumer did not make because an earlier consumer of the same value had (each
reshard once) is no call: it is listed in ``reused`` and in ``table()`` as ``reused``, never
counted.
"""

from __future__ import annotations

from collections import Counter
from types import TracebackType

from mpipar.comm import CommEvent, ReusedReshard, _recorders


class CommDebugMode:
    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self.reused: list[ReusedReshard] = []

    def record(self, event: CommEvent) -> None:
        self.events.append(event)

    def record_reused(self, note: ReusedReshard) -> None:
        self.reused.append(note)

    def counts(self) -> dict[str, int]:
        """Number of events per op, e.g. ``{'all_reduce': 2, 'all_gather': 1}``."""
        return dict(Counter(e.op for e in self.events))

    def get_total_counts(self) -> int:
        return len(self.events)

    def bytes_by_op(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for e in self.events:
            out[e.op] += e.input_nbytes
        return dict(out)

    def table(self) -> str:
        """The events as text, one line each, then the reshards reused (no call) after them."""
        lines = [str(e) for e in self.events] + [str(r) for r in self.reused]
        return "\n".join(lines) or "(no communication)"

    def __enter__(self) -> CommDebugMode:
        _recorders.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _recorders.remove(self)
