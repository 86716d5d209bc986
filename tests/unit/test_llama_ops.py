"""The Llama blocks' ops against independent NumPy formulas and against their dense runs on split layouts.

(Every op also runs in ``test_ops_equivalence.py``'s generic check: random meshes and input
placements, forward and backward, == the dense run.) Here:

* fused attention == attention from separate ops (matmul, mask, softmax, matmul; their own
  tests vouch for them), forward and backward, over generated shapes, key blocks, grouped
  heads and sequence orders, float64;
* rotary embedding == Hugging Face's rotate-half formula; rms_norm and swiglu == NumPy;
* the splits the rules promise, with their collectives pinned: the query sequence split (keys
  and values all-gathered forward, their gradients reduce-scattered backward: context
  parallel), the heads split with key/value heads split, and replicated when the split
  exceeds them (their gradients then all-reduced).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar.nn import functional as F
from mpipar.ops import apply
from mpipar.spec import zigzag_order
from mpipar.spmd import infer_forward


def _plain_attention(q: dist.Tensor, k: dist.Tensor, v: dist.Tensor, qpos: np.ndarray, kpos: np.ndarray) -> dist.Tensor:
    """Attention from separate ops, (B, S, H, D) in and out, key/value heads repeated."""
    b, _, h, d = q.shape
    hk = k.shape[2]
    qt = dist.transpose(q, [0, 2, 1, 3])
    kt = dist.transpose(k, [0, 2, 1, 3])
    vt = dist.transpose(v, [0, 2, 1, 3])
    if hk != h:
        sk = k.shape[1]
        kt = dist.reshape(dist.expand(dist.unsqueeze(kt, 2), [b, hk, h // hk, sk, d]), [b, h, sk, d])
        vt = dist.reshape(dist.expand(dist.unsqueeze(vt, 2), [b, hk, h // hk, sk, d]), [b, h, sk, d])
    mask = np.where(kpos[None, :] > qpos[:, None], -np.inf, 0.0)
    att = dist.add(dist.scale(dist.matmul(qt, kt, transpose_y=True), 1.0 / np.sqrt(d)), dist.Tensor(mask))
    return dist.transpose(dist.matmul(F.softmax(att, axis=-1), vt), [0, 2, 1, 3])


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    s=st.integers(1, 9),
    hk=st.integers(1, 2),
    group=st.integers(1, 3),
    d=st.sampled_from([2, 4]),
    block=st.integers(1, 10),
    permuted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_attention_equals_separate_ops(
    b: int, s: int, hk: int, group: int, d: int, block: int, permuted: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    h = hk * group
    arrays = [rng.standard_normal((b, s, h, d)), rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d))]
    pos = rng.permutation(s) if permuted else np.arange(s)
    cot = rng.standard_normal((b, s, h, d))

    def run(fused: bool) -> tuple[np.ndarray, list[np.ndarray]]:
        ts = [dist.Tensor(a, stop_gradient=False) for a in arrays]
        if fused:
            out = F.scaled_dot_product_attention(
                *ts, is_causal=True, positions=pos if permuted else None, block_size=block
            )
        else:
            out = _plain_attention(*ts, pos, pos)
        dist.sum(dist.multiply(out, dist.Tensor(cot))).backward()
        return out.numpy(), [t.grad.numpy() for t in ts]

    (want, want_g), (got, got_g) = run(False), run(True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_fused_attention_keeps_no_score_matrix() -> None:
    """Backward keeps q, k, v, the output and the (B, S, H) log-sum-exp: nothing S x S."""
    rng = np.random.default_rng(0)
    q, k, v = (dist.Tensor(rng.standard_normal((1, 64, 2, 4)), stop_gradient=False) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, block_size=16)
    saved = [t for t in out._grad_fn.ctx.inputs + out._grad_fn.ctx.outputs if t is not None]
    assert sorted(tuple(t.shape) for t in saved) == sorted([(1, 64, 2, 4)] * 4 + [(1, 64, 2)])


def test_rotary_embedding_is_hugging_faces_rotate_half() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 3, 8))
    pos = np.array([0, 5, 1, 4, 2, 3])
    inv = 500000.0 ** (-np.arange(0, 8, 2) / 8)
    ang = np.concatenate([pos[:, None] * inv] * 2, axis=-1)[None, :, None, :]  # HF: cat(freqs, freqs)
    rot = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)  # rotate_half
    want = x * np.cos(ang) + rot * np.sin(ang)
    got, _, _ = F.fused_rotary_position_embedding(dist.Tensor(x), position_ids=pos, rotary_emb_base=500000.0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=1e-13)


def test_rms_norm_and_swiglu_match_numpy() -> None:
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((3, 5, 8)), rng.standard_normal(8)
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(F.rms_norm(dist.Tensor(x), 8, dist.Tensor(w), 1e-5).numpy(), want, rtol=1e-13)
    g, u = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(F.swiglu(dist.Tensor(g), dist.Tensor(u)).numpy(), want, rtol=1e-13)
    np.testing.assert_allclose(F.swiglu(dist.Tensor(np.concatenate([g, u], -1))).numpy(), want, rtol=1e-13)
    np.testing.assert_allclose(F.silu(dist.Tensor(g)).numpy(), g / (1 + np.exp(-g)), rtol=1e-13)


# ---------------------------------------------------------------------- splits and their collectives
def _split_run(
    mesh: dist.ProcessMesh, q_pl: list, kv_pl: list, h: int, hk: int, seed: int = 0
) -> tuple[Counter[str], Counter[str], list[np.ndarray], list[np.ndarray], list[str]]:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((2, 8, h, 4)), rng.standard_normal((2, 8, hk, 4)), rng.standard_normal((2, 8, hk, 4))]
    cot = rng.standard_normal((2, 8, h, 4))
    dense = [dist.Tensor(a, stop_gradient=False) for a in arrays]
    out = F.scaled_dot_product_attention(*dense, is_causal=True, block_size=3)
    dist.sum(dist.multiply(out, dist.Tensor(cot))).backward()
    want = [out.numpy()] + [t.grad.numpy() for t in dense]
    ts = [dist.shard_tensor(a, mesh, pl) for a, pl in zip(arrays, [q_pl, kv_pl, kv_pl], strict=True)]
    for t in ts:
        t.stop_gradient = False
    c = dist.shard_tensor(cot, mesh, q_pl)
    with dist.CommDebugMode() as fwd:
        out = F.scaled_dot_product_attention(*ts, is_causal=True, block_size=3)
    with dist.CommDebugMode() as bwd:
        dist.sum(dist.multiply(out, c)).backward()
    got = [out.full_tensor()] + [t.grad.full_tensor() for t in ts]
    grads = [t.grad.spec.placements_str for t in ts]
    return Counter(fwd.counts()), Counter(bwd.counts()), got, want, grads


def _close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_sequence_split_gathers_keys_and_reduce_scatters_their_gradients() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["cp"])
    seq = [dist.Shard(1)]
    fwd, bwd, got, want, grads = _split_run(mesh, seq, seq, h=4, hk=2)
    _close(got, want)
    assert fwd == Counter({"all_gather": 2})  # key and value
    # dk, dv: each rank's queries contribute to every key (Partial), reduce-scattered to the key's split
    assert bwd["reduce_scatter"] == 2 and "all_gather" not in bwd
    assert grads == ["S(1)", "S(1)", "S(1)"]


def test_heads_split_needs_no_communication_when_key_value_heads_divide() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["tp"])
    heads = [dist.Shard(2)]
    fwd, bwd, got, want, _ = _split_run(mesh, heads, heads, h=4, hk=2)
    _close(got, want)
    assert not fwd and not bwd.get("all_gather") and not bwd.get("all_reduce")


def test_heads_split_beyond_key_value_heads_replicates_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp=4 over 2 key/value heads: each rank reads the key/value head of its query head; the
    key/value gradients are Partial over tp and all-reduced (one each)."""
    # one all-reduce per gradient, as pinned below (the default buckets would fuse them into one)
    monkeypatch.setenv("MPIPAR_GRAD_BUCKET_MIB", "off")
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
    fwd, bwd, got, want, grads = _split_run(mesh, [dist.Shard(2)], [dist.Replicate()], h=4, hk=2)
    _close(got, want)
    assert not fwd
    assert bwd["all_reduce"] == 2 and grads[1:] == ["R", "R"]
    spec = dist.DistSpec((2, 8, 4, 4), mesh, [dist.Shard(2)])
    kv = dist.DistSpec((2, 8, 2, 4), mesh, [dist.Shard(2)])
    res = infer_forward("scaled_dot_product_attention", [spec, kv, kv])
    assert [s.placements_str for s in res.flat_inputs()] == ["S(2)", "R", "R"]
    assert "key/value heads replicated" in res.reason


def test_two_axes_batch_and_sequence() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    pl = [dist.Shard(0), dist.Shard(1)]
    fwd, bwd, got, want, _ = _split_run(mesh, pl, pl, h=2, hk=1, seed=3)
    _close(got, want)
    # key and value, each gathered in both cp groups (one per dp row); their gradients likewise
    assert fwd == Counter({"all_gather": 4}) and bwd["reduce_scatter"] == 4


def test_rope_splits_with_its_positions() -> None:
    """Sequence-split x rotates each token by its global position: positions follow the split."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["cp"])
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 8, 2, 4))
    pos = zigzag_order(8, 2)
    want, _, _ = F.fused_rotary_position_embedding(dist.Tensor(x), position_ids=pos)
    with dist.CommDebugMode() as comm:
        got, _, _ = F.fused_rotary_position_embedding(dist.shard_tensor(x, mesh, [dist.Shard(1)]), position_ids=pos)
    assert got.spec.placements_str == "S(1)" and not comm.events  # positions sliced locally
    np.testing.assert_allclose(got.full_tensor(), want.numpy(), rtol=1e-13)


def test_zigzag_order_balances_causal_work() -> None:
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    for cp in (2, 4):
        order = zigzag_order(32, cp)
        assert sorted(order.tolist()) == list(range(32))
        # visible (query, key) pairs of each rank's queries: every key up to the query's position
        work = [int(np.sum(part + 1)) for part in np.split(order, cp)]
        assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match=r"length 10 must divide into 2 x cp\(4\)"):
        zigzag_order(10, 4)


def test_bad_attention_inputs_are_named_errors() -> None:
    q = dist.Tensor(np.zeros((1, 4, 3, 2)))
    kv = dist.Tensor(np.zeros((1, 4, 2, 2)))
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 key/value heads"):
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    with pytest.raises(ValueError, match="position_ids must be 4 integers"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True, positions=np.arange(3))
    with pytest.raises(ValueError, match="head_dim must be even"):
        apply("fused_rotary_position_embedding", [dist.Tensor(np.zeros((1, 2, 1, 3))), dist.Tensor(np.arange(2))])
