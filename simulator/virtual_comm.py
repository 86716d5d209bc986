"""The virtual communicator: every member of every group lives in this process.

Results are computed from all members' buffers in group order (the summation order every
backend uses), so a run is deterministic. One result array is shared by all members that
receive the same value (arrays are read-only). Calls are checked the way MPI would need them
to match: a member missing, a shape or dtype that disagrees with what the receiver expects,
a ``recv`` with no matching ``send`` -- each is an error here instead of a hang there.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpipar.comm import Array, Communicator, Group, PointToPoint, Shape, reduce_arrays
from mpipar.reshard.executor import freeze


class VirtualCommunicator(Communicator):
    name = "virtual"
    sums_deferred_products = True
    """``all_reduce`` takes ``mpipar._deferred.Product`` pieces (its sum is ``reduce_arrays``)."""

    def __init__(self) -> None:
        self._mailbox: dict[tuple[int, int, int], deque[Array]] = defaultdict(deque)

    @staticmethod
    def _all(op: str, group: Group, bufs: Mapping[int, Any]) -> list[Any]:
        missing = [r for r in group if r not in bufs]
        if missing:
            raise RuntimeError(
                f"{op} on group {list(group)}: rank(s) {missing} did not contribute; under MPI this "
                "collective would hang"
            )
        return [bufs[r] for r in group]

    @staticmethod
    def _check_same(op: str, group: Group, arrays: Sequence[Array]) -> None:
        first = arrays[0]
        for r, a in zip(group, arrays, strict=True):
            if a.shape != first.shape or a.dtype != first.dtype:
                raise RuntimeError(
                    f"{op} on group {list(group)}: rank {r} passes {a.dtype}{list(a.shape)} but rank "
                    f"{group[0]} passes {first.dtype}{list(first.shape)}"
                )

    def _all_reduce(self, group: Group, bufs: Mapping[int, Array], op: str) -> dict[int, Array]:
        arrays = self._all("all_reduce", group, bufs)
        self._check_same("all_reduce", group, arrays)
        result = freeze(reduce_arrays(arrays, op))
        return {r: result for r in group}

    def _all_gather(self, group: Group, bufs: Mapping[int, Array], shapes: Sequence[Shape]) -> dict[int, list[Array]]:
        arrays = self._all("all_gather", group, bufs)
        for r, a, s in zip(group, arrays, shapes, strict=True):
            if tuple(a.shape) != tuple(s):
                raise RuntimeError(
                    f"all_gather on group {list(group)}: rank {r} passes shape {list(a.shape)}, others expect {list(s)}"
                )
        return {r: arrays for r in group}

    def _reduce_scatter(self, group: Group, chunks: Mapping[int, Sequence[Array]], op: str) -> dict[int, Array]:
        rows = self._all("reduce_scatter", group, chunks)
        out = {}
        for i, m in enumerate(group):
            column = [row[i] for row in rows]
            self._check_same("reduce_scatter", group, column)
            out[m] = freeze(reduce_arrays(column, op))
        return out

    def _all_to_all(
        self, group: Group, chunks: Mapping[int, Sequence[Array]], recv_shapes: Mapping[int, Sequence[Shape]]
    ) -> dict[int, list[Array]]:
        rows = self._all("all_to_all", group, chunks)
        out = {}
        for j, r in enumerate(group):
            received = [row[j] for row in rows]
            for src, a, s in zip(group, received, recv_shapes[r], strict=True):
                if tuple(a.shape) != tuple(s):
                    raise RuntimeError(
                        f"all_to_all on group {list(group)}: rank {src} sends {list(a.shape)} to rank {r}, "
                        f"which expects {list(s)}"
                    )
            out[r] = received
        return out

    def _broadcast(
        self, group: Group, bufs: Mapping[int, Array | None], root: int, shape: Shape, dtype: np.dtype
    ) -> dict[int, Array]:
        value = bufs.get(root)
        if value is None:
            raise RuntimeError(f"broadcast on group {list(group)}: root {root} has no buffer")
        if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
            raise RuntimeError(
                f"broadcast root {root} passes {value.dtype}{list(value.shape)}, members expect {dtype}{list(shape)}"
            )
        return {r: value for r in group}

    def _reduce(self, group: Group, bufs: Mapping[int, Array], op: str, root: int) -> dict[int, Array]:
        arrays = self._all("reduce", group, bufs)
        self._check_same("reduce", group, arrays)
        return {root: freeze(reduce_arrays(arrays, op))}

    def _exchange(self, transfers: Sequence[PointToPoint], hosted: set[int]) -> dict[tuple[int, int, int], Array]:
        out = {}
        for t in transfers:
            if t.data is None:
                raise RuntimeError(f"transfer {t.src} -> {t.dst}: the sender has no data")
            if tuple(t.data.shape) != tuple(t.shape):
                raise RuntimeError(
                    f"transfer {t.src} -> {t.dst}: sends {list(t.data.shape)}, receiver expects {list(t.shape)}"
                )
            out[(t.src, t.dst, t.tag)] = t.data
        return out

    def _send(self, src: int, dst: int, buf: Array, tag: int) -> None:
        self._mailbox[(src, dst, tag)].append(freeze(buf))

    def _recv(self, src: int, dst: int, shape: Shape, dtype: np.dtype, tag: int) -> Array:
        box = self._mailbox.get((src, dst, tag))
        if not box:
            raise RuntimeError(
                f"rank {dst} receives from rank {src} (tag {tag}) but nothing was sent; under MPI this would deadlock"
            )
        value = box.popleft()
        if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
            raise RuntimeError(
                f"rank {dst} expects {dtype}{list(shape)} from rank {src} (tag {tag}) but got "
                f"{value.dtype}{list(value.shape)}"
            )
        return value

    def _barrier(self, group: Group) -> None:
        return None

    def pending(self) -> list[tuple[int, int, int]]:
        """Point-to-point messages sent but never received (a schedule bug under MPI)."""
        return [k for k, q in self._mailbox.items() if q]
