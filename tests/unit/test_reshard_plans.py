"""Reshard plans: byte optimality, pinned collectives, golden text of named transitions."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mpipar as dist
from mpipar.spec import box_intersect, box_numel, chunk_range

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "reshard_plans.txt")


def _mesh1(n: int) -> dist.ProcessMesh:
    return dist.ProcessMesh(list(range(n)), dim_names=["x"])


def _chunks(size: int, n: int) -> list[int]:
    return [e - s for s, e in (chunk_range(size, n, i) for i in range(n))]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (3, 2), (16,)])
def test_one_axis_transitions_are_byte_optimal(n: int, shape: tuple[int, ...]) -> None:
    """Each 1-d transition is one step of the expected kind, at the lower bound of bytes."""
    mesh = _mesh1(n)
    T = int(np.prod(shape))
    rows = _chunks(shape[0], n)
    last = shape[-1]
    cases = {
        # (src, dst): (kind, elements the busiest rank must receive)
        ("S(0)", "R"): ("all_gather", T - min(rows) * T // shape[0]),
        ("P(sum)", "R"): ("all_reduce", 2 * (n - 1) / n * T),
        # With very uneven chunks (3 rows on 8 ranks) all_reduce + slice moves fewer bytes.
        ("P(sum)", "S(0)"): min(
            ("reduce_scatter", (n - 1) * max(rows) * T // shape[0]),
            ("all_reduce+slice", 2 * (n - 1) / n * T),
            key=lambda c: (c[1], len(c[0])),
        ),
        ("R", "S(0)"): ("slice", 0),
        ("R", "P(sum)"): ("partial", 0),
        ("S(0)", "P(max)"): ("partial", 0),
    }
    if len(shape) > 1:
        # Each rank keeps the overlap of its row block and column block; it receives the rest.
        spec_src = dist.DistSpec(shape, mesh, [dist.Shard(0)])
        spec_dst = dist.DistSpec(shape, mesh, [dist.Shard(1)])
        need = 0
        for r in range(n):
            inter = box_intersect(spec_src.local_box(r), spec_dst.local_box(r))
            need = max(need, box_numel(spec_dst.local_box(r)) - (box_numel(inter) if inter else 0))
        cases[("S(0)", "S(1)")] = ("all_to_all", need)
        assert need <= (n - 1) * max(_chunks(last, n)) * max(rows)
    for (src, dst), (kind, elems) in cases.items():
        plan = dist.plan_reshard(
            dist.DistSpec(shape, mesh, dist.parse_placements(src)),
            dist.DistSpec(shape, mesh, dist.parse_placements(dst)),
        )
        assert "+".join(s.kind for s in plan.steps) == kind, (src, dst, plan)
        assert plan.recv_elems_per_rank() == pytest.approx(elems), (src, dst, plan)


def test_two_by_two_whole_mesh_optimum() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    shape = (8, 8)
    itemsize = 4
    T = 64 * itemsize
    pp = dist.plan_reshard(
        dist.DistSpec(shape, mesh, [dist.Partial(), dist.Partial()]), dist.DistSpec(shape, mesh, [dist.Replicate()] * 2)
    )
    assert pp.bytes_per_rank(itemsize) == 1.5 * T  # not 2 T axis by axis
    assert [s.kind for s in pp.steps] == ["all_reduce"] and pp.steps[0].axes == (0, 1)
    swap = dist.plan_reshard(
        dist.DistSpec(shape, mesh, [dist.Shard(0), dist.Shard(1)]),
        dist.DistSpec(shape, mesh, [dist.Shard(1), dist.Shard(0)]),
    )
    assert swap.bytes_per_rank(itemsize) == 0.25 * T  # not 0.5 T (DTensor) or 0.75 T (Paddle)
    assert [s.kind for s in swap.steps] == ["all_to_all"]


def test_executed_bytes_match_the_plan_for_the_swap() -> None:
    """The exchange really moves a quarter of the tensor: two ranks keep their block."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    x = dist.shard_tensor(np.arange(64.0).reshape(8, 8), mesh, [dist.Shard(0), dist.Shard(1)])
    with dist.CommDebugMode() as comm:
        y = dist.reshard(x, mesh, [dist.Shard(1), dist.Shard(0)])
    assert comm.counts() == {"all_to_all": 1}
    np.testing.assert_array_equal(y.full_tensor(), np.arange(64.0).reshape(8, 8))
    # rank 0's block (rows 0-3, cols 0-3) stays; rank 1 gives its block to rank 2 and back.
    np.testing.assert_array_equal(y.local_tensor(1), np.arange(64.0).reshape(8, 8)[4:, :4])


@pytest.mark.parametrize(
    ("src", "dst", "counts"),
    [
        ("S(0)R", "RR", {"all_gather": 4}),  # one call per x group (column) of the 2x4 mesh
        ("RS(1)", "RR", {"all_gather": 2}),  # one call per y group (row)
        ("P(sum)R", "RR", {"all_reduce": 4}),
        ("RP(sum)", "RS(0)", {"reduce_scatter": 2}),
        ("P(sum)P(sum)", "RR", {"all_reduce": 1}),
        ("S(0)R", "S(0)R", {}),
        ("RR", "S(0)S(1)", {}),
    ],
)
def test_pinned_collective_counts(src: str, dst: str, counts: dict[str, int]) -> None:
    mesh = dist.ProcessMesh(np.arange(8).reshape(2, 4), dim_names=["x", "y"])
    x = dist.shard_tensor(np.arange(48.0).reshape(8, 6), mesh, dist.parse_placements(src))
    with dist.CommDebugMode() as comm:
        y = dist.reshard(x, mesh, dist.parse_placements(dst))
    assert comm.counts() == counts
    np.testing.assert_allclose(y.full_tensor(), np.arange(48.0).reshape(8, 6))


def test_events_record_groups_sizes_and_reason() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    x = dist.shard_tensor(np.zeros((4, 6), dtype=np.float32), mesh, [dist.Shard(0), dist.Replicate()])
    with dist.CommDebugMode() as comm:
        dist.reshard(x, mesh, [dist.Replicate(), dist.Replicate()])
    assert [e.ranks for e in comm.events] == [(0, 2), (1, 3)]
    e = comm.events[0]
    assert (e.op, e.input_nbytes, e.output_nbytes, e.dtype) == ("all_gather", 2 * 6 * 4, 4 * 6 * 4, "float32")
    assert "S(0)R -> RR" in e.context


def test_cross_mesh_sends_each_element_once() -> None:
    """Pipeline hand-off R on [0..3] to R on [4..7]: slice, send quarters, gather on arrival."""
    mesh0 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    mesh1 = dist.ProcessMesh([4, 5, 6, 7], dim_names=["x"])
    x = dist.shard_tensor(np.arange(32.0).reshape(8, 4), mesh0, [dist.Replicate()])
    with dist.CommDebugMode() as comm:
        y = dist.reshard(x, mesh1, [dist.Replicate()])
    assert comm.counts() == {"send": 4, "all_gather": 1}
    assert sum(e.input_nbytes for e in comm.events if e.op == "send") == 32 * 8
    assert {e.ranks for e in comm.events if e.op == "send"} == {(0, 4), (1, 5), (2, 6), (3, 7)}
    np.testing.assert_array_equal(y.full_tensor(), np.arange(32.0).reshape(8, 4))


def _named_transitions() -> list[tuple[str, dist.DistSpec, dist.DistSpec]]:
    m1 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    m2 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    m2b = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])
    p = dist.parse_placements

    def s(shape: tuple[int, ...], mesh: dist.ProcessMesh, text: str) -> dist.DistSpec:
        return dist.DistSpec(shape, mesh, p(text))

    return [
        ("S->R", s((8, 6), m1, "S(0)"), s((8, 6), m1, "R")),
        ("P->R", s((8, 6), m1, "P(sum)"), s((8, 6), m1, "R")),
        ("P->S", s((8, 6), m1, "P(sum)"), s((8, 6), m1, "S(1)")),
        ("S(0)->S(1)", s((8, 6), m1, "S(0)"), s((8, 6), m1, "S(1)")),
        ("R->S", s((8, 6), m1, "R"), s((8, 6), m1, "S(0)")),
        ("R->P", s((8, 6), m1, "R"), s((8, 6), m1, "P(sum)")),
        ("S->P(max)", s((8, 6), m1, "S(0)"), s((8, 6), m1, "P(max)")),
        ("uneven S(0)->S(1)", s((5, 3), m1, "S(0)"), s((5, 3), m1, "S(1)")),
        ("2x2 PP->RR", s((8, 6), m2, "P(sum)P(sum)"), s((8, 6), m2, "RR")),
        ("2x2 transpose", s((8, 6), m2, "S(0)S(1)"), s((8, 6), m2, "S(1)S(0)")),
        ("2x2 nested gather", s((8, 6), m2, "S(0)S(0)"), s((8, 6), m2, "RR")),
        ("2x2 nested reorder", s((8, 6), m2, "RS(0)"), s((8, 6), m2, "S(0)R")),
        ("2x2 P,S(1) -> S(0),R", s((8, 6), m2, "P(sum)S(1)"), s((8, 6), m2, "S(0)R")),
        ("2x2 P(avg)P(sum) -> P(max)R", s((8, 6), m2, "P(avg)P(sum)"), s((8, 6), m2, "P(max)R")),
        (
            "seed 2.3 R[0,1] -> S(0)[2,3]",
            s((2, 3), dist.ProcessMesh([0, 1], dim_names=["x"]), "R"),
            s((2, 3), dist.ProcessMesh([2, 3], dim_names=["x"]), "S(0)"),
        ),
        ("seed 4.4 stage hand-off", s((4, 8, 16), m2, "S(0)S(2)"), s((4, 8, 16), m2b, "S(0)S(2)")),
        (
            "partial to another stage",
            s((8, 6), m2, "P(sum)R"),
            s((8, 6), dist.ProcessMesh([4, 5], dim_names=["x"]), "R"),
        ),
        ("2x2 -> 1-d same ranks", s((8, 6), m2, "S(0)S(1)"), s((8, 6), m1, "S(1)")),
    ]


def _render() -> str:
    blocks = []
    for name, src, dst in _named_transitions():
        blocks.append(f"## {name}\n{dist.plan_reshard(src, dst).format(itemsize=4)}")
    return "\n\n".join(blocks) + "\n"


def test_golden_plans() -> None:
    """Plans print stably; a behaviour change shows up in review. UPDATE_GOLDEN=1 rewrites."""
    text = _render()
    if os.environ.get("UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read()


def test_golden_transitions_are_correct() -> None:
    for name, src, dst in _named_transitions():
        value = np.random.default_rng(0).random(src.shape)
        x = dist.shard_tensor(value, src.mesh, list(src.placements))
        y = dist.reshard(x, dst.mesh, list(dst.placements))
        np.testing.assert_allclose(y.full_tensor(), value, rtol=1e-12, err_msg=name)
