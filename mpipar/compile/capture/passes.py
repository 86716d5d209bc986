"""The passes that turn a trace into the program that runs: constants folded, repeats made once,
updates moved up to their gradients, updates allowed to write in place, last uses dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpipar.compile.capture.instructions import Array, Indexed, Instruction, Kind, RunKind, Step
from mpipar.compile.capture.results import rebind_slots, template_slots
from mpipar.compile.capture.sources import TensorSource
from mpipar.compile.capture.tracer import Tracer


def fold_constants(tr: Tracer, instrs: Indexed, template: list[Any], kept: set[int]) -> Indexed:
    """The instructions less those that make the same arrays on every run: a pure one
    (``Tracer.pure``) whose inputs are all constants (the seed of backward, its scaling,
    reshape and broadcast). Their outputs become constants holding the traced values (which
    the validation run reproduced bit for bit), read-only so nothing writes into them; one
    whose output the step returns or leaves behind keeps running (a result is an array of its own)."""
    const = {s for s, _ in tr.consts}
    out = []
    for i, instr in instrs:
        made = instr.made()
        if (
            i in tr.pure
            and instr.kind is not Kind.EFFECT
            and all(s in const for s in instr.inputs)
            and not kept.intersection(made)
        ):
            for s in made:
                a = tr.arrays[s]
                if isinstance(a, np.ndarray) and a.flags.writeable:
                    a = a.copy()
                    a.flags.writeable = False
                template[s] = a
                const.add(s)
            continue
        out.append((i, instr))
    return out


def same_once(tr: Tracer, instrs: Indexed, kept: set[int], alias: dict[int, int]) -> Indexed:
    """The instructions less repeats: a pure one-output instruction calling the same function
    object on the same slots as an earlier one (a step that writes the same product twice)
    reads that one's output instead (``alias``: slot -> the slot it reads).
    Forgotten at every update or effect, which may overwrite a slot in place."""
    seen: dict[tuple[Any, tuple[int, ...]], int] = {}
    out: Indexed = []
    for i, (fn, ins, outs, kind) in instrs:
        if alias:
            ins = tuple(alias.get(s, s) for s in ins)
        if i in tr.updates or kind is Kind.EFFECT:
            seen.clear()
        elif i in tr.pure and kind is Kind.ONE and outs not in kept:
            try:
                key = (fn, ins)
                hash(key)
            except TypeError:
                key = None
            if key is not None:
                if key in seen:
                    alias[outs] = seen[key]
                    continue
                seen[key] = outs
        out.append((i, Instruction(fn, ins, outs, kind)))
    return out


def updates_early(tr: Tracer, instrs: Indexed) -> Indexed:
    """Each optimizer update moved up to right after the last instruction it must follow, as a
    hand-written step updates each weight as soon as its gradient is made: the gradient is
    still in cache, and its memory goes back to the allocator for the rest of backward. The
    arithmetic is the same (each update reads the same arrays), so are the bits. An update
    follows: the makers of its inputs; every instruction reading or making an array that
    shares memory with the shard it may overwrite (SGD in place); every update that may
    overwrite memory its inputs share; and every effect but the step counts of other
    parameters (its own count stays after it: Adam's bias correction reads the count as it
    was). Only on NumPy, where memory sharing can be asked (elsewhere the order stays)."""
    if not tr.updates or not numpy_only(tr):
        return instrs
    out: Indexed = []
    for i, ins_ in instrs:
        if i not in tr.updates:
            out.append((i, ins_))
            continue
        who = tr.updates[i]
        ins = ins_.inputs
        target = tr.arrays[ins[0]]
        shared = {s for s, a in enumerate(tr.arrays) if hasattr(a, "shape") and np.may_share_memory(a, target)}
        reads = [tr.arrays[s] for s in ins]
        pos = 0
        for k, (j, instr_j) in enumerate(out):
            ins_j, kind_j, made = instr_j.inputs, instr_j.kind, instr_j.made()
            if kind_j is Kind.EFFECT:
                after = tr.bumps.get(j) in (None, who)
            elif j in tr.updates:
                after = any(np.may_share_memory(tr.arrays[ins_j[0]], a) for a in reads if hasattr(a, "shape")) or bool(
                    shared.intersection(ins_j)
                )
            else:
                after = False
            if after or set(ins).intersection(made) or shared.intersection(ins_j) or shared.intersection(made):
                pos = k + 1
        out.insert(pos, (i, ins_))
    return out


_RUN_KINDS = {Kind.ONE: RunKind.ONE, Kind.SEVERAL: RunKind.SEVERAL, Kind.EFFECT: RunKind.EFFECT}


def with_drops(instrs: list[Instruction], kept: set[int]) -> list[Step]:
    """Each instruction with the slots it reads or makes for the last time (none that the
    outputs or the results put back need): the run drops them right after it."""
    last: dict[int, int] = {}
    for i, instr in enumerate(instrs):
        for s in (*instr.inputs, *instr.made()):
            last[s] = i
    drops: list[list[int]] = [[] for _ in instrs]
    for s, i in last.items():
        if s not in kept:
            drops[i].append(s)
    out = []
    for (fn, ins, outs, kind), d in zip(instrs, drops, strict=True):
        run = _RUN_KINDS[kind]
        if kind is Kind.ONE and len(ins) in (1, 2):
            run = RunKind.UNARY if len(ins) == 1 else RunKind.BINARY  # ``Program.run`` calls them directly
        out.append(Step(fn, ins, outs, run, tuple(d)))
    return out


def optimizer_setup(opt: Any) -> tuple[Any, ...]:
    """What an optimizer's step does besides the updates the program replays: its clip, its
    update layouts (ZeRO), offloading, master weights and parameter list, by identity."""
    return (
        id(opt._grad_clip),
        id(opt._update_layout),
        id(opt.offload),
        opt._multi_precision,
        tuple(map(id, opt._parameter_list)),
        type(opt._learning_rate),
    )


def owns(p: Any) -> bool:
    a = next(iter(p._shards.values()))
    return type(a) is np.ndarray and a.base is None and a.flags.c_contiguous and a.flags.owndata


def write_in_place(fn: Callable[..., Any], flags: list[bool], k: int, *arrays: Array) -> Any:
    """An update allowed to overwrite the parameter's shard (``SGD``'s ``w -= lr * g``) when the
    run began with nothing but the parameter holding it; read-only otherwise (a new array)."""
    if flags[k]:
        arrays[0].flags.writeable = True
    return fn(*arrays)


def numpy_only(tr: Tracer) -> bool:
    """Are all the trace's arrays NumPy's own (exactly ``np.ndarray``, or NumPy scalars)? Only
    there can ``np.may_share_memory`` and the memory flags be asked; a device array (CuPy's, or
    the CI stand-in's NumPy subclass standing for it) is not NumPy memory, so the program keeps
    the trace's order and writes nothing in place there."""
    return all(type(a) is np.ndarray or isinstance(a, np.generic) for a in tr.arrays if hasattr(a, "shape"))


def in_place_updates(tr: Tracer) -> list[tuple[int, Any, int]]:
    """The updates that may overwrite the parameter's shard: no later instruction, output or
    result reads that shard or anything sharing its memory (a view, a no-op reshard's output).
    None on device arrays (``numpy_only``): ``owns`` would refuse them on every run anyway."""
    if not tr.in_place or not numpy_only(tr):
        return []
    out = []
    for i, p, r in tr.in_place:
        ins = tr.instrs[i].inputs
        src = ins[0]
        if not any(s == src and key[0] is TensorSource and key[1] == id(p) for key, s in tr.root_slot.items()):
            continue
        base = tr.arrays[src]
        new = tr.instrs[i].outputs[0]
        shared = {
            s for s, a in enumerate(tr.arrays) if s != new and hasattr(a, "shape") and np.may_share_memory(a, base)
        }
        later = {j for _, ins_j, _, _ in tr.instrs[i + 1 :] for j in ins_j}
        kept = set(template_slots(tr.out_template)) | {s for e in tr.rebind for s in rebind_slots(e)}
        if not (shared & (later | kept)):
            out.append((i, p, r))
    return out
