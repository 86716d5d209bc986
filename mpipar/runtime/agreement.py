"""Cross-rank agreement by default: every collective carries its signature in its own messages.

Without a check, a rank that reduces with ``max`` while its group sums, or sends float32 where
the others send float64 of the same byte count, finishes with exit 0 and different
"replicated" values on different ranks: MPI moves bytes and cannot tell. The full check
(``MPIPAR_CHECK_COLLECTIVES=1``) exchanges JSON signatures in an extra collective per call;
this module is the cheap check that is on by default (``MPIPAR_AGREE``, default 1).

A call's signature is four 64-bit words (``signature_words``):

====  =====================================================================================
w0    a tag (0x5349), the op, the reduce op, the dtype (its type character), the root + 1
w1    the element count (all_to_all: the count this member sends to its ring successor)
w2    a hash of the shape(s) (all_gather, reduce_scatter: of every piece's shape)
w3    a hash of the group, and the call's number on that group
====  =====================================================================================

and it travels inside a message the call already sends:

* **gathered reductions** (an all-reduce or reduce small enough to gather whole buffers, the
  path of most activation and gradient reductions): the words ride as a 32-byte trailer of the
  buffer each member already sends (``trailer_elements`` extra elements of the data's dtype,
  moved as bits: these paths apply no MPI reduction op). Every receiving member compares every
  row's trailer with its own. The data elements are reduced exactly as before (the trailer
  columns are left out of the fold), so the result is bit-identical.
* **every other collective** (the split all-reduce, reduce-scatter, all-gather, all-to-all,
  broadcast, barrier, MPI's native sums): one 32-byte message to the ring successor on the
  group's own communicator, posted before the call's data moves and waited for with it (no
  synchronisation of its own). A disagreement anywhere in the group shows between some pair of
  ring neighbours, so the successor of that pair finds it. While the call blocks (a mismatch
  can make the data call wait for ever), the fault watchdog tests this message after its grace
  second and reports the mismatch itself.

A mismatch is a ``CollectiveMismatchError`` naming both ranks and both signatures (op, reduce
op, dtype, element count, root, call number), within a second or two. The hashes use Python's
``hash`` of tuples of ints, which is the same in every process (only str and bytes hashing is
salted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpipar.runtime.faults import call_text

TRAILER_BYTES = 32
_TAG = 0x5349
_M64 = (1 << 64) - 1
_OPS = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier")
_OP_CODE = {op: k + 1 for k, op in enumerate(_OPS)}
_REDUCE = ("sum", "avg", "max", "min")
_REDUCE_CODE = {op: k + 1 for k, op in enumerate(_REDUCE)}


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def signature_words(
    op: str, dtype: Any, reduce_type: str | None, parts: Mapping[str, Any], group: tuple[int, ...], seq: int
) -> np.ndarray:
    """The four words of this member's call (see the module docstring)."""
    char = ord(np.dtype(dtype).char) if dtype != "" else 0
    root = parts.get("root")
    w0 = (
        (_TAG << 48)
        | (_OP_CODE.get(op, 0) << 40)
        | (_REDUCE_CODE.get(reduce_type, 0) << 32)  # type: ignore[arg-type]
        | (char << 24)
        | ((int(root) + 1 if root is not None else 0) & 0xFFFFFF)
    )
    if "shape" in parts:
        shape = tuple(int(d) for d in parts["shape"])
        w1, w2 = _count(shape), hash(shape) & _M64
    elif "shapes" in parts:
        shapes = tuple(tuple(int(d) for d in s) for s in parts["shapes"])
        w1, w2 = sum(_count(s) for s in shapes), hash(shapes) & _M64
    elif "sends" in parts:
        successor = (group.index(_member(parts)) + 1) % len(group)
        w1, w2 = _count(parts["sends"][successor]), 0
    else:
        w1 = w2 = 0
    w3 = ((hash(group) & 0xFFFFFFFF) << 32) | (seq & 0xFFFFFFFF)
    return np.array([w0, w1 & _M64, w2, w3], dtype=np.uint64)


def _member(parts: Mapping[str, Any]) -> int:
    return int(parts["me"])


def describe(words: np.ndarray) -> str:
    """A signature in words: ``all_reduce(max) of float64, 48 elements (call #3 on its group)``."""
    w0, w1, _, w3 = (int(w) for w in words)
    if w0 >> 48 != _TAG:
        return f"no mpipar collective (the bytes where its signature belongs read {[hex(int(w)) for w in words]})"
    op_code, red_code, char, root = (w0 >> 40) & 0xFF, (w0 >> 32) & 0xFF, (w0 >> 24) & 0xFF, w0 & 0xFFFFFF
    op = _OPS[op_code - 1] if 0 < op_code <= len(_OPS) else f"op #{op_code}"
    label = f"{op}({_REDUCE[red_code - 1]})" if 0 < red_code <= len(_REDUCE) else op
    try:
        dtype = np.dtype(chr(char)).name if char else ""
    except TypeError:
        dtype = f"dtype {chr(char)!r}"
    text = label
    if op == "all_to_all":
        text += f" of {dtype}, sending {w1} elements to its ring successor"
    elif dtype:
        text += f" of {dtype}, {w1} elements"
    if root:
        text += f" (root {root - 1})"
    return f"{text} (call #{w3 & 0xFFFFFFFF} on its group)"


def expected_from_predecessor(parts: Mapping[str, Any], group: tuple[int, ...]) -> int:
    """all_to_all: the element count this member expects from its ring predecessor."""
    i = group.index(_member(parts))
    return _count(parts["recvs"][(i - 1) % len(group)])


def ring_problem(
    group: tuple[int, ...],
    me: int,
    mine: np.ndarray,
    peer: int,
    theirs: np.ndarray,
    facts: tuple[Any, ...],
    expect: int | None = None,
) -> str | None:
    """The mismatch between this member's words and its ring predecessor's, or None.

    ``expect`` (all_to_all) replaces the element count compared: what this member expects
    from the predecessor rather than what it sends itself. ``facts`` are ``own_description``'s
    arguments (the text is built only for a mismatch)."""
    if expect is None:
        if (mine == theirs).all():
            return None
    else:
        want = mine.copy()
        want[1] = np.uint64(expect)
        if (want == theirs).all():
            return None
    return mismatch_message(group, me, own_description(*facts), peer, theirs)


def rows_problem(
    group: tuple[int, ...], me: int, mine: np.ndarray, rows: np.ndarray, facts: tuple[Any, ...]
) -> str | None:
    """The first member whose trailer (a row of ``rows``, 4 words each) differs from ours, or None."""
    same = (rows == mine).all(axis=1)
    if same.all():
        return None
    j = int(np.flatnonzero(~same)[0])
    return mismatch_message(group, me, own_description(*facts), group[j], rows[j])


def mismatch_message(group: tuple[int, ...], me: int, own_desc: str, peer: int, theirs: np.ndarray) -> str:
    return (
        f"collective mismatch on group {list(group)} (found by rank {me}): rank {me} issued {own_desc}, "
        f"but rank {peer} issued {describe(theirs)}. Every member of a group must issue the same collectives "
        "in the same order, with the same reduce op, dtype and shapes; look for a collective inside a branch "
        "only some ranks take, or a Partial with a different reduce op on some rank. "
        "(Checked by default through each collective's own messages; MPIPAR_CHECK_COLLECTIVES=1 compares "
        "every member's full signature.)"
    )


def own_description(op: str, dtype: Any, reduce_type: str | None, parts: Mapping[str, Any], seq: int) -> str:
    """This member's signature with its full shape (the words carry only a count and a hash)."""
    return f"{call_text(op, np.dtype(dtype) if dtype != '' else '', reduce_type, parts)} (call #{seq} on its group)"


def trailer_elements(dtype: np.dtype) -> int | None:
    """How many elements of ``dtype`` hold the 32-byte trailer, or None when they cannot."""
    size = np.dtype(dtype).itemsize
    return TRAILER_BYTES // size if size and TRAILER_BYTES % size == 0 else None
