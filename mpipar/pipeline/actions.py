"""The pipeline action IR: one token per thing a pipeline rank does, shared by every tool.

A schedule is, per rank, a list of actions. Each action has a canonical string form used
everywhere it is shown (the builder, the dry-run validator, the ``step x rank`` grid, CSV,
timeline span names, Chrome traces, the dashboard) and parsed back by ``parse_action``:

=================  ==========================================================================
token              meaning (``s`` = stage on the acting rank, ``m`` = micro-batch)
=================  ==========================================================================
``sFm``            forward of stage ``s`` on micro-batch ``m``
``sBm``            backward of stage ``s``: the whole backward, or only the input gradient
                   when the schedule splits backward (zero-bubble kinds)
``sWm``            weight gradient of stage ``s`` (zero-bubble kinds only)
``sSEND_Fm``       send stage ``s``'s forward output of ``m`` to stage ``s+1``'s rank
``sRECV_Fm``       receive stage ``s-1``'s forward output of ``m`` (the input of stage ``s``)
``sSEND_Bm``       send stage ``s``'s input gradient of ``m`` to stage ``s-1``'s rank
``sRECV_Bm``       receive stage ``s+1``'s input gradient of ``m`` (the output grad of ``s``)
=================  ==========================================================================

The stage in a token is always the stage that lives on the acting rank, so ``1RECV_F0`` is
run by the rank holding stage 1 and matches ``0SEND_F0`` on the rank holding stage 0.

Data dependencies (``dependencies``): ``sFm`` needs ``(s-1)Fm``; ``sBm`` needs ``sFm`` and
``(s+1)Bm``; ``sWm`` needs ``sBm``. Across ranks, a dependency is satisfied through the
matching receive; on one rank, by list order.

    >>> a = parse_action("1RECV_F0")
    >>> a.kind, a.stage, a.microbatch, str(a)
    ('RECV_F', 1, 0, '1RECV_F0')
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
ACTION_KINDS = COMPUTE_KINDS + COMM_KINDS
ACTION_SPAN_KINDS = ("F", "B", "W", "SEND", "RECV")
"""The ``kind`` a timeline span of an action carries: comm tokens collapse to SEND / RECV."""

TOKEN_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)\s*$")
"""Groups: stage, kind, micro-batch."""


class ScheduleError(ValueError):
    """A malformed pipeline request or schedule. ``rank``/``index``/``action`` locate the fault."""

    def __init__(
        self, message: str, *, rank: int | None = None, index: int | None = None, action: Action | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.action = action


@dataclass(frozen=True)
class Blocked:
    """Where one rank is stuck in a deadlocked dry run, and why."""

    rank: int
    index: int
    action: Action
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank} is blocked at action #{self.index} {self.action}: {self.reason}"


class ScheduleDeadlock(ScheduleError):
    """A dry run found actions that can never run. ``blocked`` lists every stuck rank."""

    def __init__(self, message: str, blocked: list[Blocked]) -> None:
        first = blocked[0]
        super().__init__(message, rank=first.rank, index=first.index, action=first.action)
        self.blocked = blocked


@dataclass(frozen=True)
class Action:
    """One action of one pipeline rank. ``peer`` is the other rank of a send/recv (else None).

    Equality includes ``peer``; ``key`` (kind, stage, micro-batch) identifies the action
    independently of it. ``str`` is the canonical token.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"pipeline action kind {self.kind!r} is unknown; use one of {', '.join(ACTION_KINDS)}")
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"pipeline action {self.kind} needs a non-negative int {name}, got {value!r}")
        if self.peer is not None:
            if self.kind in COMPUTE_KINDS:
                raise ValueError(
                    f"compute action {self.stage}{self.kind}{self.microbatch} has no peer, got {self.peer!r}"
                )
            if isinstance(self.peer, bool) or not isinstance(self.peer, int) or self.peer < 0:
                raise ValueError(f"action {self} needs a non-negative int peer rank, got {self.peer!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        peer = f", peer={self.peer}" if self.peer is not None else ""
        return f"Action({str(self)!r}{peer})"

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.stage, self.microbatch)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("SEND")

    @property
    def is_recv(self) -> bool:
        return self.kind.startswith("RECV")

    @property
    def span_kind(self) -> str:
        """F, B, W, SEND or RECV: the ``kind`` of this action's timeline span."""
        return self.kind.split("_", 1)[0]

    @property
    def direction(self) -> str | None:
        """For send/recv, which pass's tensor moves: ``F`` (activation) or ``B`` (gradient)."""
        return self.kind[-1] if self.is_comm else None

    def with_peer(self, peer: int | None) -> Action:
        return Action(self.kind, self.stage, self.microbatch, peer)


def parse_action(text: str | Action, peer: int | None = None) -> Action:
    """Read a canonical token (``"0F1"``, ``"2RECV_B3"``) back into an ``Action``."""
    if isinstance(text, Action):
        return text if peer is None else text.with_peer(peer)
    if not isinstance(text, str):
        raise TypeError(f"a pipeline action is an Action or a token like '0F1', got {text!r}")
    m = TOKEN_RE.match(text)
    if m is None:
        raise ValueError(
            f"cannot parse pipeline action {text!r}; write <stage><kind><microbatch> with kind one of "
            f"{', '.join(ACTION_KINDS)}, e.g. '0F1', '1B0', '2SEND_F3'"
        )
    return Action(m.group(2), int(m.group(1)), int(m.group(3)), peer)


# Shorthand constructors, named after the token letters they stand for.
def F(stage: int, microbatch: int) -> Action:
    return Action("F", stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action("B", stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action("W", stage, microbatch)


def dependencies(action: Action, num_stages: int, split_backward: bool) -> list[Action]:
    """The compute actions whose results ``action`` (a compute action) consumes.

    ``sFm`` <- ``(s-1)Fm``; ``sBm`` <- ``sFm``, ``(s+1)Bm``; ``sWm`` <- ``sBm``.
    ``split_backward`` is accepted for symmetry: W exists only when backward is split.
    """
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [F(s - 1, m)] if s > 0 else []
    if action.kind == "B":
        deps = [F(s, m)]
        if s < num_stages - 1:
            deps.append(B(s + 1, m))
        return deps
    if action.kind == "W":
        if not split_backward:
            raise ValueError(f"{action} is a weight-gradient action but this schedule does not split backward")
        return [B(s, m)]
    raise ValueError(f"{action} is not a compute action")


def final_backward_kind(split_backward: bool) -> str:
    """The action that finishes a micro-batch on a stage (its activations can be freed after)."""
    return "W" if split_backward else "B"


def matching(action: Action) -> Action:
    """The other half of a transfer: ``0SEND_F2`` <-> ``1RECV_F2``, ``1SEND_B2`` <-> ``0RECV_B2``."""
    s, m = action.stage, action.microbatch
    table = {
        "SEND_F": ("RECV_F", s + 1),
        "RECV_F": ("SEND_F", s - 1),
        "SEND_B": ("RECV_B", s - 1),
        "RECV_B": ("SEND_B", s + 1),
    }
    if action.kind not in table:
        raise ValueError(f"{action} is not a send or receive")
    kind, stage = table[action.kind]
    return Action(kind, stage, m)


def transfer_tag(action: Action, num_stages: int) -> int:
    """A message tag both halves of one transfer agree on, unique within a schedule.

    ``0SEND_F2`` and ``1RECV_F2`` get the same tag; so do ``1SEND_B2`` and ``0RECV_B2``. The
    tag counts (micro-batch, sending stage, direction), so runtimes can match messages by tag.
    """
    if not action.is_comm:
        raise ValueError(f"{action} is not a send or receive; only transfers have tags")
    send = action if action.is_send else matching(action)
    direction = 0 if send.kind == "SEND_F" else 1
    return (send.microbatch * num_stages + send.stage) * 2 + direction


def producer(action: Action) -> Action:
    """The compute action whose result a send ships: ``sSEND_Fm`` <- ``sFm``, ``sSEND_Bm`` <- ``sBm``."""
    if action.kind == "SEND_F":
        return F(action.stage, action.microbatch)
    if action.kind == "SEND_B":
        return B(action.stage, action.microbatch)
    raise ValueError(f"{action} is not a send")
