"""Tensors: dense values, and distributed tensors holding the shards of the hosted ranks.

One class serves both, because the seeds mark tensors *in place*
(``dist.shard_tensor(self.linear1.weight, mesh, [Shard(1)])`` with the result dropped): a
dense ``Tensor`` becomes distributed by being marked, and a ``Parameter`` stays a
``Parameter``. ``isinstance(t, DistTensor)`` is true exactly for distributed ones.

Storage
-------
* dense: ``_value`` is the whole array, held by every process.
* distributed: ``_spec`` (global shape, mesh, placements) and ``_shards = {rank: array}``
  for the ranks this process hosts (all of them in the simulator, one under MPI, none when
  the process is outside the mesh).
* under ``--reference`` (one big device): ``_spec`` keeps the placements the script asked
  for, but ``_value`` holds the whole global array and nothing is ever communicated.

Arrays held by a tensor are read-only; operations build new arrays.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from mpipar import _capture_hooks
from mpipar._modes import Mode, execution_mode
from mpipar._xp import to_numpy
from mpipar.backend import current_backend
from mpipar.mesh import ProcessMesh
from mpipar.placement import Placement
from mpipar.reshard.executor import execute_plan, freeze
from mpipar.reshard.planner import plan_reshard
from mpipar.spec import DistSpec, interned
from mpipar.tensor_text import held_value, tensor_text

Array = Any


class Shape(tuple):
    """A tuple of ints that also compares equal to a list (Paddle's ``.shape`` is a list)."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = tuple.__hash__

    def __repr__(self) -> str:
        return repr(list(self))


class _DistTensorMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, Tensor) and obj.is_dist


class DistTensor(metaclass=_DistTensorMeta):
    """``isinstance(t, DistTensor)``: ``t`` is a distributed ``Tensor``. Not constructed directly."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("build distributed tensors with dist.shard_tensor(data, mesh, placements)")


_storage_ids = itertools.count(1)

_new_object = object.__new__
"""What ``Tensor.__new__(cls)`` calls (Tensor defines no ``__new__``), called directly: the
constructors every op output and saved view go through skip the ``__new__`` wrapper's checks."""


def _exact_dims(shape: Sequence[int], what: str) -> tuple[int, ...]:
    """``shape`` as Python ints, refusing what ``int()`` would silently truncate or wrap."""
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence | np.ndarray):
        raise TypeError(f"{what}: shape {shape!r} is not a sequence of ints")
    dims = []
    for i, n in enumerate(shape):
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise TypeError(f"{what}: shape {tuple(shape)!r} dim {i} is {n!r}; dims are non-negative integers")
        dims.append(int(n))
    return tuple(dims)


class _ShardsOnFirstUse:
    """``Tensor._shards`` where a tensor has none of its own: the shards of a tensor whose op
    deferred them (``mpipar._deferred``, a process hosting every rank), computed on first use
    and kept in the tensor's own dict; else an ``AttributeError``, as for any missing field.

    A descriptor with no ``__set__``, so a tensor's own ``_shards`` is found before it without
    a call. (A ``__getattr__`` on ``Tensor`` did this once, but a class with one has every
    attribute read of every tensor take CPython's slow generic path: about 45 ns instead of
    10 ns, and an eager step reads tensor fields hundreds of times.)"""

    def __get__(self, tensor: Tensor | None, owner: type | None = None) -> Any:
        if tensor is None:
            return self
        deferred = tensor.__dict__.get("_deferred")
        if deferred is None:
            raise AttributeError(f"{type(tensor).__name__!r} object has no attribute '_shards'")
        shards = tensor.__dict__["_shards"] = deferred.shards()
        return shards


class Tensor:
    """A dense or distributed tensor (see the module docstring)."""

    _spec: DistSpec | None
    _shards: dict[int, Array] = _ShardsOnFirstUse()  # type: ignore[assignment]
    _deferred: Any = None
    """Shards not computed yet (``mpipar._deferred.DeferredShards``), set by ``ops.dispatch``
    instead of ``_shards`` in a process hosting several ranks; ``_shards`` computes them on
    first use, while the communicator may sum the deferred products without writing them."""
    _init: Callable[[tuple[int, ...], Any], Array] | None = None
    """A lazy value: ``init(shape, box)`` gives any box of it (counter-based initializers)."""
    _reshards: dict[DistSpec, tuple[int, Tensor]] | None = None
    """Each reshard once: the layouts this computed value was already resharded to, as
    ``target spec -> (storage id of the source when resharded, a view of the result)``. Ops'
    outputs have one (shared with their detached views, which saved tensors are); leaves
    (parameters, inputs) do not, so a parameter never holds a gathered copy across steps."""

    # Fields one module sets and another reads, declared here so that both see one typed name
    # (the tensor module is below all of them; none of them is imported here).
    _compute_spec: DistSpec | None = None
    """ZeRO-3: the layout a parameter stored split is computed in. Set by
    ``parallel.shard_optimizer`` (stage 3); read by ``ops.dispatch``, which gathers to it
    before each op that uses the parameter."""
    _regather: tuple[Tensor, DistSpec] | None = None
    """A gathered copy that backward gathers again instead of keeping: ``(source, layout)``.
    Set by ``ops.dispatch`` (ZeRO-3) and ``models.gpt`` (sequence parallel); read by
    ``tape.pack_saved`` (what a node saves) and ``simulator.step_trace`` (the parameter behind it)."""
    _grad_any_layout: bool = False
    """The gradient of this leaf keeps the layout backward gave it (Partial too). Set by
    ``recompute`` on a recomputed block's detached inputs; read by ``autograd`` and ``overlap``,
    which otherwise reshard a leaf's gradient to its own layout."""
    # Defaults most tensors keep (op outputs, detached views): class attributes, so that making
    # a tensor (every op makes several) sets only what differs, and allocates no hook list.
    _dense: Array | None = None
    _abstract: bool = False
    name: str | None = None
    grad: Tensor | None = None
    grad_placements: list[Placement] | None = None
    """Layout of this leaf's gradient when it should differ from its own (ZeRO-2)."""
    _grad_fn: Any = None
    _out_index: int = 0
    backward: Callable[..., None]
    """``backward(grad_tensor=None, retain_graph=False)``, set on the class by ``mpipar.autograd``
    (which is above this module)."""
    _grad_hooks: Sequence[Callable[[Tensor], Tensor | None]] = ()
    """This leaf's gradient hooks (``register_hook`` makes the instance's own list)."""

    # Paddle's parameter attributes, with Paddle's defaults: declared on every tensor because
    # the optimizers take any trainable tensor, not only a Parameter.
    need_clip: bool = True
    """Set by ``nn.layer`` (``ParamAttr(need_clip=...)``); read by the gradient clips
    (``optimizer.ClipGradByGlobalNorm``, fleet's hybrid optimizer)."""
    optimize_attr: Mapping[str, float] = MappingProxyType({"learning_rate": 1.0})
    """Per-parameter options (``learning_rate``: a multiplier). Set by ``nn.layer``; read by
    ``Optimizer.step``."""
    is_distributed: bool = False
    """Fleet: a model-parallel slice. Set by ``fleet.meta_parallel.mp_layers``; read by fleet's
    optimizer, whose clip sums it over the model group."""
    split_axis: int | None = None
    """Fleet: the dim a model-parallel weight is split along (set by ``mp_layers``)."""
    is_firstly_shared: bool = True
    """Fleet: False on the copies of a weight shared by pipeline stages after the first. Set by
    ``fleet.meta_parallel.pp_layers``; read by fleet's clip, which counts the weight once."""

    def __init__(
        self,
        data: Any = None,
        dtype: Any = None,
        stop_gradient: bool = True,
        name: str | None = None,
    ) -> None:
        self._spec = None
        self._shards = {}
        self._sid = next(_storage_ids)
        """Identifies the storage: a detached view shares it (memory accounting de-duplicates)."""
        if data is not None:
            self._value = freeze(_as_array(data, dtype, copy=True))
            self._dtype = self._value.dtype
            self._shape = Shape(self._value.shape)
        else:
            self._dtype = np.dtype(dtype or np.float32)
            self._shape = Shape(())
        self.stop_gradient = stop_gradient
        if name is not None:
            self.name = name

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _from_shards(
        cls, spec: DistSpec, shards: Mapping[int, Array], dtype: Any, like: Tensor | None = None
    ) -> Tensor:
        t = _new_object(cls)
        # What ``Tensor.__init__(t, None, dtype)`` sets and ``_hold_shards`` does not: a fresh
        # storage id, no history (every reshard and optimizer update makes one of these).
        t._sid = next(_storage_ids)
        t.stop_gradient = True
        t._hold_shards(spec, shards, np.dtype(dtype))
        if like is not None:
            t.stop_gradient = like.stop_gradient
        return t

    @classmethod
    def _from_frozen_shards(cls, spec: DistSpec, shards: dict[int, Array], dtype: np.dtype) -> Tensor:
        """``_from_shards`` of shards already frozen (a reshard plan's result), taken as they
        are, and a NumPy ``dtype``: no second pass over them."""
        t = _new_object(cls)
        t.__dict__ = {
            "_spec": interned(spec),
            "_shards": shards,
            "_sid": next(_storage_ids),
            "_dtype": dtype,
            "_shape": Shape(spec.shape),
            "stop_gradient": True,
        }
        return t

    @property
    def _value(self) -> Array | None:
        """The whole value of a dense tensor (materialising a lazy one), else None."""
        if self._init is not None:
            self._materialize()
        return self._dense

    @_value.setter
    def _value(self, value: Array | None) -> None:
        self._dense = value

    @classmethod
    def lazy(
        cls,
        shape: Sequence[int],
        dtype: Any,
        init: Callable[[tuple[int, ...], Any], Array],
        kind: type[Tensor] | None = None,
    ) -> Tensor:
        """A dense tensor whose values are produced on demand, box by box, by ``init``.

        Marking it with ``shard_tensor`` makes each rank generate only its own shard; using it
        dense generates the whole value once.
        """
        t = (kind or cls).__new__(kind or cls)
        Tensor.__init__(t, None, dtype=dtype)
        t._init = init
        t._shape = Shape(_exact_dims(shape, "Tensor.lazy"))
        t._dtype = np.dtype(dtype)
        return t

    def _materialize(self) -> None:
        init, self._init = self._init, None
        assert init is not None
        if execution_mode() is Mode.ABSTRACT:
            self._abstract = True
            return
        value = np.asarray(init(tuple(self._shape), tuple((0, n) for n in self._shape)), dtype=self._dtype)
        self._dense = freeze(value)

    @property
    def is_lazy(self) -> bool:
        return self._init is not None

    @classmethod
    def abstract(cls, shape: Sequence[int], dtype: Any, spec: DistSpec | None = None) -> Tensor:
        """A tensor with a shape, dtype and layout but no values (shape-only planning)."""
        t = cls.__new__(cls)
        Tensor.__init__(t, None, dtype=dtype)
        t._abstract = True
        t._spec = spec
        t._shape = Shape(_exact_dims(shape, "Tensor.abstract"))
        t._dtype = np.dtype(dtype)
        return t

    @property
    def is_abstract(self) -> bool:
        """True in shape-only mode: the tensor has a layout but holds no values."""
        return self._abstract

    @classmethod
    def _from_reference(cls, spec: DistSpec, value: Array) -> Tensor:
        t = cls.__new__(cls)
        Tensor.__init__(t, None, dtype=value.dtype)
        t._spec = spec
        t._value = freeze(value)
        t._dtype = value.dtype
        t._shape = Shape(spec.shape)
        return t

    @classmethod
    def _op_output(cls, spec: DistSpec, dtype: np.dtype, shards: dict[int, Array] | None = None) -> Tensor:
        """An op's output with this layout and (NumPy) dtype, ``shards`` (taken as they are, not
        copied; the caller owns nothing else that refers to them), a fresh storage id and no
        history. A computed value: it may be resharded once per layout (``_reshards``)."""
        t = _new_object(Tensor)
        t.__dict__ = {  # the fields as one dict: every op call makes one
            "_spec": spec,
            "_shards": {} if shards is None else shards,
            "_sid": next(_storage_ids),
            "_dtype": dtype,
            "_shape": Shape(spec.shape),
            "stop_gradient": True,
            "_reshards": {},  # a computed value: reshard it once (``mpipar.distribute.reshard``)
        }
        return t

    @classmethod
    def _deferred_output(cls, spec: DistSpec, dtype: np.dtype, deferred: Any) -> Tensor:
        """An op's output whose shards ``_deferred`` computes on first read (``mpipar._deferred``):
        no ``_shards`` of its own until then, so ``_ShardsOnFirstUse`` reaches the deferral."""
        t = cls._op_output(spec, dtype)
        del t.__dict__["_shards"]
        t._deferred = deferred
        return t

    @classmethod
    def _dense_output(cls, value: Array, frozen: bool = True) -> Tensor:
        """A dense output holding ``value`` (made read-only unless ``frozen`` is False: a captured
        program hands out its arrays as they are), a fresh storage id and no history."""
        t = cls.__new__(cls)
        Tensor.__init__(t, None, dtype=value.dtype)
        t._value = freeze(value) if frozen else value
        t._shape = Shape(value.shape)
        t._dtype = value.dtype
        return t

    def _renew_storage(self, dense: Array | None = None) -> None:
        """A new value in place: a new storage id (reshards of the old value are not reused) and,
        for a dense tensor, ``dense`` as its value."""
        self._sid = next(_storage_ids)
        if dense is not None:
            self._dense = dense

    def _set_history(self, node: Any, index: int = 0) -> None:
        """This tensor is output ``index`` of the tape node ``node`` (the op or reshard that made it)."""
        self._grad_fn = node
        self._out_index = index

    def _take_init(self) -> Callable[[tuple[int, ...], Any], Array] | None:
        """The lazy initialiser, handed over once: the tensor is no longer lazy."""
        init, self._init = self._init, None
        return init

    def _drop_shards(self) -> None:
        """Let go of this (gathered, ZeRO-3) copy's shards: backward gathers them again."""
        self._shards = {}

    def _mark_computed(self) -> None:
        """A value an op computed: each reshard of it is made once and reused (``_reshards``)."""
        self._reshards = {}

    def _set_dist(self, spec: DistSpec, shards: Mapping[int, Array], dtype: np.dtype) -> None:
        self._sid = next(_storage_ids)
        self._value = None
        self._hold_shards(spec, shards, dtype)

    def _set_own_shard(self, rank: int, array: Array) -> None:
        """``_set_dist(self.spec, {rank: array}, self.dtype)`` for a distributed tensor whose one
        shard is rank ``rank``'s and whose new value keeps its layout, dtype and shape (an
        optimizer update): the layout is already interned and the shape already set."""
        self._sid = next(_storage_ids)
        self._dense = None
        self._shards = {rank: freeze(array)}

    def _deferred_shards(self) -> Any:
        """The ``DeferredShards`` standing in for this tensor's shards while they are not yet
        computed, else None."""
        if "_shards" in self.__dict__:
            return None
        deferred = self.__dict__.get("_deferred")
        return None if deferred is None or deferred.computed else deferred

    def _plan_input(self, plan: Any, backend: Any) -> Mapping[int, Any]:
        """What a reshard plan runs on: the shards, or, for a Partial sum whose op deferred its
        products (``mpipar._deferred``) when the plan is one all-reduce(sum) and the
        communicator takes products, the per-rank products, which it sums without writing."""
        deferred = self._deferred_shards()
        if deferred is None or len(plan.steps) != 1 or not getattr(backend.comm, "sums_deferred_products", False):
            return self._shards
        step = plan.steps[0]
        if step.kind != "all_reduce" or (step.reduce_type or "sum") != "sum":
            return self._shards
        return deferred.products

    def _hold_shards(self, spec: DistSpec, shards: Mapping[int, Array], dtype: np.dtype) -> None:
        """Become the distributed tensor ``spec`` with these (frozen) local shards."""
        self._spec = interned(spec)
        self._shards = {r: freeze(a) for r, a in shards.items()}
        self._dtype = dtype
        self._shape = Shape(spec.shape)

    def detach(self) -> Tensor:
        """The same value with no history (shares the read-only storage)."""
        t = _new_object(Tensor)
        fields = self.__dict__
        if "_shards" not in fields:  # shards deferred (or a lazy value): the general path
            Tensor.__init__(t, None, dtype=self._dtype)
            t._take_storage(self)
            t._reshards = self._reshards
            t.name = self.name
            return t
        # Every op saves its inputs detached (``tape.pack_saved``): the fields ``__init__`` and
        # ``_take_storage`` would set, as one dict read from this one's, without their calls.
        # Fields this one leaves at the class's default stay so (an attribute a tensor lacks is
        # looked up on the class, the slow way: the tape makes several views per op).
        view = {
            "_spec": fields["_spec"],
            "_shards": fields["_shards"],
            "_sid": fields["_sid"],
            "_dtype": fields["_dtype"],
            "_shape": fields["_shape"],
            "stop_gradient": True,
        }
        if "_reshards" in fields:  # (the same value: the same reshards already made)
            view["_reshards"] = fields["_reshards"]
        if "_dense" in fields:
            view["_dense"] = fields["_dense"]
        if "name" in fields:
            view["name"] = fields["name"]
        if "_abstract" in fields:
            view["_abstract"] = fields["_abstract"]
        if "_init" in fields:
            view["_init"] = fields["_init"]
        t.__dict__ = view
        return t

    def _take_storage(self, other: Tensor) -> None:
        """Become ``other``'s value and layout (used by in-place marking)."""
        self._abstract = other._abstract
        self._init = other._init
        self._sid = other._sid
        self._spec = other._spec
        deferred = other._deferred_shards()
        if deferred is not None:  # share the deferral rather than compute the shards now
            self.__dict__.pop("_shards", None)
            self._deferred = deferred
        else:
            self._shards = other._shards
        self._dense = other._dense
        self._dtype = other._dtype
        self._shape = other._shape

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> Shape:
        """The global shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return self.ndim

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def numel(self) -> int:
        return self.size

    @property
    def is_dist(self) -> bool:
        return self._spec is not None

    def is_dense(self) -> bool:
        return self._spec is None

    @property
    def spec(self) -> DistSpec:
        if self._spec is None:
            raise ValueError(f"{self._label()} is dense: it has no DistSpec (mark it with dist.shard_tensor)")
        return self._spec

    @property
    def process_mesh(self) -> ProcessMesh | None:
        return self._spec.mesh if self._spec is not None else None

    @property
    def placements(self) -> list[Placement] | None:
        return list(self._spec.placements) if self._spec is not None else None

    @property
    def hosted_ranks(self) -> tuple[int, ...]:
        """Ranks whose shard this process holds (empty for dense tensors)."""
        return tuple(self._shards)

    # OneFlow's global-tensor spelling (seed 002); ``placement``, ``to_global`` and ``to_local``
    # are installed by mpipar.oneflow, which builds on this module
    @property
    def is_global(self) -> bool:
        return self._spec is not None

    @property
    def sbp(self) -> tuple[Placement, ...] | None:
        """OneFlow's ``tensor.sbp``: one SBP (an mpipar placement) per placement dimension."""
        return tuple(self._spec.placements) if self._spec is not None else None

    def _label(self) -> str:
        kind = "DistTensor" if self.is_dist else "Tensor"
        name = f" {self.name!r}" if self.name else ""
        return f"{kind}{name} of shape {list(self._shape)}"

    # ------------------------------------------------------------------ autograd (``backward`` is installed by mpipar.autograd)
    @property
    def is_leaf(self) -> bool:
        return self._grad_fn is None

    def grad_spec(self) -> DistSpec:
        """The layout this leaf's gradient is kept in: its own (Partial read as Replicate)."""
        spec = self._spec
        if spec is None:
            spec = self.spec  # raises: a dense tensor has no layout
        return DistSpec(spec.shape, spec.mesh, self.grad_placements) if self.grad_placements else spec._without_partial

    def clear_grad(self, set_to_zero: bool = False) -> None:
        self.grad = None

    clear_gradient = clear_grad

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> Callable[[], None]:
        """Call ``hook(grad)`` when this leaf's gradient arrives (it may return a replacement)."""
        hooks = self.__dict__.get("_grad_hooks")
        if hooks is None:
            hooks = self._grad_hooks = []
        hooks.append(hook)

        def remove() -> None:
            if hook in hooks:
                hooks.remove(hook)

        return remove

    # ------------------------------------------------------------------ values
    def local_tensor(self, rank: int | None = None) -> Array:
        """The shard of hosted ``rank`` (this process's only rank when omitted)."""
        if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
            tr.escape("local_tensor")
        if self._abstract:
            raise ValueError(f"{self._label()} has no values: it was built in shape-only mode (planning, estimating)")
        if self._value is not None:  # dense, or one big device under --reference
            return self._value
        if rank is None and len(self._shards) > 1:
            # a per-rank program in the simulator (simulator.per_rank) means its own rank
            rank = current_backend().program_rank
        if rank is None:
            if len(self._shards) != 1:
                raise ValueError(
                    f"{self._label()} has shards of ranks {list(self._shards)} in this process; "
                    "pass the rank: local_tensor(rank)"
                )
            return next(iter(self._shards.values()))
        try:
            return self._shards[rank]
        except KeyError:
            raise ValueError(
                f"rank {rank} holds no shard of {self._label()} on {self.spec.mesh} in this process; "
                f"hosted ranks here: {list(self._shards)}"
            ) from None

    def set_value(self, value: Any) -> None:
        """Replace a dense tensor's values in place (Paddle's ``Tensor.set_value``): same shape and
        dtype; a manual-mode program writes parameters it rebuilt from shards this way."""
        if self.is_dist or self._abstract:
            raise ValueError(
                f"set_value: {self._label()} is not a dense tensor with values; reshard or rebuild it instead"
            )
        new = np.asarray(value)
        if tuple(new.shape) != tuple(self.shape) or new.dtype != self.dtype:
            raise ValueError(
                f"set_value: {self._label()} is {self.dtype}{list(self.shape)}, the value is {new.dtype}{list(new.shape)}; "
                "pass one of the same shape and dtype"
            )
        self._init = None  # a lazy tensor's pending initialiser must not overwrite the new value
        self._value = freeze(np.array(new, copy=True))

    def full_tensor(self) -> np.ndarray:
        """The global value as a NumPy array, on every process (a collective under MPI)."""
        if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
            tr.escape("full_tensor, numpy, item, float, bool")
        if self._abstract:
            raise ValueError(f"{self._label()} has no values: it was built in shape-only mode (planning, estimating)")
        if self._value is not None:
            return np.array(to_numpy(self._value))
        spec = self.spec
        backend = current_backend()
        replicated = spec.replicated
        if replicated is spec:  # already whole on every rank of the mesh: nothing to plan or move
            shards = self._shards
        else:
            plan = plan_reshard(spec, replicated)
            shards = execute_plan(plan, self._plan_input(plan, backend), self._dtype, backend)
        value = next(iter(shards.values())) if shards else None
        world = backend.world_group()
        if not spec.mesh._id_set.issuperset(world):
            root = spec.mesh.process_ids[0]
            hosted = {r: (value if r in shards else None) for r in world if backend.hosts(r)}
            got = backend.comm.broadcast(world, hosted, root, spec.shape, self._dtype)
            value = next(iter(got.values()))
        assert value is not None
        return np.array(to_numpy(value))

    def numpy(self) -> np.ndarray:
        return self.full_tensor()

    def item(self) -> Any:
        value = self.full_tensor()
        if value.size != 1:
            raise ValueError(f"item() needs a tensor with one element; {self._label()} has {value.size}")
        return value.reshape(()).item()

    def tolist(self) -> Any:
        return self.full_tensor().tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.full_tensor()
        return value.astype(dtype) if dtype is not None else value

    def __format__(self, spec: str) -> str:
        if spec and self.size == 1:
            return format(self.item(), spec)
        return str(self) if not spec else format(str(self), spec)

    def __str__(self) -> str:
        """Paddle's print, value included, made without communicating (see ``mpipar.tensor_text``):
        the global value where this process holds it (always in the simulator and ``--reference``;
        under MPI when the tensor is replicated on this rank), else this rank's piece, labelled."""
        if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
            tr.escape("print, str")  # a captured step would not print again when replayed
        if self._abstract:
            dist = (self._spec, "shape-only: no values") if self._spec is not None else None
            return tensor_text(self._shape, self._dtype, self.stop_gradient, None, dist)
        if self._spec is None or self._value is not None:
            dist = (self._spec, "GlobalDenseTensor") if self._spec is not None else None
            return tensor_text(self._shape, self._dtype, self.stop_gradient, self._value, dist)
        shards = self._shards
        whole = held_value(self._spec, shards)
        if whole is not None:
            return tensor_text(self._shape, self._dtype, self.stop_gradient, whole, (self._spec, "GlobalDenseTensor"))
        if not shards:
            label = f"GlobalDenseTensor not on this rank (rank {current_backend().rank} is outside the mesh)"
            return tensor_text(self._shape, self._dtype, self.stop_gradient, None, (self._spec, label))
        rank, local = next(iter(shards.items()))
        if any(p.is_partial() for p in self._spec.placements):
            what = "a partial piece"
        else:
            what = "box [" + ", ".join(f"{lo}:{hi}" for lo, hi in self._spec.local_box(rank)) + "]"
        label = f"LocalDenseTensor(rank {rank}, {what})"
        return tensor_text(self._shape, self._dtype, self.stop_gradient, local, (self._spec, label))

    def __repr__(self) -> str:
        if self._spec is not None:
            return (
                f"DistTensor(shape={list(self._shape)}, dtype={self._dtype}, mesh={self._spec.mesh}, "
                f"placements={list(self._spec.placements)!r})"
            )
        return f"Tensor(shape={list(self._shape)}, dtype={self._dtype}, value={np.asarray(to_numpy(self._value))!r})"


class Parameter(Tensor):
    """A trainable tensor (``stop_gradient`` False). Marking it keeps it a Parameter."""

    def __init__(self, data: Any = None, dtype: Any = None, name: str | None = None, trainable: bool = True) -> None:
        super().__init__(data, dtype=dtype, stop_gradient=not trainable, name=name)

    @property
    def trainable(self) -> bool:
        return not self.stop_gradient

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self.stop_gradient = not value


# ======================================================================== values and each-reshard-once
def _as_array(data: Any, dtype: Any, copy: bool) -> np.ndarray:
    if isinstance(data, Tensor):
        data = data.full_tensor()
    try:
        arr = np.array(data, dtype=dtype, copy=copy) if copy else np.asarray(data, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"cannot make a tensor from {type(data).__name__}: it is not a rectangular numeric array ({exc})"
        ) from None
    if arr.dtype == object:
        raise TypeError(f"cannot make a tensor from {data!r}: it is not a rectangular numeric array")
    return arr


_reuse_enabled = [True]


@contextlib.contextmanager
def reuse_reshards(enabled: bool) -> Iterator[None]:
    """Turn each-reshard-once on or off inside the block (on by default).

    Off, every consumer reshards for itself and the conflict policy does not price earlier
    reshards as free: the behaviour before reuse, kept to measure what reuse saves (tests,
    ``benchmarks/``). Results are the same values either way.
    """
    _reuse_enabled.append(bool(enabled))
    try:
        yield
    finally:
        _reuse_enabled.pop()


def reuse_enabled() -> bool:
    return _reuse_enabled[-1]


def reshards_made(tensor: Tensor) -> frozenset[DistSpec]:
    """The layouts ``tensor``'s current value was already resharded to (free to use again)."""
    cache = tensor._reshards
    if not cache:
        return frozenset()
    return frozenset(spec for spec, (sid, _) in cache.items() if sid == tensor._sid)


def to_tensor(data: Any, dtype: Any = None, stop_gradient: bool = True) -> Tensor:
    """A dense tensor (Paddle's ``paddle.to_tensor``)."""
    return Tensor(data, dtype=dtype, stop_gradient=stop_gradient)
