"""Paddle's ``split_with_num`` rule: the same layouts as ``split`` with an int count."""

from __future__ import annotations

import pytest

import mpipar as dist
from mpipar import spmd


@pytest.mark.parametrize("placements", [[dist.Shard(0)], [dist.Shard(1)], [dist.Replicate()], [dist.Partial()]])
def test_split_with_num_matches_split(placements: list[dist.Placement]) -> None:
    mesh = dist.ProcessMesh([0, 1])
    x = dist.DistSpec([4, 6], mesh, placements)
    got = spmd.infer_forward("split_with_num", [x], num=3, axis=1)
    want = spmd.infer_forward("split", [x], num_or_sections=3, axis=1)
    assert got.inputs == want.inputs and got.outputs == want.outputs
    assert len(got.outputs) == 3 and all(tuple(o.shape) == (4, 2) for o in got.outputs)
    # the split axis cannot stay sharded: every output piece must be whole along it
    assert all(p != dist.Shard(1) for o in got.outputs for p in o.placements)


def test_split_with_num_bad_num() -> None:
    x = dist.DistSpec([4, 6], dist.ProcessMesh([0, 1]), [dist.Replicate()])
    with pytest.raises(TypeError, match=r"num=\(2, 4\)"):
        spmd.infer_forward("split_with_num", [x], num=[2, 4], axis=1)
    with pytest.raises(ValueError, match="into 4 equal parts"):
        spmd.infer_forward("split_with_num", [x], num=4, axis=1)
