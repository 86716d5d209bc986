"""Backward passes replayed: a training step's backward, once seen twice alike, runs as the
kernels it recorded instead of through its gradient functions.

Every step of a training loop records the same tape (the same ops on the same layouts, shapes
and dtypes), and every backward pass over it asks the same gradient functions the same
questions: the same rules, decisions and output layouts, answered from the caches, around the
same kernels. This module keeps, per *graph key* (each node's cached decision: op, input
layouts, shapes, dtypes and decided attributes; the attributes its gradient reads beyond
those; which inputs need a gradient; how the nodes connect), the kernels that backward ran, in
order, with where each took its arrays from (a node's saved inputs and outputs, the seed, an
earlier kernel's output) and where each leaf's gradient came from. A later pass with the same
key (checked node for node, and which saved arrays are one array) runs those kernels on its own
saved arrays and hands each leaf its gradient through the engine's usual accumulation
(``autograd._accumulate_leaf``: the cast, the leaf's hooks, the data-parallel reduction and its
buckets all run as before). The kernels, their arguments and their order are the ones the
gradient functions would run, so every gradient is bit for bit what the eager pass computes.

A pass is recorded by running it eagerly with a recorder listening where a captured step's
tracer does (``mpipar._capture_hooks``): each kernel call, each array made, each reshard, each
value read in Python. The recording is kept only if the pass did nothing it cannot replay:

* no collective inside a gradient function but a reshard's (a reshard is an instruction: its
  plan runs again at replay, its collectives where the eager pass runs them; the leaves' own
  reductions run outside the recording, at replay too);
* no tensor value read in Python (control flow could depend on the data), no array that does
  not come from a saved array, the seed or a recorded kernel;
* only gradient functions of mpipar's own ops and reshards (a user-registered op's gradient or
  a recomputed block's runs Python of the user's, which replay would skip);
* kernel attributes that are plain values (never an array, whose values could change).

A key is replayed once two recordings of it agree instruction for instruction (as
``compile_step(capture=True)`` traces twice). Passes that cannot be replayed run eagerly as
before; a loop whose graphs never repeat (a new shape every step) stops recording after a few
misses and then records only now and then. (A node's key holds only the attributes its gradient
reads, ``OpDef.grad_attrs``: dropout's fresh key every step is not one of them.)

Replay runs only where nothing else listens: a process hosting one rank of the mesh (under
MPI), the main thread, no op, reshard, program or pipeline hooks, no captured step being traced
or replayed, no saved-tensor hooks and no ZeRO-3 parameter made in the process (its regather
notes), one root whose seed gradient is ones (``loss.backward()``). A recorded pass is compiled
into one function (``_compile``) that checks a graph is the recorded one and runs the
instructions. ``MPIPAR_BACKWARD_REPLAY=off`` (or ``set_backward_replay(False)``) runs every pass
eagerly (``docs/performance.md``, "Backward replay").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mpipar import _capture_hooks, _tape, comm, distribute, hooks
from mpipar.backend import current_backend
from mpipar.env import env_flag
from mpipar.ops import dispatch
from mpipar.reshard.executor import execute_plan
from mpipar.tensor import Tensor

if TYPE_CHECKING:
    from mpipar._tape import Node

_enabled = [env_flag("MPIPAR_BACKWARD_REPLAY", True)]

RECORDINGS_TO_AGREE = 2
"""Recordings of one key that must agree before it is replayed."""
MAX_PROGRAMS = 256
"""Keys kept (programs and candidates); the cache starts afresh past this."""
MISSES_BEFORE_BACKOFF = 4
"""Passes in a row that could not be replayed before recording only every ``BACKOFF_EVERY``th."""
BACKOFF_EVERY = 64

KERNEL, CREATE, LEAF, RELEASE, RESHARD = 0, 1, 2, 3, 4


def set_backward_replay(enabled: bool) -> None:
    """Turn backward replay on or off for this process (``MPIPAR_BACKWARD_REPLAY``); programs
    recorded so far stay (their keys still say when each applies)."""
    _enabled[0] = bool(enabled)


def backward_replay_enabled() -> bool:
    return _enabled[0]


def forget_programs() -> None:
    """Drop every recording and program: the next passes are recorded afresh (a program calls
    the kernel functions it recorded, so code that swaps an op's kernel forgets them)."""
    _programs.clear()
    _by_root.clear()
    _misses[0] = _misses[1] = 0


@dataclass
class ReplayStats:
    """What backward replay did in this process (``backward_replay_stats()``)."""

    replayed: int = 0
    """Passes run from a program."""
    recorded: int = 0
    """Passes run eagerly while recording."""
    refused: dict[str, int] = field(default_factory=dict)
    """Why recordings were not kept: reason -> count."""
    eager: int = 0
    """Passes run eagerly without recording (not eligible, backing off, or nothing to replay)."""


_stats = ReplayStats()


def backward_replay_stats(reset: bool = False) -> ReplayStats:
    """This process's replay counts (a copy); ``reset`` starts them afresh (and ends a back-off)."""
    got = ReplayStats(_stats.replayed, _stats.recorded, dict(_stats.refused), _stats.eager)
    if reset:
        _stats.replayed = _stats.recorded = _stats.eager = 0
        _stats.refused.clear()
        _misses[0] = _misses[1] = 0
    return got


@dataclass(eq=False)
class _Entry:
    """A key's recordings: the program once ``RECORDINGS_TO_AGREE`` of them agreed."""

    candidate: list[tuple[Any, ...]] | None = None
    """The first recording's comparable form."""
    agreed: int = 0
    program: Program | None = None
    dead: str | None = None
    """Why this key is never replayed (a refused recording, or two that disagreed)."""


_programs: dict[Any, _Entry] = {}
_by_root: dict[Any, list[Program]] = {}
"""The programs by their root node's key part: the first thing a pass looks up."""
_misses = [0, 0]
"""[passes in a row not replayed, passes since the last recording while backing off]."""


def walk(root: Tensor) -> tuple[list[Node], Any, list[Any]] | None:
    """``root``'s nodes in the engine's order (``_tape.topo_order``: parents first), the graph
    key and every node's saved tensors in slot order (each node's inputs, then outputs); None
    when some node cannot be replayed. (Only passes no program took come here.)"""
    order = _tape.topo_order(root)
    index: dict[Node, int] = {}
    parts: list[Any] = []
    saved: list[Any] = []
    for k, node in enumerate(order):
        sig = node.sig
        if sig is None:  # (set only for the gradient functions of mpipar's ops and reshards)
            return None
        index[node] = k
        part: list[Any] = [sig]
        for p in node.parents:
            if p is None:
                part.append(None)
            elif (fn := p._grad_fn) is None:
                part.append(p.stop_gradient)
            else:
                part.append((index[fn], p._out_index, p.stop_gradient))
        parts.append(tuple(part))
        ctx = node.ctx
        saved += ctx.inputs
        saved += ctx.outputs
    return order, (tuple(parts), root._spec, root._out_index, current_backend()), saved


def eligible(roots: Sequence[Tensor], grads: Sequence[Tensor | None], defer: Any) -> int | None:
    """The rank this process hosts, when this backward pass may be replayed or recorded."""
    if (
        not _enabled[0]
        or defer is not None
        or len(roots) != 1
        or grads[0] is not None
        or hooks.op_hooks
        or hooks.op_start_hooks
        or hooks.reshard_hooks
        or hooks.program_hooks
        or hooks.stage_runs
        or _capture_hooks.capture_tracers
        or dispatch._replaying
        or _tape._saved_hooks
        or dispatch.stored_split_seen[0]
        or threading.current_thread() is not threading.main_thread()
    ):
        return None
    root = roots[0]
    if root._spec is None or root._abstract or root._grad_fn is None or root.stop_gradient:
        return None
    shards = root.__dict__.get("_shards")
    if shards is None or len(shards) != 1:
        return None
    backend = current_backend()
    if backend.shape_only or backend.reference:
        return None
    (r,) = shards
    return r


def run(
    root: Tensor,
    r: int,
    retain_graph: bool,
    eager: Callable[[list[Node] | None, Recorder | None], None],
    accumulate: Callable[[Tensor, Tensor], None],
) -> None:
    """Backpropagate from ``root``: replayed, recorded (``eager(order, recorder)``: the engine
    over ``walk``'s order) or plainly eager (``eager(order or None, None)``);
    ``accumulate(leaf, grad)`` is the engine's accumulation of a leaf's gradient (both handed
    in: the engine imports this module)."""
    sig = root._grad_fn.sig  # type: ignore[union-attr]
    if sig is not None:  # (a node's key part is hashable: ``dispatch._node_sig`` checks)
        programs = _by_root.get(sig)
        if programs:
            for program in programs:
                if program.rank == r and program.run(root, retain_graph, accumulate):
                    _misses[0] = 0
                    _stats.replayed += 1
                    return
    walked = walk(root)
    if walked is None:  # some node is never replayed
        _stats.eager += 1
        eager(None, None)
        return
    order, key, saved = walked
    entry = _programs.get(key)
    if entry is not None and (entry.dead is not None or entry.program is not None):
        # (a program that did not take this graph: its saved arrays are not one where it needs them)
        _stats.eager += 1
        eager(order, None)
        return
    _misses[0] += 1
    if _misses[0] > MISSES_BEFORE_BACKOFF:
        _misses[1] += 1
        if _misses[1] % BACKOFF_EVERY:
            _stats.eager += 1
            eager(order, None)
            return
    rec = Recorder(order, saved, r)
    _stats.recorded += 1
    tripwire = _Tripwire(rec)
    comm._recorders.append(tripwire)
    _capture_hooks.capture_tracers.append(rec)
    try:
        eager(order, rec)
    finally:
        if rec in _capture_hooks.capture_tracers:
            _capture_hooks.capture_tracers.remove(rec)
        comm._recorders.remove(tripwire)
    if entry is None:
        if len(_programs) >= MAX_PROGRAMS:
            _programs.clear()
            _by_root.clear()
        entry = _programs[key] = _Entry()
    if rec.refused is not None:
        entry.dead = rec.refused
        _stats.refused[rec.refused] = _stats.refused.get(rec.refused, 0) + 1
        return
    seen = rec.seen
    if entry.candidate is None:
        entry.candidate, entry.agreed = seen, 1
    elif seen != entry.candidate:
        entry.dead = "two recordings of one graph ran other kernels"
        _stats.refused[entry.dead] = _stats.refused.get(entry.dead, 0) + 1
        return
    else:
        entry.agreed += 1
    if entry.agreed >= RECORDINGS_TO_AGREE:
        entry.program = _compile(rec, root, current_backend())
        entry.candidate = None
        programs = _by_root.setdefault(entry.program.root_sig, [])
        programs.append(entry.program)


@dataclass(eq=False)
class Program:
    """A recorded backward pass compiled into one Python function (``_compile``): it checks that
    a graph is the recorded one, node for node, and runs the recorded instructions on it."""

    root_sig: Any
    rank: int
    run: Callable[[Tensor, bool, Callable[[Tensor, Tensor], None]], bool]
    """``run(root, retain_graph, accumulate)``: False (having done nothing) when ``root``'s graph
    is not the recorded one, else True once the pass is done."""
    source: str
    """The function's text (kept for a reader debugging a replayed pass)."""


def _push(op: Any, attrs: dict[str, Any]) -> None:
    """The op hooks that joined during the pass (the gradient buckets' session, once a reduction
    started) hear each replayed kernel as they would its op."""
    for hook in list(hooks.op_hooks):
        hook.on_op(op, (), (), (), None, attrs)


def _reshard_run(plan: Any, arr: Any, dtype: np.dtype, backend: Any, context: tuple[str, ...], r: int) -> Any:
    """A recorded reshard, under the communication context it ran in."""
    outer = comm._context[:]
    comm._context[:] = context
    try:
        return execute_plan(plan, {r: arr}, dtype, backend)[r]
    finally:
        comm._context[:] = outer


def _compile(rec: Recorder, root: Tensor, backend: Any) -> Program:
    """The recorded pass as one function of straight-line Python: first every check that the
    graph is the recorded one (each node's key part, each parent edge, which nodes are one node,
    which saved arrays are one array), then each instruction, every array let go after its last
    use, so a pass holds no more than the eager one does."""
    order, r = rec.order, rec.r
    index = rec.index
    consts: dict[str, Any] = {
        "Tensor": Tensor,
        "ndarray": np.ndarray,
        "output_array": dispatch.output_array,
        "push": _push,
        "reshard_run": _reshard_run,
        "op_output": Tensor._op_output,
        "OP_HOOKS": hooks.op_hooks,
        "current_backend": current_backend,
        "BACKEND": backend,
    }
    names = iter(range(1 << 30))

    def const(value: Any) -> str:
        name = f"c{next(names)}"
        consts[name] = value
        return name

    last = len(order) - 1
    lines = [
        "def replay(root, retain_graph, accumulate):",
        f"    n{last} = root._grad_fn",
        f"    if n{last}.sig != {const(order[last].sig)} or root._out_index != {root._out_index}:",
        "        return False",
        "    if current_backend() is not BACKEND:",
        "        return False",
    ]
    bound = {last}
    by_sig: dict[Any, list[int]] = {}
    for k in range(last, -1, -1):
        node = order[k]
        by_sig.setdefault(node.sig, []).append(k)
        lines.append(f"    ps = n{k}.parents")
        lines.append(f"    if len(ps) != {len(node.parents)}:")
        lines.append("        return False")
        for i, p in enumerate(node.parents):
            lines.append(f"    p = ps[{i}]")
            if p is None:
                lines.append("    if p is not None:")
            elif (fn := p._grad_fn) is None:
                lines.append(
                    f"    if p is None or p._grad_fn is not None or p.stop_gradient != {bool(p.stop_gradient)}:"
                )
            else:
                lines.append(
                    f"    if p is None or p._out_index != {p._out_index} or p.stop_gradient != {bool(p.stop_gradient)}:"
                )
                lines.append("        return False")
                j = index[fn]
                if j in bound:
                    lines.append(f"    if p._grad_fn is not n{j}:")
                else:
                    bound.add(j)
                    lines.append(f"    n{j} = p._grad_fn")
                    lines.append(f"    if n{j}.sig != {const(fn.sig)}:")
            lines.append("        return False")
    for same in by_sig.values():  # nodes with one key part are other nodes where recorded so
        for a in range(len(same)):
            for b in range(a + 1, len(same)):
                lines.append(f"    if n{same[a]} is n{same[b]}:")
                lines.append("        return False")
    # The saved arrays the instructions read (each node's inputs, then outputs, in slot order).
    where: list[tuple[int, str, int]] = []
    for k, node in enumerate(order):
        where += [(k, "inputs", j) for j in range(len(node.ctx.inputs))]
        where += [(k, "outputs", j) for j in range(len(node.ctx.outputs))]
    reads = sorted(rec.saved_read | {i for pair in rec.same for i in pair})
    if reads:
        lines.append("    try:")
        for i in reads:
            k, kind, j = where[i]
            lines.append(f"        s{i} = n{k}.ctx.{kind}[{j}]._shards[{r}]")
        lines.append("    except (AttributeError, KeyError, IndexError, TypeError):")
        lines.append("        return False")
    for a, b in sorted(rec.same):
        lines.append(f"    if s{a} is not s{b}:")
        lines.append("        return False")
    # When each array is read last: let go of it there.
    slot_out = rec.n_saved
    uses: dict[int, int] = {}
    made: list[list[int]] = []
    for pos, ins in enumerate(rec.program):
        kind = ins[0]
        outs: list[int] = []
        if kind == KERNEL:
            for a in ins[5]:
                uses[a] = pos
            n_out = 1 if ins[6] is None else len(ins[6])
            outs = list(range(slot_out, slot_out + n_out))
        elif kind == CREATE:
            outs = [slot_out]
        elif kind == RESHARD:
            uses[ins[4]] = pos
            outs = [slot_out]
        elif kind == LEAF:
            uses[ins[3]] = pos
        slot_out += len(outs)
        made.append(outs)
    for s_ in range(rec.n_saved, slot_out):
        uses.setdefault(s_, -1)  # made, never read: let go at once
    drop: dict[int, list[int]] = {}
    for s_, pos in uses.items():
        if pos < 0:
            continue
        drop.setdefault(pos, []).append(s_)
    wrapped: set[int] = set()
    settle_later = _settled_at_the_end(rec, order)
    if settle_later:
        lines.append("    later = []")
    for pos, ins in enumerate(rec.program):
        kind = ins[0]
        outs = made[pos]
        if kind == KERNEL:
            _, op, kernel, ctx, attrs, args, multi, dt, shape = ins
            call = f"{const(kernel)}({const(ctx)}, " + ", ".join(f"s{a}" for a in args)
            call += f", **{const(attrs)})" if attrs else ")"
            if multi is None:
                o = outs[0]
                lines.append(f"    s{o} = {call}")
                d, sh = const(dt), const(shape)
                lines.append(f"    if s{o}.__class__ is ndarray and s{o}.dtype is {d} and s{o}.shape == {sh}:")
                lines.append(f"        s{o}.setflags(False)")
                lines.append("    else:")
                lines.append(f"        s{o} = output_array({const(op)}, None, {r}, 0, s{o}, {d}, {sh})")
            else:
                lines.append(f"    t = {call}")
                for j, (o, (dt_j, shape_j)) in enumerate(zip(outs, multi, strict=True)):
                    lines.append(
                        f"    s{o} = output_array({const(op)}, None, {r}, {j}, t[{j}], {const(dt_j)}, {const(shape_j)})"
                    )
                lines.append("    del t")
            lines.append("    if OP_HOOKS:")
            lines.append(f"        push({const(op)}, {const(attrs)})")
        elif kind == CREATE:  # (the seed of ones: made once, read-only, as every pass's seed is)
            _, make, shape, dtype = ins
            seed = make(shape, dtype=dtype)
            if isinstance(seed, np.ndarray):
                seed.setflags(False)  # type: ignore[call-arg]  # positional: ``executor.freeze``
            lines.append(f"    s{outs[0]} = {const(seed)}")
        elif kind == RESHARD:
            _, plan, dtype, bk, slot, context = ins
            lines.append(
                f"    s{outs[0]} = reshard_run({const(plan)}, s{slot}, {const(dtype)}, {const(bk)}, {const(context)}, {r})"
            )
        elif kind == LEAF:
            _, k, i, slot, spec, dt, same_as = ins
            if (k, i) in settle_later:  # (its tensor made at the end too: no other leaf shares it)
                lines.append(f"    later.append((n{k}.parents[{i}], {const(spec)}, {const(dt)}, s{slot}))")
            else:
                if same_as not in wrapped:
                    wrapped.add(same_as)
                    lines.append(f"    w{same_as} = op_output({const(spec)}, {const(dt)}, {{{r}: s{slot}}})")
                lines.append(f"    accumulate(n{k}.parents[{i}], w{same_as})")
        else:  # RELEASE: ``Node.release`` written out (the saved tensors' counts are the recorded graph's)
            node = order[ins[1]]
            lines.append("    if not retain_graph:")
            lines.append(f"        c = n{ins[1]}.ctx")
            lines.append(f"        c.inputs = [{', '.join(['None'] * len(node.ctx.inputs))}]")
            lines.append(f"        c.outputs = [{', '.join(['None'] * len(node.ctx.outputs))}]")
        for s_ in sorted(drop.get(pos, ())) + [o for o in outs if uses.get(o) == -1]:
            lines.append(f"    del s{s_}")
    if settle_later:
        lines.append("    for leaf, spec, dt, arr in later:")
        lines.append(f"        accumulate(leaf, op_output(spec, dt, {{{r}: arr}}))")
    lines.append("    return True")
    source = "\n".join(lines) + "\n"
    namespace = dict(consts)
    exec(compile(source, "<mpipar backward replay>", "exec"), namespace)
    return Program(order[last].sig, r, namespace["replay"], source)


def _settled_at_the_end(rec: Recorder, order: list[Node]) -> set[tuple[int, int]]:
    """The leaf gradients (node, input) a replay hands to the engine after its last kernel
    rather than where the pass made them: those already in their leaf's layout (nothing to
    reduce, so no reduction to start early) of leaves that get one gradient in the pass (the
    order of a leaf's contributions stays). The engine's work for them (the cast, the hooks,
    the accumulation) then runs in one stretch, not between kernels, each of which empties the
    caches it would run with."""
    counts: dict[int, int] = {}
    shared: dict[int, int] = {}  # leaves per gradient tensor (``same_as``): one tensor, one leaf
    leaves: dict[tuple[int, int], tuple[Tensor, int]] = {}
    for ins in rec.program:
        if ins[0] == LEAF:
            _, k, i, _slot, spec, _dt, same_as = ins
            shared[same_as] = shared.get(same_as, 0) + 1
            leaf = order[k].parents[i]
            if leaf is None:
                continue
            counts[id(leaf)] = counts.get(id(leaf), 0) + 1
            own = leaf._spec
            if own is not None and spec is own._without_partial and not leaf.grad_placements:
                leaves[(k, i)] = (leaf, same_as)
    return {key for key, (leaf, same_as) in leaves.items() if counts[id(leaf)] == 1 and shared[same_as] == 1}


class _Tripwire:
    """Any collective while recording (outside a leaf's accumulation) makes the recording refuse."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def record(self, event: Any) -> None:
        if self.rec.listening:
            self.rec.refuse(f"a {event.op} runs inside a gradient function")


class Recorder:
    """A backward pass being recorded: a captured step's tracer (``_capture_hooks.CaptureTracer``)
    for the places that run array work, and the engine's notes of leaves and released nodes."""

    def __init__(self, order: list[Node], saved: list[Any], r: int) -> None:
        self.thread = threading.get_ident()
        self.order = order
        self.index = {node: k for k, node in enumerate(order)}
        self.r = r
        self.refused: str | None = None
        self.listening = True
        self.keep: list[Any] = list(saved)  # alive until the end: ids stay unique
        self.n_saved = self.n_slots = len(saved)
        self.by_tensor: dict[int, int] = {}
        """A saved tensor (the node's own detached object) -> its slot."""
        self.by_array: dict[int, int] = {}
        """An array -> its (first) slot."""
        self.holders: dict[int, list[int]] = {}
        """A saved array -> every saved slot holding it (several: one value saved twice)."""
        for i, t in enumerate(saved):
            if t is None or type(t) is not Tensor or t._spec is None:
                continue
            arr = t._shards.get(r)
            if arr is None:
                continue
            self.keep.append(arr)
            self.by_tensor[id(t)] = i
            self.by_array.setdefault(id(arr), i)
            self.holders.setdefault(id(arr), []).append(i)
        self.same: set[tuple[int, int]] = set()
        """Saved slots a kernel read as one array without saying through which tensor: the
        program holds only where they are one array again (``Program.arrays`` checks)."""
        self.saved_read: set[int] = set()
        self.program: list[tuple[Any, ...]] = []
        self.seen: list[tuple[Any, ...]] = []
        self.grad_ids: dict[int, int] = {}

    def _slot_of(self, t: Any, arr: Any) -> int | None:
        """The slot of ``arr``, read through tensor ``t`` (None: not known, or ambiguous)."""
        s = self.by_tensor.get(id(t))
        if s is None:
            s = self.by_array.get(id(arr))
            held = self.holders.get(id(arr))
            # (only a saved slot: an instruction that returned a saved array as it is, such as a
            # reshard's local step, made that array a slot of its own, which the program holds)
            if s is not None and s < self.n_saved and held is not None and len(held) > 1:
                self.same.update((s, other) for other in held[1:])
        if s is not None and s < self.n_saved:
            self.saved_read.add(s)
        return s

    # ------------------------------------------------------------------ the engine's notes
    def leaf(self, node: Node, i: int, g: Tensor) -> None:
        """Node ``node``'s input ``i`` is a leaf receiving ``g``: noted, then accumulated unheard."""
        if self.refused is not None:
            return
        arr = g.__dict__.get("_shards", {}).get(self.r) if g._spec is not None else None
        slot = None if arr is None else self._slot_of(g, arr)
        if slot is None:
            self.refuse("a leaf's gradient comes from work the recording did not see")
            return
        same_as = self.grad_ids.setdefault(id(g), len(self.grad_ids))
        self.keep.append(g)
        ins = (LEAF, self.index[node], i, slot, g._spec, g._dtype, same_as)
        self.program.append(ins)
        self.seen.append(ins)

    def pause(self) -> None:
        """A leaf's accumulation runs now (its reduction, cast and hooks run at replay too)."""
        self.listening = False
        if self in _capture_hooks.capture_tracers:
            _capture_hooks.capture_tracers.remove(self)

    def resume(self) -> None:
        self.listening = True
        _capture_hooks.capture_tracers.append(self)

    def released(self, node: Node) -> None:
        ins = (RELEASE, self.index[node])
        self.program.append(ins)
        self.seen.append(ins)

    # ------------------------------------------------------------------ CaptureTracer
    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def escape(self, what: str) -> None:
        if threading.get_ident() == self.thread:
            self.refuse(f"a gradient function reads a tensor's value in Python ({what})")

    def note_leaf(self, leaf: Any) -> None:
        pass  # (leaves are accumulated with the recorder paused; see ``leaf``)

    def note_optimizer(self, opt: Any) -> None:
        self.refuse("an optimizer steps inside backward")

    def _arg_slots(self, used: Sequence[Any], arrays: Sequence[Any]) -> tuple[int, ...] | None:
        slots = []
        for t, a in zip(used, arrays, strict=True):
            s = self._slot_of(t, a)
            if s is None:
                return None
            slots.append(s)
        return tuple(slots)

    def _new_slot(self, arr: Any) -> None:
        self.keep.append(arr)
        self.by_array[id(arr)] = self.n_slots
        self.n_slots += 1

    def record_kernel(
        self,
        op: Any,
        ctx: Any,
        attrs: dict[str, Any],
        dtypes: Sequence[Any],
        used: Sequence[Any],
        r: int | None,
        arrays: Sequence[Any],
        got: Any,
        dense: bool = False,
        raw: Any = None,
    ) -> None:
        if self.refused is not None:
            return
        if dense or r != self.r:
            self.refuse(f"{op.name} runs outside this rank's distributed kernels")
            return
        args = self._arg_slots(used, arrays) if len(used) == len(arrays) else None
        if args is None:
            self.refuse(f"{op.name} reads an array the recording did not see made")
            return
        try:
            frozen_attrs = dispatch.freeze_attrs(attrs)
            hash(frozen_attrs)
        except TypeError:
            self.refuse(f"{op.name} has an attribute that is not a plain value")
            return
        if not _plain_attrs(attrs):
            self.refuse(f"{op.name} has an attribute that is not a plain value")
            return
        outs = list(got)
        shapes = tuple(tuple(a.shape) for a in outs)
        out_dtypes = tuple(np.dtype(d) for d in dtypes)
        ins: tuple[Any, ...]
        if op.multi_output:
            ins = (
                KERNEL,
                op,
                op.kernel,
                ctx,
                dict(attrs),
                args,
                tuple(zip(out_dtypes, shapes, strict=True)),
                None,
                None,
            )
        else:
            ins = (KERNEL, op, op.kernel, ctx, dict(attrs), args, None, out_dtypes[0], shapes[0])
        self.program.append(ins)
        self.seen.append((KERNEL, op.name, id(ctx), frozen_attrs, args, out_dtypes, shapes))
        for a in outs:
            self._new_slot(a)

    def create(self, make: Any, shapes: Sequence[tuple[int, ...]], dtype: Any) -> tuple[Any, ...]:
        made = tuple(make(s, dtype=dtype) for s in shapes)
        if self.refused is None:
            for s, a in zip(shapes, made, strict=True):
                ins = (CREATE, make, tuple(s), np.dtype(dtype))
                self.program.append(ins)
                self.seen.append(ins)
                self._new_slot(a)
        return made

    def reshard(self, plan: Any, tensor: Any, backend: Any) -> dict[int, Any]:
        """A reshard inside a gradient function: an instruction (its collectives, if any, run at
        replay where the eager pass runs them, under the same context)."""
        shards = tensor.__dict__.get("_shards")
        arr = None if shards is None or len(shards) != 1 else shards.get(self.r)
        slot = None if arr is None or self.refused is not None else self._slot_of(tensor, arr)
        if slot is None:
            self.refuse("a gradient function reshards a value the recording did not see made")
            return execute_plan(plan, tensor._plan_input(plan, backend), tensor.dtype, backend)
        context = tuple(comm._context)
        self.listening = False  # (its collectives are the instruction's)
        try:
            out = execute_plan(plan, {self.r: arr}, tensor.dtype, backend)
        finally:
            self.listening = True
        if list(out) != [self.r]:
            self.refuse("a reshard inside a gradient function left other ranks' shards")
            return out
        ins = (RESHARD, plan, np.dtype(tensor.dtype), backend, slot, context)
        self.program.append(ins)
        self.seen.append((RESHARD, plan, np.dtype(tensor.dtype), slot, context))
        self._new_slot(out[self.r])
        return out

    def _unheard(self, make: Callable[[], Any]) -> Any:
        """``make()`` with this recorder out of the way (what runs when no tracer listens)."""
        listening = self in _capture_hooks.capture_tracers
        if listening:
            _capture_hooks.capture_tracers.remove(self)
        try:
            return make()
        finally:
            if listening:
                _capture_hooks.capture_tracers.append(self)

    def from_global(self, dst: Any, tensor: Any) -> dict[int, Any]:
        self.refuse("a gradient function distributes a dense tensor")
        return self._unheard(lambda: distribute.reshard_to(tensor, dst)._shards)  # type: ignore[no-any-return]

    def shard_array(self, spec: Any, data: Any, dtype: Any) -> dict[int, Any]:
        self.refuse("a gradient function distributes an array")
        return self._unheard(  # type: ignore[no-any-return]
            lambda: distribute.shard_tensor(data, spec.mesh, list(spec.placements), dtype=dtype)._shards
        )

    def update(
        self, opt: Any, p: Any, lr: float, src: Any, gv: Any, state: dict[str, Any], r: int, cdt: Any
    ) -> tuple[Any, dict[str, Any]]:
        self.refuse("an optimizer updates inside backward")
        return opt._update_shard(src, gv, r, cdt, state, lr)  # type: ignore[no-any-return]

    def bump_step(self, opt: Any, p: Any) -> None:
        self.refuse("an optimizer steps inside backward")


_PLAIN_TYPES = (bool, int, float, str, type(None), np.dtype, np.generic)


def _plain_attrs(attrs: dict[str, Any]) -> bool:
    """Attributes made only of scalars, dtypes and tuples or lists of them (never an array or
    an object whose value could change between passes)."""

    def plain(v: Any) -> bool:
        if isinstance(v, (*_PLAIN_TYPES, type)):
            return True
        if isinstance(v, (tuple, list)):
            return all(plain(x) for x in v)
        return False

    return all(plain(v) for v in attrs.values())
