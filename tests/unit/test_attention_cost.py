"""Fused attention in the traced cost model (``simulator.op_cost``): what its kernel computes on
each rank, the attributes a plan records for it, and those attributes read from untrusted files.

The counts are checked against the kernel itself: every call of ``mpipar.ops.attention``'s tile
setup is recorded while the traced run computes, and each rank's priced score count must be the
one its kernel call ran (causal masks skip the key tiles wholly in a rank's future, so a
contiguous sequence split gives every rank a different count, and the zigzag split evens them).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.compile.plan import Plan, PlanOp
from mpipar.compile.trace import trace
from mpipar.nn import functional as F
from mpipar.ops import attention
from mpipar.untrusted import FileFormatError
from simulator.cost import load_profile
from simulator.op_cost import ATTENTION_GEMMS, PlanCosts

B, S, H, D = 1, 16, 2, 4


def _traced(
    monkeypatch: pytest.MonkeyPatch, placement: dist.Placement, causal: bool = True, block: int = 4
) -> tuple[Plan, dict[int, int]]:
    """Forward and backward of fused attention on 4 cp ranks, traced; and the scores each
    rank's forward kernel call computed, keyed by its first query position."""
    ran: dict[int, int] = {}
    heads = attention._heads

    def counting(c: Any, q: Any, k: Any, v: Any, positions: Any, is_causal: bool, scale: Any, blk: int) -> Any:
        hd = heads(c, q, k, v, positions, is_causal, scale, blk)
        keys = sum(j1 - j0 for j0, j1 in hd.tiles)
        ran.setdefault(int(hd.qpos.min()), hd.qt.shape[0] * hd.qt.shape[1] * hd.qt.shape[2] * keys)
        return hd

    monkeypatch.setattr(attention, "_heads", counting)
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["cp"])
    rng = np.random.default_rng(0)
    ts = [dist.shard_tensor(rng.standard_normal((B, S, H, D)), mesh, [placement]) for _ in range(3)]
    for t in ts:
        t.stop_gradient = False
    with trace() as rec:
        out = F.scaled_dot_product_attention(*ts, is_causal=causal, block_size=block)
        dist.sum(out).backward()
    return rec.plan(), ran


def _ops(plan: Plan, name: str) -> list[PlanOp]:
    return [op for op in plan.ops if op.op == name]


@pytest.mark.parametrize("placement", [dist.Shard(1), dist.ZigzagShard(1)])
def test_priced_scores_are_the_kernels_per_rank(monkeypatch: pytest.MonkeyPatch, placement: dist.Placement) -> None:
    plan, ran = _traced(monkeypatch, placement)
    (fwd,) = _ops(plan, "scaled_dot_product_attention")
    (bwd,) = _ops(plan, "scaled_dot_product_attention_grad")
    assert fwd.attrs == bwd.attrs == (("is_causal", True), ("block_size", 4))
    costs = PlanCosts(plan, load_profile("cpu-local"))
    firsts = {r: int(costs._positions(fwd.inputs[0], fwd.required_placements[0], r).min()) for r in range(4)}
    priced = {r: costs.attention_work(fwd, r)[0] for r in range(4)}
    assert priced == {r: ran[firsts[r]] for r in range(4)}
    per_rank_queries = S // 4
    if placement == dist.Shard(1):
        # Rank r holds positions 4r..4r+3: the key tiles 0..r run, the later ones are its future.
        assert priced == {r: B * H * per_rank_queries * 4 * (r + 1) for r in range(4)}
        times = costs.op_times(fwd)
        assert isinstance(times, dict) and times[0] < times[1] < times[2] < times[3]
    else:
        # Chunks r and 7 - r of 2 tokens: the last query is 2 (7 - r) + 1; tiles of 4 up to it.
        assert priced == {r: B * H * per_rank_queries * 4 * -(-(16 - 2 * r) // 4) for r in range(4)}
    for r in range(4):  # backward: the scores again, then dV, dP, dQ, dK: 5 GEMMs to forward's 2
        assert costs.op_flops(bwd, r) == pytest.approx(costs.op_flops(fwd, r) * 5 / 2, rel=1e-12)
        assert costs.op_flops(fwd, r) == 2.0 * priced[r] * D * ATTENTION_GEMMS[fwd.op]


def test_without_the_mask_every_rank_runs_every_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, ran = _traced(monkeypatch, dist.Shard(1), causal=False)
    (fwd,) = _ops(plan, "scaled_dot_product_attention")
    costs = PlanCosts(plan, load_profile("cpu-local"))
    assert {costs.attention_work(fwd, r)[0] for r in range(4)} == set(ran.values()) == {B * H * (S // 4) * S}
    assert isinstance(costs.op_times(fwd), float)


@pytest.mark.parametrize("profile", ["cpu-local", "h100-nvlink-ib", "h100-sxm"])
def test_attention_time_grows_with_the_tiles_it_runs(monkeypatch: pytest.MonkeyPatch, profile: str) -> None:
    plan, _ = _traced(monkeypatch, dist.Shard(1))
    costs = PlanCosts(plan, load_profile(profile))
    for op in (*_ops(plan, "scaled_dot_product_attention"), *_ops(plan, "scaled_dot_product_attention_grad")):
        times = [costs.op_time(op, r) for r in range(4)]
        assert 0 < times[0] < times[1] < times[2] < times[3], (op.op, times)


def test_exponentials_are_priced_where_the_profile_has_a_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, _ = _traced(monkeypatch, dist.Shard(1))
    (fwd,) = _ops(plan, "scaled_dot_product_attention")
    hw = load_profile("h100-sxm")
    free = dataclasses.replace(hw, exp_per_s=None)
    scores = PlanCosts(plan, hw).attention_work(fwd, 3)[0]
    gap = PlanCosts(plan, hw).op_time(fwd, 3) - PlanCosts(plan, free).op_time(fwd, 3)
    assert gap == pytest.approx(scores / hw.exp_per_s, rel=1e-9)


def test_plans_keep_the_attributes_and_refuse_forged_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plan, _ = _traced(monkeypatch, dist.ZigzagShard(1), block=8)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    sdpa = [i for i, o in enumerate(data["ops"]) if o["op"] == "scaled_dot_product_attention"]
    assert data["ops"][sdpa[0]]["attrs"] == {"is_causal": True, "block_size": 8}
    assert all("attrs" not in o for o in data["ops"] if not o["op"].startswith("scaled_dot"))
    assert Plan.load(str(path)).ops == plan.ops
    i = sdpa[0]
    for attrs, message in [
        ({"is_causal": "yes"}, "attrs.is_causal: 'yes' is not a boolean"),
        ({"block_size": 0}, "attrs.block_size: 0 is not a positive integer"),
        ({"block_size": True}, "attrs.block_size: True is not a positive integer"),
        ({"block_size": 2.5}, "attrs.block_size: 2.5 is not a positive integer"),
        ({"scale": 1.0}, "attrs.scale: 1.0 is not an op attribute a plan records"),
        ([True], "attrs: [True] is not a JSON object"),
    ]:
        forged = json.loads(path.read_text())
        forged["ops"][i]["attrs"] = attrs
        path.write_text(json.dumps(forged))
        with pytest.raises(FileFormatError, match=re.escape(f"field ops[{i}].{message}")):
            Plan.load(str(path))


def test_every_recorded_attribute_is_one_plans_know() -> None:
    from mpipar.compile.plan import OP_ATTRS
    from mpipar.ops.dispatch import _OPS

    recorded = {a for op in _OPS.values() for a in op.cost_attrs}
    assert recorded and recorded <= set(OP_ATTRS)
