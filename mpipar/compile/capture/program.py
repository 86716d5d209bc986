"""A captured step: the program that runs it without its Python, checked before every run."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

from mpipar.compile.capture.instructions import RunKind, Stale
from mpipar.compile.capture.passes import (
    fold_constants,
    in_place_updates,
    optimizer_setup,
    owns,
    same_once,
    updates_early,
    with_drops,
    write_in_place,
)
from mpipar.compile.capture.results import apply_rebind, build, rebind_slots, template_slots, weak_rebind
from mpipar.compile.capture.sources import getter
from mpipar.compile.capture.tracer import Tracer
from mpipar.optimizer.optimizer import _ALONE_REFS, _shard_refs


class Program:
    """A captured step: instructions over slots, how to fill its roots, where its results go."""

    def __init__(self, tr: Tracer) -> None:
        self.n = len(tr.arrays)
        self.binders = [(s, getter(src)) for s, src in tr.roots]
        self.template: list[Any] = [None] * self.n
        for s, a in tr.consts:
            self.template[s] = a
        self.out = tr.out_template
        self.leaf_guards = [(weakref.ref(leaf), state) for leaf, state in tr.start_grads]
        self.tensor_guards = [(weakref.ref(t), spec, dtype) for t, spec, dtype in tr.start_tensors]
        self.optimizer_guards = [(weakref.ref(opt), optimizer_setup(opt)) for opt in tr.optimizers.values()]
        self.alone: list[tuple[weakref.ref[Any], list[bool], int]] = []
        self.alone_flags: list[bool] = []
        instrs = list(tr.instrs)
        for k, (i, p, _) in enumerate(in_place_updates(tr)):
            self.alone_flags.append(False)
            self.alone.append((weakref.ref(p), self.alone_flags, k))
            instrs[i] = instrs[i]._replace(fn=partial(write_in_place, instrs[i].fn, self.alone_flags, k))
        self._alone_test = (_ALONE_REFS, _shard_refs)
        kept = set(template_slots(tr.out_template)) | {s for e in tr.rebind for s in rebind_slots(e)}
        self.alias: dict[int, int] = {}
        """Slots never made because an earlier instruction makes the same array (``same_once``)."""
        indexed = fold_constants(tr, list(enumerate(instrs)), self.template, kept)
        indexed = updates_early(tr, same_once(tr, indexed, kept, self.alias))
        self.instrs = [ins for _, ins in indexed]
        """The instructions as they run (folded, reordered): what the validation run checks."""
        self.program = with_drops(self.instrs, kept)
        self.rebind = weak_rebind(tr.rebind)

    def run(self, flat: Sequence[Any]) -> Any:
        """The step on this call's arguments; raises ``Stale`` (before any work) if a check fails."""
        for ref, (stop, grad) in self.leaf_guards:
            leaf = ref()
            if leaf is None or leaf.stop_gradient != stop:
                raise Stale
            g = leaf.grad
            if (g is None) != (grad is None) or (g is not None and (g._spec != grad[0] or g._dtype != grad[1])):
                raise Stale
        for ref, spec, dtype in self.tensor_guards:
            t = ref()
            if t is None or (t._spec is not spec and t._spec != spec) or t._dtype != dtype or t._grad_fn is not None:
                raise Stale
        for ref, setup in self.optimizer_guards:
            opt = ref()
            if opt is None or optimizer_setup(opt) != setup:
                raise Stale
        if self.alone:
            alone_refs, shard_refs = self._alone_test
            for ref, flags, k in self.alone:
                # As eager's ``_unfreeze_if_alone``: nothing but the parameter may hold its shard.
                p = ref()
                flags[k] = p is not None and len(p._shards) == 1 and owns(p) and shard_refs(p)[:2] == alone_refs
        slots = list(self.template)
        for s, get in self.binders:
            slots[s] = get(flat)
        binary, unary, one, several = RunKind.BINARY, RunKind.UNARY, RunKind.ONE, RunKind.SEVERAL
        for fn, ins, outs, kind, drop in self.program:
            if kind is binary:  # one output of two inputs (most kernels): no argument list to build
                slots[outs] = fn(slots[ins[0]], slots[ins[1]])
            elif kind is unary:
                slots[outs] = fn(slots[ins[0]])
            elif kind is one:
                slots[outs] = fn(*[slots[i] for i in ins])
            elif kind is several:
                for o, a in zip(outs, fn(*[slots[i] for i in ins]), strict=True):
                    slots[o] = a
            else:  # an effect
                fn()
            for s in drop:  # last use: let the allocator hand the memory to the next array while it is hot
                slots[s] = None
        apply_rebind(self.rebind, slots)
        return build(self.out, slots)
