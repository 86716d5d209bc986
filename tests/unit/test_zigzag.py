"""The load-balanced (zigzag) split ``ZigzagShard``: a placement of its own.

Reshard to and from it (Replicate, Shard, Partial, other meshes) keeps the global value
(hypothesis, float64, against the plain-NumPy oracle in ``strategies``); its compact and
readable forms parse back; a layout it cannot describe is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import global_value, make_tensor

import mpipar as dist
from mpipar.placement import Placement, ZigzagShard, parse_placements
from mpipar.reshard.planner import plan_reshard


@st.composite
def zigzag_cases(draw: st.DrawFn) -> tuple[list[int], dist.ProcessMesh, list[Placement], list[Placement]]:
    """A 1- or 2-d mesh, a shape whose dim 1 splits into 2k chunks, and two placement lists of
    which at least one holds a zigzag split (outermost on its dim, as the spec requires)."""
    mesh_shape = draw(st.sampled_from([[2], [3], [4], [2, 2], [2, 3], [3, 2], [1, 2]]))
    ids = draw(st.permutations(list(range(8))))[: int(np.prod(mesh_shape))]
    mesh = dist.ProcessMesh(np.array(ids).reshape(mesh_shape), dim_names=["x", "y"][: len(mesh_shape)])
    lcm = int(np.lcm.reduce([2 * k for k in mesh_shape]))
    shape = [draw(st.integers(1, 3)), lcm * draw(st.integers(1, 2)), draw(st.integers(1, 3))]

    def one(zig: bool) -> list[Placement]:
        options: list[Placement] = [dist.Replicate(), dist.Shard(0), dist.Shard(1), dist.Shard(2), dist.Partial()]
        pls = [draw(st.sampled_from(options)) for _ in mesh_shape]
        if zig:
            axis = draw(st.integers(0, len(mesh_shape) - 1))
            pls = [dist.Replicate() if p == dist.Shard(1) and a < axis else p for a, p in enumerate(pls)]
            pls[axis] = ZigzagShard(1)
        return pls

    first = draw(st.booleans())
    return shape, mesh, one(first or draw(st.booleans())), one(not first or draw(st.booleans()))


@settings(max_examples=150, deadline=None)
@given(zigzag_cases(), st.integers(0, 2**31 - 1))
def test_reshard_to_and_from_zigzag_keeps_the_value(case: tuple, seed: int) -> None:
    shape, mesh, src_pls, dst_pls = case
    src, dst = dist.DistSpec(shape, mesh, src_pls), dist.DistSpec(shape, mesh, dst_pls)
    t, expected = make_tensor(src, seed)
    np.testing.assert_allclose(global_value(t), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(t.full_tensor(), expected, rtol=1e-12, atol=1e-12)
    out = dist.reshard(t, mesh, dst_pls)
    assert out.spec == dst
    np.testing.assert_allclose(global_value(out), expected, rtol=1e-12, atol=1e-12)
    # and across meshes: the same placements on other process ids
    other = dist.ProcessMesh(np.array(mesh.process_ids)[::-1].reshape(mesh.shape) + 8, dim_names=mesh.dim_names)
    moved = dist.reshard(t, other, dst_pls)
    np.testing.assert_allclose(global_value(moved), expected, rtol=1e-12, atol=1e-12)


def test_zigzag_shards_hold_one_early_and_one_late_chunk() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["cp"])
    x = np.arange(16.0).reshape(2, 8)
    t = dist.shard_tensor(x, mesh, [ZigzagShard(1)])
    np.testing.assert_array_equal(t.local_tensor(0), x[:, [0, 1, 6, 7]])
    np.testing.assert_array_equal(t.local_tensor(1), x[:, [2, 3, 4, 5]])
    np.testing.assert_array_equal(t.full_tensor(), x)
    assert t.spec.positions(t.spec.local_box(1), 1).tolist() == [2, 3, 4, 5]


def test_zigzag_moves_are_the_collectives_of_a_sequence_split() -> None:
    """Z -> R one all_gather, R -> Z a local slice, P -> Z one reduce_scatter, Z <-> S via R."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["cp"])
    z = dist.DistSpec([2, 16], mesh, [ZigzagShard(1)])

    def kinds(a: dist.DistSpec, b: dist.DistSpec) -> list[str]:
        return [s.kind for s in plan_reshard(a, b).steps]

    assert kinds(z, z.with_placements([dist.Replicate()])) == ["all_gather"]
    assert kinds(z.with_placements([dist.Replicate()]), z) == ["slice"]
    assert kinds(z.with_placements([dist.Partial()]), z) == ["reduce_scatter"]
    assert kinds(z, z.with_placements([dist.Shard(1)])) == ["all_gather", "slice"]
    assert kinds(z.with_placements([dist.Shard(1)]), z) == ["all_gather", "slice"]


def test_printing_and_parsing() -> None:
    z = ZigzagShard(1)
    assert repr(z) == "ZigzagShard(dim=1)" and str(z) == "Z(1)"
    assert z != dist.Shard(1) and z.is_shard(1) and dist.ZigzagShard is ZigzagShard
    assert parse_placements("Z(1)S(2)") == [z, dist.Shard(2)]
    assert parse_placements("[R, Z(0), P(sum)]") == [dist.Replicate(), ZigzagShard(0), dist.Partial()]
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["cp", "tp"])
    spec = dist.DistSpec([2, 8], mesh, [ZigzagShard(-1), dist.Shard(1)])
    assert spec.placements_str == "Z(1)S(1)"
    assert dist.DistSpec.from_dict(spec.to_dict()) == spec


def test_layouts_a_zigzag_split_cannot_have_are_refused_by_name() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["tp", "cp"])
    with pytest.raises(ValueError, match=r"Z\(1\) on mesh axis 0 \('tp', 2 ranks\).*size 6.*4 equal chunks"):
        dist.DistSpec([2, 6], mesh, [ZigzagShard(1), dist.Replicate()])
    with pytest.raises(ValueError, match=r"already split by mesh axis 0 \('tp'\).*outermost"):
        dist.DistSpec([2, 8], mesh, [dist.Shard(1), ZigzagShard(1)])


def test_checkpoints_of_zigzag_tensors_load_into_any_layout(tmp_path: Path) -> None:
    """Saved in plain boxes, read back chunk by chunk into a zigzag split or any other layout."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["cp", "tp"])
    x = np.random.default_rng(0).standard_normal((8, 8))
    dist.save_state_dict({"x": dist.shard_tensor(x, mesh, [ZigzagShard(0), dist.Shard(1)])}, str(tmp_path / "ck"))
    for pls in (
        [dist.Replicate(), dist.Replicate()],
        [ZigzagShard(0), dist.Shard(1)],
        [dist.Shard(0), ZigzagShard(1)],
        [ZigzagShard(1), dist.Partial()],
    ):
        into = dist.shard_tensor(np.zeros((8, 8)), mesh, pls)
        dist.load_state_dict({"x": into}, str(tmp_path / "ck"))
        assert into.placements == pls
        np.testing.assert_array_equal(global_value(into), x, err_msg=str(pls))
