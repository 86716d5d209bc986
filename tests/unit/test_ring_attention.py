"""Ring attention (``scaled_dot_product_attention(..., cp_comm="ring")``): the keys and values of a
sequence split on a mesh axis pass around that axis's ring instead of being gathered. Forward
and gradients equal one device (hypothesis, float64) for plain and zigzag splits, batch and
head splits beside it, grouped-query heads replicated over tp, causal or not."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar.comm import CommEvent
from mpipar.nn import functional as F
from mpipar.placement import Placement

LAYOUTS: list[tuple[list[int], list[str], list[Placement]]] = [
    ([2], ["cp"], [dist.ZigzagShard(1)]),
    ([3], ["cp"], [dist.Shard(1)]),
    ([4], ["cp"], [dist.ZigzagShard(1)]),
    ([2, 2], ["dp", "cp"], [dist.Shard(0), dist.ZigzagShard(1)]),
    ([2, 2], ["cp", "tp"], [dist.ZigzagShard(1), dist.Shard(2)]),
]


def _attend(
    arrays: list[np.ndarray], grad: np.ndarray, mesh: dist.ProcessMesh | None, pls: list[Placement], **kw: object
) -> tuple[np.ndarray, list[np.ndarray], list[CommEvent]]:
    ts = [dist.Tensor(a) if mesh is None else dist.shard_tensor(a, mesh, pls) for a in arrays]
    for t in ts:
        t.stop_gradient = False
    with dist.CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(*ts, **kw)  # type: ignore[arg-type]
        dist.sum(dist.multiply(out, dist.Tensor(grad))).backward()
    return out.numpy(), [t.grad.numpy() for t in ts], list(comm.events)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(LAYOUTS),
    st.sampled_from([(4, 2), (4, 4), (2, 1)]),
    st.booleans(),
    st.integers(1, 5),
    st.integers(0, 2**31 - 1),
)
def test_ring_equals_one_device(
    layout: tuple[list[int], list[str], list[Placement]], heads: tuple[int, int], causal: bool, block: int, seed: int
) -> None:
    shape, names, pls = layout
    mesh = dist.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape), dim_names=names)
    rng = np.random.default_rng(seed)
    h, hk = heads
    t = 12 if 3 in shape else 8
    arrays = [rng.standard_normal((2, t, n, 3)) for n in (h, hk, hk)]
    grad = rng.standard_normal((2, t, h, 3))
    kw = {"is_causal": causal, "block_size": block}
    want, want_g, _ = _attend(arrays, grad, None, pls, **kw)
    got, got_g, events = _attend(arrays, grad, mesh, pls, cp_comm="ring", **kw)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
    # Nothing gathered along cp (tp may gather key/value heads it cannot split); sends only there.
    cp_groups = {tuple(g) for g in mesh.groups((names.index("cp"),))}
    assert not [e for e in events if e.op == "all_gather" and tuple(e.ranks) in cp_groups]
    sends = [e for e in events if e.op == "send"]
    assert sends and all(any(set(e.ranks) <= set(g) for g in cp_groups) for e in sends)


def test_ring_sends_instead_of_gathering() -> None:
    """cp=4: forward 3 sends of keys and 3 of values per rank; backward 3 of each and 4 of each
    gradient (home after the last step); the all-gather option sends nothing."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["cp"])
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 8, 2, 2)) for _ in range(3)]
    grad = rng.standard_normal((1, 8, 2, 2))
    _, _, ring = _attend(arrays, grad, mesh, [dist.ZigzagShard(1)], is_causal=True, cp_comm="ring")
    assert Counter(e.op for e in ring) == {"send": (2 * 3 + 2 * 3 + 2 * 4) * 4}
    _, _, gather = _attend(arrays, grad, mesh, [dist.ZigzagShard(1)], is_causal=True)
    assert Counter(e.op for e in gather) == {"all_gather": 2, "reduce_scatter": 2}


def test_unknown_cp_comm_is_refused() -> None:
    x = dist.Tensor(np.zeros((1, 4, 1, 2)))
    with pytest.raises(ValueError, match="cp_comm 'tree' is not one of allgather, ring"):
        F.scaled_dot_product_attention(x, x, x, cp_comm="tree")
