"""Paddle fleet (seed 001) in the simulator: one thread per rank, against one device.

The strategy's checks (each error names the key and the value), the 4-D topology and every
getter of the hybrid communicate group on 16 ranks, each tensor-parallel layer against its
dense twin in float64 (outputs, weight and input gradients), the optimizer's reductions,
sharding, clipping and merge against a dense optimizer, the pipeline's errors, and the seed
example's losses in every launch mode against one device.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import environ, run_python

import mpipar as dist
from mpipar.compat.fleet import base
from mpipar.compat.fleet.meta_parallel.pp_layers import segment_uniform
from mpipar.compat.fleet.optimizer import partition_parameters
from mpipar.distributed import fleet
from mpipar.distributed.fleet.meta_parallel import (
    ColumnParallelLinear,
    LayerDesc,
    ParallelCrossEntropy,
    PipelineLayer,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from simulator.launch import uses_manual_api
from simulator.per_rank import PerRankBackend, run_per_rank

LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)


@pytest.fixture(autouse=True)
def _fresh_fleet() -> Iterator[None]:
    base._states.clear()
    yield
    base._states.clear()


def per_rank(n: int, program: Callable[[int], Any]) -> dict[int, Any]:
    """``program(rank)`` as the program of each of ``n`` virtual ranks; their results by rank."""
    backend = PerRankBackend(n)
    results: dict[int, Any] = {}
    with dist.use_backend(backend):
        backend.world.run(lambda: results.__setitem__(dist.get_rank(), program(dist.get_rank())))
    return results


def recorded(rank: int) -> Any:
    """A ``CommDebugMode`` on rank 0 only: the threads of per-rank programs share the process's
    recorders, so one recorder hears the world; ``rank0_counts`` keeps rank 0's collectives."""
    return dist.CommDebugMode() if rank == 0 else contextlib.nullcontext()


def rank0_counts(mode: Any) -> dict[str, int]:
    if mode is None:
        return {}
    counts: dict[str, int] = {}
    for e in mode.events:
        if 0 in e.ranks:
            counts[e.op] = counts.get(e.op, 0) + 1
    return counts


def init(dp: int = 1, pp: int = 1, sh: int = 1, mp: int = 1, **configs: Any) -> fleet.HybridCommunicateGroup:
    """``fleet.init`` with these degrees (``sh``: sharding) and strategy attributes ``configs``."""
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": dp, "pp_degree": pp, "sharding_degree": sh, "mp_degree": mp}
    for name, value in configs.items():
        setattr(s, name, value)
    fleet.init(is_collective=True, strategy=s)
    return fleet.get_hybrid_communicate_group()


# ---------------------------------------------------------------------- strategy checks
@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ({"mp_degree": 0}, "strategy.hybrid_configs['mp_degree'] = 0: must be a positive int"),
        ({"pp_degree": "2"}, "strategy.hybrid_configs['pp_degree'] = '2': must be a positive int"),
        ({"sharding_degree": True}, "strategy.hybrid_configs['sharding_degree'] = True: must be a positive int"),
        ({"dp_degree": -2}, "strategy.hybrid_configs['dp_degree'] = -2: must be a positive int (or -1"),
        ({"tp_degree": 2}, "strategy.hybrid_configs: unknown key 'tp_degree'"),
    ],
)
def test_hybrid_configs_refuse_bad_values_naming_key_and_value(configs: dict[str, Any], message: str) -> None:
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=re.escape(message)):
        s.hybrid_configs = configs


def test_other_configs_are_checked_on_assignment() -> None:
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=re.escape("strategy.sharding_configs['stage'] = 3")):
        s.sharding_configs = {"stage": 3}
    with pytest.raises(ValueError, match=re.escape("strategy.sharding_configs['segment_broadcast_MB'] = 0")):
        s.sharding_configs = {"segment_broadcast_MB": 0}
    with pytest.raises(ValueError, match=re.escape("strategy.pipeline_configs['schedule_mode'] = 'GPipe'")):
        s.pipeline_configs = {"schedule_mode": "GPipe"}
    with pytest.raises(ValueError, match=re.escape("strategy.pipeline_configs['micro_batch_size'] = 0")):
        s.pipeline_configs = {"micro_batch_size": 0}
    with pytest.raises(ValueError, match=re.escape("strategy.sharding = 1: must be True or False")):
        s.sharding = 1
    with pytest.raises(AttributeError, match=re.escape("DistributedStrategy.amp = True: not a switch fleet supports")):
        s.amp = True
    with pytest.raises(TypeError, match=re.escape("strategy.hybrid_configs must be a dict")):
        s.hybrid_configs = [("dp_degree", 2)]


def test_assignments_merge_and_both_spellings_resolve() -> None:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2}
    s.hybrid_configs = {"pp_degree": 2}  # merged: mp stays 2
    assert s.hybrid_configs == {"dp_degree": -1, "pp_degree": 2, "sharding_degree": 1, "mp_degree": 2}
    r = s.resolved()
    assert (r.dp_degree, r.pp_degree, r.sharding_degree, r.mp_degree) == (-1, 2, 1, 2)
    seed = fleet.DistributedStrategy()
    seed.sharding = True
    seed.sharding_configs = {"sharding_degree": 2, "mp_degree": 2, "pp_degree": 1, "dp_degree": 2, "gradient_merge_acc_step": 4,
                             "optimize_offload": True}  # fmt: skip
    r = seed.resolved()
    assert r.degrees == (2, 1, 2, 2) and r.gradient_merge_steps == 4 and r.offload


def test_contradictions_are_refused() -> None:
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.hybrid_configs = {"mp_degree": 2}
    s.sharding_configs = {"mp_degree": 4}
    with pytest.raises(
        ValueError, match=re.escape("hybrid_configs['mp_degree'] = 2 but strategy.sharding_configs['mp_degree'] = 4")
    ):
        s.resolved()
    off = fleet.DistributedStrategy()
    off.sharding_configs = {"mp_degree": 2}
    with pytest.raises(ValueError, match=re.escape("sharding_configs['mp_degree'] = 2 but strategy.sharding is False")):
        off.resolved()
    nopipe = fleet.DistributedStrategy()
    nopipe.pipeline = False
    nopipe.hybrid_configs = {"pp_degree": 2}
    with pytest.raises(ValueError, match=re.escape("pp_degree = 2 but strategy.pipeline is False")):
        nopipe.resolved()
    merge = fleet.DistributedStrategy()
    merge.sharding, merge.gradient_merge = True, True
    merge.sharding_configs = {"gradient_merge_acc_step": 2}
    merge.gradient_merge_configs = {"k_steps": 3}
    with pytest.raises(
        ValueError, match=re.escape("gradient_merge_acc_step'] = 2 but strategy.gradient_merge_configs['k_steps'] = 3")
    ):
        merge.resolved()


def test_degrees_must_multiply_to_the_world_size() -> None:
    def program(rank: int) -> str:
        try:
            init(dp=2, pp=2, sh=2, mp=2)
        except ValueError as exc:
            return str(exc)
        return "no error"

    out = per_rank(8, program)
    assert out[0].startswith(
        "fleet.init: dp_degree(2) * pp_degree(2) * sharding_degree(2) * mp_degree(2) = 16 != world size 8"
    )

    def fill(rank: int) -> str:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"mp_degree": 3}
        try:
            fleet.init(is_collective=True, strategy=s)
        except ValueError as exc:
            return str(exc)
        return "no error"

    assert (
        "world size 4 is not a multiple of pp_degree(1) * sharding_degree(1) * mp_degree(3) = 3" in per_rank(4, fill)[0]
    )
    with pytest.raises(ValueError, match="is_collective=True"):
        fleet.init()


# ---------------------------------------------------------------------- topology and hcg
def test_hcg_getters_on_a_4d_topology_of_16_ranks() -> None:
    def program(rank: int) -> dict[str, Any]:
        hcg = init(dp=2, pp=2, sh=2, mp=2)
        return {
            "coord": (hcg.get_data_parallel_rank(), hcg.get_stage_id(), hcg.get_sharding_parallel_rank(), hcg.get_model_parallel_rank()),
            "sizes": (hcg.get_data_parallel_world_size(), hcg.get_pipe_parallel_world_size(),
                      hcg.get_sharding_parallel_world_size(), hcg.get_model_parallel_world_size()),
            "groups": tuple(g.ranks for g in (hcg.get_data_parallel_group(), hcg.get_pipe_parallel_group(),
                                             hcg.get_sharding_parallel_group(), hcg.get_model_parallel_group())),
            "src": (hcg.get_data_parallel_group_src_rank(), hcg.get_sharding_parallel_group_src_rank(),
                    hcg.get_model_parallel_group_src_rank()),
            "p2p": hcg.get_p2p_groups(),
            "first_last": (hcg.is_first_stage, hcg.is_last_stage),
            "from_stage": hcg.get_rank_from_stage(1),
            "mode": hcg.get_parallel_mode(),
            "global": hcg.get_global_rank(),
            "pipe_rank": hcg.get_pipe_parallel_rank(),
            "check": hcg.get_check_parallel_group().ranks,
        }  # fmt: skip

    out = per_rank(16, program)
    for rank, got in out.items():
        d, p, s, m = rank // 8, rank // 4 % 2, rank // 2 % 2, rank % 2  # Paddle's order: data, pipe, sharding, model
        assert got["coord"] == (d, p, s, m)
        assert got["sizes"] == (2, 2, 2, 2)
        assert got["groups"] == (
            (m + 2 * s + 4 * p, m + 2 * s + 4 * p + 8),
            (m + 2 * s + 8 * d, m + 2 * s + 8 * d + 4),
            (m + 4 * p + 8 * d, m + 4 * p + 8 * d + 2),
            (2 * s + 4 * p + 8 * d, 2 * s + 4 * p + 8 * d + 1),
        )
        assert got["src"] == (got["groups"][0][0], got["groups"][2][0], got["groups"][3][0])
        other = rank + 4 if p == 0 else rank - 4
        assert got["p2p"] == (other, other)
        assert got["first_last"] == (p == 0, p == 1)
        assert got["from_stage"] == rank - 4 * p + 4
        assert got["mode"] == fleet.ParallelMode.PIPELINE_PARALLEL
        assert got["global"] == rank and got["pipe_rank"] == p
        assert got["check"] == tuple(range(16))


def test_topology_round_trips_and_parallel_modes() -> None:
    topo = fleet.CommunicateTopology(["data", "pipe", "sharding", "model"], [2, 1, 3, 2])
    for r in range(topo.world_size()):
        assert topo.get_rank(**dict(zip(topo.get_hybrid_group_names(), topo.get_coord(r), strict=True))) == r
    assert topo.get_comm_list("sharding")[0] == [0, 2, 4]
    assert topo.get_axis_list("data", 1) == list(range(6, 12))
    mesh = topo.mesh()  # the same layout as a ProcessMesh, for placements on its axes
    assert list(mesh.shape) == [2, 1, 3, 2] and mesh.dim_names == ["data", "pipe", "sharding", "model"]
    assert list(mesh.process_ids) == list(range(12))
    with pytest.raises(ValueError, match="get_rank: model=2 is outside the axis of size 2"):
        topo.get_rank(data=0, pipe=0, sharding=0, model=2)
    modes = per_rank(
        2, lambda r: [init(dp=2).get_parallel_mode(), init(sh=2).get_parallel_mode(), init(mp=2).get_parallel_mode()]
    )
    assert modes[0] == [
        fleet.ParallelMode.DATA_PARALLEL,
        fleet.ParallelMode.SHARDING_PARALLEL,
        fleet.ParallelMode.TENSOR_PARALLEL,
    ]


# ---------------------------------------------------------------------- layers against dense
def _grad(t: dist.Tensor) -> np.ndarray:
    assert t.grad is not None
    return t.grad.numpy()


def _square_loss(f: Callable[[dist.Tensor], dist.Tensor], x: np.ndarray) -> tuple[dist.Tensor, dist.Tensor]:
    """``y = f(x)`` on an input that wants its gradient, then ``sum(y * y)`` backpropagated: ``(x, y)``."""
    xt = dist.to_tensor(x)
    xt.stop_gradient = False
    y = f(xt)
    dist.sum(dist.multiply(y, y)).backward()
    return xt, y


def _dense_reference(build: Callable[[], Any]) -> Any:
    dist.seed(7)
    with dist.nn.layer.default_dtype("float64"):
        return build()


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear_matches_dense(mp: int, gather_output: bool) -> None:
    x = np.random.default_rng(0).normal(size=(3, 5, 6))

    def dense() -> tuple[np.ndarray, ...]:
        layer = dist.nn.Linear(6, 8)
        xt, y = _square_loss(layer, x)
        return y.numpy(), _grad(layer.weight), _grad(layer.bias), _grad(xt)

    def program(rank: int) -> tuple[np.ndarray, ...]:
        hcg = init(mp=mp)
        dist.seed(7)
        with dist.nn.layer.default_dtype("float64"):
            layer = ColumnParallelLinear(6, 8, gather_output=gather_output)
        assert layer.weight.is_distributed and layer.weight.shape == [6, 8 // mp]
        # per-slice loss when split: the sum over the group is the dense loss
        xt, y = _square_loss(layer, x)
        assert hcg.get_model_parallel_rank() == rank
        return y.numpy(), _grad(layer.weight), _grad(layer.bias), _grad(xt)

    want = _dense_reference(dense)
    got = per_rank(mp, program)
    cols = np.split(np.arange(8), mp)
    for r in range(mp):
        y, gw, gb, gx = got[r]
        np.testing.assert_allclose(y, want[0] if gather_output else want[0][..., cols[r]], rtol=1e-12)
        np.testing.assert_allclose(gw, want[1][:, cols[r]], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(gb, want[2][cols[r]], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(gx, want[3], rtol=1e-12, atol=1e-13)  # c_identity summed the slices' parts


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_dense(mp: int, input_is_parallel: bool) -> None:
    x = np.random.default_rng(1).normal(size=(4, 8))

    def dense() -> tuple[np.ndarray, ...]:
        layer = dist.nn.Linear(8, 5)
        xt, y = _square_loss(layer, x)
        return y.numpy(), _grad(layer.weight), _grad(layer.bias), _grad(xt)

    def program(rank: int) -> tuple[np.ndarray, ...]:
        init(mp=mp)
        dist.seed(7)
        with dist.nn.layer.default_dtype("float64"):
            layer = RowParallelLinear(8, 5, input_is_parallel=input_is_parallel)
        rows = np.split(np.arange(8), mp)[rank]
        xt, y = _square_loss(layer, x[:, rows] if input_is_parallel else x)
        return y.numpy(), _grad(layer.weight), _grad(layer.bias), _grad(xt)

    want = _dense_reference(dense)
    got = per_rank(mp, program)
    rows = np.split(np.arange(8), mp)
    for r in range(mp):
        y, gw, gb, gx = got[r]
        np.testing.assert_allclose(y, want[0], rtol=1e-12)
        np.testing.assert_allclose(gw, want[1][rows[r]], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(gb, want[2], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(gx, want[3][:, rows[r]] if input_is_parallel else want[3], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("mp", [2, 4])
def test_vocab_parallel_embedding_and_parallel_cross_entropy_match_dense(mp: int) -> None:
    ids = np.random.default_rng(2).integers(0, 12, size=(3, 5))
    labels = np.random.default_rng(3).integers(0, 12, size=(3, 5))
    labels[0, 0] = -100  # ignored row

    def dense() -> tuple[np.ndarray, ...]:
        emb, head = dist.nn.Embedding(12, 4), dist.nn.Linear(4, 12)
        logits = head(emb(dist.to_tensor(ids)))
        loss = dist.nn.functional.cross_entropy(logits, dist.to_tensor(labels), reduction="none")
        dist.sum(loss).backward()
        return loss.numpy(), _grad(emb.weight), _grad(head.weight)

    def program(rank: int) -> tuple[np.ndarray, ...]:
        init(mp=mp)
        dist.seed(7)
        with dist.nn.layer.default_dtype("float64"):
            emb = VocabParallelEmbedding(12, 4)
            head = ColumnParallelLinear(4, 12, gather_output=False)
        loss = ParallelCrossEntropy()(head(emb(dist.to_tensor(ids))), dist.to_tensor(labels[..., None]))
        dist.sum(loss).backward()
        return loss.numpy(), _grad(emb.weight), _grad(head.weight)

    want = _dense_reference(dense)
    got = per_rank(mp, program)
    part = np.split(np.arange(12), mp)
    for r in range(mp):
        loss, g_emb, g_head = got[r]
        assert loss.shape == (3, 5, 1) and loss[0, 0, 0] == 0.0
        np.testing.assert_allclose(loss, want[0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g_emb, want[1][part[r]], rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(g_head, want[2][:, part[r]], rtol=1e-10, atol=1e-13)


def test_split_and_concat_are_each_others_backward() -> None:
    """c_concat gathers the members' slices (group None: the world); its gradient is this
    member's slice; c_split slices and its gradient is gathered whole."""
    from mpipar.compat.fleet.meta_parallel.mp_ops import c_concat, c_split

    whole = np.arange(12.0).reshape(2, 6)
    weights = np.arange(12.0).reshape(2, 6) + 1  # a loss sum(w * y) with the same w on every member

    def program(rank: int) -> tuple[np.ndarray, ...]:
        piece = dist.to_tensor(np.split(whole, 3, axis=-1)[rank])
        piece.stop_gradient = False
        joined = c_concat(piece)
        dist.sum(dist.multiply(joined, dist.to_tensor(weights))).backward()
        full = dist.to_tensor(whole)
        full.stop_gradient = False
        mine = c_split(full)
        dist.sum(dist.multiply(mine, dist.to_tensor(np.split(weights, 3, axis=-1)[rank]))).backward()
        return joined.numpy(), _grad(piece), mine.numpy(), _grad(full)

    got = per_rank(3, program)
    for r in range(3):
        joined, g_piece, mine, g_full = got[r]
        np.testing.assert_array_equal(joined, whole)
        np.testing.assert_array_equal(g_piece, np.split(weights, 3, axis=-1)[r])
        np.testing.assert_array_equal(mine, np.split(whole, 3, axis=-1)[r])
        np.testing.assert_array_equal(g_full, weights)  # every member's slice gradient, gathered


@settings(max_examples=20)
@given(
    mp=st.sampled_from([1, 2, 3, 4]),
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    sizes=st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 5)),
    gather=st.booleans(),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_column_then_row_matches_dense_on_any_shape(
    mp: int, lead: list[int], sizes: tuple[int, int, int], gather: bool, has_bias: bool, seed: int
) -> None:
    """Megatron's pair (column with or without gather, then row with or without a parallel
    input) on random shapes and degrees: output and every gradient equal the dense pair's."""
    n_in, k, n_out = sizes
    hidden = k * mp  # the split dim must divide by mp
    x = np.random.default_rng(seed).normal(size=(*lead, n_in))

    def dense() -> list[np.ndarray]:
        dist.seed(seed)
        with dist.nn.layer.default_dtype("float64"):
            a = dist.nn.Linear(n_in, hidden, bias_attr=None if has_bias else False)
            b = dist.nn.Linear(hidden, n_out)
        xt, y = _square_loss(lambda t: b(dist.nn.functional.gelu(a(t))), x)
        return [y.numpy(), _grad(xt), _grad(a.weight), _grad(b.weight), _grad(b.bias)]

    def program(rank: int) -> list[np.ndarray]:
        init(mp=mp)
        dist.seed(seed)
        with dist.nn.layer.default_dtype("float64"):
            a = ColumnParallelLinear(n_in, hidden, has_bias=has_bias, gather_output=gather)
            b = RowParallelLinear(hidden, n_out, input_is_parallel=not gather)
        xt, y = _square_loss(lambda t: b(dist.nn.functional.gelu(a(t))), x)
        return [y.numpy(), _grad(xt), _grad(a.weight), _grad(b.weight), _grad(b.bias)]

    want = dense()
    for r, got in per_rank(mp, program).items():
        part = np.split(np.arange(hidden), mp)[r]
        expect = [want[0], want[1], want[2][:, part], want[3][part], want[4]]
        for g, w in zip(got, expect, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("bucket_mb", "update_calls"), [(32, 1), (1e-9, 7)])
def test_collectives_of_a_tensor_parallel_step_are_pinned(bucket_mb: float, update_calls: int) -> None:
    """Embedding -> column -> row -> column head -> parallel cross entropy on mp=2, then the
    optimizer on dp=2: the all-reduces Megatron's layout needs, and no more; the update's
    gradients in one bucket (32 MB), or one call per parameter when buckets hold one byte."""
    ids = np.random.default_rng(8).integers(0, 8, size=(2, 3))

    def program(rank: int) -> tuple[dict[str, int], dict[str, int], list[np.ndarray]]:
        init(dp=2, mp=2, sharding_configs={"segment_broadcast_MB": bucket_mb})
        dist.seed(1)
        emb, col = VocabParallelEmbedding(8, 4), ColumnParallelLinear(4, 8, gather_output=False)
        row, head = RowParallelLinear(8, 4, input_is_parallel=True), ColumnParallelLinear(4, 8, gather_output=False)
        params = [p for m in (emb, col, row, head) for p in m.parameters()]
        opt = fleet.distributed_optimizer(dist.optimizer.SGD(parameters=params))
        with recorded(rank) as step:
            logits = head(row(col(emb(dist.to_tensor(ids[rank // 2 :: 2])))))  # this dp rank's row
            dist.mean(ParallelCrossEntropy()(logits, dist.to_tensor(ids[rank // 2 :: 2]))).backward()
        with recorded(rank) as update:
            opt.step()
        return rank0_counts(step), rank0_counts(update), [p.numpy() for p in params]

    out = per_rank(4, program)
    # forward: embedding 1, row 1, cross entropy 3 (max, sum of exp, target); backward: the two
    # column layers' c_identity
    assert out[0][0] == {"all_reduce": 7}
    assert out[0][1] == {"all_reduce": update_calls}
    for a, b in zip(out[0][2], out[2][2], strict=True):  # dp replicas stepped alike
        np.testing.assert_array_equal(a, b)


def test_buckets_give_the_same_bits_as_one_call_per_parameter() -> None:
    def run(bucket_mb: float) -> list[np.ndarray]:
        def program(rank: int) -> list[np.ndarray]:
            init(dp=2, sharding_configs={"segment_broadcast_MB": bucket_mb})
            dist.seed(4)
            layers = [dist.nn.Linear(3, 5), dist.nn.Linear(5, 2)]
            params = [p for m in layers for p in m.parameters()]
            opt = fleet.distributed_optimizer(dist.optimizer.SGD(learning_rate=0.5, parameters=params))
            x = np.random.default_rng(rank).normal(size=(4, 3)).astype("float32")
            dist.mean(layers[1](layers[0](dist.to_tensor(x)))).backward()
            opt.step()
            return [p.numpy() for p in params]

        return per_rank(2, program)[0]

    for a, b in zip(run(32), run(1e-9), strict=True):
        np.testing.assert_array_equal(a, b)


def test_layer_errors_name_the_layer_and_the_size() -> None:
    with pytest.raises(ValueError, match=re.escape("ColumnParallelLinear: no model-parallel group; call fleet.init")):
        ColumnParallelLinear(4, 4)

    def program(rank: int) -> list[str]:
        init(mp=4)
        errors = []
        for build in (
            lambda: ColumnParallelLinear(4, 6),
            lambda: RowParallelLinear(10, 4),
            lambda: VocabParallelEmbedding(6, 4),
        ):
            try:
                build()
            except ValueError as exc:
                errors.append(str(exc))
        emb = VocabParallelEmbedding(8, 2)
        try:
            emb(dist.to_tensor(np.array([8])))
        except ValueError as exc:
            errors.append(str(exc))
        return errors

    errors = per_rank(4, program)[0]
    assert errors[0].startswith(
        "ColumnParallelLinear: out_features = 6 does not split evenly over the model-parallel group of 4 ranks"
    )
    assert errors[1].startswith("RowParallelLinear: in_features = 10 does not split evenly")
    assert errors[2].startswith("VocabParallelEmbedding: num_embeddings = 6 does not split evenly")
    assert errors[3] == "VocabParallelEmbedding: id 8 is outside the vocabulary of 8"


# ---------------------------------------------------------------------- the optimizer
def _mlp_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(4)
    return [(rng.normal(size=(8, 6)), rng.normal(size=(8, 6))) for _ in range(3)]


def _dense_training(clip: float, merge: int) -> list[np.ndarray]:
    dist.seed(11)
    with dist.nn.layer.default_dtype("float64"):
        up, down = dist.nn.Linear(6, 8), dist.nn.Linear(8, 6)
    params = [up.weight, up.bias, down.weight, down.bias]
    opt = dist.optimizer.AdamW(
        learning_rate=0.1, parameters=params, grad_clip=dist.optimizer.ClipGradByGlobalNorm(clip)
    )
    for i, (x, y) in enumerate(_mlp_batches()):
        d = dist.subtract(down(dist.nn.functional.gelu(up(dist.to_tensor(x)))), dist.to_tensor(y))
        dist.scale(dist.mean(dist.multiply(d, d)), 1.0 / merge).backward()
        if (i + 1) % merge == 0:
            opt.step()
            opt.clear_grad()
    return [p.numpy() for p in params]


@pytest.mark.parametrize(
    ("dp", "sharding", "mp", "stage", "merge"),
    [(2, 1, 2, 1, 1), (1, 2, 2, 1, 1), (1, 2, 2, 2, 1), (2, 2, 1, 2, 1), (1, 4, 1, 1, 3), (2, 1, 2, 1, 3)],
)
def test_hybrid_optimizer_matches_one_device(dp: int, sharding: int, mp: int, stage: int, merge: int) -> None:
    """dp/sharding ranks read shares of the batch, mp ranks hold slices; after the steps every
    rank's parameters are one device's (clipping engaged: the norm is above 0.05)."""
    clip = 0.05
    want = _dense_training(clip, merge)

    def program(rank: int) -> dict[str, Any]:
        hcg = init(dp=dp, sh=sharding, mp=mp, sharding_configs={"stage": stage}, sharding=sharding > 1,
                   gradient_merge=merge > 1, gradient_merge_configs={"k_steps": merge, "avg": False})  # fmt: skip
        dist.seed(11)
        with dist.nn.layer.default_dtype("float64"):
            up = ColumnParallelLinear(6, 8, gather_output=False)
            down = RowParallelLinear(8, 6, input_is_parallel=True)
        params = [up.weight, up.bias, down.weight, down.bias]
        inner = dist.optimizer.AdamW(
            learning_rate=0.1, parameters=params, grad_clip=dist.optimizer.ClipGradByGlobalNorm(clip)
        )
        opt = fleet.distributed_optimizer(inner)
        n_data = dp * sharding
        share = hcg.get_data_parallel_rank() * sharding + hcg.get_sharding_parallel_rank()
        for x, y in _mlp_batches():
            rows = slice(share * 8 // n_data, (share + 1) * 8 // n_data)
            d = dist.subtract(down(dist.nn.functional.gelu(up(dist.to_tensor(x[rows])))), dist.to_tensor(y[rows]))
            dist.scale(dist.mean(dist.multiply(d, d)), 1.0 / merge).backward()  # avg=False: the user scales
            opt.step()
            opt.clear_grad()
        return {"params": [p.numpy() for p in params], "owned": len(inner._parameter_list), "states": len(inner._states),
                "mp_rank": hcg.get_model_parallel_rank()}  # fmt: skip

    got = per_rank(dp * sharding * mp, program)
    for out in got.values():
        m = out["mp_rank"]
        cols, rows = np.split(np.arange(8), mp)[m], np.split(np.arange(8), mp)[m]
        expect = [want[0][:, cols], want[1][cols], want[2][rows], want[3]]
        for g, w in zip(out["params"], expect, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
        if sharding > 1:  # ZeRO: optimizer states only for this rank's parameters
            assert 0 < out["owned"] < 4 and out["states"] == out["owned"]
    if sharding > 1:
        assert sum(got[r]["owned"] for r in range(sharding * mp) if got[r]["mp_rank"] == 0) == 4


def test_clipping_was_engaged_in_the_reference() -> None:
    """The optimizer test's clip (0.05) is below the gradient norm, so it tests clipping."""
    assert not np.allclose(_dense_training(0.05, 1)[0], _dense_training(1e9, 1)[0])


def test_partition_gives_each_parameter_to_the_least_loaded_member() -> None:
    params = [dist.to_tensor(np.zeros(s)) for s in ((10,), (4,), (4,), (3,), (8,))]
    assert partition_parameters(params, 2) == [0, 1, 1, 1, 0]


def test_offload_keeps_the_states_on_the_host_and_changes_nothing() -> None:
    def program(rank: int) -> tuple[Any, list[np.ndarray]]:
        init(sh=2, sharding_configs={"optimize_offload": True}, sharding=True)
        dist.seed(3)
        with dist.nn.layer.default_dtype("float64"):
            layer = dist.nn.Linear(4, 2)
        opt = fleet.distributed_optimizer(dist.optimizer.AdamW(learning_rate=0.1, parameters=layer.parameters()))
        x = np.arange(8.0).reshape(2, 4) + rank
        dist.mean(layer(dist.to_tensor(x))).backward()
        opt.step()
        return opt.inner_opt.offload, [p.numpy() for p in layer.parameters()]

    got = per_rank(2, program)
    assert got[0][0] is not None and got[0][0].moved
    for a, b in zip(got[0][1], got[1][1], strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------- pipeline layers
def test_segments_and_pipeline_errors() -> None:
    assert segment_uniform(5, 2) == [0, 2, 5]
    assert segment_uniform(4, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        segment_uniform(3, 4)

    def program(rank: int) -> list[str]:
        init(pp=2, pipeline=True, pipeline_configs={"micro_batch_size": 2, "accumulate_steps": 2})
        errors = []
        try:
            PipelineLayer([LayerDesc(dist.nn.Linear, 2, 2)] * 2, num_stages=3)
        except ValueError as exc:
            errors.append(str(exc))
        model = fleet.distributed_model(
            PipelineLayer([LayerDesc(dist.nn.Linear, 2, 2)] * 3, loss_fn=lambda out, y: dist.mean(out))
        )
        opt = fleet.distributed_optimizer(dist.optimizer.SGD(learning_rate=0.1, parameters=model.parameters()))
        try:
            model.train_batch([np.zeros((3, 2)), np.zeros((3, 2))], opt)
        except ValueError as exc:
            errors.append(str(exc))
        errors.append(repr(model._layers))
        return errors

    out = per_rank(2, program)
    assert (
        out[0][0]
        == "PipelineLayer: num_stages = 3 but the topology's pp_degree is 2; pass num_stages=hcg.get_pipe_parallel_world_size()"
    )
    assert (
        out[0][1]
        == "train_batch: inputs have 3 rows but pipeline_configs micro_batch_size (2) * accumulate_steps (2) = 4"
    )
    assert "stage 0 of 2: layers 0..0" in out[0][2] and "stage 1 of 2: layers 1..2" in out[1][2]


def test_eval_batch_and_a_plain_model_match_one_device() -> None:
    """``eval_batch`` over 2 stages gives one stage's loss on both; a non-pipeline model under
    mp=2 runs as is (``HybridParallelModel``) and gives the dense loss."""
    x = np.random.default_rng(5).normal(size=(4, 4))

    def loss_fn(out: dist.Tensor, y: dist.Tensor) -> dist.Tensor:
        return dist.mean(dist.multiply(out, out))

    def pipeline(pp: int) -> Callable[[int], float]:
        def program(rank: int) -> float:
            init(pp=pp, pipeline=pp > 1, pipeline_configs={"micro_batch_size": 2, "accumulate_steps": 2})
            dist.seed(0)
            with dist.nn.layer.default_dtype("float64"):
                model = fleet.distributed_model(PipelineLayer([LayerDesc(dist.nn.Linear, 4, 4)] * 3, loss_fn=loss_fn))
            return float(model.eval_batch([x, x]))

        return program

    two, one = per_rank(2, pipeline(2)), per_rank(1, pipeline(1))
    assert two[0] == two[1]  # the last stage's loss, broadcast to the first
    np.testing.assert_allclose(two[0], one[0], rtol=1e-12)

    def mp_program(rank: int) -> float:
        init(mp=2)
        dist.seed(9)
        with dist.nn.layer.default_dtype("float64"):
            model = fleet.distributed_model(dist.nn.Sequential(ColumnParallelLinear(4, 6, gather_output=False),
                                                               RowParallelLinear(6, 4, input_is_parallel=True)))  # fmt: skip
        assert isinstance(model, fleet.HybridParallelModel) and len(model.parameters()) == 4
        out = model(dist.to_tensor(x))
        return float(dist.mean(dist.multiply(out, out)))

    dist.seed(9)
    with dist.nn.layer.default_dtype("float64"):
        dense = dist.nn.Sequential(dist.nn.Linear(4, 6), dist.nn.Linear(6, 4))
    out = dense(dist.to_tensor(x))
    want = float(dist.mean(dist.multiply(out, out)))
    mp = per_rank(2, mp_program)
    np.testing.assert_allclose([mp[0], mp[1]], [want, want], rtol=1e-12)


def test_recompute_reruns_the_collectives_and_keeps_the_gradients() -> None:
    """strategy.recompute: every layer of the stage is recomputed in backward, its manual
    collectives (c_identity, mp_allreduce) run again in the same order on every mp rank."""
    x = np.random.default_rng(6).normal(size=(4, 4))

    def program(recompute: bool) -> Callable[[int], list[np.ndarray]]:
        def run(rank: int) -> list[np.ndarray]:
            init(mp=2, recompute=recompute)
            dist.seed(2)
            with dist.nn.layer.default_dtype("float64"):
                layer = PipelineLayer([LayerDesc(ColumnParallelLinear, 4, 6, gather_output=False),
                                       LayerDesc(RowParallelLinear, 6, 4, input_is_parallel=True)])  # fmt: skip
            assert layer._recompute_interval == (1 if recompute else 0)
            with recorded(rank) as comm:
                out = layer(dist.to_tensor(x))
                dist.mean(dist.multiply(out, out)).backward()
            return [rank0_counts(comm).get("all_reduce", 0), *(_grad(p) for p in layer.parameters())]

        return run

    plain, again = per_rank(2, program(False)), per_rank(2, program(True))
    # the row layer's mp_allreduce (the input needs no gradient: c_identity records no backward);
    # recompute runs that forward again in backward
    assert (plain[0][0], again[0][0]) == (1, 2)
    for r in range(2):
        for a, b in zip(plain[r][1:], again[r][1:], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-12)


def test_distributed_optimizer_refuses_another_strategy() -> None:
    def program(rank: int) -> str:
        init(dp=2)
        other = fleet.DistributedStrategy()
        other.hybrid_configs = {"mp_degree": 2}
        try:
            fleet.distributed_optimizer(dist.optimizer.SGD(parameters=[dist.Parameter(np.zeros(2))]), strategy=other)
        except ValueError as exc:
            return str(exc)
        return "no error"

    assert "the strategy differs from the one fleet.init built the groups from" in per_rank(2, program)[0]


def test_a_non_pipeline_model_with_pp_is_refused() -> None:
    def program(rank: int) -> str:
        init(pp=2, pipeline=True)
        try:
            fleet.distributed_model(dist.nn.Linear(2, 2))
        except ValueError as exc:
            return str(exc)
        return "no error"

    assert "pp_degree = 2 needs the model written as a fleet.meta_parallel.PipelineLayer" in per_rank(2, program)[0]


# ---------------------------------------------------------------------- spellings and launch
def test_paddle_spellings_reach_fleet() -> None:
    import mpipar
    import mpipar.distributed.fleet as fleet_module

    assert mpipar.distributed.fleet is fleet is fleet_module is mpipar.fleet
    assert mpipar.distributed.all_reduce is dist.all_reduce
    assert fleet.utils.recompute is dist.recompute


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import mpipar as paddle\ns = paddle.distributed.fleet.DistributedStrategy()\n", True),
        ("from mpipar.distributed import fleet\n", True),
        ("import mpipar.distributed.fleet as fleet\n", True),
        ("from mpipar import fleet\n", True),
        ("from mpipar.distributed.fleet.meta_parallel import PipelineLayer\n", True),
        ("import mpipar as dist\nx = dist.shard_tensor(1, 2, 3)\n", False),
    ],
)
def test_fleet_scripts_run_per_rank(tmp_path: Any, source: str, expected: bool) -> None:
    script = tmp_path / "s.py"
    script.write_text(source)
    assert uses_manual_api(str(script)) is expected


def _run(*args: str) -> list[tuple[str, str]]:
    out = run_python(*args, env=environ(drop_prefix="MPIPAR_", one_thread=True), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return LOSS.findall(out.stdout)


EXAMPLE = "examples/fleet/hybrid.py"
COMMON = ("--tiny", "--dtype", "float64", "--steps", "3")


def run_example(n: int, *flags: str) -> list[tuple[str, str]]:
    """The example's step lines, run in this process: as one device (``n`` = 1) or as the
    programs of ``n`` virtual ranks, what ``python -m simulator -n n`` runs (without paying a
    process start per case)."""
    path = os.path.join(REPO, EXAMPLE)
    saved_argv, saved_path, saved_dtype = sys.argv, list(sys.path), dist.get_default_dtype()
    sys.argv = [path, *COMMON, *flags]
    sys.path.insert(0, os.path.dirname(path))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            if n == 1:
                runpy.run_path(path, run_name="__main__")
            else:
                backend = PerRankBackend(n)
                with dist.use_backend(backend):
                    run_per_rank(lambda: runpy.run_path(path, run_name="__main__"), backend)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        dist.set_default_dtype(saved_dtype)
        base._states.clear()
    return LOSS.findall(out.getvalue())


def assert_same_losses(got: list[tuple[str, str]], want: list[tuple[str, str]]) -> None:
    assert len(got) == len(want) == 3, (got, want)
    for (s1, v1), (s2, v2) in zip(want, got, strict=True):
        assert s1 == s2
        np.testing.assert_allclose(float(v2), float(v1), rtol=1e-9)


def test_seed_example_from_the_command_line_prints_one_devices_losses() -> None:
    """The real launchers: ``python script.py`` and ``python -m simulator -n 8`` (per-rank programs
    chosen because the script imports fleet)."""
    one = _run(EXAMPLE, *COMMON)
    assert_same_losses(_run("-m", "simulator", "-n", "8", EXAMPLE, *COMMON), one)
    assert_same_losses(run_example(1), one)


@pytest.mark.parametrize(
    ("n", "flags", "batch"),
    [
        # the defaults (mp=2, pp=2, sharding=2 in the seed's spelling) run from the command line above
        (8, ("--num-dp", "2", "--num-sharding", "1", "--schedule", "FThenB"), ("--shared-embedding",)),  # tied, clipped
        (8, ("--sharding-stage", "2", "--recompute", "--offload"), ("--gradient-merge", "2")),
        (4, ("--num-mp", "1", "--num-pp", "4"), ("--shared-embedding", "--batch-size", "4", "--accumulate-steps", "4")),
        pytest.param(16, ("--num-dp", "2"), (), marks=pytest.mark.slow),  # all four degrees 2 (16 threads)
    ],
)
def test_seed_example_prints_one_devices_losses(n: int, flags: tuple[str, ...], batch: tuple[str, ...]) -> None:
    assert_same_losses(run_example(n, *flags, *batch), run_example(1, *batch))


def test_gradient_merge_defers_the_update() -> None:
    merged, plain = run_example(1, "--gradient-merge", "2"), run_example(1)
    assert merged[0] == plain[0] and merged[1] != plain[1]  # no update after step 0: its gradient waits for step 1
