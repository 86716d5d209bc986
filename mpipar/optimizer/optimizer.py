"""The optimizer base: per-parameter states in a chosen layout, elementwise updates on shards.

An update is elementwise, so it runs on each hosted shard with plain NumPy: the distributed
update is bit-for-bit the dense one. The layout it runs in is the parameter's own unless
``shard_optimizer`` set a sharded one (ZeRO): the parameter and its gradient are then cut to
that layout (a local slice), updated there, and the new values gathered back (ZeRO-1/2) --
or, for ZeRO-3, the parameter lives in that layout.

``multi_precision=True`` (Paddle's flag) keeps, for every 16-bit parameter (float16,
bfloat16), a float32 master copy in the update layout (state ``master_weight``) and float32
moments: the update runs in float32 on the master with the gradient cast up, and the
parameter becomes the master cast down. Small updates then accumulate in the master instead
of being rounded away in 16 bits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from mpipar import _capture_hooks, autograd, hooks
from mpipar._modes import Mode, execution_mode, in_static_mode
from mpipar._xp import array_module
from mpipar.backend import current_backend
from mpipar.comm import comm_context
from mpipar.distribute import reshard_to
from mpipar.ops import math as M
from mpipar.optimizer.lr import LRScheduler
from mpipar.optimizer.offload import OffloadConfig, move_states
from mpipar.runtime import collector
from mpipar.spec import DistSpec
from mpipar.tensor import Tensor

Array = Any

LOW_PRECISION = ("float16", "bfloat16")
"""Parameter dtypes that ``multi_precision=True`` gives a float32 master copy."""
MASTER = "master_weight"


class L2Decay:
    """L2 regularisation: adds ``coeff * param`` to the gradient (Paddle's ``regularizer.L2Decay``)."""

    def __init__(self, coeff: float = 0.0) -> None:
        self.coeff = float(coeff)

    def __repr__(self) -> str:
        return f"L2Decay(coeff={self.coeff})"

    def decayed(self, p: Array, g: Array) -> Array:
        """``g`` with the penalty's gradient added (elementwise, on a shard)."""
        return g + p.dtype.type(self.coeff) * p if self.coeff else g


class L1Decay:
    """L1 regularisation: adds ``coeff * sign(param)`` to the gradient (Paddle's ``regularizer.L1Decay``)."""

    def __init__(self, coeff: float = 0.0) -> None:
        self.coeff = float(coeff)

    def __repr__(self) -> str:
        return f"L1Decay(coeff={self.coeff})"

    def decayed(self, p: Array, g: Array) -> Array:
        return g + p.dtype.type(self.coeff) * array_module(p).sign(p) if self.coeff else g


def regularized(regularization: float | L1Decay | L2Decay | None, p: Array, g: Array) -> Array:
    """``g`` plus the weight-decay term of ``regularization`` (a float is an L2 coefficient, as in
    Paddle), computed on one shard: the penalty is elementwise, so shards need no communication."""
    if regularization is None:
        return g
    if isinstance(regularization, (L1Decay, L2Decay)):
        return regularization.decayed(p, g)
    if isinstance(regularization, (int, float)) and not isinstance(regularization, bool):
        return L2Decay(float(regularization)).decayed(p, g)
    raise TypeError(
        f"weight_decay must be a float, mpipar.regularizer.L1Decay or L2Decay, got {type(regularization).__name__}"
    )


class ClipGradByGlobalNorm:
    """Scale all gradients so their global L2 norm is at most ``clip_norm``."""

    def __init__(self, clip_norm: float) -> None:
        self.clip_norm = float(clip_norm)

    def __call__(self, params_grads: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        if not params_grads:
            return params_grads
        # Sum of squares per mesh (pipeline stages live on different meshes), then across meshes.
        per_mesh: dict[Any, Tensor] = {}
        for p, g in params_grads:
            if p.need_clip:
                sq = M.sum_(M.square(g))
                key = tuple(sq.spec.mesh.process_ids) if sq.is_dist else None
                per_mesh[key] = sq if key not in per_mesh else M.add(per_mesh[key], sq)
        if not per_mesh:
            return params_grads
        if execution_mode() is Mode.ABSTRACT:
            # No values to compare with clip_norm: trace the step that clips (what it costs when it does).
            return [(p, M.scale(g, 1.0) if p.need_clip else g) for p, g in params_grads]
        total = sum(float(v) for _, v in sorted(per_mesh.items(), key=lambda kv: kv[0] or ()))
        norm = float(np.sqrt(total))
        if norm <= self.clip_norm:
            return params_grads
        factor = self.clip_norm / norm
        return [(p, M.scale(g, factor) if p.need_clip else g) for p, g in params_grads]


def _param_lr(p: Tensor, lr: float) -> float:
    """``lr`` times ``p``'s own multiplier (``optimize_attr["learning_rate"]``, as Paddle's
    ``ParamAttr(learning_rate=...)``): the rate ``p``'s update uses."""
    return lr * float(p.optimize_attr.get("learning_rate", 1.0))


class Optimizer:
    state_names: tuple[str, ...] = ()

    def __init__(
        self,
        learning_rate: float | LRScheduler = 0.001,
        parameters: Iterable[Tensor] | None = None,
        weight_decay: float | L1Decay | L2Decay | None = None,
        grad_clip: Callable[[list[tuple[Tensor, Tensor]]], list[tuple[Tensor, Tensor]]] | None = None,
        name: str | None = None,
        multi_precision: bool = False,
    ) -> None:
        self._multi_precision = bool(multi_precision)
        if parameters is None and not in_static_mode():
            raise ValueError(f"{type(self).__name__} needs parameters= (e.g. model.parameters())")
        # Static mode (Paddle's habit): no parameters yet; ``minimize`` takes the program's own.
        self._parameter_list = [p for p in parameters] if parameters is not None else []
        for i, p in enumerate(self._parameter_list):
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__}: parameters[{i}] is {type(p).__name__}, not a Tensor")
        self._learning_rate = learning_rate
        regularized(weight_decay, np.zeros(1), np.zeros(1))  # refuses a bad weight_decay now, not at the step
        self.regularization = weight_decay
        self._grad_clip = grad_clip
        self._states: dict[int, dict[str, Any]] = {}
        self._update_layout: Callable[[Tensor], DistSpec | None] | None = None
        """Set by shard_optimizer: the layout each parameter is updated (and its states kept) in."""
        self.offload: OffloadConfig | None = None
        """Set by offload_optimizer: states kept in host memory between steps (mpipar/optimizer/offload.py)."""

    # ------------------------------------------------------------------ learning rate
    def get_lr(self) -> float:
        lr = self._learning_rate
        return float(lr()) if isinstance(lr, LRScheduler) else float(lr)

    def set_lr(self, value: float) -> None:
        if isinstance(self._learning_rate, LRScheduler):
            raise ValueError("set_lr: this optimizer follows an LRScheduler; step the scheduler instead")
        self._learning_rate = float(value)

    def set_lr_scheduler(self, scheduler: LRScheduler) -> None:
        self._learning_rate = scheduler

    # ------------------------------------------------------------------ steps
    def clear_grad(self, set_to_zero: bool = True) -> None:
        for p in self._parameter_list:
            p.clear_grad()

    clear_gradients = clear_grad

    def minimize(
        self, loss: Tensor, startup_program: Any = None, parameters: Any = None, no_grad_set: Any = None
    ) -> None:
        """Eager: backward and one update. In static mode on a program's variable: the update is
        added to that program, and runs with it (``Executor.run``)."""
        if loss.is_abstract:
            if any(p.on_minimize(self, loss, parameters, no_grad_set) for p in list(hooks.program_hooks)):
                return
            raise ValueError(
                f"minimize: {loss._label()} has no values and is no variable of a static program being built; "
                "call minimize inside the program_guard (in static mode) that computed the loss"
            )
        if not self._parameter_list:
            raise ValueError(
                f"{type(self).__name__}.minimize: the optimizer has no parameters (built with parameters=None "
                "outside static mode); pass parameters=model.parameters()"
            )
        loss.backward()
        self.step()

    def step(self) -> None:
        backend = current_backend()
        if (  # the usual eager step: ``_step_each``
            self._grad_clip is None  # (a clip reads every gradient first)
            and type(self)._step_param is _BASE_STEP_PARAM  # (AdamW decides per parameter first)
            and self._update_layout is None
            and self.offload is None
            and not self._multi_precision
            and not _capture_hooks.capture_tracers
            and not hooks.op_hooks
            and not hooks.op_start_hooks
            and not hooks.reshard_hooks
            and not hooks.program_hooks
            and not hooks.stage_runs
            and not backend.shape_only
            and not backend.reference
        ):
            self._step_each()
        else:
            with autograd.no_grad(), hooks.phase("optimizer"):
                if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
                    tr.note_optimizer(self)  # a captured step: its parameters' grads and states are results
                params_grads = [(p, p.grad) for p in self._parameter_list if p.grad is not None and not p.stop_gradient]
                if self._grad_clip is not None:
                    params_grads = self._grad_clip(params_grads)
                lr = self.get_lr()
                for p, g in params_grads:
                    self._step_param(p, g, _param_lr(p, lr))
        collector.step_done()  # a step boundary: the collector's one-time freeze after the warm-up

    def _step_each(self) -> None:
        """``step`` where nothing listens (no op, reshard or program hooks, pipeline stage run or
        captured step: none would see the phase) and no clip, master copy, offload or update
        layout applies: each parameter in turn, those whose one shard this process holds in
        its own layout (``_step_one_shard``: an eager step under MPI) updated with NumPy alone,
        without the grad-mode and phase contexts only ops and reshards read; any other (the
        first step, a gradient in another layout) through the general path, inside them."""
        lr = self.get_lr()
        # The short path's parameters are made writable first, then updated back to back:
        # each update's kernels empty the caches the next parameter's Python would run with.
        batch: list[tuple[Tensor, Tensor, float, dict[str, Any]]] = []
        batched: set[int] = set()
        for p in self._parameter_list:
            g = p.grad
            if g is None or p.stop_gradient:
                continue
            lr_p = _param_lr(p, lr)
            state = self._own_shard_state(p, g)
            if state is not None:
                if id(p) in batched:  # (one parameter listed twice: its updates one after the other)
                    self._update_one_shards(batch)
                    batch, batched = [], set()
                if self.updates_in_place:
                    _unfreeze_if_alone(p)  # (no local here refers to p's shard dict or array)
                batch.append((p, g, lr_p, state))
                batched.add(id(p))
            else:
                with autograd.no_grad(), hooks.phase("optimizer"):
                    self._step_param_general(p, g, lr_p)
        if batch:
            self._update_one_shards(batch)

    def layout_of(self, p: Tensor) -> DistSpec | None:
        """The layout ``p`` is updated and its states are kept in (None: dense)."""
        if self._update_layout is not None:
            spec = self._update_layout(p)
            if spec is not None:
                return spec
        return p.grad_spec() if p.is_dist else None

    def _step_param(self, p: Tensor, g: Tensor, lr: float) -> None:
        if (
            self._update_layout is None
            and self.offload is None
            and not self._multi_precision
            and not _capture_hooks.capture_tracers
            and (state := self._own_shard_state(p, g)) is not None
        ):
            backend = current_backend()
            if not backend.shape_only and not backend.reference:
                self._step_one_shard(p, g, lr, state)
                return
        self._step_param_general(p, g, lr)

    def _own_shard_state(self, p: Tensor, g: Tensor) -> dict[str, Any] | None:
        """p's states when ``_step_one_shard`` may update it: this process holds p's one shard,
        the gradient arrived in p's own layout (specs are interned), which is its update layout
        (no Partial, no ``grad_placements``), and p has values and states (not its first step).
        Else None. (The optimizer-wide conditions are its callers'.)"""
        spec = p._spec
        if (
            spec is not None
            and g._spec is spec
            and not p.grad_placements
            and spec._without_partial is spec  # so ``layout_of(p)`` is p's own spec
            and not p._abstract
            and not g._abstract
            and p._init is None
            and len(p.__dict__.get("_shards", ())) == 1
        ):
            return self._states.get(id(p))
        return None

    def _step_one_shard(self, p: Tensor, g: Tensor, lr: float, state: dict[str, Any]) -> None:
        """``_step_param`` where this process holds p's one shard (MPI), the gradient is in p's
        own layout, and nothing else applies (no master copy, offload, update layout or captured
        step; not the first step): the same update, without the general path's checks."""
        if self.updates_in_place:
            _unfreeze_if_alone(p)  # (before any local here refers to p's shard dict or array)
        self._update_one_shards([(p, g, lr, state)])

    def _update_one_shards(self, batch: list[tuple[Tensor, Tensor, float, dict[str, Any]]]) -> None:
        """``_step_one_shard``'s update of each ``(p, g, lr, state)`` (made writable
        already where it may be), one after the other. A parameter updated in place and with no
        state to set takes its new value after the last update; any other at once, so that no
        two of its old and new arrays are held beyond its own update."""
        names = self.state_names
        settle: list[tuple[Tensor, int, Array, dict[str, Any]]] = []
        for p, g, lr, state in batch:
            (r,) = p._shards
            new_value, new_states = self._update_shard(p, g, r, p._dtype, state, lr)
            if not names and new_value is p._shards[r]:
                settle.append((p, r, new_value, state))
                continue
            for n in names:
                state[n] = Tensor._from_shards(p.spec, {r: new_states[n]}, state[n].dtype)
            state["step"] = state.get("step", 0) + 1
            p._set_own_shard(r, new_value)  # (p's own spec is its update layout: ``_own_shard_state``)
        for p, r, new_value, state in settle:
            state["step"] = state.get("step", 0) + 1
            p._set_own_shard(r, new_value)

    def _update_shard(
        self, src: Tensor, g: Tensor, r: int, dtype: Any, state: dict[str, Any], lr: float
    ) -> tuple[Array, dict[str, Array]]:
        """``_update`` of rank ``r``'s shard: of ``src`` (the parameter or its master copy), of
        ``g`` cast to ``dtype`` (the one the update computes in) and of each state."""
        grad = g._shards[r]
        if grad.dtype != dtype:  # (``astype(copy=False)`` costs a call even when nothing changes)
            grad = grad.astype(dtype)
        names = self.state_names
        return self._update(src._shards[r], grad, {n: state[n]._shards[r] for n in names} if names else {}, lr, state)

    def _step_param_general(self, p: Tensor, g: Tensor, lr: float) -> None:
        layout = self.layout_of(p)
        backend = current_backend()
        # identity first: in a training loop the layout is the parameter's own spec object
        p_in = layout is None or p._spec is layout or (p._spec is not None and p._spec == layout)
        g_in = layout is None or g._spec is layout or (g._spec is not None and g._spec == layout)
        if p_in and g_in:  # the usual case: nothing to move, so no context to open (and no label to format)
            pv, gv = p, g
        else:
            with comm_context(f"optimizer update of {p._label()}"):
                pv = p if p_in else reshard_to(p, layout)
                gv = g if g_in else reshard_to(g, layout)
        fresh = id(p) not in self._states  # states made this step start on the device: nothing to fetch
        state = self._state(p, layout)
        ranks: tuple[int, ...] = ()  # the ranks offloaded states move on (only looked up when there are any)
        if self.offload is not None:
            ranks = tuple(p.spec.mesh.process_ids) if p.is_dist else tuple(range(backend.world_size))
        if self.offload is not None and not fresh:
            move_states(state, self._state_keys(p), self.offload, "to_device", ranks)
        master = self._master_weight(p, pv, state)
        src = master if master is not None else pv  # what the update reads and writes
        cdt = src.dtype
        mode = execution_mode([pv], backend)
        direct: tuple[DistSpec, dict[int, Array]] | None = None  # p's layout and new shards, to take as they are
        if mode is Mode.ABSTRACT:
            new_p = Tensor.abstract(p.shape, p.dtype, layout)
        elif layout is None or mode is Mode.DENSE:
            values = {n: state[n]._value for n in self.state_names}
            grad = np.asarray(gv._value).astype(cdt, copy=False)
            new_value, new_states = self._update(np.asarray(src._value), grad, values, lr, state)
            for n in self.state_names:
                state[n] = _like(state[n], value=new_states[n])
            if master is not None:
                state[MASTER] = _like(master, value=new_value)
                new_value = new_value.astype(p.dtype)
            new_p = _like(pv, value=new_value)
        else:
            if self.updates_in_place and master is None and self.offload is None:
                _unfreeze_if_alone(pv)
            memo: dict[tuple[int, ...], tuple[Array, dict[str, Array]]] = {}
            shards: dict[int, Array] = {}
            new_state_shards: dict[str, dict[int, Array]] = {n: {} for n in self.state_names}
            tr = _capture_hooks.capture_tracer() if _capture_hooks.capture_tracers else None
            if tr is not None and (master is not None or self.offload is not None):
                tr.refuse(f"{p._label()} is updated through a master copy or offloaded states")
            if tr is None and len(pv._shards) == 1:  # one hosted rank (MPI): no replicas to share with
                (r,) = pv._shards
                new_value, new_states = self._update_shard(src, gv, r, cdt, state, lr)
                shards[r] = new_value
                for n in self.state_names:
                    new_state_shards[n][r] = new_states[n]
            else:
                for r in pv._shards:
                    key = (id(src._shards[r]), id(gv._shards[r]), *(id(state[n]._shards[r]) for n in self.state_names))
                    if key not in memo:  # replicas compute once
                        if tr is not None:  # a captured step being traced: the update is an instruction
                            memo[key] = tr.update(self, p, lr, src, gv, state, r, cdt)
                        else:
                            memo[key] = self._update_shard(src, gv, r, cdt, state, lr)
                    shards[r] = memo[key][0]
                    for n in self.state_names:
                        new_state_shards[n][r] = memo[key][1][n]
            for n in self.state_names:
                state[n] = Tensor._from_shards(layout, new_state_shards[n], state[n].dtype)
            if master is not None:
                state[MASTER] = Tensor._from_shards(layout, shards, cdt)
                down: dict[int, Array] = {}  # replicas share one cast
                shards = {r: down.setdefault(id(a), a.astype(p.dtype)) for r, a in shards.items()}
            if layout is p._spec and not p.is_lazy:  # the usual case: the new shards become p's own
                direct = (layout, shards)
            else:
                new_p = Tensor._from_shards(layout, shards, p.dtype)
        if self.offload is not None:
            move_states(state, self._state_keys(p), self.offload, "to_host", ranks)
        state["step"] = state.get("step", 0) + 1
        if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
            if layout is None or mode is not Mode.DISTRIBUTED:
                tr.refuse(f"{p._label()} is updated dense (the capture records distributed updates)")
            tr.bump_step(self, p)
        if direct is not None:  # updated in p's own layout: what ``_take_storage`` of a new tensor does
            p._set_dist(direct[0], direct[1], p.dtype)
            return
        if p.is_dist and new_p.is_dist and new_p.spec != p.spec:
            with comm_context(f"optimizer: gather the updated {p._label()}"):
                new_p = reshard_to(new_p, p.spec)
        p._take_storage(new_p)

    def _state(self, p: Tensor, layout: DistSpec | None) -> dict[str, Any]:
        state = self._states.get(id(p))
        if state is None:
            state = {n: _zeros(p, layout, self.state_dtype(p)) for n in self.state_names}
            state["step"] = 0
            self._states[id(p)] = state
        return state

    def uses_master_weight(self, p: Tensor) -> bool:
        """Whether ``p`` is updated through a float32 master copy (``multi_precision`` and 16 bits)."""
        return self._multi_precision and str(np.dtype(p.dtype)) in LOW_PRECISION

    def state_dtype(self, p: Tensor) -> np.dtype:
        """The dtype of ``p``'s optimizer states: float32 under a master copy, else ``p``'s own."""
        return np.dtype(np.float32) if self.uses_master_weight(p) else np.dtype(p.dtype)

    def _master_weight(self, p: Tensor, pv: Tensor, state: dict[str, Any]) -> Tensor | None:
        """``p``'s float32 master copy in the update layout (made from ``pv`` at the first step)."""
        if not self.uses_master_weight(p):
            return None
        if MASTER not in state:
            state[MASTER] = _cast(pv, np.dtype(np.float32))
        return state[MASTER]

    def _state_keys(self, p: Tensor) -> tuple[str, ...]:
        state = self._states.get(id(p), {})
        return (*self.state_names, MASTER) if MASTER in state else self.state_names

    updates_in_place = False
    """Whether ``_update`` writes the new parameter into ``p`` when ``p`` is writable (see
    ``_unfreeze_if_alone``), instead of returning a new array."""

    def _update(
        self, p: Array, g: Array, states: dict[str, Array], lr: float, meta: dict[str, Any]
    ) -> tuple[Array, dict[str, Array]]:
        """One elementwise update on local arrays; returns the new parameter and states.

        ``p`` is read-only, except when nothing but the parameter holds it (``updates_in_place``
        optimizers only): then it is writable and the update may overwrite it and return it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def state_tensors(self) -> dict[str, Tensor]:
        """Every optimizer state tensor, named ``<param name>.<state>`` (memory accounting, checkpoints)."""
        out = {}
        for i, p in enumerate(self._parameter_list):
            state = self._states.get(id(p))
            if state is None:
                continue
            for n in self._state_keys(p):
                out[f"{p.name or f'param_{i}'}.{n}"] = state[n]
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.state_tensors())
        out["steps"] = {
            p.name or f"param_{i}": self._states[id(p)]["step"]
            for i, p in enumerate(self._parameter_list)
            if id(p) in self._states
        }
        if isinstance(self._learning_rate, LRScheduler):
            out["LR_Scheduler"] = self._learning_rate.state_dict()
        return out

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, before or after this optimizer's first step.

        Each state may be distributed in any layout, dense, or a NumPy array (as a checkpoint
        gives it back): it is moved into the layout this optimizer keeps it in (the ZeRO split
        included), so the next step updates exactly the restored values. Parameters without an
        entry in ``state["steps"]`` keep their states. Under ``multi_precision`` the states are
        float32 and a saved ``<name>.master_weight`` is restored too (without one, the next step
        makes the master from the parameter).
        """
        steps = state.get("steps", {})
        restored: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self._parameter_list):
            name = p.name or f"param_{i}"
            if name not in steps:
                continue
            layout = self.layout_of(p)
            want = self.state_dtype(p)
            restored[id(p)] = {n: _state_in_layout(state, f"{name}.{n}", p, layout, want) for n in self.state_names}
            if self.uses_master_weight(p) and f"{name}.{MASTER}" in state:
                restored[id(p)][MASTER] = _state_in_layout(state, f"{name}.{MASTER}", p, layout, want)
            restored[id(p)]["step"] = int(steps[name])
        self._states.update(restored)  # all or nothing; never re-created lazily: _state finds them
        if "LR_Scheduler" in state and isinstance(self._learning_rate, LRScheduler):
            self._learning_rate.set_state_dict(state["LR_Scheduler"])


def _state_in_layout(state: dict[str, Any], key: str, p: Tensor, layout: DistSpec | None, dtype: Any = None) -> Tensor:
    """``state[key]`` as a tensor in ``layout`` (dense when None), checked against parameter ``p``
    (its shape, and ``dtype`` -- default ``p``'s)."""
    if key not in state:
        raise ValueError(
            f"set_state_dict: no {key!r}, though state['steps'] names its parameter; pass the dict that "
            "state_dict() returned (every state of a parameter with a step count)"
        )
    value = state[key]
    if not isinstance(value, Tensor):
        if not isinstance(value, np.ndarray):
            raise TypeError(f"set_state_dict: {key!r} is a {type(value).__name__}; give a Tensor or a NumPy array")
        value = Tensor(np.array(value))
    want = np.dtype(p.dtype if dtype is None else dtype)
    if tuple(value.shape) != tuple(p.shape) or value.dtype != want:
        raise ValueError(
            f"set_state_dict: {key!r} is {value.dtype}{list(value.shape)}, but its parameter {p._label()} is "
            f"{p.dtype}{list(p.shape)}"
            + (f" (its states are kept as {want})" if want != p.dtype else "")
            + "; restore states saved for this model (cast them first if the dtype changed)"
        )
    if layout is None:
        return Tensor(value.full_tensor()) if value.is_dist else value
    if value.is_dist and value.spec == layout:
        return value
    with comm_context(f"optimizer: restore {key}"):
        return reshard_to(value, layout)


def _zeros(p: Tensor, layout: DistSpec | None, dtype: Any = None) -> Tensor:
    backend = current_backend()
    dtype = p.dtype if dtype is None else np.dtype(dtype)
    mode = execution_mode([p], backend)
    if mode is Mode.ABSTRACT:
        return Tensor.abstract(p.shape, dtype, layout)
    if layout is None or mode is Mode.DENSE:
        t = Tensor(np.zeros(p.shape, dtype=dtype))
        if layout is not None:
            return Tensor._from_reference(layout, t._value)
        return t
    by_box: dict[Any, Array] = {}
    shards = {}
    for r in backend.hosted_ranks(layout.mesh):
        box = layout.boxes[r]
        if box not in by_box:
            by_box[box] = backend.xp.zeros(layout.local_shape(r), dtype=dtype)
        shards[r] = by_box[box]
    return Tensor._from_shards(layout, shards, dtype)


def _cast(t: Tensor, dtype: np.dtype) -> Tensor:
    """``t``'s value in ``dtype``, in ``t``'s own layout (shard by shard: a ZeRO-3 parameter is not gathered)."""
    backend = current_backend()
    mode = execution_mode([t], backend)
    if mode is Mode.ABSTRACT:
        return Tensor.abstract(t.shape, dtype, t.spec if t.is_dist else None)
    if not t.is_dist:
        return Tensor(np.asarray(t._value).astype(dtype))
    if mode is Mode.DENSE:
        return Tensor._from_reference(t.spec, np.asarray(t._value).astype(dtype))
    cast: dict[int, Array] = {}  # replicas share one copy
    return Tensor._from_shards(
        t.spec, {r: cast.setdefault(id(a), a.astype(dtype)) for r, a in t._shards.items()}, dtype
    )


def _shard_refs(t: Tensor) -> tuple[int, int, Array]:
    """References to ``t``'s shard dict and to its (first) shard, as counted from here, and the shard."""
    shards = t._shards
    a = next(iter(shards.values()))
    return sys.getrefcount(shards), sys.getrefcount(a), a


class _Alone:
    """A stand-in holding a shard dict and an array nothing else references."""

    def __init__(self) -> None:
        self._shards = {0: np.empty(1)}


_ALONE_REFS = _shard_refs(_Alone())[:2]  # type: ignore[arg-type]
"""What ``_shard_refs`` counts when the tensor alone holds its shards (interpreters differ)."""


def _unfreeze_if_alone(t: Tensor) -> None:
    """Make ``t``'s one shard writable when nothing but ``t`` can see it, so the update may
    overwrite it instead of allocating a new parameter (one pass and one allocation less, as a
    hand-written ``w -= lr * g``).

    Shards are values that other tensors share (a detached view shares the dict, a slice or a
    pending send references the array), so this happens only when neither the dict nor the
    array has any other reference, and the array owns its memory (a view may share its buffer
    with anything). After backward the tape has dropped its saved tensors, so in a training
    loop this holds from the second step on (the first step's shards may be views of the
    array the parameter was made from).
    """
    if len(t._shards) != 1:  # replicas in one process share arrays
        return
    dict_refs, array_refs, a = _shard_refs(t)  # (no local here may hold the dict or the array)
    if (dict_refs, array_refs) != _ALONE_REFS:
        return
    if type(a) is np.ndarray and a.base is None:
        flags = a.flags  # (each ``a.flags`` makes a new object)
        if flags.c_contiguous and flags.owndata:
            flags.writeable = True


def _like(t: Tensor, value: Array) -> Tensor:
    """A tensor with ``t``'s layout (dense, or one big device) holding ``value``."""
    if t.is_dist:
        return Tensor._from_reference(t.spec, value)
    return Tensor(value) if not isinstance(value, Tensor) else value


_BASE_STEP_PARAM = Optimizer._step_param
"""``Optimizer._step_param`` itself: a subclass that overrides it (AdamW decides per parameter
whether it decays) is stepped through it, never through ``_step_each``'s short path."""
