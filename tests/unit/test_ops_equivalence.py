"""Every op, forward and backward, on random meshes and input placements == the dense result.

Inputs come from each op's checker samples; placements (Shard, Replicate, Partial of every
type) and meshes (up to 2-d, uneven) are drawn by hypothesis. The distributed run goes
through dispatch (rule, reshard, per-rank kernel) and autograd; the oracle is the same
program on dense tensors. float64, tolerance 1e-12.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_scripts.kernels_on_device import nest_inputs as _nest
from strategies import meshes, placements_for

import mpipar as dist
from mpipar.ops import apply, get_op, registered_ops
from simulator.partial import random_partial_tensor

DIFFERENTIABLE = [op.name for op in registered_ops() if op.grad is not None and op.sample is not None]
ALL = [op.name for op in registered_ops() if op.sample is not None]


def _flat(inputs: list[Any]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for x in inputs:
        out.extend(np.asarray(v) for v in (x if isinstance(x, list) else [x]))
    return out


def _scale(arrays: list[np.ndarray]) -> float:
    return max([1.0] + [float(np.abs(a).max()) for a in arrays if a.size and np.issubdtype(a.dtype, np.floating)]) * 16


def _run(
    op_name: str, tensors: list[dist.Tensor], inputs: list[Any], attrs: dict[str, Any], cots: list[np.ndarray] | None
) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    op = get_op(op_name)
    out = apply(op_name, _nest(inputs, tensors), attrs)
    outs = list(out) if op.multi_output else [out]
    values = [o.full_tensor() for o in outs]
    grads: list[np.ndarray | None] = [None] * len(tensors)
    if cots is not None:
        loss = None
        for o, c in zip(outs, cots, strict=True):
            if np.issubdtype(o.dtype, np.floating) and not o.stop_gradient:
                term = dist.sum(dist.multiply(o, dist.to_tensor(c)))
                loss = term if loss is None else dist.add(loss, term)
        if loss is not None:
            loss.backward()
            grads = [t.grad.full_tensor() if t.grad is not None else None for t in tensors]
    return values, grads


@pytest.mark.parametrize("op_name", ALL)
@settings(max_examples=12)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_forward_and_backward_match_dense(op_name: str, data: st.DataObject, seed: int) -> None:
    op = get_op(op_name)
    rng = np.random.default_rng(seed)
    inputs, attrs = data.draw(st.sampled_from(op.sample(rng)))
    arrays = _flat(inputs)
    trainable = [
        np.issubdtype(a.dtype, np.floating) and (op.differentiable is None or i in op.differentiable)
        for i, a in enumerate(arrays)
    ]
    # dense oracle
    dense = [dist.Tensor(a, stop_gradient=not tr) for a, tr in zip(arrays, trainable, strict=True)]
    want, _ = _run(op_name, dense, inputs, attrs, None)
    cots = [rng.standard_normal(w.shape) for w in want] if op.grad is not None else None
    dense = [dist.Tensor(a, stop_gradient=not tr) for a, tr in zip(arrays, trainable, strict=True)]
    want, want_grads = _run(op_name, dense, inputs, attrs, cots)
    # distributed run
    mesh = data.draw(meshes(max_ranks=6, max_ndim=2, id_pool=6))
    tensors = []
    for a, tr in zip(arrays, trainable, strict=True):
        pls = data.draw(placements_for(mesh, a.ndim, partial=bool(np.issubdtype(a.dtype, np.floating))))
        # Partial inputs hold random contributions on every rank (not value + zeros).
        t = random_partial_tensor(a, dist.DistSpec(a.shape, mesh, pls), rng)
        t.stop_gradient = not tr
        tensors.append(t)
    got, got_grads = _run(op_name, tensors, inputs, attrs, cots)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (op_name, j)
        if np.issubdtype(w.dtype, np.floating):
            # 1e-12 relative to the data's scale (random partial contributions cancel on reduction)
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12 * _scale(arrays), err_msg=f"{op_name} output {j}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{op_name} output {j}")
    for i, (g, w) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert (g is None) == (w is None), (op_name, i)
        if w is not None:
            np.testing.assert_allclose(
                g, w, rtol=1e-12, atol=1e-12 * _scale(arrays), err_msg=f"{op_name} grad of input {i}"
            )


@pytest.mark.parametrize("op_name", DIFFERENTIABLE)
def test_gradients_match_finite_differences(op_name: str) -> None:
    """The gradient functions themselves are right (central differences on the dense path)."""
    op = get_op(op_name)
    rng = np.random.default_rng(1)
    for inputs, attrs in op.sample(rng)[:2]:
        arrays = _flat(inputs)
        float_in = [
            i
            for i, a in enumerate(arrays)
            if np.issubdtype(a.dtype, np.floating) and (op.differentiable is None or i in op.differentiable)
        ]
        tensors = [dist.Tensor(a, stop_gradient=i not in float_in) for i, a in enumerate(arrays)]
        probe = apply(op_name, _nest(inputs, tensors), attrs)
        probe = list(probe) if op.multi_output else [probe]
        # Outputs that carry a gradient get a random cotangent; the others (layer_norm's rstd) none.
        wanted = [np.issubdtype(o.dtype, np.floating) and not o.stop_gradient for o in probe]
        cots = [rng.standard_normal(o.shape) if w else np.zeros(o.shape) for o, w in zip(probe, wanted, strict=True)]
        # A float32 output (cast) needs a larger step; the ops checked this way are smooth there.
        eps = 1e-2 if any(o.dtype == np.float32 for o in probe) else 1e-6

        def f(
            arrs: list[np.ndarray], inputs: list = inputs, attrs: dict = attrs, cots: list = cots, wanted: list = wanted
        ) -> float:
            res = apply(op_name, _nest(inputs, [dist.Tensor(a) for a in arrs]), attrs)
            res = list(res) if op.multi_output else [res]
            return float(
                sum(
                    np.sum(r.full_tensor().astype(np.float64) * c)
                    for r, c, w in zip(res, cots, wanted, strict=True)
                    if w
                )
            )

        tensors = [dist.Tensor(a, stop_gradient=i not in float_in) for i, a in enumerate(arrays)]
        _, grads = _run(op_name, tensors, inputs, attrs, cots)
        for i in float_in:
            num = np.zeros_like(arrays[i])
            for idx in np.ndindex(arrays[i].shape):
                plus = [a.copy() for a in arrays]
                minus = [a.copy() for a in arrays]
                plus[i][idx] += eps
                minus[i][idx] -= eps
                num[idx] = (f(plus) - f(minus)) / (2 * eps)
            assert grads[i] is not None, (op_name, i)
            np.testing.assert_allclose(grads[i], num, rtol=1e-5, atol=1e-6, err_msg=f"{op_name} d/d input {i}")


def test_embedding_gradient_with_a_shard_of_no_columns() -> None:
    """A table of 4 columns split over 2 x 3 ranks leaves some ranks no column: the gradient's
    kernel must still reshape its empty slice (it once asked NumPy to infer a dim of it)."""
    rng = np.random.default_rng(0)
    ids = np.array([6, 2, 6, 4, 6, 1])
    table = rng.standard_normal((7, 4))
    cot = rng.standard_normal((6, 4))
    dense = dist.Tensor(table, stop_gradient=False)
    dist.sum(
        dist.multiply(apply("embedding", [dist.Tensor(ids), dense], {"padding_idx": 2}), dist.to_tensor(cot))
    ).backward()
    mesh = dist.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
    split = dist.shard_tensor(table, mesh, [dist.Shard(1), dist.Shard(1)])
    split.stop_gradient = False
    assert 0 in [split.spec.local_shape(r)[1] for r in range(6)]
    ids_t = dist.shard_tensor(ids, mesh, [dist.Replicate(), dist.Replicate()])
    out = apply("embedding", [ids_t, split], {"padding_idx": 2})
    dist.sum(dist.multiply(out, dist.to_tensor(cot))).backward()
    assert split.grad is not None and dense.grad is not None
    np.testing.assert_allclose(split.grad.full_tensor(), dense.grad.full_tensor(), rtol=1e-12, atol=1e-12)
