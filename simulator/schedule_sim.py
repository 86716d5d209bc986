"""Simulating a pipeline schedule in virtual time: ``simulate_schedule(schedule, cost) -> Timeline``.

Every rank runs its action list in order. Sends and receives are posted where they stand and
never block the rank (``isend``/``irecv``), or, with the cost's ``blocking_transfers``, hold it
until their transfer is done (a rendezvous: mpipar's runtime waits for every message of a
hand-off on both sides); a transfer starts once both halves are posted and
lasts the cost's transfer time; a compute action starts when its rank is free and the transfers
it consumes have arrived. Transfers do not contend with each other (point-to-point links are
independent and full duplex). The timeline has each rank's compute spans on its ``compute``
track and each send/receive, spanning the transfer, on its ``comm`` track.

With ``cost="unit"``: F costs 1, B 2 (split-backward kinds: B 1 and W 1), communication 0, so
the compute spans are exactly the earliest timing the compute order allows.

With a ``PipelineCost`` carrying ``memory``, the timeline also gets memory curves per rank:
model state (parameters, gradients, optimizer state) for the whole step; a stage's activations
of a micro-batch from the start of its F to the end of its last backward action (B, or W when
backward is split); communication buffers while a message is in transit.

    python -m simulator schedule 1F1B -p 4 -m 8 [-v 2] [--comm] [-o timeline.json] [--chrome trace.json]
"""

from __future__ import annotations

import math
import sys
from typing import Any

from mpipar import cliargs
from mpipar.debug.timeline import MemoryCurve, Span, Timeline
from mpipar.pipeline import Action, Schedule, build_schedule, matching
from mpipar.pipeline.actions import final_backward_kind
from mpipar.pipeline.validate import local_inputs
from simulator.cost import PipelineCost


def simulate_schedule(schedule: Schedule, cost: str | PipelineCost = "unit") -> Timeline:
    """The timeline of ``schedule`` under ``cost`` (``"unit"`` or a ``simulator.cost.PipelineCost``)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"simulate_schedule needs an mpipar.pipeline.Schedule (from build_schedule), got {type(schedule).__name__}"
        )
    if isinstance(cost, str):
        if cost != "unit":
            raise ValueError(
                f"simulate_schedule cost {cost!r} is unknown; pass 'unit' or a simulator.cost.PipelineCost"
            )
        cost = PipelineCost.unit(schedule.num_stages)
    elif not isinstance(cost, PipelineCost):
        raise TypeError(f"simulate_schedule cost must be 'unit' or a PipelineCost, got {type(cost).__name__}")
    if cost.num_stages != schedule.num_stages:
        raise ValueError(
            f"simulate_schedule: the cost describes {cost.num_stages} stages but the schedule has "
            f"{schedule.num_stages}; build the PipelineCost with num_stages={schedule.num_stages}"
        )
    # Refuses, naming rank and action, what could never run under the cost's semantics.
    schedule.validate("rendezvous" if cost.blocking_transfers else "nonblocking")
    return _Run(schedule, cost).timeline()


class _Run:
    def __init__(self, schedule: Schedule, cost: PipelineCost) -> None:
        self.schedule = schedule
        self.cost = cost
        n = schedule.num_ranks
        self.free = [0.0] * n
        self.pos = [0] * n
        self.compute_end: dict[tuple[str, int, int], float] = {}
        self.posted: dict[tuple[str, int, int], tuple[int, float]] = {}  # comm key -> (rank, post time)
        self.arrival: dict[tuple[str, int, int], float] = {}  # recv key -> transfer end
        self.spans: list[Span] = []
        self.deltas: list[list[tuple[float, str, float]]] = [[] for _ in range(n)]
        self.activation_start: dict[tuple[int, int], float] = {}

    def timeline(self) -> Timeline:
        schedule = self.schedule
        remaining = sum(len(row) for row in schedule.actions)
        while remaining:
            progressed = 0
            for rank in range(schedule.num_ranks):
                while self.pos[rank] < len(schedule.actions[rank]) and self._step(rank):
                    self.pos[rank] += 1
                    progressed += 1
            if not progressed:  # validate("nonblocking") passed, so this is a bug here
                raise RuntimeError(f"simulate_schedule stalled at positions {self.pos} of {schedule!r}")
            remaining -= progressed
        meta: dict[str, Any] = {
            "source": "simulated",
            "schedule": schedule.kind,
            "num_stages": schedule.num_stages,
            "num_ranks": schedule.num_ranks,
            "num_chunks": schedule.num_chunks,
            "num_microbatches": schedule.num_microbatches,
            "split_backward": schedule.split_backward,
        }
        return Timeline(
            self.spans, ranks=range(schedule.num_ranks), memory=self._memory(), time_unit=self.cost.time_unit, meta=meta
        )

    def _step(self, rank: int) -> bool:
        """Run rank's head action if it can run now; False if it waits for another rank."""
        action = self.schedule.actions[rank][self.pos[rank]]
        if action.is_comm:
            if action.key not in self.posted:
                self.posted[action.key] = (rank, self.free[rank])
            other = matching(action)
            send, recv = (action, other) if action.is_send else (other, action)
            if other.key in self.posted and recv.key not in self.arrival:
                self._transfer(send, recv)
            if not self.cost.blocking_transfers:
                return True
            if recv.key not in self.arrival:
                return False  # held until the other side posts its half
            self.free[rank] = max(self.free[rank], self.arrival[recv.key])
            return True
        ready = self.free[rank]
        for dep in local_inputs(
            action, self.schedule.num_stages, self.schedule.num_ranks, self.schedule.split_backward
        ):
            if dep.is_comm:
                if dep.key not in self.arrival:
                    return False
                ready = max(ready, self.arrival[dep.key])
            else:
                ready = max(ready, self.compute_end[dep.key])
        end = ready + self.cost.compute_time(action, self.schedule.split_backward)
        self.compute_end[action.key] = end
        self.free[rank] = end
        self.spans.append(Span(rank, str(action), action.kind, action.stage, action.microbatch, ready, end, "compute"))
        self._track_activations(rank, action, ready, end)
        return True

    def _transfer(self, send: Action, recv: Action) -> None:
        src, send_time = self.posted[send.key]
        dst, recv_time = self.posted[recv.key]
        start = max(send_time, recv_time)
        end = start + self.cost.transfer_time(send)
        self.arrival[recv.key] = end
        self.spans.append(Span(src, str(send), "SEND", send.stage, send.microbatch, start, end, "comm", dst))
        self.spans.append(Span(dst, str(recv), "RECV", recv.stage, recv.microbatch, start, end, "comm", src))
        nbytes = self.cost.message_bytes(send)
        if nbytes and end > start:
            for rank in (src, dst):
                self.deltas[rank] += [(start, "comm_buffers", nbytes), (end, "comm_buffers", -nbytes)]

    def _track_activations(self, rank: int, action: Action, start: float, end: float) -> None:
        memory = self.cost.memory
        if memory is None:
            return
        nbytes = memory.activations[action.stage]
        if action.kind == "F":
            self.deltas[rank].append((start, "activations", nbytes))
        elif action.kind == final_backward_kind(self.schedule.split_backward):
            self.deltas[rank].append((end, "activations", -nbytes))

    def _memory(self) -> list[MemoryCurve] | None:
        memory = self.cost.memory
        if memory is None:
            return None
        curves = []
        for rank in range(self.schedule.num_ranks):
            stages = self.schedule.stages_of(rank)
            baseline = {
                "parameters": sum(memory.parameters[s] for s in stages),
                "gradients": sum(memory.gradients[s] for s in stages),
                "optimizer_state": sum(memory.optimizer_state[s] for s in stages),
            }
            curves.append(MemoryCurve.from_deltas(rank, self.deltas[rank], baseline))
        return curves


# ---------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """``python -m simulator schedule KIND -p P -m M``: grid, per-rank bubble, optional files."""
    parser = cliargs.Parser(
        prog="python -m simulator schedule",
        description="Build a pipeline schedule, print its step x rank grid and its simulated bubble.",
    )
    parser.add_argument("kind", help="FThenB, 1F1B, Interleaved1F1B or ZBH1")
    parser.add_argument(
        "-p",
        "--ranks",
        type=cliargs.int_range(1, 1 << 16, "a pipeline rank count"),
        required=True,
        help="pipeline ranks",
    )
    parser.add_argument(
        "-m",
        "--microbatches",
        type=cliargs.int_range(1, 1 << 16, "a micro-batch count"),
        required=True,
        help="micro-batches per step",
    )
    parser.add_argument(
        "-v",
        "--chunks",
        type=cliargs.int_range(1, 1 << 10, "a chunk count"),
        default=1,
        help="model chunks per rank (Interleaved1F1B)",
    )
    parser.add_argument("--comm", action="store_true", help="show sends/receives in the grid")
    parser.add_argument(
        "--times",
        default=None,
        metavar="F,B,W",
        help="per-stage compute times instead of unit cost (B and W: the two backward halves)",
    )
    parser.add_argument(
        "--comm-time",
        type=cliargs.finite_float(0.0, 1e9, "a non-negative time"),
        default=0.0,
        help="time of every transfer (with --times)",
    )
    parser.add_argument("--csv", metavar="PATH", type=cliargs.output_path, help="write the action lists as CSV")
    parser.add_argument(
        "-o",
        "--timeline",
        metavar="PATH",
        type=cliargs.output_path,
        help="write the simulated timeline (mpipar.timeline JSON)",
    )
    parser.add_argument(
        "--chrome",
        metavar="PATH",
        type=cliargs.output_path,
        help="write the timeline as Chrome trace JSON (Perfetto opens it)",
    )
    ns = parser.parse_args(argv)
    try:
        schedule = build_schedule(ns.kind, ns.ranks * ns.chunks, ns.microbatches, ns.chunks)
    except ValueError as exc:
        parser.error(str(exc))
    cost: str | PipelineCost = "unit"
    if ns.times is not None:
        try:
            f, b, w = (float(x) for x in ns.times.split(","))
        except ValueError:
            parser.error(f"--times takes three numbers F,B,W, got {ns.times!r}")
        if not all(math.isfinite(t) and 0 <= t <= 1e9 for t in (f, b, w)):
            parser.error(f"--times: {ns.times!r} must be three finite non-negative times F,B,W")
        cost = PipelineCost.uniform(
            schedule.num_stages, forward=f, backward_input=b, backward_weight=w, comm=ns.comm_time
        )
    elif ns.comm_time:
        cost = PipelineCost.uniform(schedule.num_stages, comm=ns.comm_time)
    timeline = simulate_schedule(schedule, cost)
    print(schedule.grid(comm=ns.comm), end="")
    print()
    unit = timeline.time_unit
    print(f"step time {timeline.makespan:g} {unit}; bubble fraction {timeline.bubble_fraction():.4f}")
    in_flight = schedule.peak_in_flight()
    for rank in timeline.ranks:
        stages = ", ".join(f"{s}: {in_flight[s]}" for s in schedule.stages_of(rank))
        print(
            f"  rank {rank}: busy {timeline.busy(rank):g}, bubble {timeline.bubble(rank):g} "
            f"({timeline.bubble_fraction(rank):.4f}); peak micro-batches in flight per stage {{{stages}}}"
        )
    try:
        if ns.csv:
            with open(ns.csv, "w", encoding="utf-8") as fh:
                fh.write(schedule.to_csv())
            print(f"wrote {ns.csv}")
        if ns.timeline:
            timeline.save(ns.timeline)
            print(f"wrote {ns.timeline}")
        if ns.chrome:
            timeline.save_chrome_trace(ns.chrome)
            print(f"wrote {ns.chrome} (open in https://ui.perfetto.dev)")
    except OSError as exc:
        return cliargs.fail(parser.prog, f"cannot write {exc.filename or 'the output'}: {exc.strerror or exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
