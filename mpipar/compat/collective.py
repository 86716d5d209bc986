"""Manual mode: Paddle's collective API on the tensors of this rank's own program.

    import mpipar as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    t = dist.to_tensor(np.full(4, rank, "float32"))
    dist.all_reduce(t)                          # in place: every rank now holds 0+1+...+(world-1)
    if rank == 0:
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)

Every call acts in place on a dense ``Tensor`` (or a writable NumPy array), with Paddle's
names and signatures (``tensor`` first, ``group=None`` meaning the world, ``src``/``dst``
global ranks, ``sync_op``). Where the calls travel depends on the launch:

* ``mpiexec -n N``: through the MPI/NCCL communicator of ``mpipar.runtime`` (one member per
  process), so ``MPIPAR_CHECK_COLLECTIVES=1`` and the watchdog see manual calls too.
* ``python -m simulator -n N script.py``: each virtual rank runs the script in its own
  thread (``simulator.per_rank``); the backend there supplies ``manual_transport()``.
* a world of one rank (``python script.py``, ``--reference``): every group has one member and
  every collective is the identity on its input, which is what one device computes.

Calls go through the ``Communicator`` public methods, so they show in ``CommDebugMode``,
traced plans and measured timelines like a reshard's collectives.

Autograd, as in Paddle's dygraph: the in-place collectives do not record a backward. The
differentiable pair of Paddle's model-parallel layers is here as functions:
``mp_allreduce`` (forward all_reduce sum, backward identity: a row-parallel layer's output)
and ``c_identity`` (forward identity, backward all_reduce sum: a column-parallel layer's input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar import autograd, hooks
from mpipar._modes import Mode, execution_mode
from mpipar._xp import to_numpy
from mpipar.backend import Backend, current_backend
from mpipar.comm import Array, ManualTransport, Shape
from mpipar.reshard.executor import freeze
from mpipar.tensor import Tensor

Group_ = tuple[int, ...]


class ReduceOp:
    """Paddle's reduce operations (the values are mpipar's reduce-type names)."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    AVG = "avg"


_OPS = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD, ReduceOp.AVG)


class ManualCallError(ValueError):
    """A manual collective called with arguments that cannot be right on this rank."""


@dataclass(frozen=True)
class Group:
    """A communication group (Paddle's ``Group``): global ranks in the order that defines positions."""

    ranks: tuple[int, ...]
    id: int = 0

    @property
    def nranks(self) -> int:
        return len(self.ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This rank's position in the group, -1 when it is not a member (Paddle's convention)."""
        me = current_backend().rank
        return self.ranks.index(me) if me in self.ranks else -1

    def is_member(self) -> bool:
        return current_backend().rank in self.ranks

    def get_group_rank(self, rank: int) -> int:
        return self.ranks.index(rank) if rank in self.ranks else -1

    def __repr__(self) -> str:
        return f"Group(id={self.id}, ranks={list(self.ranks)})"


class Task:
    """What ``isend``/``irecv`` (and any call with ``sync_op=False``) return: ``wait()`` completes it."""

    def __init__(self, finish: Any = None) -> None:
        self._finish = finish

    def wait(self) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


_DONE = Task()


class CommTransport:
    """Manual calls over a ``Communicator`` that hosts exactly this process's rank (MPI, NCCL).

    Buffers go in as the backend's arrays (``backend.xp``: NumPy under MPI, CuPy under NCCL)
    and results come back as NumPy, the arrays dense tensors hold.
    """

    def __init__(self, backend: Backend) -> None:
        self.comm = backend.comm
        self.me = backend.rank
        self.xp = backend.xp

    def _in(self, a: Array) -> Array:
        return a if self.xp is np else self.xp.asarray(a)

    @staticmethod
    def _out(a: Array) -> Array:
        return to_numpy(a)

    def all_reduce(self, group: Group_, buf: Array, op: str) -> Array:
        return self._out(self.comm.all_reduce(group, {self.me: self._in(buf)}, op)[self.me])

    def all_gather(self, group: Group_, buf: Array) -> list[Array]:
        pieces = self.comm.all_gather(group, {self.me: self._in(buf)}, [tuple(buf.shape)] * len(group))[self.me]
        return [self._out(p) for p in pieces]

    def reduce_scatter(self, group: Group_, chunks: Sequence[Array], op: str) -> Array:
        return self._out(self.comm.reduce_scatter(group, {self.me: [self._in(c) for c in chunks]}, op)[self.me])

    def all_to_all(self, group: Group_, chunks: Sequence[Array], recv_shapes: Sequence[Shape]) -> list[Array]:
        out = self.comm.all_to_all(group, {self.me: [self._in(c) for c in chunks]}, {self.me: list(recv_shapes)})
        return [self._out(p) for p in out[self.me]]

    def broadcast(self, group: Group_, buf: Array, root: int) -> Array:
        out = self.comm.broadcast(group, {self.me: self._in(buf)}, root, tuple(buf.shape), buf.dtype)
        return self._out(out[self.me])

    def reduce(self, group: Group_, buf: Array, op: str, root: int) -> Array | None:
        out = self.comm.reduce(group, {self.me: self._in(buf)}, op, root).get(self.me)
        return None if out is None else self._out(out)

    def barrier(self, group: Group_) -> None:
        self.comm.barrier(group)

    def send(self, dst: int, buf: Array) -> None:
        self.comm.send(self.me, dst, self._in(buf))

    def recv(self, src: int, shape: Shape, dtype: np.dtype) -> Array:
        return self._out(self.comm.recv(src, self.me, shape, dtype))


# ---------------------------------------------------------------------- world and groups
_groups: dict[tuple[int, ...], int] = {}


def _world() -> tuple[int, ...]:
    return tuple(range(current_backend().world_size))


def new_group(ranks: Sequence[int] | None = None, backend: str | None = None, timeout: Any = None) -> Group:
    """A group of the given global ranks (all of them when None). Every rank must call it, as in Paddle."""
    world = _world()
    members = world if ranks is None else tuple(int(r) for r in ranks)
    if not members:
        raise ManualCallError("new_group(ranks=[]): a group needs at least one rank")
    bad = [r for r in members if r not in world]
    if bad:
        raise ManualCallError(
            f"new_group(ranks={list(members)}): rank {bad[0]} is outside the world of {len(world)} ranks "
            f"(0..{len(world) - 1}); launch with more ranks or drop it"
        )
    if len(set(members)) != len(members):
        raise ManualCallError(f"new_group(ranks={list(members)}): a rank is listed twice")
    # The id is the group's first creation's: the same on every rank (they create groups in the
    # same order) and the same for every thread of per-rank programs.
    if members not in _groups:
        _groups[members] = len(_groups) + 1
    return Group(members, id=_groups[members])


def _members(group: Group | None, call: str) -> tuple[int, ...] | None:
    """The group's ranks, or None when this rank is not a member (the call is then a no-op, as in Paddle)."""
    if group is None:
        return _world()
    if not isinstance(group, Group):
        raise TypeError(f"{call}: group must be a Group from dist.new_group(ranks), got {type(group).__name__}")
    world = _world()
    if any(r not in world for r in group.ranks):
        raise ManualCallError(f"{call}: {group} names ranks outside the world of {len(world)} ranks")
    return group.ranks if current_backend().rank in group.ranks else None


def _transport(call: str) -> ManualTransport:
    backend = current_backend()
    own = backend.manual_transport(call)
    if own is not None:
        return own
    if backend.name in ("mpi", "nccl"):
        return CommTransport(backend)
    if execution_mode((), backend) is Mode.DENSE:
        raise ManualCallError(
            f"{call}: under --reference a manual program runs as one device, but the world was fixed to "
            f"{backend.world_size} ranks; drop -n (python -m simulator --reference script.py)"
        )
    raise ManualCallError(
        f"{call}: a manual collective over {backend.world_size} ranks needs one program per rank, but the "
        f"{backend.name} backend hosts all ranks in one program; run the script with "
        f"`python -m simulator -n {backend.world_size} script.py` (it runs one thread per rank) or "
        f"`mpiexec -n {backend.world_size} python script.py`"
    )


# ---------------------------------------------------------------------- tensors in and out
def _read(t: Any, what: str) -> Array:
    if isinstance(t, Tensor):
        if t.is_dist:
            raise TypeError(
                f"{what} is a distributed tensor on {t.process_mesh}; manual collectives act on this rank's "
                "own tensor: pass dist_tensor.local_tensor() (and rebuild with dist.dtensor_from_local)"
            )
        value = t._value
        if value is None:
            raise ValueError(f"{what} has no values (built in shape-only mode)")
        return value
    if isinstance(t, np.ndarray) or hasattr(t, "__cuda_array_interface__"):
        return t
    raise TypeError(f"{what} must be a dist.Tensor or a NumPy array, got {type(t).__name__}")


def _write(t: Any, value: Array, what: str) -> None:
    """Replace ``t``'s values in place (Paddle's collectives write into the tensor passed)."""
    old = _read(t, what)
    if tuple(value.shape) != tuple(old.shape) or value.dtype != old.dtype:
        raise ManualCallError(
            f"{what} is {old.dtype}{list(old.shape)} but the collective delivers {value.dtype}{list(value.shape)}; "
            "allocate it with that shape and dtype"
        )
    if isinstance(t, Tensor):
        t._value = freeze(np.array(value, copy=True))
    else:
        if not t.flags.writeable:
            raise ManualCallError(f"{what} is a read-only NumPy array; pass a writable one (np.array(x))")
        t[...] = value


def _like(template: Any, value: Array) -> Any:
    """A new result of the same kind as ``template`` (Tensor or array) holding ``value``."""
    if isinstance(template, Tensor):
        return Tensor(value, dtype=value.dtype)
    return np.array(value, copy=True)


def _check_op(op: str, call: str) -> str:
    if op not in _OPS:
        raise ManualCallError(f"{call}: op={op!r} is not a reduce op; use dist.ReduceOp.SUM/MAX/MIN/PROD/AVG")
    return op


def _check_rank(rank: int, members: tuple[int, ...], call: str, name: str) -> int:
    if rank not in members:
        raise ManualCallError(
            f"{call}: {name}={rank} is not a member of the group {list(members)}; pass a global rank in it"
        )
    return int(rank)


def _product(arrays: Sequence[Array]) -> Array:
    """Left fold of ``*`` in group order (the order every other reduction uses)."""
    out = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        out = out * a
    return out.astype(arrays[0].dtype, copy=False)


def _all_reduce_value(tp: ManualTransport, members: tuple[int, ...], value: Array, op: str) -> Array:
    if op == ReduceOp.PROD:  # the communicators fold sum/avg/max/min; a product is a gather and a local fold
        return _product(tp.all_gather(members, value))
    return tp.all_reduce(members, value, op)


# ---------------------------------------------------------------------- traced plans
def _traced(
    call: str,
    members: tuple[int, ...],
    kind: str,
    reduce_type: str | None,
    placements: tuple[str, str],
    tensor: Any,
    nbytes: int,
    pieces: tuple[tuple[int, int, int], ...] = (),
) -> None:
    """Report this rank's manual call to the plan recorders (``mpipar.trace``), as a one-step
    reshard; a recorder keeps the calls of the rank whose program opened it.

    ``placements`` are real placement strings on the group's 1-D mesh, so the plan file loads
    through ``Plan.from_dict``'s checks; a rooted call names its root in ``call`` (the reshard's
    reason) because no placement says "on one rank only"."""
    if not hooks.reshard_hooks:
        return
    t = tensor if isinstance(tensor, Tensor) else Tensor(np.asarray(tensor))
    for rec in list(hooks.reshard_hooks):
        rec.on_manual_collective(call, members, kind, reduce_type, placements[0], placements[1], t, nbytes, pieces)


# ---------------------------------------------------------------------- the collectives
def barrier(group: Group | None = None) -> None:
    """Block until every member of ``group`` reaches the barrier."""
    members = _members(group, "barrier")
    if members is not None and len(members) > 1:
        _transport("barrier").barrier(members)


def all_reduce(tensor: Any, op: str = ReduceOp.SUM, group: Group | None = None, sync_op: bool = True) -> Task:
    """Every member's ``tensor`` becomes the reduction of all members' (in place)."""
    _check_op(op, "all_reduce")
    members = _members(group, "all_reduce")
    value = _read(tensor, "all_reduce tensor")
    if members is not None and len(members) > 1:
        _write(tensor, _all_reduce_value(_transport("all_reduce"), members, value, op), "all_reduce tensor")
        if op == ReduceOp.PROD:  # travels as an all_gather (see _all_reduce_value)
            _traced("all_reduce(prod)", members, "all_gather", None, ("S(0)", "R"), tensor, value.nbytes * len(members))
        else:
            _traced("all_reduce", members, "all_reduce", op, (f"P({op})", "R"), tensor, value.nbytes)
    return _DONE


def broadcast(tensor: Any, src: int, group: Group | None = None, sync_op: bool = True) -> Task:
    """Every member's ``tensor`` becomes rank ``src``'s (in place)."""
    members = _members(group, "broadcast")
    value = _read(tensor, "broadcast tensor")
    if members is not None and len(members) > 1:
        root = _check_rank(src, members, "broadcast", "src")
        _write(tensor, _transport("broadcast").broadcast(members, value, root), "broadcast tensor")
        sends = tuple((root, r, int(value.nbytes)) for r in members if r != root)
        _traced(f"broadcast from rank {root}", members, "transfer", None, ("R", "R"), tensor, value.nbytes, sends)
    return _DONE


def reduce(tensor: Any, dst: int, op: str = ReduceOp.SUM, group: Group | None = None, sync_op: bool = True) -> Task:
    """Rank ``dst``'s ``tensor`` becomes the reduction of all members'; the others' are unchanged."""
    _check_op(op, "reduce")
    members = _members(group, "reduce")
    value = _read(tensor, "reduce tensor")
    if members is not None and len(members) > 1:
        root = _check_rank(dst, members, "reduce", "dst")
        tp = _transport("reduce")
        if op == ReduceOp.PROD:
            gathered = tp.all_gather(members, value)
            result = _product(gathered) if current_backend().rank == root else None
        else:
            result = tp.reduce(members, value, op, root)
        if result is not None:
            _write(tensor, result, "reduce tensor")
        sends = tuple((r, root, int(value.nbytes)) for r in members if r != root)
        _traced(f"reduce to rank {root}", members, "transfer", None, (f"P({op})", "R"), tensor, value.nbytes, sends)
    return _DONE


def all_gather(tensor_list: Any, tensor: Any, group: Group | None = None, sync_op: bool = True) -> Task:
    """Every member gets all members' ``tensor`` (equal shapes): into ``tensor_list`` (cleared,
    then one entry per member) or, when ``tensor_list`` is a tensor, concatenated along axis 0 into it."""
    members = _members(group, "all_gather")
    value = _read(tensor, "all_gather tensor")
    if members is None:
        return _DONE
    pieces = [value] if len(members) == 1 else _transport("all_gather").all_gather(members, value)
    if len(members) > 1:
        _traced("all_gather", members, "all_gather", None, ("S(0)", "R"), tensor, value.nbytes * len(members))
    if isinstance(tensor_list, list):
        tensor_list.clear()
        tensor_list.extend(_like(tensor, p) for p in pieces)
    else:
        _write(tensor_list, np.concatenate([np.asarray(p) for p in pieces], axis=0), "all_gather output tensor")
    return _DONE


def _split_input(tensor_list: Any, n: int, call: str) -> list[Array]:
    """A list of ``n`` tensors, or one tensor split into ``n`` equal pieces along axis 0."""
    if isinstance(tensor_list, list | tuple):
        if len(tensor_list) != n:
            raise ManualCallError(
                f"{call}: the list has {len(tensor_list)} tensors but the group has {n} members; pass one per member"
            )
        return [_read(t, f"{call} list entry {i}") for i, t in enumerate(tensor_list)]
    whole = _read(tensor_list, f"{call} input tensor")
    if whole.ndim == 0 or whole.shape[0] % n:
        raise ManualCallError(
            f"{call}: the input tensor's first dimension {list(whole.shape)[:1]} does not split into {n} equal "
            "pieces; pass a list of tensors (one per member, sizes may differ) instead"
        )
    return list(np.split(np.asarray(whole), n, axis=0))


def reduce_scatter(
    tensor: Any, tensor_list: Any, op: str = ReduceOp.SUM, group: Group | None = None, sync_op: bool = True
) -> Task:
    """Member i's ``tensor`` becomes the reduction over members of their ``tensor_list[i]``."""
    _check_op(op, "reduce_scatter")
    members = _members(group, "reduce_scatter")
    if members is None:
        return _DONE
    chunks = _split_input(tensor_list, len(members), "reduce_scatter")
    me = members.index(current_backend().rank)
    if len(members) == 1:
        result = chunks[0]
    elif op == ReduceOp.PROD:
        tp = _transport("reduce_scatter")
        result = _product(tp.all_to_all(members, chunks, [tuple(chunks[me].shape)] * len(members)))
    else:
        result = _transport("reduce_scatter").reduce_scatter(members, chunks, op)
    _write(tensor, result, "reduce_scatter tensor")
    if len(members) > 1:
        _traced("reduce_scatter", members, "reduce_scatter", op, (f"P({op})", "S(0)"), tensor, result.nbytes)
    return _DONE


def alltoall(in_tensor_list: Any, out_tensor_list: Any, group: Group | None = None, sync_op: bool = True) -> Task:
    """Member r sends ``in_tensor_list[j]`` to member j, which gets it at ``out_tensor_list[r]``.

    ``out_tensor_list`` empty: filled with pieces shaped like this rank's inputs (Paddle's
    equal-shape rule). Pre-filled with tensors: written in place, so pieces may differ in size.
    """
    members = _members(group, "alltoall")
    if members is None:
        return _DONE
    n = len(members)
    chunks = _split_input(in_tensor_list, n, "alltoall")
    given = isinstance(out_tensor_list, list) and len(out_tensor_list) == n
    if given:
        shapes = [tuple(_read(t, f"alltoall out_tensor_list[{i}]").shape) for i, t in enumerate(out_tensor_list)]
    elif isinstance(out_tensor_list, list) and not out_tensor_list:
        shapes = [tuple(c.shape) for c in chunks]
    else:
        raise ManualCallError("alltoall: out_tensor_list must be an empty list or a list of one tensor per member")
    pieces = chunks if n == 1 else _transport("alltoall").all_to_all(members, chunks, shapes)
    if n > 1:
        received = sum(int(p.nbytes) for p in pieces)
        _traced("alltoall", members, "all_to_all", None, ("S(0)", "S(0)"), chunks[0], received)
    if given:
        for i, (t, p) in enumerate(zip(out_tensor_list, pieces, strict=True)):
            _write(t, p, f"alltoall out_tensor_list[{i}]")
    else:
        template = in_tensor_list[0] if isinstance(in_tensor_list, list | tuple) else in_tensor_list
        out_tensor_list.extend(_like(template, p) for p in pieces)
    return _DONE


def scatter(
    tensor: Any, tensor_list: Any = None, src: int = 0, group: Group | None = None, sync_op: bool = True
) -> Task:
    """Member j's ``tensor`` becomes rank ``src``'s ``tensor_list[j]`` (others may pass None)."""
    members = _members(group, "scatter")
    value = _read(tensor, "scatter tensor")
    if members is None:
        return _DONE
    root = _check_rank(src, members, "scatter", "src")
    me = current_backend().rank
    empty = np.zeros((0,), dtype=value.dtype)
    if me == root:
        if tensor_list is None:
            raise ManualCallError(
                f"scatter: rank {root} is the source and must pass tensor_list (one tensor per member)"
            )
        chunks = _split_input(tensor_list, len(members), "scatter")
    else:
        chunks = [empty] * len(members)
    if len(members) == 1:
        _write(tensor, chunks[0], "scatter tensor")
        return _DONE
    # An all_to_all in which only the source sends anything: one matched call on every backend.
    shapes = [tuple(value.shape) if r == root else (0,) for r in members]
    pieces = _transport("scatter").all_to_all(members, chunks, shapes)
    _write(tensor, pieces[members.index(root)], "scatter tensor")
    _traced(f"scatter from rank {root}", members, "all_to_all", None, ("R", "S(0)"), tensor, value.nbytes)
    return _DONE


def gather(
    tensor: Any, gather_list: list[Any] | None = None, dst: int = 0, group: Group | None = None, sync_op: bool = True
) -> Task:
    """Rank ``dst``'s ``gather_list`` gets every member's ``tensor`` (equal shapes), in group order."""
    members = _members(group, "gather")
    value = _read(tensor, "gather tensor")
    if members is None:
        return _DONE
    root = _check_rank(dst, members, "gather", "dst")
    me = current_backend().rank
    if me == root and gather_list is None:
        raise ManualCallError(f"gather: rank {root} is the destination and must pass gather_list (an empty list)")
    if len(members) == 1:
        pieces = [value]
    else:
        empty = np.zeros((0,), dtype=value.dtype)
        chunks = [value if r == root else empty for r in members]
        shapes = [tuple(value.shape) if me == root else (0,) for _ in members]
        pieces = _transport("gather").all_to_all(members, chunks, shapes)
        _traced(f"gather to rank {root}", members, "all_to_all", None, ("S(0)", "R"), tensor, value.nbytes)
    if me == root and gather_list is not None:
        gather_list.clear()
        gather_list.extend(_like(tensor, p) for p in pieces)
    return _DONE


def _peer(rank: int, call: str, name: str) -> int:
    world = _world()
    me = current_backend().rank
    if rank not in world:
        raise ManualCallError(f"{call}: {name}={rank} is outside the world of {len(world)} ranks (0..{len(world) - 1})")
    if rank == me:
        raise ManualCallError(f"{call}: rank {me} names itself as {name}; a message needs another rank")
    return int(rank)


def send(tensor: Any, dst: int = 0, group: Group | None = None, sync_op: bool = True) -> Task:
    """Send ``tensor`` to rank ``dst`` (buffered: it returns once the data is handed over)."""
    peer = _peer(dst, "send", "dst")
    value = np.array(_read(tensor, "send tensor"), copy=True)
    _transport("send").send(peer, value)
    me = current_backend().rank
    _traced(f"send to rank {peer}", (me, peer), "transfer", None, ("R", "R"), tensor, value.nbytes,
            ((me, peer, int(value.nbytes)),))  # fmt: skip
    return _DONE


def recv(tensor: Any, src: int = 0, group: Group | None = None, sync_op: bool = True) -> Task:
    """Receive into ``tensor`` (in place) the next message from rank ``src``; shape and dtype must match."""
    peer = _peer(src, "recv", "src")
    value = _read(tensor, "recv tensor")
    _write(tensor, _transport("recv").recv(peer, tuple(value.shape), value.dtype), "recv tensor")
    return _DONE


def isend(tensor: Any, dst: int, group: Group | None = None) -> Task:
    """``send`` returning a task; the data is copied at the call, so ``wait()`` has nothing left to do."""
    return send(tensor, dst, group)


def irecv(tensor: Any, src: int | None = None, group: Group | None = None) -> Task:
    """A task whose ``wait()`` receives into ``tensor`` from rank ``src``."""
    if src is None:
        raise ManualCallError(
            "irecv: pass src= (receiving from any rank is not supported: it makes runs nondeterministic)"
        )
    peer = _peer(src, "irecv", "src")
    _read(tensor, "irecv tensor")
    return Task(lambda: recv(tensor, peer, group))


# ---------------------------------------------------------------------- differentiable pair
def _group_or_world(group: Group | None) -> tuple[int, ...] | None:
    return _members(group, "mp_allreduce")


def _reduced(x: Tensor, group: Group | None) -> Tensor:
    members = _group_or_world(group)
    value = _read(x, "mp_allreduce input")
    if members is not None and len(members) > 1:
        value = _transport("mp_allreduce").all_reduce(members, value, ReduceOp.SUM)
    return Tensor(value, dtype=value.dtype)


def _link(out: Tensor, x: Tensor, name: str, grad: Any) -> Tensor:
    """Record ``out = name(x)`` on the tape with backward ``grad(g)``."""
    if not autograd.is_grad_enabled() or x.stop_gradient:
        return out
    ctx = autograd.GradContext(name, {}, [None], [None], [tuple(x.shape)], [x.dtype], [True])
    node = autograd.Node(name, lambda _ctx, grads: [grad(grads[0])], ctx, [x], 1)
    out.stop_gradient = False
    out._set_history(node)
    return out


def mp_allreduce(x: Tensor, group: Group | None = None) -> Tensor:
    """Forward: all_reduce sum over ``group``; backward: identity (Paddle's ``_mp_allreduce``)."""
    return _link(_reduced(x, group), x, "mp_allreduce", lambda g: g)


def c_identity(x: Tensor, group: Group | None = None) -> Tensor:
    """Forward: identity; backward: all_reduce sum of the gradient over ``group`` (Paddle's ``_c_identity``)."""
    out = Tensor(_read(x, "c_identity input"), dtype=x.dtype)
    return _link(out, x, "c_identity", lambda g: None if g is None else _reduced(g, group))


__all__ = [
    "CommTransport",
    "Group",
    "ManualCallError",
    "ManualTransport",
    "ReduceOp",
    "Task",
    "all_gather",
    "all_reduce",
    "alltoall",
    "barrier",
    "broadcast",
    "c_identity",
    "gather",
    "irecv",
    "isend",
    "mp_allreduce",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]
