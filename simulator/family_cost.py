"""Step time and memory of a GPT/Llama training step on a GPU cluster, in closed form per layer.

    shape = preset("llama3-405b").sized(1)
    strategy = FamilyStrategy(dp=64, tp=8, pp=16, cp=1, micro_batches=32, schedule="Interleaved1F1B", chunks=4)
    est = price(shape, strategy, load_profile("h100-sxm"))
    est.step_time_s, est.mfu, est.peak_bytes

``simulator.estimate`` traces mpipar's own GPT; this module prices any ``ModelShape``
(``simulator.family``: grouped-query attention, SwiGLU, RMSNorm, untied embeddings, fused
attention) under data, tensor (with sequence parallelism), pipeline and context parallelism
and ZeRO 0-3, from the same ``HardwareProfile`` constants and the same pipeline simulator
(``simulator.fast_pipeline`` through ``fast_estimate.pipeline``). Everything one layer does on
one rank for one micro-batch is listed once (``layer_costs``); a stage is its layers plus the
embedding (first stage) or the final norm, output layer and loss (last stage); the schedule
is simulated over those stage costs; each pipeline rank then pays its gradient reduction and
optimizer step. What each term is and where it comes from:

* **GEMMs**: q/k/v, o, the MLP's matrices (SwiGLU's gate and up as one GEMM), the output layer:
  ``2 m n k`` FLOPs on the local shard at ``peak * gemm_efficiency(F)`` (the profile's size
  curve, the constant calibrated on Korthikanti et al. 2022's 22B rows). Backward: the input
  gradient and the weight gradient, one forward's FLOPs each.
* **attention core**: plain attention computes the whole masked ``s x s`` score matrix (two
  batched GEMMs, ``4 s h`` FLOPs per token forward, twice that backward) and keeps the scores;
  fused attention computes the causal half only (cp ranks hold mirrored chunks, so each does
  half of its rows' work) and its backward recomputes the scores: 2.5 forwards (Dao 2022:
  ``QK^T`` again, then ``dV``, ``dP``, ``dQ``, ``dK``). Its softmax's exponentials, one per
  score computed forward and one again backward, run on the special function units at the
  profile's ``exp_per_s`` and add to the GEMMs' time (``_exponentials``); plain attention's
  softmax is a memory-bound kernel, priced by its bytes.
* **elementwise kernels** (norms, residual adds or Megatron's fused bias-dropout-add, the
  activation, rotary, plain attention's scale-mask-softmax and dropout, the loss): the bytes each
  fused kernel reads and writes at ``memory_Bps``, plus ``kernel_launch_s`` per kernel. They are
  counted kernel by kernel already, so the profile's ``elementwise_fusion`` (the traced model's
  primitive ops per fused kernel) does not divide them: dividing halved every norm, activation
  and softmax, the overheads that are a larger share of a small model's step, and the one fitted
  constant took up the difference (a lower GEMM efficiency, pessimistic on large models).
  Backward reads the saved input and the output gradient and writes the input gradient:
  1.5 times the forward's bytes.
* **recompute**: ``full`` runs each layer's forward again in backward (its collectives too);
  ``selective`` runs plain attention's core again. Fused attention already recomputes its
  scores, so ``selective`` adds nothing to it.
* **tensor parallel** (group of ``tp`` consecutive ranks): per layer two all-reduces of the
  ``t x h`` activation forward and two backward; with sequence parallelism an all-gather and a
  reduce-scatter in their place (the same bytes), and in backward also the re-gather of the
  two GEMM inputs kept split. None of them is hidden behind compute: Korthikanti et al. 2022's
  two 22B rows (the calibration) agree within 1% with each other only so (hiding the backward
  ones behind the weight-gradient GEMMs, as ``estimate`` does, leaves them 13% apart: the
  sequence-parallel row 6% too fast, the full-recompute one 7% too slow, one GEMM constant
  fitting neither).
* **context parallel** (``cp`` ranks, stride ``tp``): each rank holds ``s / cp`` tokens of every
  sequence; attention all-gathers the keys and values of the whole sequence (Llama 3's
  all-gather context parallelism), keeps only its shard, re-gathers it in backward and
  reduce-scatters the key/value gradients. Not overlapped (Llama 3 reports it exposed).
  ``cp_comm="ring"`` instead passes each rank's key/value block around the cp ring: ``cp - 1``
  sends forward, each hidden behind one block's share (``1 / cp``) of the attention core; in
  backward ``cp - 1`` steps each sending a key/value block and its gradients' block behind one
  block's share of the core's backward, and the gradients' last send home exposed.
* **pipeline**: ``stage_layer_counts`` (lighter first and last stages when the layers do not
  divide); one micro-batch's activation (``t x h``, split ``tp`` ways under sequence
  parallelism) sent between stages over the link between their ranks.
* **data parallel** over ``dp * cp`` ranks (cp ranks hold the same weights): ZeRO 0 all-reduces
  the 16-bit gradients once per step, ZeRO 1/2 reduce-scatter them and all-gather the updated
  parameters (the same bytes on the wire); ZeRO 2 reduce-scatters every micro-batch's
  gradients (a sharded gradient cannot accumulate whole ones) and all-gathers the parameters
  once; ZeRO 3 (FSDP) also all-gathers every layer's parameters for its forward and again for
  its backward, every micro-batch. ``overlap``: the step's reduction runs while the pipeline rank's last
  backward runs (only what outlasts it is paid, and never less than one layer's share), and
  ZeRO 2/3's per-layer collectives run while the layer's kernels run (only what outlasts that
  computation is paid; the prefetched layer's parameters are one more buffer).
* **optimizer**: AdamW on float32 masters and moments, one fused kernel streaming 28 bytes per
  element held at ``memory_Bps`` (not divided by ``elementwise_fusion``: those bytes are the
  fused kernel's own).
* **memory**: 2 + 2 + 12 bytes per parameter (16-bit weights and gradients; float32 master,
  two moments: the ZeRO paper's accounting), split over ``dp * cp`` by ZeRO's stage; per
  layer and micro-batch the activations of Korthikanti et al. 2022, Table 2 generalised to
  grouped-query attention, SwiGLU, no dropout and fused attention (``activation_bytes``),
  times what the schedule holds in flight on each pipeline rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from simulator.cost import HardwareProfile, collective_time
from simulator.family import ModelShape, stage_layer_counts
from simulator.step_trace import GPTStrategy

BYTES = 2
"""16-bit activations, weights and gradients (mixed precision, float32 masters)."""
STATE_BYTES = {"parameters": 2, "gradients": 2, "optimizer_state": 12}
OPTIMIZER_STREAM_BYTES = 28
"""AdamW reads gradient (2), master, two moments (12) and writes them and the 16-bit weight back."""
BACKWARD_ELEMENTWISE = 1.5


@dataclass(frozen=True)
class FamilyStrategy:
    """How a step is laid out: degrees (``dp x cp x tp`` ranks per stage), pipeline, memory knobs."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    zero: int = 0
    micro_batches: int = 1
    schedule: str = "1F1B"
    chunks: int = 1
    overlap: bool = False
    """Gradient reduction overlapped with the last backward; ZeRO 3 gathers prefetched."""
    cp_comm: str = "allgather"
    """Context parallel keys and values: ``allgather`` or ``ring`` (point-to-point, overlapped)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "micro_batches", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FamilyStrategy {name} must be a positive int, got {value!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"FamilyStrategy recompute must be none, selective or full, got {self.recompute!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"FamilyStrategy zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.cp_comm not in ("allgather", "ring"):
            raise ValueError(f"FamilyStrategy cp_comm must be allgather or ring, got {self.cp_comm!r}")
        object.__setattr__(self, "schedule", _schedule_name(self.schedule, self.chunks))

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def pipeline_strategy(self) -> GPTStrategy:
        """The schedule's description for ``simulator.fast_estimate.pipeline``."""
        return GPTStrategy(pp=self.pp, micro_batches=self.micro_batches, schedule=self.schedule, chunks=self.chunks)

    def mesh_text(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp},cp={self.cp}"


@functools.lru_cache(maxsize=64)
def _schedule_name(schedule: str, chunks: int) -> str:
    """The schedule's canonical name, by its own checks (kind; chunks only with an interleaved one)."""
    name = GPTStrategy(chunks=chunks, schedule=schedule).schedule
    if name not in ("1F1B", "Interleaved1F1B"):
        raise ValueError(f"FamilyStrategy schedule must be 1F1B or Interleaved1F1B, got {schedule!r}")
    return name


def check_layout(shape: ModelShape, st: FamilyStrategy) -> None:
    """``ValueError`` naming what does not divide: heads and key/value heads by tp, the sequence by
    ``2 cp`` (two mirrored chunks per cp rank), the layers over the pipeline stages."""
    if shape.heads % st.tp:
        raise ValueError(f"tp={st.tp} must divide the {shape.heads} attention heads")
    if shape.kv % st.tp and st.tp % shape.kv:
        raise ValueError(f"tp={st.tp} and the {shape.kv} key/value heads must divide one another")
    if st.cp > 1 and shape.seq % (2 * st.cp):
        raise ValueError(f"cp={st.cp}: the sequence ({shape.seq}) must split into 2 x cp equal chunks")
    if st.chunks > 1 and st.micro_batches % st.pp:
        raise ValueError(
            f"the interleaved schedule needs micro-batches ({st.micro_batches}) to be a multiple of pp ({st.pp})"
        )
    if shape.layers < max(1, st.num_stages - 2):
        # The first and the last stage may hold only the embedding and the output layer
        # (``stage_layer_counts``: Llama 3's one-layer chunks); every stage between needs a layer.
        raise ValueError(f"{shape.layers} layers cannot fill pp {st.pp} x chunks {st.chunks} stages")


# ---------------------------------------------------------------------- one layer, one micro-batch
@dataclass(frozen=True)
class Work:
    """Seconds of one part on one rank for one micro-batch."""

    forward: float = 0.0
    backward: float = 0.0
    """Backward compute and exposed communication, recompute included, weight gradients excluded."""
    weight: float = 0.0
    """Weight-gradient GEMMs (what a split-backward schedule can defer, what hides SP collectives)."""
    gemm_flops_forward: float = 0.0
    gemm_flops_backward: float = 0.0
    compute_forward: float = 0.0
    """Forward kernels alone (no communication): what ZeRO's prefetched gathers can hide behind."""
    compute_backward: float = 0.0
    """Backward kernels alone, weight gradients and recompute included."""


def _gemm(hw: HardwareProfile, flops: float) -> float:
    if flops <= 0:
        return 0.0
    return flops / (_peak(hw) * hw.gemm_efficiency(flops))


def _roofline(hw: HardwareProfile, flops: float, nbytes: float) -> float:
    """A GEMM that streams ``nbytes`` through memory takes at least that long."""
    t = _gemm(hw, flops)
    return max(t, nbytes / hw.memory_Bps) if hw.memory_Bps else t


def _peak(hw: HardwareProfile) -> float:
    return float(hw.flops_per_s.get("bfloat16", hw.flops_per_s.get("float16", max(hw.flops_per_s.values()))))


def _stream(hw: HardwareProfile, nbytes: float, kernels: float) -> float:
    """Memory-bound kernels moving ``nbytes`` between them, plus a launch each.

    The bytes are those of the fused kernels the implementations run (one LayerNorm/RMSNorm, one
    bias-GELU or SwiGLU, one bias-dropout-add, one scale-mask-softmax, one Adam step over every
    element), so the profile's ``elementwise_fusion`` -- how many of the *traced* model's
    primitive ops one such kernel replaces -- does not divide them again."""
    bw = hw.memory_Bps
    if bw is None:
        raise ValueError(
            f"hardware profile {hw.name!r} has no memory_Bps: the family model prices elementwise work by it"
        )
    return nbytes / bw + kernels * hw.kernel_launch_s


def _exponentials(hw: HardwareProfile, count: float) -> float:
    """Seconds of ``count`` exponentials in fused attention's softmax: on a GPU they run on the
    special function units (``HardwareProfile.exp_per_s``), 16 per clock per SM against 2048
    (A100) or 4096 (H100) dense 16-bit tensor FLOPs, so at head dim 128 (512 GEMM FLOPs per
    score, forward) they take a quarter (A100) or half (H100) of the GEMMs' time at peak.
    FlashAttention-2 runs a tile's softmax between its two GEMMs, so the time adds; FlashAttention-3
    overlaps them on Hopper (not priced here). No rate in the profile: taken as free."""
    return count / hw.exp_per_s if hw.exp_per_s else 0.0


def _link(hw: HardwareProfile, span: int) -> Any:
    """The link of a group whose ranks lie in aligned blocks of ``span`` consecutive device ids:
    inside a node only when every block fits in one (``span`` divides the node's devices)."""
    per_node = hw.devices_per_node
    return hw.intra_node if per_node is None or (span <= per_node and per_node % span == 0) else hw.inter_node


def _coll(hw: HardwareProfile, op: str, nbytes: float, size: int, span: int) -> float:
    return collective_time(op, nbytes, size, _link(hw, span), hw.reduction_Bps) if size > 1 else 0.0


def local_kv_heads(shape: ModelShape, tp: int) -> int:
    """Key/value heads on one tensor-parallel rank: split while there are enough, else one (replicated)."""
    return max(shape.kv // tp, 1)


def activation_bytes(shape: ModelShape, st: FamilyStrategy) -> int:
    """Bytes one layer keeps for backward, one micro-batch, one rank (Korthikanti et al. 2022,
    Table 2: ``s b h (34 + 5 a s / h)`` for GPT without parallelism; sequence parallelism splits
    the ``10 s b h`` of norms, dropout masks and GEMM inputs, tensor parallelism the rest)."""
    h, tp = shape.hidden, st.tp
    t = shape.micro_batch_size * shape.seq // st.cp  # local tokens
    t_sp = t // tp if st.sequence_parallel else t
    if st.recompute == "full":
        return BYTES * h * t_sp  # the layer's input, the only tensor kept
    drop = shape.dropout_rate > 0
    # Sequence-split region: both norms' inputs, the q/k/v and MLP GEMMs' inputs, dropout masks.
    seq_region = 2 * BYTES * h + 2 * BYTES * h + (2 * h if drop else 0)
    heads = shape.heads // tp
    kv_width = local_kv_heads(shape, tp) * shape.head_dim
    q_width = h // tp
    f = shape.ffn // tp
    per_token = BYTES * (q_width + 2 * kv_width)  # q, k, v
    per_token += BYTES * q_width  # attention output = o's input
    if shape.mlp == "swiglu":
        per_token += BYTES * (2 * f + f)  # gate and up outputs, their product (down's input)
    else:
        per_token += BYTES * (f + f)  # fc1 output (GELU's input), GELU's output (fc2's input)
    if shape.attention == "fused":
        per_token += 4 * heads  # float32 log-sum-exp per head
    elif st.recompute != "selective":
        s = shape.seq
        per_token += BYTES * heads * s  # softmax output
        if drop:
            per_token += heads * s + BYTES * heads * s  # its dropout mask and output
    return seq_region * t_sp + per_token * t


_LAYER_CACHE: dict[tuple[object, ...], tuple[HardwareProfile, Work]] = {}


def layer_costs(shape: ModelShape, st: FamilyStrategy, hw: HardwareProfile) -> Work:
    """One layer, one micro-batch, one rank (module docstring): it depends on the shape (its
    micro-batch size), ``tp``, ``cp`` (and its communication), sequence parallelism and recompute only, so the search's
    candidates share it (kept per profile object; the entry holds the profile, so its id is not
    reused meanwhile)."""
    key = (shape, st.tp, st.cp, st.cp_comm, st.sequence_parallel and st.tp > 1, st.recompute, id(hw))
    hit = _LAYER_CACHE.get(key)
    if hit is not None and hit[0] is hw:
        return hit[1]
    if len(_LAYER_CACHE) >= 65536:
        _LAYER_CACHE.clear()
    work = _layer_costs(shape, st, hw)
    _LAYER_CACHE[key] = (hw, work)
    return work


def layer_messages(shape: ModelShape, st: FamilyStrategy) -> dict[str, int]:
    """Bytes of each collective one layer issues per micro-batch (``collective_time``'s sizes):
    ``tp``: the ``t x h`` activation each tensor-parallel collective moves (whole, 16-bit);
    ``cp``: the keys and values of the whole sequence each context-parallel all-gather (and the
    gradients' reduce-scatter) moves; ``zero``: one layer's parameters on a tensor-parallel rank
    (ZeRO 2/3's per-layer gathers and reduce-scatters)."""
    t = shape.micro_batch_size * shape.seq // st.cp
    kv_width = local_kv_heads(shape, st.tp) * shape.head_dim
    return {
        "tp": BYTES * t * shape.hidden,
        "cp": 2 * BYTES * shape.micro_batch_size * shape.seq * kv_width,
        "zero": BYTES * layer_parameters_local(shape, st.tp),
    }


def _layer_costs(shape: ModelShape, st: FamilyStrategy, hw: HardwareProfile) -> Work:
    h, s, tp, cp = shape.hidden, shape.seq, st.tp, st.cp
    t = shape.micro_batch_size * s // cp
    sp = st.sequence_parallel and tp > 1
    t_sp = t // tp if sp else t
    heads = shape.heads // tp
    hd = shape.head_dim
    kv_width = local_kv_heads(shape, tp) * hd
    f = shape.ffn // tp
    up = 2 * f if shape.mlp == "swiglu" else f
    gemms = [2 * t * h * (h // tp + 2 * kv_width), 2 * t * (h // tp) * h, 2 * t * h * up, 2 * t * f * h]
    gemm_f = sum(_gemm(hw, x) for x in gemms)
    # Attention core: two batched GEMMs over the local heads; queries t, keys the whole sequence.
    # The scores and their weighted sum: batched GEMMs over (sequence, head) pairs, each of
    # inner size ``head_dim``: plain attention writes and reads the s x s scores through memory
    # (a roofline on those bytes); fused attention keeps its tiles on chip.
    core_flops = 4.0 * t * s * hd * heads
    pairs = shape.micro_batch_size * heads
    if shape.attention == "fused":
        # Causal blocks only. Each score computed takes one exponential on the special function
        # units, beside the tile's two GEMMs, which wait for it (``_exponentials``); backward
        # recomputes the scores' exponentials once, then dV, dP, dQ, dK.
        core_gemm = _gemm(hw, core_flops / 2)
        exps = _exponentials(hw, core_flops / 2 / (4 * hd))
        core_f = core_gemm + exps
        core_b = 2.5 * core_gemm + exps
    else:
        q = s // cp  # the local queries of one sequence
        scores = BYTES * pairs * (q * s)  # one q x s matrix per (sequence, head) written, one read
        qkv_bytes = BYTES * pairs * hd * (q + 2 * s)
        core_f = 2 * _roofline(hw, core_flops / 2, scores + qkv_bytes)
        core_b = 2 * core_f
    # Elementwise bytes, forward: sequence-split region and tensor-split region.
    # Each is one kernel's traffic per token: the norms read x and write y (4h bytes); the residual
    # adds read two and write one (6h), or with dropout Megatron's fused bias-dropout-add, which
    # also writes the 1-byte mask (7h).
    seq_bytes = 2 * 4 * h + 2 * (7 if shape.dropout_rate > 0 else 6) * h
    seq_kernels = 2 + 2
    tp_bytes = (3 * f if shape.mlp == "swiglu" else 2 * f) * BYTES  # the activation: read up (gate, up), write
    tp_kernels = 1
    if shape.norm == "rmsnorm":  # rotary on q and k
        tp_bytes += 2 * BYTES * (h // tp + kv_width)
        tp_kernels += 1
    core_bytes = 0.0
    core_kernels = 0
    if shape.attention == "plain":
        core_bytes = 2 * BYTES * heads * s  # scale + mask + softmax
        core_kernels = 1
        if shape.dropout_rate > 0:
            core_bytes += 2 * BYTES * heads * s + heads * s
            core_kernels += 1
    elem_f = _stream(hw, seq_bytes * t_sp + tp_bytes * t, seq_kernels + tp_kernels)
    core_elem_f = _stream(hw, core_bytes * t, core_kernels)
    launches = 6 * hw.kernel_launch_s  # four GEMMs and the attention core's two
    # Tensor-parallel collectives of the t x h activation.
    messages = layer_messages(shape, st)
    act = messages["tp"]

    if tp > 1 and sp:
        tp_f = 2 * (_coll(hw, "all_gather", act, tp, tp) + _coll(hw, "reduce_scatter", act, tp, tp))
        tp_b = tp_f + 2 * _coll(hw, "all_gather", act, tp, tp)  # and the re-gather of the GEMM inputs
    else:
        tp_f = 2 * _coll(hw, "all_reduce", act, tp, tp)
        tp_b = tp_f
    # Context-parallel gathers of k and v (all tokens of the local sequences) and their gradients.
    kv = messages["cp"]
    if st.cp_comm == "ring" and cp > 1:
        send = collective_time("send", kv / cp, 2, _link(hw, tp * cp))  # one rank's block to the next
        cp_f = (cp - 1) * max(0.0, send - core_f / cp)
        cp_b = (cp - 1) * max(0.0, 2 * send - core_b / cp) + send
    else:
        cp_f = _coll(hw, "all_gather", kv, cp, tp * cp)
        cp_b = cp_f + _coll(hw, "reduce_scatter", kv, cp, tp * cp)

    compute_f = gemm_f + core_f + elem_f + core_elem_f + launches
    forward = compute_f + tp_f + cp_f
    weight = gemm_f
    compute_b = gemm_f + core_b + BACKWARD_ELEMENTWISE * (elem_f + core_elem_f) + launches
    backward = compute_b + tp_b + cp_b
    if st.recompute == "full":
        backward += forward
        compute_b += compute_f
    elif st.recompute == "selective" and shape.attention == "plain":
        backward += core_f + core_elem_f
        compute_b += core_f + core_elem_f
    gflops_f = sum(gemms) + (core_flops / 2 if shape.attention == "fused" else core_flops)
    gflops_b = sum(gemms) + (2.5 * core_flops / 2 if shape.attention == "fused" else 2 * core_flops)
    return Work(forward, backward, weight, gflops_f, gflops_b, compute_f, compute_b + weight)


@functools.lru_cache(maxsize=65536)
def layer_parameters_local(shape: ModelShape, tp: int) -> int:
    """One layer's parameters on one tensor-parallel rank (norms replicated, key/value heads
    replicated when ``tp`` exceeds them)."""
    h, f = shape.hidden, shape.ffn // tp
    kv_width = local_kv_heads(shape, tp) * shape.head_dim
    n = 2 * h * (h // tp) + 2 * h * kv_width + (3 if shape.mlp == "swiglu" else 2) * h * f
    n += 2 * (2 * h if shape.norm == "layernorm" else h)
    if shape.gpt_style:
        n += h // tp + 2 * kv_width + h + (2 * f if shape.mlp == "swiglu" else f) + h
    return n


def _ends_work(shape: ModelShape, st: FamilyStrategy, hw: HardwareProfile) -> tuple[Work, Work]:
    """The embedding (first stage) and the final norm, output layer and loss (last stage)."""
    h, v, tp = shape.hidden, shape.vocab, st.tp
    t = shape.micro_batch_size * shape.seq // st.cp
    sp = st.sequence_parallel and tp > 1
    t_sp = t // tp if sp else t
    act = BYTES * t * h
    # Embedding: a vocabulary-parallel lookup, then its all-reduce (reduce-scatter under SP).
    emb_comm = _coll(hw, "reduce_scatter" if sp else "all_reduce", act, tp, tp)
    emb = _stream(hw, 2 * BYTES * h * t_sp, 1)
    first = Work(forward=emb + emb_comm, backward=BACKWARD_ELEMENTWISE * emb + emb_comm)
    # Output layer on the gathered activation, then a vocabulary-parallel float32 cross entropy.
    out_flops = 2.0 * t * h * (v // tp)
    gemm = _gemm(hw, out_flops)
    gather = _coll(hw, "all_gather", act, tp, tp) if sp else 0.0
    loss = _stream(hw, 3 * 4 * t * (v // tp) + 4 * BYTES * h * t_sp, 3)
    last = Work(
        forward=gemm + gather + loss,
        backward=gemm + gather + BACKWARD_ELEMENTWISE * loss,
        weight=gemm,
        gemm_flops_forward=out_flops,
        gemm_flops_backward=2 * out_flops,
    )
    return first, last


# ---------------------------------------------------------------------- the pipeline
@dataclass(frozen=True)
class ScheduleTimes:
    makespan: float
    ends: tuple[float, ...]
    """Per pipeline rank: when its last backward ends."""
    in_flight: tuple[int, ...]
    """Per pipeline rank: activation bytes held at once."""
    bubble: float


def schedule_times(
    st: FamilyStrategy, fwd: list[float], bwd: list[float], sends: list[float], act: tuple[int, ...]
) -> ScheduleTimes:
    """The pipeline's makespan, each rank's end and its activations in flight, in closed form.

    1F1B over stages of forward ``f_s`` and backward ``b_s`` seconds per micro-batch: the first
    micro-batch crosses every stage forward and back, and the slowest stage paces the other
    ``m - 1``: ``sum f + sum b + (m - 1) max(f + b)``, plus a send each way per boundary (exact
    for even stages: ``(m + p - 1)(f + b)``, Narayanan et al. 2021, section 2.2.1). The
    interleaved schedule (``v`` chunks per rank, ``m`` a multiple of ``p``): the busiest rank's
    ``m`` rounds of its chunks plus a bubble of ``p - 1`` chunk times (their ``(p - 1)(t_f +
    t_b) / v``), plus a send each way per boundary too: the first micro-batch crosses all
    ``p v - 1`` boundaries between virtual stages before the pipeline is full (chunk ``c`` on
    the last rank sends to chunk ``c + 1`` on the first), and its gradient all of them back
    (the simulator's extra time is exactly ``2 (p v - 1)`` sends while a send is short of the
    schedule's slack; counting ``p - 1`` of them undercharged one-layer chunks by 2%). Rank
    ``k`` finishes when the last backward has drained from it to rank 0, so earlier by the
    backward of the stages before it. In flight: 1F1B's rank ``k`` holds
    ``min(m, p - k)`` micro-batches; the interleaved rank ``k`` ``2 (p - k - 1) + (v - 1) p + 1``
    chunk activations (Megatron-LM's warm-up), at most ``m v``.
    ``tests/test_family.py`` checks both against ``simulator.schedule_sim`` on even stages.
    """
    p, v, m = st.pp, st.chunks, st.micro_batches
    n = p * v
    work = [f + b for f, b in zip(fwd, bwd, strict=True)]
    if v == 1:
        makespan = sum(fwd) + sum(bwd) + (m - 1) * max(work) + 2 * sum(sends)
    else:
        lane_work = [sum(work[s] for s in range(k, n, p)) for k in range(p)]
        makespan = m * max(lane_work) + (p - 1) * max(work) + 2 * sum(sends)
    ends = []
    drained = 0.0
    for k in range(p):
        ends.append(makespan - drained)
        drained += bwd[k] + (sends[k] if k < len(sends) else 0.0)
    flight = in_flight(st, act)
    busy = m * sum(work)
    bubble = 1.0 - busy / (p * makespan) if makespan > 0 else 0.0
    return ScheduleTimes(makespan, tuple(ends), flight, bubble)


# ---------------------------------------------------------------------- the step
@dataclass
class FamilyEstimate:
    shape: ModelShape
    strategy: FamilyStrategy
    hardware: str
    step_time_s: float
    pipeline_s: float
    bubble_fraction: float
    tail_s: list[float]
    layers_per_stage: list[int]
    stage_seconds: list[dict[str, float]]
    """Per (virtual) stage, one micro-batch: forward, backward_input, backward_weight."""
    state_bytes_per_lane: list[int]
    activation_bytes_per_lane: list[int]
    activation_bytes_per_layer: int
    model_flops: float
    hardware_flops: float
    peak_flops_per_device: float
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def peak_bytes_per_lane(self) -> list[int]:
        return [s + a for s, a in zip(self.state_bytes_per_lane, self.activation_bytes_per_lane, strict=True)]

    @property
    def peak_bytes(self) -> int:
        return max(self.peak_bytes_per_lane)

    @property
    def tokens_per_step(self) -> int:
        st = self.strategy
        return self.shape.micro_batch_size * st.micro_batches * st.dp * self.shape.seq

    def utilization(self, flops: float) -> float:
        return flops / (self.step_time_s * self.peak_flops_per_device * self.strategy.world_size)

    @property
    def mfu(self) -> float:
        return self.utilization(self.model_flops)

    @property
    def tflops_per_device(self) -> float:
        """Model FLOP/s per device in TFLOP/s (how published runs quote throughput)."""
        return self.model_flops / self.step_time_s / self.strategy.world_size / 1e12

    def to_dict(self) -> dict[str, Any]:
        st, sh = self.strategy, self.shape
        world = st.world_size
        return {
            "format": "mpipar.estimate",
            "version": 1,
            "model": {
                "layers": sh.layers,
                "hidden": sh.hidden,
                "heads": sh.heads,
                "kv_heads": sh.kv,
                "ffn_hidden": sh.ffn,
                "mlp": sh.mlp,
                "norm": sh.norm,
                "untied": sh.untied,
                "attention": sh.attention,
                "seq": sh.seq,
                "vocab": sh.vocab,
                "micro_batch_size": sh.micro_batch_size,
                "dropout": sh.dropout,
                "parameters": sh.parameters,
            },
            "strategy": {
                "dp": st.dp,
                "tp": st.tp,
                "pp": st.pp,
                "cp": st.cp,
                "sequence_parallel": st.sequence_parallel,
                "recompute": st.recompute,
                "zero": st.zero,
                "micro_batches": st.micro_batches,
                "schedule": st.schedule,
                "chunks": st.chunks,
                "overlap": st.overlap,
            },
            "hardware": self.hardware,
            "world_size": world,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "hfu": self.utilization(self.hardware_flops),
            "tflops_per_device": self.tflops_per_device,
            "model_flops_per_step": self.model_flops,
            "hardware_flops_per_step": self.hardware_flops,
            "tokens_per_s": self.tokens_per_step / self.step_time_s,
            # Every rank of a pipeline rank's dp x cp x tp block holds the same bytes.
            "peak_bytes_per_rank": [self.peak_bytes_per_lane[r // (world // st.pp)] for r in range(world)]
            if world <= 65536
            else None,
            "peak_bytes_per_pipeline_rank": self.peak_bytes_per_lane,
            "activation_bytes_per_layer": self.activation_bytes_per_layer,
            "layers_per_stage": self.layers_per_stage,
            "pipeline": {
                "schedule": st.schedule,
                "num_stages": st.num_stages,
                "micro_batches": st.micro_batches,
                "pipeline_s": self.pipeline_s,
                "bubble_fraction": self.bubble_fraction,
                "tail_s": self.tail_s,
            },
            "stages": self.stage_seconds,
            "breakdown_ms": {k: 1e3 * v for k, v in self.breakdown.items()},
        }

    def summary(self) -> str:
        st, gib = self.strategy, 2.0**30
        opts = [f"dp {st.dp} x cp {st.cp} x tp {st.tp} x pp {st.pp} ({st.world_size} devices)"]
        if st.chunks > 1:
            opts.append(f"{st.chunks} chunks per pipeline rank")
        if st.sequence_parallel:
            opts.append("sequence parallel")
        opts.append(f"recompute {st.recompute}")
        if st.zero:
            opts.append(f"ZeRO-{st.zero}")
        if st.overlap:
            opts.append("overlapped gradient reduction" + (" and prefetched gathers" if st.zero == 3 else ""))
        lines = [
            self.shape.describe(),
            f"batch: {self.shape.micro_batch_size} x dp {st.dp} x {st.micro_batches} micro-batches = "
            f"{self.tokens_per_step // self.shape.seq} sequences ({self.tokens_per_step:,} tokens) per step",
            "strategy: " + ", ".join(opts) + f"; {st.schedule}",
            f"hardware: {self.hardware}",
            f"layers per stage: {_runs(self.layers_per_stage)}",
            "",
            f"{'pp rank':>7} {'state GiB':>9} {'activations GiB':>15} {'peak GiB':>8}",
        ]
        for k in range(st.pp):
            lines.append(
                f"{k:>7} {self.state_bytes_per_lane[k] / gib:>9.2f} {self.activation_bytes_per_lane[k] / gib:>15.2f} "
                f"{self.peak_bytes_per_lane[k] / gib:>8.2f}"
            )
        lines += [
            "",
            f"step time {self.step_time_s:.4g} s: pipeline {self.pipeline_s:.4g} s (bubble {self.bubble_fraction:.3f}), "
            f"then gradient reduction + optimizer up to {max(self.tail_s):.4g} s; "
            f"{self.tokens_per_step / self.step_time_s:,.0f} tokens/s",
            f"MFU {self.mfu:.1%}, HFU {self.utilization(self.hardware_flops):.1%}, "
            f"{self.tflops_per_device:.0f} TFLOP/s per device (model FLOPs {self.model_flops:.4g} per step; "
            f"peak {self.peak_flops_per_device / 1e12:.4g} TFLOP/s)",
            f"peak memory {self.peak_bytes / gib:.2f} GiB per device (pipeline rank "
            f"{self.peak_bytes_per_lane.index(self.peak_bytes)})",
        ]
        return "\n".join(lines)


def _runs(counts: list[int]) -> str:
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j + 1 < len(counts) and counts[j + 1] == counts[i]:
            j += 1
        out.append(f"{counts[i]}" if i == j else f"{counts[i]} x{j - i + 1}")
        i = j + 1
    return ", ".join(out)


def hardware_flops_per_token(shape: ModelShape, st: FamilyStrategy) -> float:
    """What the devices execute per token: the model FLOPs with fused attention's causal half
    and backward recompute, and what recompute adds."""
    h, s = shape.hidden, shape.seq
    mats = 2 * shape.layer_matrix_weights
    core = 4.0 * s * h
    core_total = core / 2 * (1 + 2.5) if shape.attention == "fused" else 3 * core
    per_layer = 3 * mats + core_total
    if st.recompute == "full":
        per_layer += mats + (core / 2 if shape.attention == "fused" else core)
    elif st.recompute == "selective" and shape.attention == "plain":
        per_layer += core
    return shape.layers * per_layer + 6.0 * shape.vocab * h


@dataclass(frozen=True)
class Memory:
    """Per pipeline rank: model state and the activations its schedule holds at once (bytes)."""

    state: tuple[int, ...]
    activations: tuple[int, ...]
    activation_per_layer: int
    stage_activations: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max(s + a for s, a in zip(self.state, self.activations, strict=True))


@functools.lru_cache(maxsize=65536)
def _lane_parameters(shape: ModelShape, tp: int, pp: int, chunks: int) -> tuple[int, ...]:
    """Parameters each pipeline rank holds on one tensor-parallel rank (before ZeRO's split)."""
    counts = _counts(shape.layers, pp, chunks)
    p_layer = layer_parameters_local(shape, tp)
    n = pp * chunks
    emb = shape.vocab * shape.hidden // tp + (shape.seq * shape.hidden if shape.gpt_style else 0)
    out = (2 if shape.norm == "layernorm" else 1) * shape.hidden
    if shape.untied or n > 1:  # a tied output layer on another stage keeps a copy of the embedding
        out += shape.vocab * shape.hidden // tp
    lanes = [sum(counts[k::pp]) * p_layer for k in range(pp)]
    lanes[0] += emb
    lanes[(n - 1) % pp] += out
    return tuple(lanes)


def memory(shape: ModelShape, st: FamilyStrategy, *, checked: bool = False) -> Memory:
    """Model state and activations per pipeline rank (module docstring); no hardware needed.
    ``checked``: the layout is known to divide (the search enumerates only such)."""
    if not checked:
        check_layout(shape, st)
    state = state_bytes(shape, st.tp, st.pp, st.chunks, st.dp * st.cp, st.zero, st.overlap)
    per_layer, act = _stage_activations(shape, st.tp, st.cp, st.sequence_parallel, st.recompute, st.pp, st.chunks)
    return Memory(state, in_flight(st, act), per_layer, act)


@functools.lru_cache(maxsize=65536)
def state_bytes(
    shape: ModelShape, tp: int, pp: int, chunks: int, replicas: int, zero: int, overlap: bool
) -> tuple[int, ...]:
    """Model state per pipeline rank: 2 + 2 + 12 bytes per parameter held, split over the
    ``replicas = dp * cp`` ranks that share the weights by ZeRO's stage, plus ZeRO 3's gathered
    layer (and the prefetched next one, with ``overlap``) and its gradient."""
    d = replicas
    per_param = (
        STATE_BYTES["parameters"] / (d if zero >= 3 else 1)
        + STATE_BYTES["gradients"] / (d if zero >= 2 else 1)
        + STATE_BYTES["optimizer_state"] / (d if zero >= 1 else 1)
    )
    gathered = 0
    if zero == 3 and d > 1:
        gathered = (2 if overlap else 1) * (STATE_BYTES["parameters"] + STATE_BYTES["gradients"])
        gathered *= layer_parameters_local(shape, tp)
    return tuple(round(n * per_param) + gathered for n in _lane_parameters(shape, tp, pp, chunks))


@functools.lru_cache(maxsize=4096)
def _counts(layers: int, pp: int, chunks: int) -> tuple[int, ...]:
    return tuple(stage_layer_counts(layers, pp, chunks))


@functools.lru_cache(maxsize=65536)
def _stage_activations(
    shape: ModelShape, tp: int, cp: int, sp: bool, recompute: str, pp: int, chunks: int
) -> tuple[int, tuple[int, ...]]:
    st = FamilyStrategy(tp=tp, cp=cp, sequence_parallel=sp, recompute=recompute)
    per_layer = activation_bytes(shape, st)
    first_act, last_act = _ends_activations(shape, st)
    act = [c * per_layer for c in _counts(shape.layers, pp, chunks)]
    act[0] += first_act
    act[-1] += last_act
    return per_layer, tuple(act)


def in_flight(st: FamilyStrategy, act: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Activation bytes each pipeline rank holds at once (``schedule_times``): 1F1B's rank ``k``
    ``min(m, p - k)`` micro-batches of its stage; the interleaved rank the peak of
    ``interleaved_peak`` over its chunks' own sizes."""
    p, v, m = st.pp, st.chunks, st.micro_batches
    out = []
    for k in range(p):
        mine = act[k::p]
        if v == 1:
            out.append(min(m, p - k) * mine[0])
        else:
            out.append(interleaved_peak(p, v, m, k, tuple(mine)))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def interleaved_peak(p: int, v: int, m: int, k: int, sizes: tuple[int, ...]) -> int:
    """The most activation bytes rank ``k`` of an interleaved pipeline holds at once, its chunk
    ``c`` keeping ``sizes[c]`` bytes per micro-batch (``m`` a multiple of ``p``).

    Megatron-LM's order (``mpipar.pipeline.schedule.interleaved``): forward ``j`` of the rank
    runs chunk ``(j // p) % v``, backward ``j`` chunk ``v - 1 - (j // p) % v``; the rank warms up
    with ``W = (v - 1) p + 2 (p - 1 - k)`` forwards, then runs one forward and one backward at a
    time. After its ``i``-th steady forward it holds forwards ``0 .. W + i`` less backwards
    ``0 .. i - 1``: ``W + 1`` chunk activations, but not ``W + 1`` of the largest chunk -- which
    chunks they are follows from the order. Where the chunks differ (the first and last ranks'
    embedding and output layer, uneven layer splits) that is the peak; counting every held
    chunk at the rank's largest (``W + 1`` times ``max(sizes)``) overstates the first rank's
    memory whenever its first chunk is the lighter one. The count repeats every ``p v`` steps
    (both orders take ``p`` more of every chunk), so one period is scanned.
    """
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple of pp ({p})")
    total = m * v
    warm = min(total, (v - 1) * p + 2 * (p - 1 - k))
    if min(sizes) == max(sizes):
        return min(total, warm + 1) * sizes[0]
    period = p * v

    def taken(n: int, c: int) -> int:  # of the first n of the order, how many run chunk c
        return (n // period) * p + min(max(n % period - c * p, 0), p)

    best = 0
    for i in range(max(1, min(total - warm, period))):
        n = min(total, warm + 1 + i)
        best = max(best, sum(sizes[c] * (taken(n, c) - taken(i, v - 1 - c)) for c in range(v)))
    return best


def _ends_activations(shape: ModelShape, st: FamilyStrategy) -> tuple[int, int]:
    """Bytes the embedding (first stage) and the final norm, output layer and loss (last stage)
    keep for one micro-batch."""
    h, v, tp = shape.hidden, shape.vocab, st.tp
    t = shape.micro_batch_size * shape.seq // st.cp
    t_sp = t // tp if st.sequence_parallel and tp > 1 else t
    first = (t_sp if shape.dropout_rate > 0 else 0) * h  # the embedding's dropout mask
    last = BYTES * h * t_sp + BYTES * h * t + 4 * t * (v // tp)  # norm input, head input, float32 logits
    return first, last


@functools.lru_cache(maxsize=4096)
def _busiest(layers: int, pp: int, chunks: int) -> int:
    counts = _counts(layers, pp, chunks)
    return max(sum(counts[k::pp]) for k in range(pp))


def busiest_lane_layers(shape: ModelShape, st: FamilyStrategy) -> int:
    return _busiest(shape.layers, st.pp, st.chunks)


def step_time_lower_bound(shape: ModelShape, st: FamilyStrategy, hw: HardwareProfile) -> float:
    """``price(...).step_time_s`` is never below this: the busiest pipeline rank computes each of
    its layers for every micro-batch, one at a time (ends, bubble, sends and tails only add)."""
    layer = layer_costs(shape, st, hw)
    return st.micro_batches * busiest_lane_layers(shape, st) * (layer.forward + layer.backward + layer.weight)


def price(shape: ModelShape, st: FamilyStrategy, hw: HardwareProfile) -> FamilyEstimate:
    """The step of ``shape`` (its micro-batch size) under ``st`` on ``hw`` (module docstring)."""
    mem = memory(shape, st)
    counts = list(_counts(shape.layers, st.pp, st.chunks))
    layer = layer_costs(shape, st, hw)
    first, last = _ends_work(shape, st, hw)
    d = st.dp * st.cp  # ranks that hold the same weights
    block = st.dp * st.cp * st.tp  # ranks per pipeline stage
    p_layer = layer_parameters_local(shape, st.tp)

    # ZeRO 3: every layer's parameters gathered forward and backward, gradients reduce-scattered,
    # every micro-batch; ZeRO 2: the gradients reduce-scattered every micro-batch (a sharded
    # gradient cannot accumulate a full one).
    z_f = z_b = 0.0
    if st.zero >= 2 and d > 1:
        gather = _coll(hw, "all_gather", BYTES * p_layer, d, block) if st.zero == 3 else 0.0
        scatter = _coll(hw, "reduce_scatter", BYTES * p_layer, d, block)
        if st.overlap:
            z_f = max(0.0, gather - layer.compute_forward)
            z_b = max(0.0, gather + scatter - layer.compute_backward)
        else:
            z_f, z_b = gather, gather + scatter

    n = st.num_stages
    lf, lw = layer.forward + z_f, layer.weight
    lb = layer.backward + z_b
    fwd = [c * lf for c in counts]
    b_w = [c * lw for c in counts]
    b_in = [c * lb for c in counts]
    for s, w in ((0, first), (n - 1, last)):
        fwd[s] += w.forward
        b_w[s] += w.weight
        b_in[s] += w.backward
    # Each tensor-parallel rank sends its 1/tp of the activation (split by sequence parallelism,
    # or Narayanan et al. 2021's scatter/gather: every rank of the group holds it whole, sends a
    # slice over its own NIC and the receivers all-gather the slices over NVLink).
    whole = BYTES * shape.micro_batch_size * (shape.seq // st.cp) * shape.hidden
    regather = 0.0 if st.sequence_parallel and st.tp > 1 else _coll(hw, "all_gather", whole, st.tp, st.tp)
    per_node = hw.devices_per_node
    sends = []
    for s in range(1, n):
        a, b = ((s - 1) % st.pp) * block, (s % st.pp) * block
        if a == b:
            sends.append(0.0)
            continue
        link = hw.intra_node if per_node is None or a // per_node == b // per_node else hw.inter_node
        sends.append(collective_time("send", whole / st.tp, 2, link) + regather)
    bwd = [b + w for b, w in zip(b_in, b_w, strict=True)]
    pipe = schedule_times(st, fwd, bwd, sends, mem.stage_activations)

    # Per pipeline rank: gradient reduction and optimizer.
    tails = []
    lane_params = _lane_parameters(shape, st.tp, st.pp, st.chunks)
    for k in range(st.pp):
        params = lane_params[k]
        sync = 0.0
        if st.zero < 2:  # ZeRO 0: all-reduce; ZeRO 1: reduce-scatter + all-gather, the same bytes
            sync = _coll(hw, "all_reduce", BYTES * params, d, block)
        elif st.zero == 2:  # the updated parameters gathered
            sync = _coll(hw, "all_gather", BYTES * params, d, block)
        if st.overlap and sync > 0 and st.zero < 2:
            last_backward = sum(bwd[k :: st.pp])
            layers_here = max(1, sum(counts[k :: st.pp]))
            sync = max(sync / layers_here, sync - last_backward)
        if not shape.untied and n > 1 and k in (0, (n - 1) % st.pp):
            sync += _coll(hw, "all_reduce", BYTES * shape.vocab * shape.hidden // st.tp, 2, 2 * block)
        held = params / (d if st.zero >= 1 else 1)
        tails.append(sync + _stream(hw, OPTIMIZER_STREAM_BYTES * held, 1))
    step = max(e + t for e, t in zip(pipe.ends, tails, strict=True))
    tokens = shape.micro_batch_size * st.micro_batches * st.dp * shape.seq
    breakdown = {
        "layer_forward": layer.forward,
        "layer_backward": layer.backward + layer.weight,
        "zero_exposed_per_layer": z_f + z_b,
    }
    return FamilyEstimate(
        shape,
        st,
        hw.name,
        step,
        pipe.makespan,
        pipe.bubble,
        tails,
        counts,
        [{"forward": fwd[s], "backward_input": b_in[s], "backward_weight": b_w[s]} for s in range(n)],
        list(mem.state),
        list(mem.activations),
        mem.activation_per_layer,
        shape.model_flops_per_token * tokens,
        hardware_flops_per_token(shape, st) * tokens,
        _peak(hw),
        breakdown,
    )
