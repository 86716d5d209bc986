"""``Schedule``: per-rank action lists of a pipeline, with the views every tool shares.

A ``Schedule`` is a value: ``num_stages`` stages dealt round-robin to ``len(actions)`` ranks
(stage ``s`` on rank ``s mod ranks``), ``num_microbatches`` micro-batches, and ``actions[rank]``,
that rank's list of ``Action`` tokens (``0F1``, ``1RECV_B0``, ...). Construction checks the
structure (right ranks, nothing missing or repeated, peers right); ``validate()`` dry-runs it
for deadlocks. Views: ``grid()`` (``step x rank`` text), ``to_csv()``, ``to_dict()`` (the JSON a
plan embeds), ``peak_in_flight()``.

    >>> s = Schedule.from_compute_orders([["0F0", "0B0"], ["1F0", "1B0"]], num_stages=2, num_microbatches=1)
    >>> [str(a) for a in s.actions[1]]
    ['1RECV_F0', '1F0', '1B0', '1SEND_B0']
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

from mpipar.pipeline.actions import Action, final_backward_kind, parse_action
from mpipar.pipeline.lower import insert_communication
from mpipar.pipeline.validate import DryRun, check_structure, dry_run, normalize, stage_rank

CSV_COLUMNS = ("rank", "index", "action", "kind", "stage", "microbatch", "peer")


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


class Schedule:
    """Per-rank pipeline action lists. See the module docstring."""

    def __init__(
        self,
        actions: Sequence[Sequence[Action | str]],
        num_stages: int,
        num_microbatches: int,
        *,
        kind: str = "custom",
        split_backward: bool | None = None,
    ) -> None:
        num_stages = _positive_int(num_stages, "num_stages")
        num_microbatches = _positive_int(num_microbatches, "num_microbatches")
        normalized = normalize(actions, num_stages, num_microbatches)
        num_ranks = len(normalized)
        if num_stages % num_ranks:
            raise ValueError(
                f"a schedule of {num_stages} stages on {num_ranks} ranks: stages are dealt round-robin "
                f"(stage s on rank s mod {num_ranks}), so num_stages must be a multiple of the number of ranks"
            )
        if split_backward is None:
            split_backward = any(a.kind == "W" for row in normalized for a in row)
        check_structure(normalized, num_stages, num_microbatches, split_backward)
        self._actions = normalized
        self._kind = str(kind)
        self._num_stages = num_stages
        self._num_microbatches = num_microbatches
        self._split_backward = bool(split_backward)
        self._dry_runs: dict[str, DryRun] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_compute_orders(
        cls,
        orders: Sequence[Sequence[Action | str]],
        num_stages: int,
        num_microbatches: int,
        *,
        kind: str = "custom",
        split_backward: bool | None = None,
    ) -> Schedule:
        """Per-rank F/B/W orders -> a full schedule, with sends and receives placed deadlock-free."""
        num_stages = _positive_int(num_stages, "num_stages")
        num_microbatches = _positive_int(num_microbatches, "num_microbatches")
        normalized = normalize(orders, num_stages, num_microbatches)
        if split_backward is None:
            split_backward = any(a.kind == "W" for row in normalized for a in row)
        if num_stages % len(normalized):
            raise ValueError(
                f"{num_stages} stages on {len(normalized)} ranks: num_stages must be a multiple of the number of ranks"
            )
        check_structure(normalized, num_stages, num_microbatches, split_backward, with_comm=False)
        full = insert_communication(normalized, num_stages, split_backward)
        return cls(full, num_stages, num_microbatches, kind=kind, split_backward=split_backward)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Read ``to_dict()``'s form back, refusing a field of the wrong type."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a schedule dict must be a mapping, got {type(data).__name__}")
        for name in ("num_stages", "num_microbatches", "actions"):
            if name not in data:
                raise ValueError(f"schedule field {name!r} is missing; fields present: {sorted(data)}")
        actions = data["actions"]
        if not isinstance(actions, list) or not all(isinstance(row, list) for row in actions):
            raise ValueError(
                f"schedule field 'actions' must be a list of token lists (one per rank), got {actions!r:.80}"
            )
        split = data.get("split_backward")
        if split is not None and not isinstance(split, bool):
            raise ValueError(f"schedule field 'split_backward' must be true, false or null, got {split!r}")
        schedule = cls(
            actions,
            data["num_stages"],
            data["num_microbatches"],
            kind=str(data.get("kind", "custom")),
            split_backward=split,
        )
        for name in ("num_ranks", "num_chunks"):
            if name in data and data[name] != getattr(schedule, name):
                raise ValueError(
                    f"schedule field {name!r} is {data[name]!r} but the action lists give {getattr(schedule, name)}"
                )
        return schedule

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        kind: str = "custom",
    ) -> Schedule:
        """Read ``to_csv()`` back. Stages and micro-batches default to the largest seen + 1."""
        reader = csv.DictReader(io.StringIO(text))
        missing = [c for c in ("rank", "index", "action") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"schedule CSV lacks column(s) {missing}; the header must include rank,index,action")
        rows: dict[int, list[tuple[int, Action]]] = {}
        for line, row in enumerate(reader, start=2):
            try:
                rank, index = int(row["rank"]), int(row["index"])
                action = parse_action(row["action"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"schedule CSV line {line}: {exc}") from None
            rows.setdefault(rank, []).append((index, action))
        if not rows:
            raise ValueError("schedule CSV has no action rows")
        num_ranks = max(rows) + 1
        lists = [[a for _, a in sorted(rows.get(r, []), key=lambda item: item[0])] for r in range(num_ranks)]
        every = [a for row in lists for a in row]
        stages = num_stages if num_stages is not None else max(a.stage for a in every) + 1
        mbs = num_microbatches if num_microbatches is not None else max(a.microbatch for a in every) + 1
        return cls(lists, stages, mbs, kind=kind)

    # ------------------------------------------------------------------ basic views
    # Read-only: a Schedule is a value (build_schedule caches and shares them).
    @property
    def kind(self) -> str:
        return self._kind

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    @property
    def num_ranks(self) -> int:
        return len(self._actions)

    @property
    def num_chunks(self) -> int:
        """Stages per rank (virtual stages of interleaved schedules; 1 otherwise)."""
        return self._num_stages // len(self._actions)

    @property
    def split_backward(self) -> bool:
        """Whether backward is split into B (input gradient) and W (weight gradient)."""
        return self._split_backward

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """``actions[rank]``: that rank's actions in execution order."""
        return self._actions

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.num_ranks)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` runs: ``rank, rank + ranks, ...`` (its chunks in order)."""
        return list(range(rank, self.num_stages, self.num_ranks))

    def compute_orders(self) -> list[list[Action]]:
        return [[a for a in row if a.is_compute] for row in self._actions]

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in row] for row in self._actions]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.kind, self.num_stages, self.num_microbatches, self.split_backward, self._actions) == (
            other.kind,
            other.num_stages,
            other.num_microbatches,
            other.split_backward,
            other._actions,
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.num_stages, self.num_microbatches, self._actions))

    def __repr__(self) -> str:
        return (
            f"Schedule(kind={self.kind!r}, num_stages={self.num_stages}, num_ranks={self.num_ranks}, "
            f"num_microbatches={self.num_microbatches}, split_backward={self.split_backward})"
        )

    # ------------------------------------------------------------------ checking
    def validate(self, semantics: str = "rendezvous") -> DryRun:
        """Dry-run every rank's list; raise ``ScheduleDeadlock`` naming the rank and action that can never run.

        ``semantics="rendezvous"`` (default) treats a send as blocking until its receive is reached;
        ``"eager"`` lets sends complete at once (buffered); ``"nonblocking"`` posts sends and
        receives without blocking and makes compute wait for its inputs (see ``validate.py``).
        Returns the ``DryRun`` (step of every action, one valid execution order).
        """
        if semantics not in self._dry_runs:
            self._dry_runs[semantics] = dry_run(self._actions, self.num_stages, self.split_backward, semantics)
        return self._dry_runs[semantics]

    def peak_in_flight(self) -> dict[int, int]:
        """Per stage, the most micro-batches whose forward ran and whose last backward action did not.

        The last backward action is B, or W when backward is split; a micro-batch in flight keeps
        its activations on the stage, so this is the activation-memory peak in micro-batches.
        """
        done_kind = final_backward_kind(self.split_backward)
        peak = {s: 0 for s in range(self.num_stages)}
        for row in self._actions:
            live: dict[int, int] = {}
            for action in row:
                if action.kind == "F":
                    live[action.stage] = live.get(action.stage, 0) + 1
                    peak[action.stage] = max(peak[action.stage], live[action.stage])
                elif action.kind == done_kind:
                    live[action.stage] -= 1
        return peak

    # ------------------------------------------------------------------ rendering
    def grid(self, comm: bool = False) -> str:
        """The ``step x rank`` text grid of a non-blocking dry run: one step per compute action.

        A cell shows the compute token the rank runs in that step, ``.`` when idle. With
        ``comm=True`` it also shows the sends/receives completed at the start of the step.
        The grid shows order and overlap, not durations (``simulator.simulate_schedule`` does).
        """
        run = self.validate("nonblocking")
        cells = [[[] for _ in range(self.num_ranks)] for _ in range(run.num_steps)]
        for rank, row in enumerate(self._actions):
            for index, action in enumerate(row):
                if comm or action.is_compute:
                    cells[run.steps[rank][index]][rank].append(str(action))
        text = [[" ".join(c) if c else "." for c in row] for row in cells]
        header = ["step", *(f"rank {r}" for r in range(self.num_ranks))]
        widths = [max(len(header[0]), len(str(run.num_steps - 1)))]
        for r in range(self.num_ranks):
            widths.append(max([len(header[r + 1]), *(len(row[r]) for row in text)]))
        title = (
            f"{self.kind}: {self.num_stages} stages on {self.num_ranks} ranks, {self.num_microbatches} micro-batches"
            + (", backward split into B and W" if self.split_backward else "")
        )
        lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
        for step, row in enumerate(text):
            values = [str(step).rjust(widths[0]), *(v.ljust(w) for v, w in zip(row, widths[1:], strict=True))]
            lines.append("  ".join(values).rstrip())
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """One row per action: rank, index in its list, token, kind, stage, micro-batch, peer."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for rank, row in enumerate(self._actions):
            for index, a in enumerate(row):
                writer.writerow([rank, index, str(a), a.kind, a.stage, a.microbatch, "" if a.peer is None else a.peer])
        return out.getvalue()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (embedded in plans); ``Schedule.from_dict`` reads it back."""
        return {
            "kind": self.kind,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_ranks": self.num_ranks,
            "num_chunks": self.num_chunks,
            "split_backward": self.split_backward,
            "actions": self.to_strings(),
        }
