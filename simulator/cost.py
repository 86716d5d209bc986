"""The cost model: communication time by the alpha-beta model, compute time from FLOPs.

A link class has a latency ``alpha`` (seconds per message step) and a bandwidth (bytes/s;
``beta = 1 / bandwidth``). A ``HardwareProfile`` has two: ``intra_node`` (e.g. NVLink) and
``inter_node`` (e.g. InfiniBand); a group that spans nodes runs at the slower class, because a
ring through it is only as fast as its slowest hop. Collective formulas on a group of ``n``
ranks (ring algorithms for reductions and gathers, pairwise exchange for all-to-all):

===============  ==========================  ==================================================
op               ``nbytes`` is               time
===============  ==========================  ==================================================
send             the message                 alpha + S*beta
all_reduce       the full buffer (per rank)  2(n-1)*alpha + 2(n-1)/n * S*beta + (n-1)/n * S*gamma
reduce_scatter   the full input (per rank)   (n-1)*alpha + (n-1)/n * S*beta + (n-1)/n * S*gamma
all_gather       the full output (per rank)  (n-1)*alpha + (n-1)/n * S*beta
all_to_all       one rank's whole buffer     (n-1)*alpha + (n-1)/n * S*beta
broadcast        the message                 min(binomial tree: L*(alpha + S*beta),
                                                 scatter + all-gather: (L + n-1)*alpha
                                                 + 2(n-1)/n * S*beta),  L = ceil(log2 n)
reduce           the message                 broadcast's time + (n-1)/n * S*gamma
===============  ==========================  ==================================================

``gamma`` is the seconds per byte of the local reduction (``1 / reduction_Bps``; the profile's
``reduction_Bps``, ``None`` where the link bandwidth already includes it, as NCCL's bus
bandwidth does). ``n == 1`` costs nothing. Compute: ``flops / (flops_per_s[dtype] *
compute_efficiency)``.

Profiles are JSON (``"format": "mpipar.hardware"``); presets live in ``simulator/presets/``
(``h100-nvlink-ib``, ``a100-nvlink-ib``, ``cpu-local``) and ``python -m simulator calibrate``
measures this machine. ``PipelineCost`` turns per-stage times (or a profile plus FLOPs and
bytes) into what ``simulator.simulate_schedule`` charges for each pipeline action.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpipar.pipeline.actions import Action
from mpipar.untrusted import load_json

PROFILE_FORMAT = "mpipar.hardware"
PROFILE_VERSION = 1
MIN_KERNEL_SCALE, MAX_KERNEL_SCALE = 0.1, 100.0
"""Bounds of ``HardwareProfile.kernel_scale`` a profile file may carry (a measured one is 1-4)."""
PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
PRICED_COMMS = ("send", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")


@dataclass(frozen=True)
class Link:
    """One class of link: latency per message step (s) and bandwidth (bytes/s)."""

    alpha_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "bandwidth_Bps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"Link {name} must be a finite number, got {value!r}")
        if self.alpha_s < 0:
            raise ValueError(f"Link alpha_s (latency, seconds) must be >= 0, got {self.alpha_s!r}")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"Link bandwidth_Bps must be > 0 bytes/s, got {self.bandwidth_Bps!r}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth_Bps

    def to_dict(self) -> dict[str, float]:
        return {"alpha_s": self.alpha_s, "bandwidth_Bps": self.bandwidth_Bps}


def collective_time(op: str, nbytes: float, group_size: int, link: Link, reduction_Bps: float | None = None) -> float:
    """Seconds for one collective on ``group_size`` ranks over ``link`` (formulas in the module docstring)."""
    if op not in PRICED_COMMS:
        raise ValueError(f"collective {op!r} has no cost formula; known: {', '.join(PRICED_COMMS)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer) or group_size < 1:
        raise ValueError(f"collective {op}: group size must be a positive int, got {group_size!r}")
    if not isinstance(nbytes, int | float | np.integer | np.floating) or not nbytes >= 0:
        raise ValueError(f"collective {op}: nbytes must be a number >= 0, got {nbytes!r}")
    if reduction_Bps is not None and not reduction_Bps > 0:
        raise ValueError(f"collective {op}: reduction_Bps must be > 0 bytes/s or None, got {reduction_Bps!r}")
    n = int(group_size)
    a, b, s = link.alpha_s, link.beta, float(nbytes)
    g = 0.0 if reduction_Bps is None else 1.0 / reduction_Bps
    if op == "send":
        return a + s * b
    if n == 1:
        return 0.0
    share = (n - 1) / n
    if op == "all_reduce":
        return 2 * (n - 1) * a + 2 * share * s * b + share * s * g
    if op == "reduce_scatter":
        return (n - 1) * a + share * s * b + share * s * g
    if op in ("all_gather", "all_to_all"):
        return (n - 1) * a + share * s * b
    steps = math.ceil(math.log2(n))
    tree = steps * (a + s * b)
    scatter_allgather = (steps + n - 1) * a + 2 * share * s * b
    return min(tree, scatter_allgather) + (share * s * g if op == "reduce" else 0.0)


@dataclass(frozen=True)
class HardwareProfile:
    """Devices, links and compute rates one cost model uses. JSON-serialisable (``to_dict``)."""

    name: str
    intra_node: Link
    inter_node: Link
    flops_per_s: Mapping[str, float]
    """Per device and dtype name (``float64``, ``float32``, ``bfloat16``, ...): peak or measured."""
    devices_per_node: int | None = None
    """Devices (ranks) per node; ``None``: all devices on one node."""
    compute_efficiency: float = 1.0
    """Achieved share of ``flops_per_s`` on model kernels (1.0 for measured rates)."""
    memory_bytes: int | None = None
    """Device memory capacity (the dashboard's capacity line); ``None`` if unknown."""
    reduction_Bps: float | None = None
    """Local reduction throughput (bytes/s) that reductions add on top of the link; ``None``: included."""
    description: str = ""
    calibration: Mapping[str, Any] | None = field(default=None, compare=False)
    """Raw measurements behind a calibrated profile (sizes, times, fits)."""
    # The GPU model's fields come last: positional construction of older profiles keeps working.
    memory_Bps: float | None = None
    """Device memory bandwidth (bytes/s): prices non-GEMM ops and the roofline of skinny GEMMs; ``None``: FLOPs only."""
    kernel_launch_s: float = 0.0
    """Seconds every kernel adds (launch and tail), on top of its work."""
    gemm_efficiency_max: float | None = None
    """Share of peak a large GEMM reaches; set, it turns on the GPU model (``simulator.op_cost``)."""
    gemm_half_flops: float = 0.0
    """FLOPs of a GEMM that reaches half of ``gemm_efficiency_max`` (the curve's knee)."""
    elementwise_fusion: float = 1.0
    """Traced elementwise/normalisation ops one fused kernel replaces (divides their bytes and launches)."""
    host_link_Bps: float | None = None
    """Host <-> device copy bandwidth per direction (bytes/s) that optimizer offload pays;
    ``None``: host and device share one memory (the move is free)."""
    # The measured CPU model (``python -m simulator calibrate`` writes it): kernel rates as
    # functions of kernel size, and the host's cost of dispatching each op, reshard and update.
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """``(FLOPs of one GEMM, share of flops_per_s it reaches)`` points, FLOPs increasing; set, a
    GEMM's efficiency is read off it (``gemm_efficiency``) instead of ``compute_efficiency``."""
    vector_curve: tuple[tuple[float, float], ...] = ()
    """``(bytes an elementwise op reads and writes, FLOP/s)`` points, bytes increasing; set, the
    non-GEMM ops and the optimizer update run at the rate of their size (``vector_rate``)."""
    op_overhead_s: float = 0.0
    """Host seconds each op's dispatch costs beyond its kernel (Python, on a CPU)."""
    reshard_overhead_s: float = 0.0
    """Host seconds each reshard call costs beyond its collectives' link time."""
    update_overhead_s: float = 0.0
    """Host seconds the optimizer spends per parameter beyond its kernels."""
    optimizer_op_overhead_s: float | None = None
    """Host seconds each optimizer-phase op (the global-norm clip's) costs beyond its kernel: it
    runs outside autograd, with no tape to record, for less than a forward or backward op's
    ``op_overhead_s``; ``None``: ``op_overhead_s``."""
    grad_sync_s: float | None = None
    """Seconds a gradient reduction of a data-parallel backward costs in a step, whole (host and
    link), as ``calibrate`` measures a dp=2 step paying it (``calibrate_host.grad_sync_cost``);
    ``None``: a reshard call (``reshard_overhead_s``) plus its collective's link time."""
    kernel_scale: float = 1.0
    """Seconds a kernel takes inside a training step per second its rate above prices it at:
    ``calibrate`` measures ``flops_per_s``, ``gemm_curve`` and ``vector_curve`` in tight loops on
    hot operands, and a step's kernels run slower (batched products of a layer's matrices, weight
    gradients as per-sequence products then a sum, operands other ops just wrote). It times
    gpt.py's model at two micro-batches and divides the growth of the measured forward+backward
    by the growth of its priced kernel seconds (``calibrate_host.kernel_scale``). Every kernel
    priced from those rates (``compute_time``, ``vector_rate``) is multiplied by it."""

    exp_per_s: float | None = None
    """Exponentials per second one device computes (a GPU's special function units): fused
    attention's softmax takes one per score it computes, beside its GEMMs' FLOPs; ``None``:
    not priced (the exponentials are taken as free)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareProfile name must be a non-empty string, got {self.name!r}")
        for attr in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, attr), Link):
                raise TypeError(f"HardwareProfile {attr} must be a Link, got {getattr(self, attr)!r}")
        if not isinstance(self.flops_per_s, Mapping) or not self.flops_per_s:
            raise ValueError(f"HardwareProfile {self.name!r}: flops_per_s needs at least one dtype -> FLOP/s entry")
        for dtype, rate in self.flops_per_s.items():
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"HardwareProfile {self.name!r}: flops_per_s[{dtype!r}] must be > 0, got {rate!r}")
        dpn = self.devices_per_node
        if dpn is not None and (isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1):
            raise ValueError(
                f"HardwareProfile {self.name!r}: devices_per_node must be a positive int or None, got {dpn!r}"
            )
        eff = self.compute_efficiency
        if isinstance(eff, bool) or not isinstance(eff, int | float) or not 0 < eff <= 1:
            raise ValueError(f"HardwareProfile {self.name!r}: compute_efficiency must be in (0, 1], got {eff!r}")
        red = self.reduction_Bps
        if red is not None and (isinstance(red, bool) or not isinstance(red, int | float) or not red > 0):
            raise ValueError(f"HardwareProfile {self.name!r}: reduction_Bps must be > 0 or None, got {red!r}")
        host = self.host_link_Bps
        if host is not None and (
            isinstance(host, bool) or not isinstance(host, int | float) or not math.isfinite(host) or not host > 0
        ):
            raise ValueError(f"HardwareProfile {self.name!r}: host_link_Bps must be > 0 bytes/s or None, got {host!r}")
        mem = self.memory_bytes
        if mem is not None and (isinstance(mem, bool) or not isinstance(mem, int) or mem <= 0):
            raise ValueError(f"HardwareProfile {self.name!r}: memory_bytes must be a positive int or None, got {mem!r}")
        gpu_fields = (
            ("memory_Bps", self.memory_Bps, True, 0.0, math.inf, "bytes/s > 0"),
            ("kernel_launch_s", self.kernel_launch_s, False, 0.0, 1.0, "seconds in [0, 1]"),
            ("gemm_efficiency_max", self.gemm_efficiency_max, True, 0.0, 1.0, "a share in (0, 1]"),
            ("gemm_half_flops", self.gemm_half_flops, False, 0.0, 1e18, "FLOPs in [0, 1e18]"),
            ("elementwise_fusion", self.elementwise_fusion, False, 1.0, 1e3, "a factor in [1, 1000]"),
            ("exp_per_s", self.exp_per_s, True, 0.0, math.inf, "exponentials/s > 0"),
        )
        for fname, value, optional, low, high, what in gpu_fields:
            if value is None and optional:
                continue
            bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            # memory_Bps and gemm_efficiency_max exclude their lower bound (a zero rate divides by zero).
            if bad or not (low < value <= high if optional else low <= value <= high):
                raise ValueError(
                    f"HardwareProfile {self.name!r}: {fname} must be {what}"
                    + (" or null" if optional else "")
                    + f", got {value!r}"
                )
        for fname in (
            "op_overhead_s",
            "reshard_overhead_s",
            "update_overhead_s",
            "optimizer_op_overhead_s",
            "grad_sync_s",
        ):
            value = getattr(self, fname)
            if value is None and fname in ("optimizer_op_overhead_s", "grad_sync_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(f"HardwareProfile {self.name!r}: {fname} must be seconds in [0, 1], got {value!r}")
        ks = self.kernel_scale
        if isinstance(ks, bool) or not isinstance(ks, int | float) or not MIN_KERNEL_SCALE <= ks <= MAX_KERNEL_SCALE:
            raise ValueError(
                f"HardwareProfile {self.name!r}: kernel_scale must be a number in "
                f"[{MIN_KERNEL_SCALE:g}, {MAX_KERNEL_SCALE:g}], got {ks!r}"
            )
        object.__setattr__(
            self, "gemm_curve", _curve(self.name, "gemm_curve", self.gemm_curve, "a share in (0, 1]", 1.0)
        )
        object.__setattr__(
            self, "vector_curve", _curve(self.name, "vector_curve", self.vector_curve, "FLOP/s > 0", math.inf)
        )
        if self.gemm_curve and self.gemm_efficiency_max is not None:
            raise ValueError(
                f"HardwareProfile {self.name!r}: gemm_curve and gemm_efficiency_max are two GEMM models; give one"
            )
        if self.gemm_efficiency_max is not None and self.memory_Bps is None:
            raise ValueError(
                f"HardwareProfile {self.name!r}: gemm_efficiency_max is set but memory_Bps is null; the GPU model "
                "prices non-GEMM ops from memory bandwidth, so give memory_Bps too (or drop gemm_efficiency_max)"
            )

    # ------------------------------------------------------------------ topology
    def node_of(self, device: int) -> int:
        return 0 if self.devices_per_node is None else int(device) // self.devices_per_node

    def link(self, group: Sequence[int]) -> Link:
        """The link class a collective on ``group`` (global device ids) runs at: the slowest it uses."""
        nodes = {self.node_of(d) for d in group}
        return self.intra_node if len(nodes) <= 1 else self.inter_node

    # ------------------------------------------------------------------ times
    def collective_time(self, op: str, nbytes: float, group: Sequence[int]) -> float:
        """Seconds for ``op`` over ``group`` (device ids); ``nbytes`` as the module table says."""
        group = list(group)
        if not group:
            raise ValueError(f"collective {op} needs a non-empty group of device ids")
        return collective_time(op, nbytes, len(group), self.link(group), self.reduction_Bps)

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` from device ``src`` to ``dst`` (0 when they are the same)."""
        if src == dst:
            return 0.0
        return collective_time("send", nbytes, 2, self.link([src, dst]))

    def comm_event_time(self, event: Any) -> float:
        """Seconds for one recorded ``mpipar.CommEvent`` (op, ranks, input/output bytes)."""
        op = event.op
        nbytes = event.output_nbytes if op in ("all_gather", "broadcast") else event.input_nbytes
        if op == "send":
            src, dst = event.ranks
            return self.p2p_time(nbytes, src, dst)
        return self.collective_time(op, nbytes, event.ranks)

    def compute_time(self, flops: float, dtype: Any = "float32") -> float:
        """Seconds for ``flops`` floating-point operations in ``dtype`` on one device."""
        key = _dtype_name(dtype)
        if key not in self.flops_per_s:
            raise ValueError(
                f"hardware profile {self.name!r} has no FLOP rate for dtype {key!r}; it knows "
                f"{sorted(self.flops_per_s)} (add one to its flops_per_s)"
            )
        if not flops >= 0:
            raise ValueError(f"compute_time: flops must be >= 0, got {flops!r}")
        return float(flops) / (self.flops_per_s[key] * self.compute_efficiency) * self.kernel_scale

    @property
    def gpu_model(self) -> bool:
        """Whether ops are priced by the GPU model (GEMM efficiency curve, bandwidth-bound rest)."""
        return self.gemm_efficiency_max is not None

    def gemm_efficiency(self, flops: float) -> float:
        """Share of peak a GEMM of ``flops`` reaches: ``max * F / (F + F_half)``.

        Rises with size and saturates: a GEMM pays a fixed cost (filling the SMs' tiles, the
        last partial wave, prologue/epilogue) that large ones amortise, as GEMM benchmarks on
        A100/H100 show (NVIDIA, "Matrix Multiplication Background" performance guide).
        """
        if self.gemm_efficiency_max is None:
            return _interpolate(self.gemm_curve, flops) if self.gemm_curve else self.compute_efficiency
        f = max(float(flops), 0.0)
        return self.gemm_efficiency_max * f / (f + self.gemm_half_flops) if f > 0 else 0.0

    def vector_rate(self, nbytes: float) -> float | None:
        """FLOP/s of an elementwise op that reads and writes ``nbytes`` (``vector_curve``, linear in
        log-bytes between its points, its end values beyond them); ``None`` without a curve."""
        return _interpolate(self.vector_curve, nbytes) / self.kernel_scale if self.vector_curve else None

    @property
    def prices_eager_runtime(self) -> bool:
        """Whether this profile prices mpipar's own eager runtime (it carries mpipar's measured
        host costs per op, reshard call or update: a ``calibrate``d CPU profile), which reduces
        each micro-batch's gradients over data parallelism as backward accumulates them (a
        partial gradient added to a replicated one), inside that micro-batch's backward (its
        weight-gradient part ``W`` when backward is split), not once per step after the last
        one as Megatron-style runtimes do (the GPU presets); and whose pipeline hand-offs hold
        both ranks until every message is through (``PipelineCost.blocking_transfers``)."""
        return not self.gpu_model and (
            self.op_overhead_s > 0 or self.reshard_overhead_s > 0 or self.update_overhead_s > 0
        )

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "description": self.description,
            "devices_per_node": self.devices_per_node,
            "links": {"intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict()},
            "flops_per_s": dict(self.flops_per_s),
            "compute_efficiency": self.compute_efficiency,
            "reduction_Bps": self.reduction_Bps,
            "memory_bytes": self.memory_bytes,
        }
        if self.gemm_efficiency_max is not None or self.memory_Bps is not None or self.kernel_launch_s:
            out.update(
                {
                    "memory_Bps": self.memory_Bps,
                    "kernel_launch_s": self.kernel_launch_s,
                    "gemm_efficiency_max": self.gemm_efficiency_max,
                    "gemm_half_flops": self.gemm_half_flops,
                    "elementwise_fusion": self.elementwise_fusion,
                }
            )
        if self.exp_per_s is not None:
            out["exp_per_s"] = self.exp_per_s
        if self.host_link_Bps is not None:
            out["host_link_Bps"] = self.host_link_Bps
        if self.gemm_curve:
            out["gemm_curve"] = [list(p) for p in self.gemm_curve]
        if self.vector_curve:
            out["vector_curve"] = [list(p) for p in self.vector_curve]
        for fname in ("op_overhead_s", "reshard_overhead_s", "update_overhead_s"):
            if getattr(self, fname):
                out[fname] = getattr(self, fname)
        if self.optimizer_op_overhead_s is not None:
            out["optimizer_op_overhead_s"] = self.optimizer_op_overhead_s
        if self.grad_sync_s is not None:
            out["grad_sync_s"] = self.grad_sync_s
        if self.kernel_scale != 1.0:
            out["kernel_scale"] = self.kernel_scale
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> HardwareProfile:
        """Read ``to_dict()``'s form; a wrong field raises ``ValueError`` naming it and its value."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: a hardware profile is a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{source}: field format is {data.get('format')!r}, expected {PROFILE_FORMAT!r}")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"{source}: field version is {data.get('version')!r}; this mpipar reads version {PROFILE_VERSION}"
            )
        allowed = {
            "format",
            "version",
            "name",
            "description",
            "devices_per_node",
            "links",
            "flops_per_s",
            "compute_efficiency",
            "reduction_Bps",
            "memory_bytes",
            "calibration",
            "memory_Bps",
            "kernel_launch_s",
            "gemm_efficiency_max",
            "gemm_half_flops",
            "elementwise_fusion",
            "exp_per_s",
            "host_link_Bps",
            "gemm_curve",
            "vector_curve",
            "op_overhead_s",
            "reshard_overhead_s",
            "update_overhead_s",
            "optimizer_op_overhead_s",
            "grad_sync_s",
            "kernel_scale",
        }
        for key in data:
            if key not in allowed:
                raise ValueError(f"{source}: field {key!r} is not a profile field; fields are {sorted(allowed)}")
        links = data.get("links")
        if not isinstance(links, Mapping):
            raise ValueError(f"{source}: field links is {links!r}, expected {{'intra_node': ..., 'inter_node': ...}}")
        parsed: dict[str, Link] = {}
        for cls_name in ("intra_node", "inter_node"):
            item = links.get(cls_name)
            if not isinstance(item, Mapping) or set(item) != {"alpha_s", "bandwidth_Bps"}:
                raise ValueError(
                    f"{source}: field links.{cls_name} is {item!r}, expected {{'alpha_s': s, 'bandwidth_Bps': B/s}}"
                )
            try:
                parsed[cls_name] = Link(item["alpha_s"], item["bandwidth_Bps"])
            except ValueError as exc:
                raise ValueError(f"{source}: field links.{cls_name}: {exc}") from None
        flops = data.get("flops_per_s")
        if not isinstance(flops, Mapping):
            raise ValueError(f"{source}: field flops_per_s is {flops!r}, expected {{dtype: FLOP/s}}")
        try:
            return cls(
                name=data.get("name"),  # type: ignore[arg-type]
                intra_node=parsed["intra_node"],
                inter_node=parsed["inter_node"],
                flops_per_s=dict(flops),
                devices_per_node=data.get("devices_per_node"),
                compute_efficiency=data.get("compute_efficiency", 1.0),
                reduction_Bps=data.get("reduction_Bps"),
                memory_bytes=data.get("memory_bytes"),
                memory_Bps=data.get("memory_Bps"),
                kernel_launch_s=data.get("kernel_launch_s", 0.0),
                gemm_efficiency_max=data.get("gemm_efficiency_max"),
                gemm_half_flops=data.get("gemm_half_flops", 0.0),
                elementwise_fusion=data.get("elementwise_fusion", 1.0),
                exp_per_s=data.get("exp_per_s"),
                description=str(data.get("description", "")),
                calibration=data.get("calibration"),
                host_link_Bps=data.get("host_link_Bps"),
                gemm_curve=data.get("gemm_curve", ()),
                vector_curve=data.get("vector_curve", ()),
                op_overhead_s=data.get("op_overhead_s", 0.0),
                reshard_overhead_s=data.get("reshard_overhead_s", 0.0),
                update_overhead_s=data.get("update_overhead_s", 0.0),
                optimizer_op_overhead_s=data.get("optimizer_op_overhead_s"),
                grad_sync_s=data.get("grad_sync_s"),
                kernel_scale=data.get("kernel_scale", 1.0),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HardwareProfile:
        """Read a profile file through ``mpipar.untrusted`` (regular file, size/depth caps, bounded numbers)."""
        name = os.fspath(path)
        data = load_json(name, kind="profile", max_bytes=1 << 20)
        return cls.from_dict(data, source=name)


MAX_CURVE_POINTS = 64


def _curve(profile: str, field_name: str, points: Any, what: str, high: float) -> tuple[tuple[float, float], ...]:
    """``points`` checked as a curve (untrusted: a profile file may come from anyone): a list of
    at most ``MAX_CURVE_POINTS`` ``[x, y]`` pairs of finite numbers, x > 0 strictly increasing,
    0 < y <= ``high``; returned as a tuple of float pairs."""
    if isinstance(points, str | bytes) or not isinstance(points, Sequence):
        raise ValueError(f"HardwareProfile {profile!r}: {field_name} must be a list of [x, y] pairs, got {points!r}")
    if len(points) > MAX_CURVE_POINTS:
        raise ValueError(
            f"HardwareProfile {profile!r}: {field_name} has {len(points)} points, at most {MAX_CURVE_POINTS}"
        )
    out: list[tuple[float, float]] = []
    for i, point in enumerate(points):
        if (
            isinstance(point, str | bytes)
            or not isinstance(point, Sequence)
            or len(point) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in point)
        ):
            raise ValueError(
                f"HardwareProfile {profile!r}: {field_name}[{i}] must be [x, y], two finite numbers, got {point!r}"
            )
        x, y = float(point[0]), float(point[1])
        if not x > 0 or (out and not x > out[-1][0]):
            raise ValueError(
                f"HardwareProfile {profile!r}: {field_name}[{i}] x = {point[0]!r}; x must be > 0 and "
                "strictly increasing along the curve"
            )
        if not 0 < y <= high:
            raise ValueError(f"HardwareProfile {profile!r}: {field_name}[{i}] y = {point[1]!r}; must be {what}")
        out.append((x, y))
    return tuple(out)


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """``points``' y at ``x``: linear in log(x) between neighbours, the end values beyond (kernel
    rates level off at both ends: fixed costs below, memory or cache limits above)."""
    if not x > points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    lx = math.log(x)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
    return points[-1][1]


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    return str(np.dtype(dtype))


def list_presets() -> list[str]:
    """Names of the bundled hardware presets (files in ``simulator/presets/``)."""
    return sorted(f[: -len(".json")] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A preset by name (``h100-nvlink-ib``) or a profile JSON file by path."""
    text = os.fspath(name_or_path)
    if os.path.isfile(text):
        return HardwareProfile.load(text)
    preset = os.path.join(PRESET_DIR, f"{text}.json")
    if os.path.isfile(preset):
        return HardwareProfile.load(preset)
    raise ValueError(
        f"no hardware profile {text!r}: not a file and not a preset; presets are {', '.join(list_presets())} "
        "(or write one with `python -m simulator calibrate -o profile.json`)"
    )


# ---------------------------------------------------------------------- pipeline costs
def _per_stage(value: float | Sequence[float], count: int, what: str) -> tuple[float, ...]:
    values = [value] * count if isinstance(value, int | float) else list(value)
    if len(values) != count:
        raise ValueError(f"PipelineCost {what} needs {count} values, got {len(values)}: {values!r}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"PipelineCost {what}[{i}] must be a finite number >= 0, got {v!r}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class StageMemory:
    """Bytes each stage holds: model state for the whole step, activations per micro-batch in flight.

    ``parameters``/``gradients``/``optimizer_state``/``activations``: one value per stage.
    ``message_forward[s]``/``message_backward[s]``: bytes of one activation (stage s -> s+1) and
    one gradient (stage s+1 -> s) message, held as communication buffers while in transit.
    """

    parameters: tuple[float, ...]
    gradients: tuple[float, ...]
    optimizer_state: tuple[float, ...]
    activations: tuple[float, ...]
    message_forward: tuple[float, ...] = ()
    message_backward: tuple[float, ...] = ()

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        parameters: float = 0.0,
        gradients: float = 0.0,
        optimizer_state: float = 0.0,
        activations: float = 0.0,
        message: float = 0.0,
    ) -> StageMemory:
        n = num_stages
        return cls(
            _per_stage(parameters, n, "parameters"),
            _per_stage(gradients, n, "gradients"),
            _per_stage(optimizer_state, n, "optimizer_state"),
            _per_stage(activations, n, "activations"),
            _per_stage(message, n - 1, "message_forward"),
            _per_stage(message, n - 1, "message_backward"),
        )


@dataclass(frozen=True)
class PipelineCost:
    """What each pipeline action costs, per stage.

    ``forward[s]``, ``backward_input[s]``, ``backward_weight[s]``: compute times of stage ``s``.
    A schedule that does not split backward charges B = input + weight; a zero-bubble one
    charges B = input and W = weight. ``send_forward[s]`` moves stage ``s``'s activation to
    ``s+1``; ``send_backward[s]`` moves the gradient from ``s+1`` back to ``s`` (both length
    ``num_stages - 1``). ``time_unit`` is ``"s"`` or ``"unit"``.
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    send_forward: tuple[float, ...]
    send_backward: tuple[float, ...]
    time_unit: str = "s"
    memory: StageMemory | None = None
    blocking_transfers: bool = False
    """Whether a send or receive holds its rank until the transfer is done (a rendezvous, as
    mpipar's runtime runs a hand-off: both sides wait for all of its messages), instead of
    being posted and left to complete while the rank goes on (``simulator.schedule_sim``)."""

    def __post_init__(self) -> None:
        n = len(self.forward)
        for name, want in (
            ("backward_input", n),
            ("backward_weight", n),
            ("send_forward", n - 1),
            ("send_backward", n - 1),
        ):
            _per_stage(getattr(self, name), want, name)
        _per_stage(self.forward, n, "forward")
        if self.time_unit not in ("s", "unit"):
            raise ValueError(f"PipelineCost time_unit must be 's' or 'unit', got {self.time_unit!r}")
        if self.memory is not None:
            for name in ("parameters", "gradients", "optimizer_state", "activations"):
                _per_stage(getattr(self.memory, name), n, f"memory.{name}")
            for name in ("message_forward", "message_backward"):
                if getattr(self.memory, name):
                    _per_stage(getattr(self.memory, name), n - 1, f"memory.{name}")

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        comm: float = 0.0,
        time_unit: str = "unit",
        memory: StageMemory | None = None,
    ) -> PipelineCost:
        """Every stage alike; every transfer costs ``comm``."""
        n = num_stages
        return cls(
            _per_stage(forward, n, "forward"),
            _per_stage(backward_input, n, "backward_input"),
            _per_stage(backward_weight, n, "backward_weight"),
            _per_stage(comm, n - 1, "send_forward"),
            _per_stage(comm, n - 1, "send_backward"),
            time_unit,
            memory,
        )

    @classmethod
    def unit(cls, num_stages: int) -> PipelineCost:
        """``cost="unit"``: F = 1, B = 2 (split: B = 1, W = 1), communication free."""
        return cls.uniform(num_stages)

    @classmethod
    def from_profile(
        cls,
        profile: HardwareProfile,
        *,
        num_stages: int,
        forward_flops: float | Sequence[float],
        message_bytes: float | Sequence[float],
        backward_input_flops: float | Sequence[float] | None = None,
        backward_weight_flops: float | Sequence[float] | None = None,
        dtype: Any = "float32",
        num_ranks: int | None = None,
        rank_devices: Sequence[int] | None = None,
        memory: StageMemory | None = None,
    ) -> PipelineCost:
        """Times from FLOPs and message sizes on ``profile``.

        Backward FLOPs default to the forward's for each half (input and weight gradients of a
        matmul each cost one forward). Stage ``s`` runs on pipeline rank ``s mod num_ranks``
        (default ``num_ranks = num_stages``), which sits on device ``rank_devices[rank]``
        (default: the rank itself); transfers between devices on one node use the intra-node link.
        """
        n = num_stages
        fwd = _per_stage(forward_flops, n, "forward_flops")
        bin_ = _per_stage(backward_input_flops if backward_input_flops is not None else fwd, n, "backward_input_flops")
        bw = _per_stage(backward_weight_flops if backward_weight_flops is not None else fwd, n, "backward_weight_flops")
        msg = _per_stage(message_bytes, n - 1, "message_bytes")
        ranks = num_ranks if num_ranks is not None else n
        devices = list(rank_devices) if rank_devices is not None else list(range(ranks))
        if len(devices) != ranks:
            raise ValueError(f"PipelineCost.from_profile: rank_devices has {len(devices)} entries for {ranks} ranks")
        device = [devices[s % ranks] for s in range(n)]
        send_f = tuple(profile.p2p_time(msg[s], device[s], device[s + 1]) for s in range(n - 1))
        send_b = tuple(profile.p2p_time(msg[s], device[s + 1], device[s]) for s in range(n - 1))
        return cls(
            tuple(profile.compute_time(f, dtype) for f in fwd),
            tuple(profile.compute_time(f, dtype) for f in bin_),
            tuple(profile.compute_time(f, dtype) for f in bw),
            send_f,
            send_b,
            "s",
            memory,
        )

    def compute_time(self, action: Action, split_backward: bool) -> float:
        s = action.stage
        if action.kind == "F":
            return self.forward[s]
        if action.kind == "B":
            return self.backward_input[s] if split_backward else self.backward_input[s] + self.backward_weight[s]
        if action.kind == "W":
            return self.backward_weight[s]
        raise ValueError(f"{action} is not a compute action")

    def transfer_time(self, send: Action) -> float:
        """Seconds (or units) of the transfer a send starts."""
        if send.kind == "SEND_F":
            return self.send_forward[send.stage]
        if send.kind == "SEND_B":
            return self.send_backward[send.stage - 1]
        raise ValueError(f"{send} is not a send")

    def message_bytes(self, send: Action) -> float:
        if self.memory is None or not self.memory.message_forward:
            return 0.0
        if send.kind == "SEND_F":
            return self.memory.message_forward[send.stage]
        return self.memory.message_backward[send.stage - 1]
