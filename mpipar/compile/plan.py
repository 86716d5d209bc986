"""Plans: the compiled form of a training step, shared by compiler, simulator, runtime and dashboard.

A plan is a versioned JSON document::

    {"format": "mpipar.plan", "version": 1,
     "meta": {"script": ..., "world_size": 8, "shape_only": false, ...},
     "meshes":   [{"id": 0, "shape": [2, 2], "process_ids": [...], "dim_names": ["dp", "tp"]}],
     "tensors":  [{"id": 3, "name": "fc1.weight", "kind": "parameter", "shape": [16, 64],
                   "dtype": "float32", "mesh": 0, "placements": "RS(1)",
                   "local_shapes": [[16, 32], ...]}],        # one per rank, in mesh order
     "ops":      [{"index": 0, "op": "matmul", "phase": "forward", "scope": "fc1",
                   "inputs": [1, 3], "outputs": [4], "rule": "matmul",
                   "decision": "mk,kn->mn; dp: split index m; tp: split index n",
                   "input_placements": ["S(0)R", "RS(1)"], "required_placements": [...],
                   "output_placements": ["S(0)S(1)"], "reshards": [0]}],
     "reshards": [{"index": 0, "op": 0, "tensor": 1, "new_tensor": 5, "reason": "...",
                   "phase": "forward", "shape": [...], "dtype": "float32",
                   "src": {"mesh": 0, "placements": "S(0)R"}, "dst": {"mesh": 0, "placements": "S(0)S(1)"},
                   "bytes_per_rank": 0.0,
                   "steps": [{"kind": "slice", "axes": ["tp"], "reduce_type": null, "src": "S(0)R",
                              "dst": "S(0)S(1)", "bytes_per_rank": 0.0, "pieces": []}]}],
     "pipeline": {"stages": [{"stage": 0, "mesh": 0}], "schedule": {...}} | null,
     "memory": {"ranks": [{"rank": 0, "parameters": 1024, ...}]} | null}

``Plan.load`` reads through ``mpipar.untrusted`` (size and depth caps, bounded numbers, UTF-8)
and ``Plan.from_dict`` checks the document as a whole: meshes (positive axes, distinct
non-negative ranks, distinct axis names), placements parsed and checked against the tensor and
mesh exactly as ``DistSpec`` checks them, local shapes that fit, unique ids, resolved references,
every integer within ``MAX_PLAN_INT`` and every string within ``MAX_PLAN_STR`` characters;
``meta.kept_for_backward`` (what the tape keeps, ``mpipar.trace``) names tensors and ops of the plan. Any
failure is a ``PlanFormatError`` (a ``FileFormatError``) naming the file, the field path and the
value; ``Plan.from_dict(p.to_dict()) == p`` (lossless).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mpipar.mesh import ProcessMesh
from mpipar.pipeline.schedule.base import Schedule
from mpipar.placement import REDUCE_TYPES, placement_problem
from mpipar.untrusted import FileFormatError, load_json

FORMAT = "mpipar.plan"
VERSION = 1
PHASES = ("forward", "backward", "optimizer", "other")
TENSOR_KINDS = ("parameter", "input", "activation", "gradient", "optimizer_state", "other")
STEP_KINDS = ("slice", "partial", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "transfer")
MAX_PLAN_INT = 1 << 62
"""Integers (ids, ranks, sizes) at or beyond this are refused: no real tensor or mesh gets near."""
MAX_PLAN_FLOAT = 1e30
"""Byte counts beyond this are refused (a 2^40 x 2^40 float64 tensor is about 1e25 bytes)."""
MAX_PLAN_STR = 1 << 16
"""Longer strings (names, decisions, placements) are refused: they are a flood, not a label."""


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def _is_positive_int(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, int) and 0 < x < MAX_PLAN_INT


OP_ATTRS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "is_causal": ("a boolean", _is_bool),
    "block_size": ("a positive integer", _is_positive_int),
}
"""The op attributes a plan records (``OpDef.cost_attrs``: what the cost model reads beside the
shapes, e.g. fused attention's causal mask and tile size): what each must be, and its check."""


DTYPE_ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""The element types a plan may name, with their bytes: every consumer can size any tensor."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name: the plan's table, else NumPy's, else 4 (the one dtype table
    the dashboard and the estimator size tensors with)."""
    if dtype in DTYPE_ITEMSIZE:
        return DTYPE_ITEMSIZE[dtype]
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 4


PlanFormatError = FileFormatError
"""A plan that does not follow the format: the one format error of every file mpipar reads
(``kind`` "plan"; ``field`` is the path at fault). The name is kept for callers and tests."""


@dataclass(frozen=True)
class PlanMesh:
    id: int
    shape: tuple[int, ...]
    process_ids: tuple[int, ...]
    dim_names: tuple[str, ...]


@functools.lru_cache(maxsize=256)
def process_mesh(m: PlanMesh) -> ProcessMesh:
    """The ``ProcessMesh`` of a plan's mesh (a pure value: a plan of a 1024-rank world is read in
    a process that hosts none of it, the dashboard or the estimator)."""
    return ProcessMesh(np.asarray(m.process_ids, dtype=np.int64).reshape(m.shape), list(m.dim_names))


@dataclass(frozen=True)
class PlanTensor:
    id: int
    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    mesh: int | None
    placements: str
    local_shapes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PlanStep:
    kind: str
    axes: tuple[str, ...]
    reduce_type: str | None
    src: str
    dst: str
    bytes_per_rank: float
    pieces: tuple[tuple[int, int, int], ...] = ()
    """For transfers: (src rank, dst rank, bytes)."""


@dataclass(frozen=True)
class PlanReshard:
    index: int
    op: int | None
    tensor: int
    new_tensor: int
    reason: str
    phase: str
    shape: tuple[int, ...]
    dtype: str
    src_mesh: int
    src: str
    dst_mesh: int
    dst: str
    bytes_per_rank: float
    steps: tuple[PlanStep, ...]


@dataclass(frozen=True)
class PlanOp:
    index: int
    op: str
    phase: str
    scope: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    rule: str
    decision: str
    input_placements: tuple[str, ...]
    required_placements: tuple[str, ...]
    output_placements: tuple[str, ...]
    reshards: tuple[int, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    """``(name, value)`` of the op's attributes the cost model reads (``OP_ATTRS``); JSON: an object."""


@dataclass
class Plan:
    meshes: list[PlanMesh] = field(default_factory=list)
    tensors: list[PlanTensor] = field(default_factory=list)
    ops: list[PlanOp] = field(default_factory=list)
    reshards: list[PlanReshard] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None

    # ------------------------------------------------------------------ queries
    def tensor(self, tid: int) -> PlanTensor:
        for t in self.tensors:
            if t.id == tid:
                return t
        raise KeyError(f"plan has no tensor {tid}")

    def mesh(self, mid: int) -> PlanMesh:
        for m in self.meshes:
            if m.id == mid:
                return m
        raise KeyError(f"plan has no mesh {mid}")

    def comm_steps(self) -> list[tuple[PlanReshard, PlanStep]]:
        return [(r, s) for r in self.reshards for s in r.steps if s.kind not in ("slice", "partial")]

    def comm_counts(self, phase: str | None = None) -> dict[str, int]:
        return dict(Counter(s.kind for r, s in self.comm_steps() if phase is None or r.phase == phase))

    def comm_bytes(self, phase: str | None = None) -> float:
        return sum(s.bytes_per_rank for r, s in self.comm_steps() if phase is None or r.phase == phase)

    def summary(self) -> str:
        lines = [
            f"plan: {len(self.ops)} ops, {len(self.tensors)} tensors, {len(self.reshards)} reshards, "
            f"{len(self.meshes)} mesh(es)"
        ]
        for ph in PHASES:
            counts = self.comm_counts(ph)
            if counts:
                pretty = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
                lines.append(f"  {ph:9s} {pretty}; {self.comm_bytes(ph) / 2**20:.3f} MiB received per rank")
        return "\n".join(lines)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        def plain(obj: Any) -> Any:
            if isinstance(obj, tuple):
                return [plain(x) for x in obj]
            if isinstance(obj, list):
                return [plain(x) for x in obj]
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            return obj

        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": plain(self.meta),
            "meshes": [plain(asdict(m)) for m in self.meshes],
            "tensors": [plain(asdict(t)) for t in self.tensors],
            "ops": [_op_to_dict(o, plain) for o in self.ops],
            "reshards": [_reshard_to_dict(r) for r in self.reshards],
            "pipeline": plain(self.pipeline),
            "memory": plain(self.memory),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file from anywhere: every refusal is a ``PlanFormatError`` naming the file."""
        name = os.fspath(path)
        try:
            data = load_json(name, kind="plan")
        except FileFormatError as exc:
            raise FileFormatError("plan", exc.field, exc.value, exc.problem, name) from None
        return cls.from_dict(data, source=name)

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Plan:
        """Build a plan from its JSON form, refusing anything malformed (``PlanFormatError``)."""
        try:
            return cls._from_dict(data)
        except FileFormatError as exc:
            if source is None or exc.source is not None:
                raise
            raise FileFormatError("plan", exc.field, exc.value, exc.problem, source) from None

    @classmethod
    def _from_dict(cls, data: Any) -> Plan:
        v = _V(data)
        v.require_object("", data)
        if data.get("format") != FORMAT:
            raise FileFormatError("plan", "format", data.get("format"), f"is not {FORMAT!r} (is this a plan file?)")
        if data.get("version") != VERSION:
            raise FileFormatError(
                "plan", "version", data.get("version"), f"is not a supported version (this mpipar reads {VERSION})"
            )
        meshes = [
            PlanMesh(
                v.int(f"meshes[{i}].id", m.get("id")),
                v.ints(f"meshes[{i}].shape", m.get("shape")),
                v.ints(f"meshes[{i}].process_ids", m.get("process_ids")),
                v.strs(f"meshes[{i}].dim_names", m.get("dim_names")),
            )
            for i, m in enumerate(v.objects("meshes", data.get("meshes")))
        ]
        mesh_ids = {m.id for m in meshes}
        for i, m in enumerate(meshes):
            if len(m.dim_names) != len(m.shape) or _prod(m.shape) != len(m.process_ids):
                raise FileFormatError(
                    "plan", f"meshes[{i}]", asdict(m), "has inconsistent shape, process_ids and dim_names"
                )
        tensors = []
        for i, t in enumerate(v.objects("tensors", data.get("tensors"))):
            mesh = t.get("mesh")
            if mesh is not None and v.int(f"tensors[{i}].mesh", mesh) not in mesh_ids:
                raise FileFormatError("plan", f"tensors[{i}].mesh", mesh, "names no mesh of the plan")
            kind = v.str(f"tensors[{i}].kind", t.get("kind"))
            if kind not in TENSOR_KINDS:
                raise FileFormatError("plan", f"tensors[{i}].kind", kind, f"is not one of {TENSOR_KINDS}")
            tensors.append(
                PlanTensor(
                    v.int(f"tensors[{i}].id", t.get("id")),
                    v.str(f"tensors[{i}].name", t.get("name")),
                    kind,
                    v.ints(f"tensors[{i}].shape", t.get("shape")),
                    _dtype(v, f"tensors[{i}].dtype", t.get("dtype")),
                    mesh,
                    v.str(f"tensors[{i}].placements", t.get("placements")),
                    tuple(
                        v.ints(f"tensors[{i}].local_shapes[{j}]", s)
                        for j, s in enumerate(v.list(f"tensors[{i}].local_shapes", t.get("local_shapes", [])))
                    ),
                )
            )
        tensor_ids = {t.id for t in tensors}
        ops = []
        for i, o in enumerate(v.objects("ops", data.get("ops"))):
            phase = v.str(f"ops[{i}].phase", o.get("phase"))
            if phase not in PHASES:
                raise FileFormatError("plan", f"ops[{i}].phase", phase, f"is not one of {PHASES}")
            ins = v.ints(f"ops[{i}].inputs", o.get("inputs"))
            outs = v.ints(f"ops[{i}].outputs", o.get("outputs"))
            for name, ids in (("inputs", ins), ("outputs", outs)):
                for j, tid in enumerate(ids):
                    if tid not in tensor_ids:
                        raise FileFormatError("plan", f"ops[{i}].{name}[{j}]", tid, "names no tensor of the plan")
            ops.append(
                PlanOp(
                    v.int(f"ops[{i}].index", o.get("index")),
                    v.str(f"ops[{i}].op", o.get("op")),
                    phase,
                    v.str(f"ops[{i}].scope", o.get("scope", "")),
                    ins,
                    outs,
                    v.str(f"ops[{i}].rule", o.get("rule", "")),
                    v.str(f"ops[{i}].decision", o.get("decision", "")),
                    v.strs(f"ops[{i}].input_placements", o.get("input_placements", [])),
                    v.strs(f"ops[{i}].required_placements", o.get("required_placements", [])),
                    v.strs(f"ops[{i}].output_placements", o.get("output_placements", [])),
                    v.ints(f"ops[{i}].reshards", o.get("reshards", [])),
                    _op_attrs(v, f"ops[{i}].attrs", o.get("attrs", {})),
                )
            )
        reshards = [
            _reshard_from_dict(v, i, r, mesh_ids) for i, r in enumerate(v.objects("reshards", data.get("reshards")))
        ]
        pipeline = data.get("pipeline")
        if pipeline is not None:
            _check_pipeline(v, pipeline, mesh_ids)
        memory = data.get("memory")
        if memory is not None:
            _check_memory(v, memory)
        meta = data.get("meta", {})
        v.require_object("meta", meta)
        plan = cls(meshes, tensors, ops, reshards, dict(meta), pipeline, memory)
        _check_plan(plan)
        return plan


MAX_PIPELINE_COUNT = 1 << 20
"""Stages and micro-batches a plan's pipeline may hold (a schedule is built per micro-batch)."""
_COST_LISTS = {"forward": 0, "backward_input": 0, "backward_weight": 0, "send_forward": 1, "send_backward": 1}
"""Per-stage cost lists of ``pipeline.cost``, with how many entries fewer than stages they have."""


def _check_pipeline(v: _V, pipeline: Any, mesh_ids: set[int]) -> None:
    """The ``pipeline`` section as ``mpipar.static`` and the dashboard's sample write it; every
    reader (the dashboard's pipeline, memory and what-if views) may then use it unguarded."""
    v.require_object("pipeline", pipeline)
    stages = v.objects("pipeline.stages", pipeline.get("stages", []))
    seen: set[int] = set()
    for i, st in enumerate(stages):
        stage = v.int(f"pipeline.stages[{i}].stage", st.get("stage"))
        if not 0 <= stage < MAX_PIPELINE_COUNT or stage in seen:
            raise FileFormatError(
                "plan", f"pipeline.stages[{i}].stage", stage, "is not a new stage number in [0, 2^20)"
            )
        seen.add(stage)
        mesh = v.int(f"pipeline.stages[{i}].mesh", st.get("mesh"))
        if mesh not in mesh_ids:
            raise FileFormatError("plan", f"pipeline.stages[{i}].mesh", mesh, "names no mesh of the plan")
        if st.get("rank") is not None and v.int(f"pipeline.stages[{i}].rank", st["rank"]) < 0:
            raise FileFormatError("plan", f"pipeline.stages[{i}].rank", st["rank"], "is negative")
    if seen and seen != set(range(len(stages))):
        raise FileFormatError("plan", "pipeline.stages", sorted(seen), f"are not the stages 0..{len(stages) - 1}")
    m = pipeline.get("num_microbatches")
    if m is not None and not 1 <= v.int("pipeline.num_microbatches", m) <= MAX_PIPELINE_COUNT:
        raise FileFormatError("plan", "pipeline.num_microbatches", m, "is not in [1, 2^20]")
    schedule = pipeline.get("schedule")
    if schedule is not None:
        _check_schedule(v, schedule, len(stages))
    cost = pipeline.get("cost")
    if cost is not None:
        v.require_object("pipeline.cost", cost)
        unit = cost.get("time_unit", "unit")
        if unit not in ("s", "unit"):
            raise FileFormatError("plan", "pipeline.cost.time_unit", unit, "is not 's' or 'unit'")
        for key in ("profile",):
            if cost.get(key) is not None:
                v.str(f"pipeline.cost.{key}", cost[key])
        for key, fewer in _COST_LISTS.items():
            if key in cost:
                values = v.list(f"pipeline.cost.{key}", cost[key])
                if len(values) != max(len(stages) - fewer, 0):
                    raise FileFormatError(
                        "plan", f"pipeline.cost.{key}", values, f"has {len(values)} entries for {len(stages)} stage(s)"
                    )
                for j, x in enumerate(values):
                    v.num(f"pipeline.cost.{key}[{j}]", x)
        for key in ("forward_flops", "backward_flops"):
            for j, x in enumerate(v.list(f"pipeline.cost.{key}", cost.get(key, []))):
                v.num(f"pipeline.cost.{key}[{j}]", x)
    step_end = pipeline.get("step_end")
    if step_end is not None:
        v.require_object("pipeline.step_end", step_end)
        for lane, items in step_end.items():
            if not lane.isdigit() or len(lane) > 7:
                raise FileFormatError("plan", "pipeline.step_end", lane, "has a key that is not a pipeline rank")
            for j, item in enumerate(v.objects(f"pipeline.step_end[{lane!r}]", items)):
                at = f"pipeline.step_end[{lane!r}][{j}]"
                for key in ("name", "kind", "track"):
                    if key in item:
                        v.str(f"{at}.{key}", item[key])
                v.num(f"{at}.duration", item.get("duration", 0.0))


def _check_schedule(v: _V, schedule: Any, num_stages: int) -> None:
    """A schedule embedded in a plan reads back as one (``Schedule.from_dict``) over the plan's
    stages; its sizes are bounded before it is built."""
    v.require_object("pipeline.schedule", schedule)
    for key in ("num_stages", "num_microbatches"):
        n = v.int(f"pipeline.schedule.{key}", schedule.get(key))
        if not 1 <= n <= MAX_PIPELINE_COUNT:
            raise FileFormatError("plan", f"pipeline.schedule.{key}", n, "is not in [1, 2^20]")
    if num_stages and schedule["num_stages"] != num_stages:
        raise FileFormatError(
            "plan",
            "pipeline.schedule.num_stages",
            schedule["num_stages"],
            f"is not the {num_stages} stages of pipeline.stages",
        )
    try:
        Schedule.from_dict(schedule)
    except (TypeError, ValueError) as exc:
        raise FileFormatError("plan", "pipeline.schedule", "{...}", f"is not a valid schedule: {exc}") from None


def _check_memory(v: _V, memory: Any) -> None:
    """The ``memory`` section: per-rank byte counts (``MemoryReport.to_dict`` and the sample's
    form, where activations and messages are per-stage objects) and an optional capacity."""
    v.require_object("memory", memory)
    if memory.get("capacity_bytes") is not None:
        v.num("memory.capacity_bytes", memory["capacity_bytes"])
    if memory.get("profile") is not None:
        v.str("memory.profile", memory["profile"])
    ranks: set[int] = set()
    for i, entry in enumerate(v.objects("memory.ranks", memory.get("ranks", []))):
        rank = v.int(f"memory.ranks[{i}].rank", entry.get("rank"))
        if rank < 0 or rank in ranks:
            raise FileFormatError(
                "plan", f"memory.ranks[{i}].rank", rank, "is negative or repeats an earlier entry's rank"
            )
        ranks.add(rank)
        for key, value in entry.items():
            at = f"memory.ranks[{i}].{v.str(f'memory.ranks[{i}]', key)}"
            if key == "rank":
                continue
            if isinstance(value, dict):
                for stage, nbytes in value.items():
                    if not stage.isdigit() or len(stage) > 7:
                        raise FileFormatError("plan", at, stage, "has a key that is not a stage number")
                    v.num(f"{at}[{stage!r}]", nbytes)
            else:
                v.num(at, value)


def _reshard_to_dict(r: PlanReshard) -> dict[str, Any]:
    return {
        "index": r.index,
        "op": r.op,
        "tensor": r.tensor,
        "new_tensor": r.new_tensor,
        "reason": r.reason,
        "phase": r.phase,
        "shape": list(r.shape),
        "dtype": r.dtype,
        "src": {"mesh": r.src_mesh, "placements": r.src},
        "dst": {"mesh": r.dst_mesh, "placements": r.dst},
        "bytes_per_rank": r.bytes_per_rank,
        "steps": [
            {
                "kind": s.kind,
                "axes": list(s.axes),
                "reduce_type": s.reduce_type,
                "src": s.src,
                "dst": s.dst,
                "bytes_per_rank": s.bytes_per_rank,
                "pieces": [list(p) for p in s.pieces],
            }
            for s in r.steps
        ],
    }


def _reshard_from_dict(v: _V, i: int, r: Mapping[str, Any], mesh_ids: set[int]) -> PlanReshard:
    path = f"reshards[{i}]"
    src, dst = r.get("src"), r.get("dst")
    v.require_object(f"{path}.src", src)
    v.require_object(f"{path}.dst", dst)
    for name, end in (("src", src), ("dst", dst)):
        if v.int(f"{path}.{name}.mesh", end.get("mesh")) not in mesh_ids:
            raise FileFormatError("plan", f"{path}.{name}.mesh", end.get("mesh"), "names no mesh of the plan")
    steps = []
    for j, s in enumerate(v.objects(f"{path}.steps", r.get("steps"))):
        kind = v.str(f"{path}.steps[{j}].kind", s.get("kind"))
        if kind not in STEP_KINDS:
            raise FileFormatError("plan", f"{path}.steps[{j}].kind", kind, f"is not one of {STEP_KINDS}")
        steps.append(
            PlanStep(
                kind,
                v.strs(f"{path}.steps[{j}].axes", s.get("axes", [])),
                _reduce_type(v, f"{path}.steps[{j}].reduce_type", s.get("reduce_type")),
                v.str(f"{path}.steps[{j}].src", s.get("src")),
                v.str(f"{path}.steps[{j}].dst", s.get("dst")),
                v.num(f"{path}.steps[{j}].bytes_per_rank", s.get("bytes_per_rank")),
                tuple(
                    tuple(v.ints(f"{path}.steps[{j}].pieces[{k}]", p))
                    for k, p in enumerate(v.list(f"{path}.steps[{j}].pieces", s.get("pieces", [])))
                ),  # type: ignore[misc]
            )
        )
    op = r.get("op")
    return PlanReshard(
        v.int(f"{path}.index", r.get("index")),
        None if op is None else v.int(f"{path}.op", op),
        v.int(f"{path}.tensor", r.get("tensor")),
        v.int(f"{path}.new_tensor", r.get("new_tensor")),
        v.str(f"{path}.reason", r.get("reason", "")),
        v.str(f"{path}.phase", r.get("phase", "forward")),
        v.ints(f"{path}.shape", r.get("shape")),
        _dtype(v, f"{path}.dtype", r.get("dtype")),
        src["mesh"],
        v.str(f"{path}.src.placements", src.get("placements")),
        dst["mesh"],
        v.str(f"{path}.dst.placements", dst.get("placements")),
        v.num(f"{path}.bytes_per_rank", r.get("bytes_per_rank")),
        tuple(steps),
    )


def _prod(values: Sequence[int]) -> int:
    out = 1
    for x in values:
        out *= x
    return out


class _V:
    """Field validators that raise PlanFormatError naming the path."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def require_object(self, path: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise FileFormatError("plan", path or "<document>", value, "is not a JSON object")

    def list(self, path: str, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise FileFormatError("plan", path, value, "is not a list")
        return value

    def objects(self, path: str, value: Any) -> list[dict[str, Any]]:
        items = self.list(path, value)
        for i, x in enumerate(items):
            self.require_object(f"{path}[{i}]", x)
        return items

    def int(self, path: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FileFormatError("plan", path, value, "is not an integer")
        if not -MAX_PLAN_INT < value < MAX_PLAN_INT:
            raise FileFormatError("plan", path, value, f"is out of range (|value| must be below 2^62 = {MAX_PLAN_INT})")
        return value

    def num(self, path: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FileFormatError("plan", path, value, "is not a non-negative number")
        if isinstance(value, int) and not 0 <= value <= MAX_PLAN_FLOAT:
            raise FileFormatError("plan", path, value, f"is not a non-negative number up to {MAX_PLAN_FLOAT:g}")
        if isinstance(value, int) and float(value) != value:
            # Stored as a float: an integer it cannot hold exactly would load as another value.
            raise FileFormatError("plan", path, value, "is an integer no float holds exactly; write it as a float")
        out = float(value)
        if not (math.isfinite(out) and 0 <= out <= MAX_PLAN_FLOAT):
            raise FileFormatError("plan", path, value, f"is not a finite non-negative number up to {MAX_PLAN_FLOAT:g}")
        return out

    def str(self, path: str, value: Any) -> str:
        if not isinstance(value, str):
            raise FileFormatError("plan", path, value, "is not a string")
        if len(value) > MAX_PLAN_STR:
            raise FileFormatError(
                "plan", path, value, f"is {len(value)} characters long, over the limit of {MAX_PLAN_STR}"
            )
        return value

    def ints(self, path: str, value: Any) -> tuple[int, ...]:
        return tuple(self.int(f"{path}[{i}]", x) for i, x in enumerate(self.list(path, value)))

    def strs(self, path: str, value: Any) -> tuple[str, ...]:
        return tuple(self.str(f"{path}[{i}]", x) for i, x in enumerate(self.list(path, value)))


def _op_to_dict(op: PlanOp, plain: Any) -> dict[str, Any]:
    out = plain(asdict(op))
    del out["attrs"]
    if op.attrs:  # only where an op records some: other ops' JSON stays as it was
        out["attrs"] = dict(op.attrs)
    return out


def _op_attrs(v: _V, path: str, value: Any) -> tuple[tuple[str, Any], ...]:
    v.require_object(path, value)
    out = []
    for name, x in value.items():
        rule = OP_ATTRS.get(name)
        if rule is None:
            raise FileFormatError(
                "plan", f"{path}.{name}", x, f"is not an op attribute a plan records ({', '.join(OP_ATTRS)})"
            )
        kind, check = rule
        if not check(x):
            raise FileFormatError("plan", f"{path}.{name}", x, f"is not {kind}")
        out.append((name, x))
    return tuple(out)


def _dtype(v: _V, path: str, value: Any) -> str:
    text = v.str(path, value)
    if text not in DTYPE_ITEMSIZE:
        raise FileFormatError("plan", path, text, f"is not an element type a plan names ({', '.join(DTYPE_ITEMSIZE)})")
    return text


def _reduce_type(v: _V, path: str, value: Any) -> str | None:
    if value is None:
        return None
    text = v.str(path, value)
    if text not in REDUCE_TYPES:
        raise FileFormatError("plan", path, text, f"is not a reduce type; known types are {REDUCE_TYPES}")
    return text


def _check_placements(text: str, mesh: PlanMesh, shape: Sequence[int], path: str) -> None:
    """The checks ``DistSpec`` makes: one placement per mesh axis, shard dims inside the tensor,
    zigzag splits outermost and dividing their dim."""
    problem = placement_problem(text, len(mesh.shape), len(shape), shape, mesh.shape)
    if problem:
        raise FileFormatError("plan", path, text, problem.replace("for a mesh of", f"for mesh {mesh.id} of"))


def _check_shape(shape: Sequence[int], path: str) -> None:
    if any(n < 0 for n in shape):
        raise FileFormatError("plan", path, list(shape), "has a negative size")


def _check_plan(plan: Plan) -> None:
    """Whole-document checks: ids unique, references resolved, meshes and placements consistent."""
    meshes: dict[int, PlanMesh] = {}
    for i, m in enumerate(plan.meshes):
        if m.id in meshes:
            raise FileFormatError("plan", f"meshes[{i}].id", m.id, "repeats the id of an earlier mesh")
        meshes[m.id] = m
        if any(n < 1 for n in m.shape):
            raise FileFormatError("plan", f"meshes[{i}].shape", list(m.shape), "has an axis of size < 1")
        if len(m.dim_names) != len(m.shape):
            raise FileFormatError(
                "plan",
                f"meshes[{i}].dim_names",
                list(m.dim_names),
                f"names {len(m.dim_names)} axes of a {len(m.shape)}-d mesh",
            )
        if len(set(m.dim_names)) != len(m.dim_names):
            raise FileFormatError("plan", f"meshes[{i}].dim_names", list(m.dim_names), "repeats an axis name")
        if _prod(m.shape) != len(m.process_ids):
            raise FileFormatError(
                "plan",
                f"meshes[{i}].process_ids",
                list(m.process_ids),
                f"is not one rank per cell of shape {list(m.shape)}",
            )
        if any(r < 0 for r in m.process_ids):
            raise FileFormatError("plan", f"meshes[{i}].process_ids", list(m.process_ids), "has a negative rank")
        if len(set(m.process_ids)) != len(m.process_ids):
            raise FileFormatError("plan", f"meshes[{i}].process_ids", list(m.process_ids), "repeats a rank")
    tensors: dict[int, PlanTensor] = {}
    for i, t in enumerate(plan.tensors):
        if t.id in tensors:
            raise FileFormatError("plan", f"tensors[{i}].id", t.id, "repeats the id of an earlier tensor")
        tensors[t.id] = t
        _check_shape(t.shape, f"tensors[{i}].shape")
        if t.mesh is None:
            continue
        mesh = meshes[t.mesh]
        _check_placements(t.placements, mesh, t.shape, f"tensors[{i}].placements")
        if t.local_shapes and len(t.local_shapes) != len(mesh.process_ids):
            raise FileFormatError(
                "plan",
                f"tensors[{i}].local_shapes",
                len(t.local_shapes),
                f"shapes for a mesh of {len(mesh.process_ids)} ranks",
            )
        for j, s in enumerate(t.local_shapes):
            if len(s) != len(t.shape) or any(a < 0 or a > b for a, b in zip(s, t.shape, strict=True)):
                raise FileFormatError(
                    "plan", f"tensors[{i}].local_shapes[{j}]", list(s), f"does not fit the tensor shape {list(t.shape)}"
                )
    for i, r in enumerate(plan.reshards):
        if r.index != i:
            raise FileFormatError("plan", f"reshards[{i}].index", r.index, f"is not its position {i} in the list")
        for field_name, tid in (("tensor", r.tensor), ("new_tensor", r.new_tensor)):
            if tid not in tensors:
                raise FileFormatError("plan", f"reshards[{i}].{field_name}", tid, "names no tensor of the plan")
        if r.op is not None and not 0 <= r.op < len(plan.ops):
            raise FileFormatError("plan", f"reshards[{i}].op", r.op, "names no op of the plan")
        if r.phase not in PHASES:
            raise FileFormatError("plan", f"reshards[{i}].phase", r.phase, f"is not one of {PHASES}")
        _check_shape(r.shape, f"reshards[{i}].shape")
        src_mesh, dst_mesh = meshes[r.src_mesh], meshes[r.dst_mesh]
        _check_placements(r.src, src_mesh, r.shape, f"reshards[{i}].src.placements")
        _check_placements(r.dst, dst_mesh, r.shape, f"reshards[{i}].dst.placements")
        ranks = set(src_mesh.process_ids) | set(dst_mesh.process_ids)
        for j, s in enumerate(r.steps):
            if len(set(s.axes)) != len(s.axes):
                raise FileFormatError("plan", f"reshards[{i}].steps[{j}].axes", list(s.axes), "repeats an axis")
            for a in s.axes:
                if a not in src_mesh.dim_names:
                    raise FileFormatError(
                        "plan",
                        f"reshards[{i}].steps[{j}].axes",
                        a,
                        f"is not an axis of mesh {src_mesh.id} {list(src_mesh.dim_names)}",
                    )
            for k, piece in enumerate(s.pieces):
                if len(piece) != 3 or piece[0] not in ranks or piece[1] not in ranks or piece[2] < 0:
                    raise FileFormatError(
                        "plan",
                        f"reshards[{i}].steps[{j}].pieces[{k}]",
                        list(piece),
                        "is not (src rank, dst rank, bytes) between the reshard's meshes",
                    )
    for i, o in enumerate(plan.ops):
        for j, ri in enumerate(o.reshards):
            if not 0 <= ri < len(plan.reshards):
                raise FileFormatError("plan", f"ops[{i}].reshards[{j}]", ri, "names no reshard of the plan")
    _check_kept(plan.meta.get(KEPT_KEY), tensors, len(plan.ops))


HOST_TENSORS_KEY = "host_tensors"
"""Meta key ``mpipar.trace`` writes: the ids of the optimizer states an ``offload_optimizer`` keeps
in host memory (readers check each entry: the plan may come from anywhere)."""

KEPT_KEY = "kept_for_backward"
"""Meta key ``mpipar.trace`` writes: ``[tensor id, forward op index or null]`` per storage the
tape keeps for backward."""


def _check_kept(kept: Any, tensors: Mapping[int, PlanTensor], num_ops: int) -> None:
    """``meta.kept_for_backward``: pairs naming a tensor of the plan and an op of it (or null)."""
    if kept is None:
        return
    if not isinstance(kept, list):
        raise FileFormatError("plan", f"meta.{KEPT_KEY}", kept, "is not a list of [tensor id, op index] pairs")
    for i, pair in enumerate(kept):
        at = f"meta.{KEPT_KEY}[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise FileFormatError("plan", at, pair, "is not a [tensor id, op index or null] pair")
        tid, op = pair
        if isinstance(tid, bool) or not isinstance(tid, int) or tid not in tensors:
            raise FileFormatError("plan", f"{at}[0]", tid, "names no tensor of the plan")
        if op is not None and (isinstance(op, bool) or not isinstance(op, int) or not 0 <= op < num_ops):
            raise FileFormatError("plan", f"{at}[1]", op, "names no op of the plan (an op index, or null)")
