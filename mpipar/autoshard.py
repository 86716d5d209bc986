"""``auto_shard(layer, mesh, example_inputs)`` (``dist.auto_shard``): choose every parameter's placements for any model.

    plan = dist.auto_shard(model, mesh, (idx, targets), step=lambda m, x, y: m.loss(x, y))
    print(plan.report())                      # every choice, its candidates and their prices
    dist.shard_layer(model, mesh, plan)       # the plan is a shard_fn

How it chooses:

1. *Units*: every ``Linear`` (candidates: ``replicate``, ``column`` -- weight ``Shard(1)``, bias
   ``Shard(0)`` -- and ``row`` -- weight ``Shard(0)``, bias replicated) and every ``Embedding``
   (``replicate``, ``vocab`` -- ``Shard(0)`` -- and ``hidden`` -- ``Shard(1)``); splits along one
   mesh axis (``axis``, default the last), replicated on the others. Candidates whose split dim
   does not divide by the axis size are dropped. Every other parameter (LayerNorm, ...) is
   replicated. Units are ordered by their weight's first use in the step.
2. *Pricing*: the step (``step(layer, *inputs)`` then ``backward``) is traced shape-only on a
   copy of the model whose parameters hold no values (``mpipar.trace`` under the shape-only
   backend), so every reshard the framework would make -- the gather of a split activation, the
   reduction of a Partial one, the loss's, the gradients' -- is in the plan with the planner's
   bytes. ``price(plan) -> (seconds, bytes)`` prices it; the default is the simulator's cost
   model (``simulator.auto_price.price_plan`` through the ``mpipar.pricers`` entry point).
3. *Dynamic programming* over the units in order of first use; units reading the same
   activation (an attention's q, k and v) form one step of the chain and take one choice. A
   step's choice fixes the layout of the activation it hands on (its *state*: ``R``
   replicated, ``S`` split on the last dim, ``P`` partial sums), so the step's price is
   modelled as a unary price per chain step and a transition price per pair of neighbours
   (the state one hands on -> the choice of the next). Both are read off traces that differ
   from a *base* layout in one chain step or one neighbouring pair: ``unary(i, c) =
   T(i=c) - T(base)``, ``pair(c', c) = T(i-1=c', i=c) - T(i-1=c') - T(i=c) + T(base)``.
   Viterbi over the chain gives the cheapest sequence under that model: about ``1 + 2n + 4n``
   traces for ``n`` chain steps with three candidates, never the ``3**n`` combinations.
4. *Rounds*: the first base is everything replicated; each round's result, if its whole traced
   step is cheaper, is the next round's base, until a round changes nothing (a fixed point:
   no single step or neighbouring pair of steps can be changed for a cheaper step) or
   ``rounds`` is reached. Prices around the final layout see the interactions a chain cannot
   (a residual stream two layers long, the loss), which is why a second round often moves a
   few choices.

5. *Conventional layouts within a tolerance*: the cost model is not exact (its target is
   about 10% of a real step), so a difference of a fraction of a percent says nothing about
   which layout is really faster. After the DP, a pass in order of first use moves each unit
   to its layer type's *conventional* layout -- the one Megatron-LM and Paddle's fleet write
   by hand -- when the whole traced step stays within ``tolerance`` (default 1%) of the
   cheapest one found. Conventional: for an ``Embedding`` indexed by the step's inputs (token
   ids: the vocabulary) the ``vocab`` split (``VocabParallelEmbedding``); for one indexed by
   values the model makes itself (positions) ``replicate`` (Megatron keeps position tables
   whole); a ``Linear`` has none (its column/row pairs are what the pricing finds wherever a
   split pays, and what a layer costs decides the rest). The report says per unit what was
   kept and at what price; ``tolerance=0`` keeps the cheapest layout.

``fixed={"name": "choice"}`` pins units (the candidates above, by sublayer name).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpipar.backend import create_backend, use_backend
from mpipar.compile.plan import Plan
from mpipar.compile.trace import trace
from mpipar.distribute import shard_tensor
from mpipar.mesh import ProcessMesh
from mpipar.nn.layer import Layer
from mpipar.nn.layers import Embedding, Linear
from mpipar.ops.math import mean
from mpipar.placement import Placement, Replicate, Shard
from mpipar.tensor import Parameter, Tensor

Pricer = Callable[[Plan], tuple[float, float]]
"""A traced step -> (seconds of the step, bytes communicated per rank)."""
Step = Callable[..., Tensor]

_EPS = 1e-12  # seconds: differences below this are ties (float noise of summed op times)


@dataclass(frozen=True)
class Candidate:
    """One way to lay a unit out: a placement on the split axis per parameter attribute."""

    name: str
    placements: tuple[tuple[str, Placement], ...]
    state: str
    """The layout of the activation the unit hands on: R, S (split last dim) or P (partial)."""


_LINEAR = (
    Candidate("replicate", (("weight", Replicate()), ("bias", Replicate())), "R"),
    Candidate("column", (("weight", Shard(1)), ("bias", Shard(0))), "S"),
    Candidate("row", (("weight", Shard(0)), ("bias", Replicate())), "P"),
)
_EMBEDDING = (
    Candidate("replicate", (("weight", Replicate()),), "R"),
    Candidate("vocab", (("weight", Shard(0)),), "P"),
    Candidate("hidden", (("weight", Shard(1)),), "S"),
)


@dataclass
class Unit:
    """A sublayer whose placements are searched, with its candidates and their prices."""

    name: str
    kind: str
    candidates: list[Candidate]
    dropped: list[str] = field(default_factory=list)
    fixed: bool = False
    choice: str = "replicate"
    how: str = ""
    stage: Stage | None = None
    """The DP step that priced this unit (with its siblings)."""
    conventional: str | None = None
    """Its layer type's conventional candidate (module docstring, point 5), None when it has none."""

    def candidate(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass(frozen=True)
class Priced:
    """One traced step's price: seconds on the slowest rank, bytes communicated per rank."""

    seconds: float
    bytes: float


class AutoShard:
    """The result of ``auto_shard``: a ``shard_fn`` for ``dist.shard_layer`` and its report."""

    def __init__(
        self,
        mesh: ProcessMesh,
        axis: str,
        units: list[Unit],
        chosen: Priced,
        baseline: Priced,
        traces: int,
        seconds: float,
        history: list[str],
        others: list[str],
        converged: bool,
        cheapest: Priced,
        cheapest_choices: dict[str, str],
        tolerance: float,
    ) -> None:
        self.mesh = mesh
        self.axis = axis
        self.units = units
        self.chosen = chosen
        self.baseline = baseline
        self.traces = traces
        self.search_seconds = seconds
        self.history = history
        self.converged = converged
        """False when ``rounds`` ran out before a round changed nothing."""
        self.others = others
        self.cheapest = cheapest
        """The cheapest traced step the DP found, before conventional layouts were kept (``chosen`` is within tolerance of it)."""
        self.cheapest_choices = cheapest_choices
        """The DP's choices before the conventional pass (``tolerance=0`` would return these)."""
        self.tolerance = tolerance

    @property
    def choices(self) -> dict[str, str]:
        """Sublayer name -> chosen candidate (``replicate``, ``column``, ``row``, ``vocab``, ``hidden``)."""
        return {u.name: u.choice for u in self.units}

    def placements(self) -> dict[str, list[Placement]]:
        """Parameter name -> its placements on the mesh (only the searched units' parameters)."""
        out: dict[str, list[Placement]] = {}
        for u in self.units:
            for attr, pl in u.candidate(u.choice).placements:
                out[f"{u.name}.{attr}" if u.name else attr] = _on_axis(self.mesh, self.axis, pl)
        return out

    def __call__(self, name: str, sublayer: Layer, mesh: ProcessMesh) -> None:
        """``shard_fn`` protocol: mark ``sublayer``'s parameters as chosen for ``name``."""
        if not mesh.same_layout(self.mesh):
            raise ValueError(
                f"auto_shard chose placements for mesh {self.mesh} (axis {self.axis!r}); shard_layer was given {mesh}: "
                "run auto_shard on the mesh you shard on"
            )
        for u in self.units:
            if u.name != name:
                continue
            for attr, pl in u.candidate(u.choice).placements:
                p = sublayer._parameters.get(attr)
                if p is not None:
                    shard_tensor(p, mesh, _on_axis(mesh, self.axis, pl))

    def report(self) -> str:
        """Every choice with its candidates and their priced seconds and bytes."""
        b, c = self.baseline, self.chosen
        lines = [
            f"auto_shard: {len(self.units)} layers on mesh {dict(zip(self.mesh.dim_names, self.mesh.shape, strict=True))}, "
            f"split axis {self.axis!r}; {self.traces} shape-only traces in {self.search_seconds:.2f} s",
            f"chosen step: {_ms(c.seconds)}, {_bytes(c.bytes)} communicated per rank; "
            f"all replicated: {_ms(b.seconds)}, {_bytes(b.bytes)}",
            f"cheapest step found: {_ms(self.cheapest.seconds)} (the chosen one is {_pct(c.seconds, self.cheapest.seconds)} "
            f"above it; conventional layouts are kept within {100 * self.tolerance:g}%)",
            "layer (kind): choice [state of its output; how chosen] | its DP step's candidates: step time, bytes per rank "
            "with only that step changed from the last round's layout",
        ]
        shown: set[int] = set()
        for u in self.units:
            head = f"  {u.name} ({u.kind}): {u.choice} [{u.candidate(u.choice).state}; {u.how}]"
            st = u.stage
            if st is None:
                lines.append(head)
            elif id(st) in shown:
                lines.append(f"{head} | priced with {st.members[0].name}")
            else:
                shown.add(id(st))
                cands = "  ".join(f"{n} {_ms(p.seconds)} {_bytes(p.bytes)}" for n, p in st.unary.items())
                with_ = f" (with {', '.join(m.name for m in st.members[1:])})" if len(st.members) > 1 else ""
                lines.append(f"{head} | {cands}{with_}")
            if u.dropped:
                lines.append(f"      dropped: {'; '.join(u.dropped)}")
        lines.append("DP rounds (each around the layout the round before chose):")
        lines.extend(f"  {h}" for h in self.history)
        if not self.converged:
            lines.append("  stopped: rounds ran out before a round changed nothing (raise rounds=)")
        if self.others:
            lines.append("replicated (no split candidates): " + ", ".join(self.others))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"AutoShard({self.choices})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _pct(seconds: float, of: float) -> str:
    return f"{100 * (seconds - of) / of:.2f}%" if of > 0 else "0.00%"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _on_axis(mesh: ProcessMesh, axis: str, pl: Placement) -> list[Placement]:
    pls: list[Placement] = [Replicate()] * mesh.ndim
    pls[mesh.axis_index(axis)] = pl
    return pls


# =============================================================================== the search
def auto_shard(
    layer: Layer,
    mesh: ProcessMesh,
    example_inputs: Sequence[Any],
    *,
    step: Step | None = None,
    axis: str | None = None,
    fixed: dict[str, str] | None = None,
    price: Pricer | None = None,
    rounds: int = 4,
    tolerance: float = 0.01,
) -> AutoShard:
    """Choose placements for ``layer``'s Linear and Embedding sublayers on ``mesh`` (module docstring).

    ``example_inputs``: the arguments of one step (tensors: their shape, dtype and layout are
    used, never their values; a dense tensor counts as replicated on ``mesh``). ``step(layer,
    *inputs)`` returns the loss (default: the mean of ``layer(*inputs)``). ``price`` overrides
    the simulator's cost model; ``rounds`` bounds the DP rounds; ``tolerance`` (a fraction of the
    step, default 0.01) is how much slower than the cheapest layout found the step may get for
    conventional layouts to be kept (module docstring, point 5; 0: the cheapest).
    """
    start = time.perf_counter()
    if not isinstance(layer, Layer):
        raise TypeError(f"auto_shard needs an mpipar.nn.Layer, got {type(layer).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"auto_shard needs a dist.ProcessMesh, got {type(mesh).__name__}")
    if isinstance(example_inputs, (Tensor, str, bytes)) or not isinstance(example_inputs, Sequence):
        raise TypeError(
            f"auto_shard example_inputs must be a tuple or list of the step's arguments, got {type(example_inputs).__name__}"
        )
    axis = mesh.dim_names[-1] if axis is None else axis
    if axis not in mesh.dim_names:
        raise ValueError(f"auto_shard axis {axis!r} is not an axis of mesh {mesh} (axes {list(mesh.dim_names)})")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"auto_shard rounds must be an int >= 1, got {rounds!r}")
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not math.isfinite(tolerance)
        or not 0 <= tolerance < 1
    ):
        raise ValueError(f"auto_shard tolerance must be a fraction of the step in [0, 1), got {tolerance!r}")
    size = mesh.get_dim_size(axis)
    pricer = price if price is not None else _default_pricer()
    run = step if step is not None else _mean_step

    units, others = _units(layer, size)
    by_name = {u.name: u for u in units}
    for name, choice in (fixed or {}).items():
        if name not in by_name:
            raise ValueError(
                f"auto_shard fixed: {name!r} is not a Linear or Embedding sublayer of {type(layer).__name__} "
                f"(these are: {sorted(by_name) or 'none'})"
            )
        u = by_name[name]
        names = [c.name for c in u.candidates]
        if choice not in names:
            raise ValueError(
                f"auto_shard fixed: {name!r} ({u.kind}) cannot be {choice!r} on axis {axis!r} of size {size}; "
                f"its candidates are {names}" + (f" (dropped: {'; '.join(u.dropped)})" if u.dropped else "")
            )
        u.candidates = [u.candidate(choice)]
        u.fixed = True

    tracer = _Tracer(layer, mesh, axis, example_inputs, run, pricer)
    uses, data_indexed = tracer.first_uses(
        {u.name: u.candidates[0] if u.fixed else u.candidate("replicate") for u in units}
    )
    for u in units:
        u.conventional = _convention(u, u.name in data_indexed)
    unused = [u for u in units if u.name not in uses]
    units = sorted((u for u in units if u.name in uses), key=lambda u: uses[u.name])
    for u in unused:  # never used by the step: nothing to price, keep it whole
        u.candidates = [u.candidates[0] if u.fixed else u.candidate("replicate")]
        u.how = "not used by the step"
        u.choice = u.candidates[0].name
    extra = {u.name: u.candidates[0] for u in unused}
    stages = _stages(units, uses)
    path = [st.base for st in stages]
    first: Priced | None = None
    history: list[str] = []
    converged = False
    for round_ in range(1, rounds + 1):
        base = {**extra, **{n: c for st, p in zip(stages, path, strict=True) for n, c in st.options[p].items()}}
        t0 = tracer.price(base)
        first = first or t0
        for st, p in zip(stages, path, strict=True):
            st.base = p
        new_path = _viterbi(tracer, stages, base, t0)
        changed = [
            f"{st.names} {old} -> {now}" for st, old, now in zip(stages, path, new_path, strict=True) if old != now
        ]
        if not changed:
            converged = True
            history.append(f"round {round_}: no change: the layout is a fixed point of the DP")
            break
        chosen_trial = tracer.price(
            {**extra, **{n: c for st, p in zip(stages, new_path, strict=True) for n, c in st.options[p].items()}}
        )
        if chosen_trial.seconds >= t0.seconds - max(_EPS, 1e-9 * t0.seconds):
            # The modelled gain did not survive the whole traced step: keep the layout we had.
            history.append(
                f"round {round_}: {'; '.join(changed)} modelled cheaper but the traced step is not "
                f"({_ms(t0.seconds)} -> {_ms(chosen_trial.seconds)}): kept the layout before it"
            )
            converged = True
            break
        history.append(f"round {round_}: {'; '.join(changed)} ({_ms(t0.seconds)} -> {_ms(chosen_trial.seconds)})")
        path = new_path
    assign = dict(extra)
    for st, name in zip(stages, path, strict=True):
        st.choice = name
        assign.update(st.options[name])
        for u in st.members:
            u.choice = st.options[name][u.name].name
            u.how = "fixed" if u.fixed else "dynamic programming"
            u.stage = st
    cheapest = tracer.price(assign)
    cheapest_choices = {u.name: u.choice for u in units}
    chosen = _keep_conventional(tracer, stages, assign, cheapest, tolerance, history)
    units.extend(unused)
    assert first is not None  # rounds >= 1: the first round always prices its base
    return AutoShard(
        mesh,
        axis,
        units,
        chosen,
        first,
        tracer.count,
        time.perf_counter() - start,
        history,
        others,
        converged,
        cheapest,
        {**cheapest_choices, **{u.name: u.choice for u in unused}},
        float(tolerance),
    )


def _convention(unit: Unit, data_indexed: bool) -> str | None:
    """The layout Megatron-LM and Paddle's fleet give this layer type by hand (module docstring, point 5)."""
    if unit.kind != "Embedding":
        return None
    wanted = "vocab" if data_indexed else "replicate"
    return wanted if wanted in {c.name for c in unit.candidates} else None


def _keep_conventional(
    tracer: _Tracer,
    stages: list[Stage],
    assign: dict[str, Candidate],
    cheapest: Priced,
    tolerance: float,
    history: list[str],
) -> Priced:
    """Move each DP step, in order, to its members' conventional candidate when the whole traced step
    stays within ``tolerance`` of ``cheapest``; update ``assign`` and the units' ``how``; the step's price."""
    budget = cheapest.seconds * (1.0 + tolerance) + _EPS
    current = cheapest
    moves: list[str] = []
    for st in stages:
        free = [u for u in st.members if not u.fixed]
        wanted = {u.conventional for u in free}
        if not free or len(wanted) != 1:
            continue  # nothing to move, or siblings with different conventions (one choice per step)
        conv = wanted.pop()
        if conv is None or conv == st.choice or conv not in st.options:
            continue
        old = st.choice
        trial_assign = {**assign, **st.options[conv]}
        trial = tracer.price(trial_assign)
        delta = _pct(trial.seconds, current.seconds)
        delta = delta if delta.startswith("-") else f"+{delta}"
        if trial.seconds <= budget:
            assign.clear()
            assign.update(trial_assign)
            current = trial
            st.choice = conv
            for u in free:
                u.choice = conv
                u.how = (
                    f"conventional: {conv} within {delta} of {old} (the DP's choice), the conventional layout kept "
                    f"(tolerance {100 * tolerance:g}%)"
                )
            moves.append(f"{st.names} {old} -> {conv} ({delta})")
        else:
            for u in free:
                u.how += (
                    f"; the conventional {conv} would cost {delta} of the step, over the tolerance "
                    f"({100 * tolerance:g}% above the cheapest)"
                )
    if moves:
        history.append(
            f"conventional layouts kept: {'; '.join(moves)} ({_ms(cheapest.seconds)} -> {_ms(current.seconds)}, "
            f"{_pct(current.seconds, cheapest.seconds)} above the cheapest)"
        )
    return current


def _viterbi(tracer: _Tracer, stages: list[Stage], base: dict[str, Candidate], t0: Priced) -> list[str]:
    """The cheapest option per stage under the chain model around ``base`` (unary + neighbour pairs)."""
    for st in stages:
        st.unary = {name: tracer.price({**base, **opt}) for name, opt in st.options.items()}
    best: dict[str, float] = {}
    back: list[dict[str, str]] = []
    for i, st in enumerate(stages):
        now: dict[str, float] = {}
        came: dict[str, str] = {}
        for name in st.options:
            unary = st.unary[name].seconds - t0.seconds
            if i == 0:
                now[name] = unary
                continue
            prev = stages[i - 1]
            value, arg = min(
                ((best[p] + unary + _pair(tracer, base, t0, prev, p, st, name), p) for p in prev.options),
                key=lambda o: (_tie(o[0]), o[1] != prev.base, _rank(o[1])),
            )
            now[name] = value
            came[name] = arg
        best = now
        back.append(came)
    if not stages:
        return []
    last = stages[-1]
    path = [min(best, key=lambda k: (_tie(best[k]), k != last.base, _rank(k)))]
    for i in range(len(stages) - 1, 0, -1):
        path.append(back[i][path[-1]])
    path.reverse()
    return path


@dataclass
class Stage:
    """Units reading the same activation (q, k, v of an attention): one step of the DP, one choice."""

    members: list[Unit]
    options: dict[str, dict[str, Candidate]]
    base: str
    unary: dict[str, Priced] = field(default_factory=dict)
    choice: str = ""

    @property
    def names(self) -> str:
        return ", ".join(u.name for u in self.members)


def _stages(units: list[Unit], uses: dict[str, tuple[int, int]]) -> list[Stage]:
    """Group units in order of first use by the activation they read; a stage's options apply one
    candidate name to all its free members (fixed ones keep theirs)."""
    groups: list[list[Unit]] = []
    for u in units:
        if groups and uses[groups[-1][0].name][1] == uses[u.name][1]:
            groups[-1].append(u)
        else:
            groups.append([u])
    stages = []
    for members in groups:  # replicate is every free unit's candidate: the names never run out
        free = [u for u in members if not u.fixed]
        names = [c.name for c in free[0].candidates] if free else ["fixed"]
        for u in free[1:]:
            names = [n for n in names if n in {c.name for c in u.candidates}]
        options = {n: {u.name: (u.candidates[0] if u.fixed else u.candidate(n)) for u in members} for n in names}
        base = "replicate" if "replicate" in options else names[0]
        stages.append(Stage(members, options, base))
    return stages


def _tie(seconds: float) -> float:
    """Seconds rounded so that float noise of summed op times does not break ties."""
    return round(seconds / _EPS) * _EPS


def _rank(name: str) -> int:
    """Tie-break: prefer the split that keeps less per rank, then the simpler one."""
    return {"column": 0, "row": 1, "vocab": 0, "hidden": 1, "replicate": 2}.get(name, 3)


def _pair(tracer: _Tracer, base: dict[str, Candidate], t0: Priced, prev: Stage, p: str, st: Stage, name: str) -> float:
    """Transition price of ``prev = p`` then ``st = name`` beyond their unary prices (0 when either is its base)."""
    if p == prev.base or name == st.base:
        return 0.0
    both = tracer.price({**base, **prev.options[p], **st.options[name]}).seconds
    return both - prev.unary[p].seconds - st.unary[name].seconds + t0.seconds


def _units(layer: Layer, size: int) -> tuple[list[Unit], list[str]]:
    units: list[Unit] = []
    others: list[str] = []
    for name, sub in layer.named_sublayers(include_self=True):
        if isinstance(sub, Linear):
            kind, cands = "Linear", _LINEAR
        elif isinstance(sub, Embedding):
            kind, cands = "Embedding", _EMBEDDING
        else:
            if sub._parameters:
                others.append(f"{name or type(sub).__name__} ({type(sub).__name__})")
            continue
        keep: list[Candidate] = []
        dropped: list[str] = []
        for c in cands:
            # Only the parameters this sublayer has (a Linear without bias has no bias placement).
            c = Candidate(
                c.name, tuple((a, pl) for a, pl in c.placements if sub._parameters.get(a) is not None), c.state
            )
            bad = [
                f"{c.name}: {attr} dim {pl.dim} of length {sub._parameters[attr].shape[pl.dim]} does not divide by {size}"
                for attr, pl in c.placements
                if isinstance(pl, Shard) and sub._parameters[attr].shape[pl.dim] % size
            ]
            if size == 1 and c.name != "replicate":
                bad = [f"{c.name}: the split axis has one rank, a split is the whole tensor"]
            (dropped.extend(bad) if bad else keep.append(c))
        units.append(Unit(name, kind, keep, dropped))
    return units, others


def _mean_step(layer: Layer, *inputs: Any) -> Tensor:
    return mean(layer(*inputs))


def _default_pricer() -> Pricer:
    """The simulator's cost model, found through the ``mpipar.pricers`` entry point."""
    from importlib.metadata import entry_points

    found = list(entry_points(group="mpipar.pricers"))
    if not found:
        raise RuntimeError(
            "auto_shard needs a pricer: pass price=callable(plan) -> (seconds, bytes), or install the simulator "
            "(pip install -e . registers simulator.auto_price.price_plan under the 'mpipar.pricers' entry point)"
        )
    fn: Pricer = found[0].load()
    return fn


# =============================================================================== tracing
class _Tracer:
    """Traces the step shape-only on value-less copies of the model, one per assignment (cached)."""

    def __init__(
        self,
        layer: Layer,
        mesh: ProcessMesh,
        axis: str,
        inputs: Sequence[Any],
        step: Step,
        pricer: Pricer,
    ) -> None:
        self.layer, self.mesh, self.axis, self.inputs, self.step, self.pricer = layer, mesh, axis, inputs, step, pricer
        self.count = 0
        self._cache: dict[tuple[tuple[str, str], ...], Priced] = {}
        self._world = max(mesh.process_ids) + 1

    def _key(self, assign: dict[str, Candidate]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, v.name) for k, v in assign.items()))

    def price(self, assign: dict[str, Candidate]) -> Priced:
        key = self._key(assign)
        if key not in self._cache:
            self._cache[key] = self._priced(self.plan(assign))
        return self._cache[key]

    def _priced(self, plan: Plan) -> Priced:
        """The pricer's answer, checked: two finite non-negative numbers."""
        out = self.pricer(plan)
        try:
            seconds, nbytes = (float(v) for v in out)
        except (TypeError, ValueError):
            raise TypeError(f"auto_shard price(plan) must return (seconds, bytes), got {out!r}") from None
        if not (math.isfinite(seconds) and math.isfinite(nbytes) and seconds >= 0 and nbytes >= 0):
            raise ValueError(f"auto_shard price(plan) must return finite non-negative (seconds, bytes), got {out!r}")
        return Priced(seconds, nbytes)

    def first_uses(self, assign: dict[str, Candidate]) -> tuple[dict[str, tuple[int, int]], set[str]]:
        """Unit name -> (index of the first op reading its weight, the tensor id of that op's other
        input); and the units whose first use's other input is computed from the step's inputs
        (an Embedding indexed by token ids, not by positions the model makes itself)."""
        plan = self.plan(assign)
        self._cache[self._key(assign)] = self._priced(plan)  # the same trace is the first round's base
        names = {t.id: t.name for t in plan.tensors if t.kind == "parameter"}
        out: dict[str, tuple[int, int]] = {}
        for op in plan.ops:
            for pos, tid in enumerate(op.inputs):
                pname = names.get(tid)
                if pname is None:
                    continue
                owner, _, attr = pname.rpartition(".")
                if attr == "weight" and owner in assign and owner not in out:
                    others = [t for j, t in enumerate(op.inputs) if j != pos]
                    # No other input (a weight transposed first): a key no other unit shares.
                    out[owner] = (op.index, others[0] if others else -(op.index + 1))
        derived = _from_inputs(plan)
        return out, {name for name, (_, other) in out.items() if other in derived}

    def plan(self, assign: dict[str, Candidate]) -> Plan:
        self.count += 1
        with use_backend(create_backend("shape-only", world_size=self._world)):
            model, params = self._copy()
            for name, cand in assign.items():
                for attr, pl in cand.placements:
                    p = params.get(f"{name}.{attr}" if name else attr)
                    if p is not None:
                        shard_tensor(p, self.mesh, _on_axis(self.mesh, self.axis, pl))
            for p in params.values():
                if not p.is_dist:
                    shard_tensor(p, self.mesh, [Replicate()] * self.mesh.ndim)
            args = [self._abstract(x) for x in self.inputs]
            with trace({"auto_shard": True}) as rec:
                for i, a in enumerate(args):
                    if isinstance(a, Tensor):
                        rec.mark(a, "input", f"input {i}")
                loss = self.step(model, *args)
                if not isinstance(loss, Tensor):
                    raise TypeError(f"auto_shard step must return the loss Tensor, got {type(loss).__name__}")
                loss.backward()
            return rec.plan()

    def _copy(self) -> tuple[Layer, dict[str, Parameter]]:
        """A copy of the model whose parameters are value-less stand-ins (nothing is materialised)."""
        memo: dict[int, Any] = {}
        params: dict[str, Parameter] = {}
        for name, p in self.layer.named_parameters():
            q = Parameter.abstract(tuple(p.shape), p.dtype)
            assert isinstance(q, Parameter)
            q.name = name
            q.stop_gradient = p.stop_gradient
            memo[id(p)] = q
            params[name] = q
        return copy.deepcopy(self.layer, memo), params

    def _abstract(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if x.is_dist:
            if not x.spec.mesh.same_layout(self.mesh):
                raise ValueError(
                    f"auto_shard example input {x._label()} lives on mesh {x.spec.mesh}, not on {self.mesh}: "
                    "lay it out on the mesh being searched (or pass it dense)"
                )
            return Tensor.abstract(tuple(x.shape), x.dtype, x.spec)
        t = Tensor.abstract(tuple(x.shape), x.dtype)
        return shard_tensor(t, self.mesh, [Replicate()] * self.mesh.ndim)


def _from_inputs(plan: Plan) -> set[int]:
    """Ids of the forward tensors computed from the step's inputs (kind ``input``), through ops and reshards."""
    derived = {t.id for t in plan.tensors if t.kind == "input"}
    by_index = {r.index: r for r in plan.reshards}
    for op in plan.ops:
        if op.phase != "forward":
            continue
        for ri in op.reshards:
            r = by_index.get(ri)
            if r is not None and r.tensor in derived:
                derived.add(r.new_tensor)
        if any(i in derived for i in op.inputs):
            derived.update(op.outputs)
    return derived
