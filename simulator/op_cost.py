"""What one recorded op or reshard of a plan costs on one rank: FLOPs, bytes, seconds.

    costs = PlanCosts(plan, profile)
    costs.op_flops(op, rank)            # 2*m*n*k for a matmul on the rank's local shards
    costs.op_time(op, rank)             # roofline: max(FLOPs / rate, bytes / bandwidth) + overhead
    costs.reshard_time(reshard, rank)   # its collectives and transfers, one after the other

Everything is read off the plan: an op's inputs in the layouts its rule required (the
plan's ``required_placements``), its outputs in theirs, each rank's local shape from the
chunking rule. FLOPs per op (local shapes):

==========================================  =============================================
op                                          FLOPs
==========================================  =============================================
matmul                                      2 * numel(out) * k  (k: the contracted length)
elementwise (add, multiply, scale, ...)     1 per output element (``ELEMENT_FLOPS`` below)
softmax, layer_norm, gelu, dropout, ...     a few per output element (``ELEMENT_FLOPS``)
sum, mean, max, min                         1 per input element
reshape, transpose, embedding, cast, ...    0 (data movement only)
==========================================  =============================================

Time of an op: ``max(flops / rate, bytes / memory_bandwidth) + op_overhead`` where ``rate``
is the profile's FLOP rate for the dtype for a matmul (times ``gemm_efficiency(flops)`` where
the profile has a measured ``gemm_curve``) and for every other op ``vector_flops`` if given,
else the profile's ``vector_rate(bytes)`` (a calibrated CPU profile's ``vector_curve``: the
rate of an elementwise op of that many bytes), else the GEMM rate, ``bytes`` are the local inputs read and outputs written (0 for ops NumPy
does as views), and ``memory_bandwidth``/``op_overhead`` are optional (``None``/0: FLOPs only);
an optimizer-phase op (the global-norm clip's) pays the profile's ``optimizer_op_overhead_s``
instead where it has one and no ``op_overhead`` is given.
Matmuls are the compute-bound part; elementwise ops run far below a GEMM's rate (NumPy makes
one pass over memory per operation), which ``vector_flops`` or the bandwidth term price. The
overhead is host time per call (Python dispatch on CPU, a kernel launch on a GPU); a reshard
call pays ``reshard_overhead`` (default ``op_overhead``) besides its collectives.

A reshard's steps run one after another: a collective on the group of its mesh axes through
the rank (``HardwareProfile.collective_time`` with the buffer the formula takes: the local
output of an all_gather, the local input otherwise); a cross-mesh ``transfer`` as the rank's
point-to-point messages, sent and received one at a time. Steps before a transfer run on the
source mesh, those after it on the destination mesh (the planner's design).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from mpipar.compile.plan import Plan, PlanMesh, PlanOp, PlanReshard, PlanStep
from mpipar.compile.plan import process_mesh as plan_mesh
from mpipar.ops.attention import key_tiles
from mpipar.placement import parse_placements
from mpipar.spec import DistSpec
from simulator.cost import HardwareProfile

ELEMENT_FLOPS: dict[str, float] = {
    "add": 1,
    "subtract": 1,
    "multiply": 1,
    "divide": 1,
    "scale": 1,
    "maximum": 1,
    "minimum": 1,
    "neg": 1,
    "abs": 1,
    "square": 1,
    "sign": 1,
    "where": 1,
    "relu": 1,
    "relu_grad": 1,
    "equal": 1,
    "not_equal": 1,
    "greater_than": 1,
    "greater_equal": 1,
    "less_than": 1,
    "less_equal": 1,
    "isfinite": 1,
    "pow": 2,
    "pow_grad": 3,
    "sqrt": 1,
    "sqrt_grad": 2,
    "rsqrt": 2,
    "exp": 1,
    "log": 1,
    "tanh": 1,
    "tanh_grad": 2,
    "sigmoid": 3,
    "sigmoid_grad": 3,
    "dropout": 2,  # compare the uniform draw, select and scale
    "dropout_grad": 2,
    "softmax": 5,  # max, subtract, exp, sum, divide
    "softmax_grad": 4,
    "log_softmax": 5,
    "log_softmax_grad": 4,
    "layer_norm": 8,  # mean, variance, normalise, scale and shift
    "layer_norm_grad": 12,
    "gelu": 10,  # the tanh approximation
    "gelu_grad": 14,
    "cross_entropy_with_softmax": 6,
    "cross_entropy_with_softmax_grad": 3,
}
"""FLOPs per output element of the elementwise and normalisation ops; others are data movement."""

REDUCTIONS = frozenset({"sum", "mean", "max", "min"})
VIEW_OPS = frozenset({"reshape", "transpose", "unsqueeze", "squeeze", "expand", "split", "slice"})
"""Ops NumPy runs as views of their input: no bytes moved, no FLOPs."""
NORM_OPS = frozenset(
    {
        "layer_norm",
        "layer_norm_grad",
        "softmax",
        "softmax_grad",
        "log_softmax",
        "log_softmax_grad",
        "cross_entropy_with_softmax",
        "cross_entropy_with_softmax_grad",
    }
)
"""Normalisation, softmax and loss kernels (a family of their own in ``estimate --breakdown``)."""
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
GATHER_OPS = frozenset({"embedding"})
"""Ops that read only the rows they gather: their table is not streamed through memory."""
ATTENTION_GEMMS = {"scaled_dot_product_attention": 2, "scaled_dot_product_attention_grad": 5}
"""Fused attention (``mpipar.ops.attention``): GEMMs per key tile, each ``2 b h q blk d`` FLOPs
(forward: the scores and their weighted sum; backward: the scores again, dV, dP, dQ, dK)."""
ATTENTION_PASSES = 6
"""Elementwise passes over each key tile's ``b x h x q x blk`` scores, forward or backward (scale,
causal mask, row max or ``- lse``, shift, exponential, row sum or ``dS``): what the kernel runs
between its GEMMs, one exponential per score among them."""


def op_family(name: str) -> str:
    """The family ``estimate --breakdown`` files an op under: gemm, norm, elementwise, embedding, view."""
    if name == "matmul":
        return "gemm"
    if name in NORM_OPS:
        return "norm"
    if name in VIEW_OPS:
        return "view"
    if name in GATHER_OPS or name.startswith("embedding"):
        return "embedding"
    return "elementwise"


@functools.lru_cache(maxsize=65536)
def _plan_spec(shape: tuple[int, ...], m: PlanMesh, placements: str) -> DistSpec:
    return DistSpec(shape, plan_mesh(m), parse_placements(placements))


@functools.lru_cache(maxsize=65536)
def _local_shapes(shape: tuple[int, ...], m: PlanMesh, placements: str) -> dict[int, tuple[int, ...]]:
    spec = _plan_spec(shape, m, placements)
    return dict(zip(m.process_ids, spec.local_shapes, strict=True))  # shapes in process_ids order, shared per layout


@functools.lru_cache(maxsize=65536)
def _uniform(shape: tuple[int, ...], m: PlanMesh, placements: str) -> bool:
    """Whether every rank of the mesh holds the same local shape (even splits)."""
    return len(set(_local_shapes(shape, m, placements).values())) == 1


@functools.lru_cache(maxsize=4096)
def _groups(m: PlanMesh, axes: tuple[str, ...]) -> dict[int, tuple[int, ...]]:
    mesh = plan_mesh(m)
    out: dict[int, tuple[int, ...]] = {}
    for group in mesh.groups([mesh.dim_names.index(a) for a in axes]):
        for r in group:
            out[r] = group
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    return int(np.dtype(dtype).itemsize)


class PlanCosts:
    """Per-rank FLOPs, bytes and seconds of a plan's ops and reshards on ``profile``."""

    def __init__(
        self,
        plan: Plan,
        profile: HardwareProfile,
        *,
        memory_bandwidth: float | None = None,
        vector_flops: float | None = None,
        op_overhead: float | None = None,
        reshard_overhead: float | None = None,
    ) -> None:
        # None: the profile's measured host costs (a calibrated CPU profile's; 0 elsewhere). An
        # ``op_overhead`` given alone also stands for the reshard call, as it always has.
        optimizer_overhead: float | None = None
        self.grad_sync: float | None = None
        if op_overhead is None:
            self.grad_sync = profile.grad_sync_s
            op_overhead = profile.op_overhead_s
            reshard_overhead = profile.reshard_overhead_s if reshard_overhead is None else reshard_overhead
            optimizer_overhead = profile.optimizer_op_overhead_s
        for name, value in (("memory_bandwidth", memory_bandwidth), ("vector_flops", vector_flops)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 per second or None, got {value!r}")
        for name, value in (("op_overhead", op_overhead), ("reshard_overhead", reshard_overhead)):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        self.plan = plan
        self.profile = profile
        self.memory_bandwidth = memory_bandwidth
        self.vector_flops = vector_flops
        self.op_overhead = float(op_overhead)
        self.reshard_overhead = self.op_overhead if reshard_overhead is None else float(reshard_overhead)
        # Optimizer-phase ops (the clip's) at the profile's own host cost for them, where it has one.
        self.optimizer_op_overhead = self.op_overhead if optimizer_overhead is None else float(optimizer_overhead)
        self._tensors = {t.id: t for t in plan.tensors}
        self._meshes = {m.id: m for m in plan.meshes}
        self._representatives: dict[tuple[PlanMesh, tuple[str, ...]], tuple[int, ...]] = {}

    # ------------------------------------------------------------------ shapes
    def local_shape(self, tid: int, placements: str | None, rank: int) -> tuple[int, ...]:
        """Tensor ``tid`` on ``rank`` laid out as ``placements`` (its own when None; dense: global)."""
        t = self._tensors[tid]
        if t.mesh is None:
            return tuple(t.shape)
        pls = t.placements if placements in (None, "dense") else placements
        return _local_shapes(tuple(t.shape), self._meshes[t.mesh], pls).get(rank, tuple(t.shape))

    def op_ranks(self, op: PlanOp) -> tuple[int, ...]:
        """The ranks that run ``op``: its output's mesh (every rank for a dense op)."""
        t = self._tensors[op.outputs[0]] if op.outputs else None
        if t is None or t.mesh is None:
            return ()
        return self._meshes[t.mesh].process_ids

    # ------------------------------------------------------------------ ops
    def attention_work(self, op: PlanOp, rank: int) -> tuple[int, int, int]:
        """Fused attention on ``rank``: ``(scores, tiles, head_dim)``, the scores it computes
        (``b x heads x local queries x keys in the tiles it runs``), the key tiles it runs and
        the head dim. As the kernel does, a key tile wholly in every local query's future is
        skipped under the causal mask; positions are read off the layouts (zigzag chunks too)."""
        attrs = dict(op.attrs)
        causal, block = bool(attrs.get("is_causal", True)), int(attrs.get("block_size", 128))
        (b, sq, heads, head_dim), (_, sk, _, _) = (
            self.local_shape(op.inputs[i], op.required_placements[i], rank) for i in (0, 1)
        )
        qpos, kpos = (
            self._positions(op.inputs[i], op.required_placements[i], rank) if causal else None for i in (0, 1)
        )
        tiles = key_tiles(sk, block, qpos, kpos)
        keys = sum(j1 - j0 for j0, j1 in tiles)
        return b * heads * sq * keys, len(tiles), head_dim

    def _spec(self, tid: int, placements: str) -> DistSpec | None:
        """Tensor ``tid`` laid out as ``placements`` (None for a dense tensor)."""
        t = self._tensors[tid]
        if t.mesh is None:
            return None
        pls = t.placements if placements in (None, "dense") else placements
        return _plan_spec(tuple(t.shape), self._meshes[t.mesh], pls)

    def _positions(self, tid: int, placements: str, rank: int) -> np.ndarray:
        """Global positions along dim 1 (the sequence) of ``tid``'s elements on ``rank``."""
        spec = self._spec(tid, placements)
        if spec is None or rank not in spec.boxes:
            return np.arange(self._tensors[tid].shape[1])
        return spec.positions(spec.boxes[rank], 1)

    def _attention_times(self, op: PlanOp) -> float | dict[int, float]:
        """``op_times`` of fused attention: under a causal mask ranks of even shards differ (a
        rank holding the sequence's start skips more key tiles), so each layout of the query and
        key boxes is priced once and every rank gets its own."""
        specs = [self._spec(op.inputs[i], op.required_placements[i]) for i in (0, 1)]
        memo: dict[tuple[object, ...], float] = {}
        out: dict[int, float] = {}
        for r in self.op_ranks(op):
            key = tuple(s.boxes.get(r) if s is not None else None for s in specs)
            if key not in memo:
                memo[key] = self.op_time(op, r)
            out[r] = memo[key]
        distinct = set(out.values())
        return next(iter(distinct), 0.0) if len(distinct) <= 1 else out

    def _attention_time(self, op: PlanOp, rank: int) -> float:
        """Fused attention: per key tile its GEMMs (at the size of one) and its elementwise
        passes over the scores (``ATTENTION_PASSES``); on the GPU model the passes stream the
        scores through memory, the exponentials run at ``exp_per_s`` and every kernel launches."""
        hw = self.profile
        scores, tiles, head_dim = self.attention_work(op, rank)
        if not tiles:
            return 0.0
        gemms = ATTENTION_GEMMS[op.op]
        flops = 2.0 * scores * head_dim * gemms
        per_gemm = flops / (gemms * tiles)
        dtype = self.op_dtype(op)
        pass_bytes = 2 * itemsize(dtype) * scores / tiles  # one tile's scores read and written
        if hw.gpu_model:
            bandwidth = self.memory_bandwidth if self.memory_bandwidth is not None else hw.memory_Bps
            assert bandwidth is not None  # HardwareProfile refuses the GPU model without memory_Bps
            peak = self.compute_time(flops, dtype) * hw.compute_efficiency  # seconds at the flat rate
            t = peak / hw.gemm_efficiency(per_gemm)
            t += ATTENTION_PASSES * tiles * pass_bytes / bandwidth
            t += scores / hw.exp_per_s if hw.exp_per_s else 0.0
            return t + tiles * (gemms + ATTENTION_PASSES) * hw.kernel_launch_s
        t = self.compute_time(flops, dtype)
        if hw.gemm_curve:
            t *= hw.compute_efficiency / hw.gemm_efficiency(per_gemm)
        t += self.vector_time(ATTENTION_PASSES * float(scores), pass_bytes if hw.vector_curve else 0.0, dtype)
        if self.memory_bandwidth is not None:
            t = max(t, ATTENTION_PASSES * tiles * pass_bytes / self.memory_bandwidth)
        return t + (self.optimizer_op_overhead if op.phase == "optimizer" else self.op_overhead)

    def op_flops(self, op: PlanOp, rank: int) -> float:
        if not op.outputs:
            return 0.0
        if op.op in ATTENTION_GEMMS:
            scores, _, head_dim = self.attention_work(op, rank)
            return 2.0 * scores * head_dim * ATTENTION_GEMMS[op.op]
        out = self.local_shape(op.outputs[0], op.output_placements[0], rank)
        if op.op == "matmul":
            x = self.local_shape(op.inputs[0], op.required_placements[0], rank)
            return 2.0 * _numel(out) * _contracted(x, out)
        if op.op in REDUCTIONS:
            return float(_numel(self.local_shape(op.inputs[0], op.required_placements[0], rank)))
        return ELEMENT_FLOPS.get(op.op, 0.0) * _numel(out)

    def op_bytes(self, op: PlanOp, rank: int) -> float:
        """Local bytes read and written (0 for view ops)."""
        if op.op in VIEW_OPS:
            return 0.0
        total = 0
        for tid, pls in zip(op.inputs, op.required_placements, strict=False):
            t = self._tensors[tid]
            if op.op in GATHER_OPS and t.dtype in FLOAT_DTYPES:
                continue  # the table: only the gathered rows are read, as many bytes as the output
            total += _numel(self.local_shape(tid, pls, rank)) * itemsize(t.dtype)
        if op.op in GATHER_OPS:
            total += sum(
                _numel(self.local_shape(t, p, rank)) * itemsize(self._tensors[t].dtype)
                for t, p in zip(op.outputs, op.output_placements, strict=False)
            )
        for tid, pls in zip(op.outputs, op.output_placements, strict=False):
            t = self._tensors[tid]
            total += _numel(self.local_shape(tid, pls, rank)) * itemsize(t.dtype)
        return float(total)

    def op_dtype(self, op: PlanOp) -> str:
        """The dtype an op computes in: its first floating input's (an embedding's table, not its ids)."""
        for tid in (*op.inputs, *op.outputs):
            dtype = self._tensors[tid].dtype
            if dtype in ("float16", "bfloat16", "float32", "float64"):
                return dtype
        return self._tensors[op.outputs[0]].dtype if op.outputs else "float32"

    def compute_time(self, flops: float, dtype: str) -> float:
        if flops <= 0:
            return 0.0
        key = dtype
        if key not in self.profile.flops_per_s:
            # A 16-bit plan on a profile that lists only one 16-bit rate: the other runs alike.
            twin = {"float16": "bfloat16", "bfloat16": "float16"}.get(key)
            key = twin if twin in self.profile.flops_per_s else key
        return self.profile.compute_time(flops, key)

    def vector_time(self, flops: float, nbytes: float, dtype: str) -> float:
        """Seconds of ``flops`` of elementwise work over ``nbytes`` read and written: at
        ``vector_flops`` if given, else the profile's rate for that size, else its GEMM rate."""
        if flops <= 0:
            return 0.0
        if self.vector_flops is not None:
            return flops / self.vector_flops
        rate = self.profile.vector_rate(nbytes)
        return flops / rate if rate is not None else self.compute_time(flops, dtype)

    def op_time(self, op: PlanOp, rank: int) -> float:
        if op.op in ATTENTION_GEMMS and op.outputs:
            return self._attention_time(op, rank)
        if self.profile.gpu_model:
            return self._gpu_op_time(op, rank)
        flops = self.op_flops(op, rank)
        if op.op == "matmul":
            t = self.compute_time(flops, self.op_dtype(op))
            if self.profile.gemm_curve and flops > 0:
                # The measured curve replaces the flat share compute_time applied.
                t *= self.profile.compute_efficiency / self.profile.gemm_efficiency(flops)
        else:
            t = self.vector_time(
                flops, self.op_bytes(op, rank) if self.profile.vector_curve else 0.0, self.op_dtype(op)
            )
        if self.memory_bandwidth is not None:
            t = max(t, self.op_bytes(op, rank) / self.memory_bandwidth)
        return t + (self.optimizer_op_overhead if op.phase == "optimizer" else self.op_overhead)

    def _gpu_op_time(self, op: PlanOp, rank: int) -> float:
        """The GPU model (module docstring): GEMMs on a size-dependent share of a roofline, the
        rest streamed through memory with the profile's fusion, every kernel a launch."""
        hw = self.profile
        if op.op in VIEW_OPS or not op.outputs:
            return 0.0
        nbytes = self.op_bytes(op, rank)
        bandwidth = self.memory_bandwidth if self.memory_bandwidth is not None else hw.memory_Bps
        assert bandwidth is not None  # HardwareProfile refuses a GEMM curve without memory_Bps
        if op.op == "matmul":
            flops = self.op_flops(op, rank)
            peak = self.compute_time(flops, self.op_dtype(op))  # seconds at the profile's (flat) rate
            peak_rate = flops / peak / hw.compute_efficiency if peak > 0 else 0.0  # undo the flat share
            if flops <= 0:
                return hw.kernel_launch_s
            # Roofline: a skinny GEMM (small intensity) is bound by streaming its operands.
            rate = min(peak_rate, flops / nbytes * bandwidth) if nbytes > 0 else peak_rate
            return flops / (rate * hw.gemm_efficiency(flops)) + hw.kernel_launch_s
        fusion = hw.elementwise_fusion
        return (nbytes / bandwidth + hw.kernel_launch_s) / fusion

    # ------------------------------------------------------------------ reshards
    def grad_sync_price(self, r: PlanReshard) -> float | None:
        """A data-parallel gradient reduction's whole seconds (``HardwareProfile.grad_sync_s``), for
        a reshard autograd inserts to bring a gradient to its parameter's layout; else None."""
        if self.grad_sync is None or r.op is not None or r.phase != "backward":
            return None
        return self.grad_sync if r.reason.startswith("gradient of") else None

    def reshard_time(self, r: PlanReshard, rank: int) -> float:
        """Seconds ``rank`` spends in reshard ``r``: its steps, plus one call's overhead."""
        whole = self.grad_sync_price(r)
        if whole is not None:
            return whole
        total = self.reshard_overhead
        crossed = False
        for step in r.steps:
            if step.kind == "transfer":
                crossed = True
                total += self._transfer_time(step, rank)
            elif step.kind not in ("slice", "partial"):
                mesh = self._meshes[r.dst_mesh if crossed else r.src_mesh]
                total += self._collective_time(r, step, mesh, rank)
        return total

    def _collective_time(self, r: PlanReshard, step: PlanStep, mesh: PlanMesh, rank: int) -> float:
        group = _groups(mesh, tuple(step.axes)).get(rank)
        if group is None or len(group) < 2:
            return 0.0
        # The formulas take the local output of an all_gather, the local input otherwise.
        pls = step.dst if step.kind == "all_gather" else step.src
        local = _local_shapes(tuple(r.shape), mesh, pls)[rank]
        nbytes = _numel(local) * itemsize(r.dtype)
        return self.profile.collective_time(step.kind, nbytes, group)

    def _transfer_time(self, step: PlanStep, rank: int) -> float:
        sent = sum(self.profile.p2p_time(n, s, d) for s, d, n in step.pieces if s == rank and s != d)
        received = sum(self.profile.p2p_time(n, s, d) for s, d, n in step.pieces if d == rank and s != d)
        return max(sent, received)

    # ------------------------------------------------------------------ all ranks at once
    def _even(self, tid: int, placements: str | None) -> bool:
        t = self._tensors[tid]
        if t.mesh is None:
            return True
        pls = t.placements if placements in (None, "dense") else placements
        return _uniform(tuple(t.shape), self._meshes[t.mesh], pls)

    def op_times(self, op: PlanOp) -> float | dict[int, float]:
        """Seconds ``op`` takes on each rank that runs it; one float when all take the same (even shards)."""
        if op.op in ATTENTION_GEMMS and op.outputs:
            return self._attention_times(op)
        ranks = self.op_ranks(op)
        pairs = [
            *zip(op.inputs, op.required_placements, strict=False),
            *zip(op.outputs, op.output_placements, strict=False),
        ]
        if all(self._even(tid, pls) for tid, pls in pairs):
            return self.op_time(op, ranks[0]) if ranks else 0.0
        return {r: self.op_time(op, r) for r in ranks}

    def reshard_times(self, r: PlanReshard) -> float | dict[int, float]:
        """Seconds reshard ``r`` takes on each rank taking part; one float when all take the same."""
        ranks = self.reshard_ranks(r)
        whole = self.grad_sync_price(r)
        if whole is not None:
            return whole
        if not any(step.kind == "transfer" for step in r.steps):
            mesh = self._meshes[r.src_mesh]
            if all(_uniform(tuple(r.shape), mesh, pls) for step in r.steps for pls in (step.src, step.dst)):
                # Even shards: a rank's time in a step depends only on its group (size, link class).
                total = self.reshard_overhead
                for step in r.steps:
                    if step.kind in ("slice", "partial"):
                        continue
                    times = {
                        self._collective_time(r, step, mesh, q)
                        for q in self._group_representatives(mesh, tuple(step.axes))
                    }
                    if len(times) != 1:
                        break
                    total += times.pop()
                else:
                    return total
        return {q: self.reshard_time(r, q) for q in ranks}

    def _group_representatives(self, mesh: PlanMesh, axes: tuple[str, ...]) -> tuple[int, ...]:
        """One rank of each class of ``axes`` groups on ``mesh``: groups of the same size on the same
        link class take the same time in a collective of even shards, so one stands for all (a
        1024-rank mesh has up to 512 groups, priced once per class instead of once each)."""
        key = (mesh, axes)
        if key not in self._representatives:
            seen: dict[tuple[int, object], int] = {}
            for group in set(_groups(mesh, axes).values()):
                seen.setdefault((len(group), id(self.profile.link(group))), min(group))
            self._representatives[key] = tuple(sorted(seen.values()))
        return self._representatives[key]

    def reshard_ranks(self, r: PlanReshard) -> tuple[int, ...]:
        ranks = set(self._meshes[r.src_mesh].process_ids) | set(self._meshes[r.dst_mesh].process_ids)
        return tuple(sorted(ranks))


def _contracted(x: Sequence[int], out: Sequence[int]) -> int:
    """k of a matmul from its first operand's and its output's local shapes.

    ``x`` is ``(..., m, k)``, or ``(..., k, m)`` when transposed: if its second-to-last
    length is the output's ``m`` it is untransposed (when ``k == m`` both readings agree).
    """
    if len(x) == 1:
        return int(x[0])
    if len(out) >= 2 and x[-2] == out[-2]:
        return int(x[-1])
    if len(out) == 1 and x[-2] == out[-1]:  # (m, k) @ (k,) -> (m,)
        return int(x[-1])
    return int(x[-2])
