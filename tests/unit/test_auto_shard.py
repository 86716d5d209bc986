"""``dist.auto_shard``: placements chosen by pricing shape-only traces, for models with no annotations.

The GPT searches price on the ``cpu-local`` preset (slow FLOPs, fast links: tensor parallelism
pays at these small widths, so the search has something to find); the GPT is the built-in one,
``GPT(cfg)`` with no ``GPTParallel``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import mpipar as dist
from mpipar.autoshard import AutoShard
from mpipar.compile.plan import Plan
from mpipar.compile.trace import trace
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel, gpt_loss
from mpipar.nn import Embedding, Layer, Linear, ReLU, Sequential
from mpipar.tensor import Tensor
from simulator import ReferenceBackend, ShapeOnlyBackend
from simulator.auto_price import price_plan

CFG = GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=4, n_embd=256, dtype="float64")
BATCH = 8
MEGATRON = {
    "blocks.0.attn.q": "column",
    "blocks.0.attn.k": "column",
    "blocks.0.attn.v": "column",
    "blocks.0.attn.proj": "row",
    "blocks.0.mlp.fc": "column",
    "blocks.0.mlp.proj": "row",
}


def _cpu(plan: Plan) -> tuple[float, float]:
    return price_plan(plan, "cpu-local")


def _mesh() -> dist.ProcessMesh:
    return dist.ProcessMesh(np.arange(2).reshape(1, 2), dim_names=["dp", "tp"])


def _tokens(seed: int, cfg: GPTConfig = CFG) -> tuple[Tensor, Tensor]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, cfg.vocab_size, (2, BATCH, cfg.block_size))
    return Tensor(data[0]), Tensor(data[1])


def _gpt_step(model: GPT, idx: Tensor, tgt: Tensor) -> Tensor:
    return gpt_loss(model(idx), tgt)


class TiedGPT(GPT):
    """GPT-2's head: the logits are ``x @ wte.T`` (the output layer shares the embedding)."""

    def _build(self, cfg: GPTConfig, par: GPTParallel | None) -> None:
        super()._build(cfg, par)
        del self.lm_head

    def forward(self, idx: Tensor) -> Tensor:
        pos = Tensor(np.arange(idx.shape[1], dtype=np.int64))
        x = self.drop(dist.add(self.wte(idx), self.wpe(pos)))
        for block in self.blocks:
            x = block(x)
        return dist.matmul(self.ln_f(x), self.wte.weight, transpose_y=True)


@pytest.fixture(autouse=True)
def _one_blas_thread() -> Iterator[None]:
    """The training tests' small matmuls: one BLAS thread (a shared machine's threads fight otherwise)."""
    with threadpool_limits(limits=1):
        yield


@pytest.fixture(scope="module")
def gpt_plan() -> AutoShard:
    return dist.auto_shard(GPT(CFG), _mesh(), _tokens(0), step=_gpt_step, price=_cpu)


def _collectives(model: GPT, mesh: dist.ProcessMesh) -> Counter[tuple[str, str, float]]:
    """(phase, collective, bytes per rank) of every communicating reshard step of one traced step."""
    with dist.use_backend(ShapeOnlyBackend(world_size=2)):
        idx, tgt = (dist.shard_tensor(t, mesh, [dist.Replicate(), dist.Replicate()]) for t in _tokens(0))
        with trace() as rec:
            _gpt_step(model, idx, tgt).backward()
    plan = rec.plan()
    return Counter(
        (r.phase, s.kind, s.bytes_per_rank)
        for r in plan.reshards
        for s in r.steps
        if s.kind not in ("slice", "partial")
    )


def _hand(choices: dict[str, str]) -> Any:
    """A hand-written shard_fn laying the named sublayers out as ``choices`` on ``tp``."""

    def shard_fn(name: str, sub: Any, mesh: dist.ProcessMesh) -> None:
        choice = choices.get(name)
        split = {"column": (1, 0), "row": (0, None), "vocab": (0, None), "hidden": (1, None)}.get(choice or "")
        if split is None:
            return
        w, b = split
        dist.shard_tensor(sub.weight, mesh, [dist.Replicate(), dist.Shard(w)])
        bias = getattr(sub, "bias", None)
        if b is not None and bias is not None:
            dist.shard_tensor(bias, mesh, [dist.Replicate(), dist.Shard(b)])

    return shard_fn


# ----------------------------------------------------------------------------- the built-in GPT
def test_gpt_without_annotations_gets_megatrons_layout(gpt_plan: AutoShard) -> None:
    choices = gpt_plan.choices
    assert choices == {**MEGATRON, "lm_head": "column", "wte": "vocab", "wpe": "replicate"}
    # The cheapest layout the DP found splits wte by hidden (its output is all-gathered, half the
    # ring traffic of the vocabulary split's all_reduce) and wpe too; both are a fraction of a
    # percent of the step, far below the cost model's accuracy, so the conventional layouts
    # (Megatron's vocabulary-parallel embedding, a replicated position table) are kept.
    assert gpt_plan.cheapest_choices == {**choices, "wte": "hidden", "wpe": "hidden"}
    assert gpt_plan.cheapest.seconds < gpt_plan.chosen.seconds <= 1.01 * gpt_plan.cheapest.seconds
    report = gpt_plan.report()
    for unit in ("wte", "blocks.0.attn.q", "blocks.0.mlp.proj", "lm_head"):
        assert f"  {unit} (" in report
    assert "wte (Embedding): vocab [P; conventional: vocab within +0.2" in report
    assert "of hidden (the DP's choice), the conventional layout kept (tolerance 1%)" in report
    assert "wpe (Embedding): replicate [R; conventional: replicate within" in report
    assert "conventional layouts kept: wte hidden -> vocab" in report and "no change" in report
    assert gpt_plan.chosen.seconds < 0.6 * gpt_plan.baseline.seconds


def test_gpt_plan_collectives_equal_the_hand_annotated_model(gpt_plan: AutoShard) -> None:
    mesh = _mesh()
    auto = GPT(CFG)
    dist.shard_layer(auto, mesh, gpt_plan)
    got, hand = _collectives(auto, mesh), _collectives(GPT(CFG, GPTParallel([mesh])), mesh)
    assert got == hand
    # Megatron's forward: one all_reduce after the embedding and after each row-parallel layer.
    assert (
        sum(n for (phase, kind, _), n in got.items() if phase == "forward" and kind == "all_reduce")
        == 1 + 2 * CFG.n_layer
    )


def test_zero_tolerance_keeps_the_cheapest_embedding_which_differs_only_by_cheaper_collectives(
    gpt_plan: AutoShard,
) -> None:
    mesh = _mesh()
    cheapest = dist.auto_shard(GPT(CFG), mesh, _tokens(0), step=_gpt_step, price=_cpu, tolerance=0)
    assert cheapest.choices == cheapest.cheapest_choices == gpt_plan.cheapest_choices
    assert cheapest.chosen == gpt_plan.cheapest and "conventional layouts kept" not in cheapest.report()
    auto = GPT(CFG)
    dist.shard_layer(auto, mesh, cheapest)
    got, hand = _collectives(auto, mesh), _collectives(GPT(CFG, GPTParallel([mesh])), mesh)
    act = float(BATCH * CFG.block_size * CFG.n_embd * 8)  # the embedding's output, float64
    wpe = float(CFG.block_size * CFG.n_embd * 8)
    # The embedding's all_reduce becomes an all_gather of the half each rank holds, and wpe's
    # gradient is reduce-scattered into its split instead of all-reduced: nothing else moves.
    assert got - hand == Counter({("forward", "all_gather", act / 2): 1, ("backward", "reduce_scatter", wpe / 2): 1})
    assert hand - got == Counter({("forward", "all_reduce", act): 1, ("backward", "all_reduce", wpe): 1})


def test_built_in_gpt_with_the_embeddings_pinned_has_the_hand_annotated_collectives() -> None:
    mesh = _mesh()
    plan = dist.auto_shard(
        GPT(CFG), mesh, _tokens(0), step=_gpt_step, price=_cpu, fixed={"wte": "vocab", "wpe": "replicate"}
    )
    assert plan.choices == {**MEGATRON, "lm_head": "column", "wte": "vocab", "wpe": "replicate"}
    auto = GPT(CFG)
    dist.shard_layer(auto, mesh, plan)
    assert _collectives(auto, mesh) == _collectives(GPT(CFG, GPTParallel([mesh])), mesh)


def test_tied_head_makes_the_embedding_vocabulary_parallel_with_megatrons_collectives() -> None:
    mesh = _mesh()
    plan = dist.auto_shard(TiedGPT(CFG), mesh, _tokens(0), step=_gpt_step, price=_cpu, fixed={"wpe": "replicate"})
    assert plan.choices == {**MEGATRON, "wte": "vocab", "wpe": "replicate"}
    assert "[R; fixed]" in plan.report()
    auto, hand = TiedGPT(CFG), TiedGPT(CFG)
    dist.shard_layer(auto, mesh, plan)
    dist.shard_layer(hand, mesh, _hand({**MEGATRON, "wte": "vocab"}))
    got = _collectives(auto, mesh)
    assert got == _collectives(hand, mesh)
    # Megatron's forward: one all_reduce after the embedding and after each row-parallel layer.
    assert (
        sum(n for (phase, kind, _), n in got.items() if phase == "forward" and kind == "all_reduce")
        == 1 + 2 * CFG.n_layer
    )


def test_gpt_trained_with_the_chosen_layout_matches_one_device(gpt_plan: AutoShard) -> None:
    def losses() -> list[float]:
        dist.seed(0)
        model = GPT(CFG)
        dist.shard_layer(model, _mesh(), gpt_plan)
        opt = dist.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        out = []
        idx, tgt = (Tensor(t.numpy()[:2, :16]) for t in _tokens(1))  # a small batch: the layout fits any
        for _ in range(3):
            loss = _gpt_step(model, idx, tgt)
            loss.backward()
            opt.step()
            opt.clear_grad()
            out.append(float(loss.full_tensor()))
        return out

    sharded = losses()
    with dist.use_backend(ReferenceBackend()):
        one_device = losses()
    np.testing.assert_allclose(sharded, one_device, rtol=1e-10)
    assert sharded[-1] < sharded[0]


# ----------------------------------------------------------------------------- an MLP stack
def _mlp(width: int, depth: int) -> Sequential:
    layers: list[Any] = []
    for _ in range(depth):
        layers += [Linear(width, width), ReLU()]
    return Sequential(*layers)


def test_mlp_stack_gets_column_then_row_pairs() -> None:
    x = Tensor(np.zeros((256, 512)))
    plan = dist.auto_shard(_mlp(512, 4), _mesh(), (x,))  # default pricer: the a100-nvlink-ib preset
    assert plan.choices == {"0": "column", "2": "row", "4": "column", "6": "row"}
    assert plan.placements()["0.weight"] == [dist.Replicate(), dist.Shard(1)]
    assert plan.placements()["2.weight"] == [dist.Replicate(), dist.Shard(0)]
    no_bias = Sequential(Linear(512, 512, bias_attr=False), ReLU(), Linear(512, 512, bias_attr=False))
    plan = dist.auto_shard(no_bias, _mesh(), (x,))
    assert plan.placements() == {
        "0.weight": [dist.Replicate(), dist.Shard(1)],
        "2.weight": [dist.Replicate(), dist.Shard(0)],
    }


def test_mlp_trained_with_the_chosen_layout_matches_one_device() -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((64, 512)) for _ in range(3)]
    plan = dist.auto_shard(_mlp(512, 4), _mesh(), (Tensor(xs[0]),))

    def losses() -> list[float]:
        dist.seed(1)
        model = _mlp(512, 4)
        dist.shard_layer(model, _mesh(), plan)
        opt = dist.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        out = []
        for x in xs:
            loss = dist.mean(dist.square(model(Tensor(x))))
            loss.backward()
            opt.step()
            opt.clear_grad()
            out.append(float(loss.full_tensor()))
        return out

    sharded = losses()
    with dist.use_backend(ReferenceBackend()):
        one_device = losses()
    np.testing.assert_allclose(sharded, one_device, rtol=1e-12)


# ----------------------------------------------------------------------------- the DP itself
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_finds_the_brute_force_optimum_of_a_chain_priced_pairwise(seed: int) -> None:
    """A pricer whose step price is exactly a sum of per-layer and neighbour-pair terms (read off
    the traced plan's weight placements): the DP's answer is the cheapest of all 3**5 layouts."""
    import itertools

    depth = 5
    rng = np.random.default_rng(seed)
    unary = rng.uniform(0, 1, (depth, 3))
    pair = rng.uniform(0, 1, (depth - 1, 3, 3))
    codes = {"R": 0, "S(1)": 1, "S(0)": 2}  # replicate, column, row of a (6, 6) weight on a 1-D mesh
    names = ["replicate", "column", "row"]

    def price(plan: Plan) -> tuple[float, float]:
        layout = {
            t.name: codes[t.placements] for t in plan.tensors if t.kind == "parameter" and t.name.endswith("weight")
        }
        c = [layout[f"{2 * i}.weight"] for i in range(depth)]
        return float(
            sum(unary[i, c[i]] for i in range(depth)) + sum(pair[i, c[i], c[i + 1]] for i in range(depth - 1))
        ), 0.0

    def total(c: tuple[int, ...]) -> float:
        return float(sum(unary[i, c[i]] for i in range(depth)) + sum(pair[i, c[i], c[i + 1]] for i in range(depth - 1)))

    best = min(itertools.product(range(3), repeat=depth), key=total)
    plan = dist.auto_shard(
        _mlp(6, depth), dist.ProcessMesh([0, 1], dim_names=["tp"]), (Tensor(np.zeros((4, 6))),), price=price
    )
    assert plan.choices == {str(2 * i): names[c] for i, c in enumerate(best)}
    assert plan.chosen.seconds == pytest.approx(total(best))
    assert plan.converged and plan.traces < 3**depth


# ----------------------------------------------------------------------------- conventional layouts
class _Tables(Layer):
    """A token table indexed by the input and a position table indexed by what forward makes."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = Embedding(16, 8)
        self.pos = Embedding(16, 8)
        self.head = Linear(8, 4)

    def forward(self, ids: Tensor) -> Tensor:
        positions = Tensor(np.arange(ids.shape[1], dtype=np.int64))
        return self.head(dist.add(self.tok(ids), self.pos(positions)))


def _tables_price(tok_vocab: float) -> Any:
    """Step seconds read off the tables' placements: hidden splits cheapest, ``tok_vocab`` the vocab split's extra."""
    tok = {"R": 0.002, "S(0)": tok_vocab, "S(1)": 0.0}
    pos = {"R": 0.001, "S(0)": 0.003, "S(1)": 0.0}

    def price(plan: Plan) -> tuple[float, float]:
        layout = {t.name: t.placements for t in plan.tensors if t.kind == "parameter"}
        return 1.0 + tok[layout["tok.weight"]] + pos[layout["pos.weight"]], 0.0

    return price


@pytest.mark.parametrize(
    ("tok_vocab", "tolerance", "want"),
    [
        (0.004, 0.01, {"tok": "vocab", "pos": "replicate"}),  # both within 1%: the conventional layouts
        (0.02, 0.01, {"tok": "hidden", "pos": "replicate"}),  # the vocab split costs 2%: the price decides
        (0.004, 0.0, {"tok": "hidden", "pos": "hidden"}),  # no tolerance: the cheapest
    ],
)
def test_conventional_embeddings_are_kept_only_within_the_tolerance(
    tok_vocab: float,
    tolerance: float,
    want: dict[str, str],
) -> None:
    ids = Tensor(np.zeros((4, 5), dtype=np.int64))
    mesh = dist.ProcessMesh([0, 1], dim_names=["tp"])
    plan = dist.auto_shard(_Tables(), mesh, (ids,), price=_tables_price(tok_vocab), tolerance=tolerance)
    assert {k: plan.choices[k] for k in want} == want
    assert {k: plan.cheapest_choices[k] for k in want} == {"tok": "hidden", "pos": "hidden"}
    assert plan.cheapest.seconds == pytest.approx(1.0)
    assert plan.chosen.seconds <= (1 + tolerance) * plan.cheapest.seconds + 1e-12
    report = plan.report()
    if want["tok"] == "vocab":
        assert "tok (Embedding): vocab [P; conventional: vocab within +0.40% of hidden (the DP's choice)" in report
    elif tolerance:
        assert (
            "the conventional vocab would cost +2.00% of the step, over the tolerance (1% above the cheapest)" in report
        )


# ----------------------------------------------------------------------------- bad input
def test_bad_requests_name_what_is_wrong() -> None:
    mesh = _mesh()
    x = (Tensor(np.zeros((4, 6))),)
    with pytest.raises(
        ValueError, match=r"'nope' is not a Linear or Embedding sublayer of Sequential \(these are: \['0', '2'\]\)"
    ):
        dist.auto_shard(_mlp(6, 2), mesh, x, fixed={"nope": "row"})
    with pytest.raises(
        ValueError,
        match=r"'0' \(Linear\) cannot be 'vocab' on axis 'tp' of size 2; its candidates are \['replicate', 'column', 'row'\]",
    ):
        dist.auto_shard(_mlp(6, 2), mesh, x, fixed={"0": "vocab"})
    with pytest.raises(ValueError, match=r"axis 'pp' is not an axis of mesh"):
        dist.auto_shard(_mlp(6, 2), mesh, x, axis="pp")
    with pytest.raises(TypeError, match="example_inputs must be a tuple or list"):
        dist.auto_shard(_mlp(6, 2), mesh, x[0])
    odd = Sequential(Linear(6, 5), ReLU(), Linear(5, 6))
    plan = dist.auto_shard(odd, mesh, x, price=lambda p: (1.0, 0.0))
    assert [c.name for c in plan.units[0].candidates] == ["replicate", "row"]
    assert "weight dim 1 of length 5 does not divide by 2" in plan.report()
    one = dist.auto_shard(
        _mlp(6, 2), dist.ProcessMesh([[0], [1]], dim_names=["dp", "tp"]), x, price=lambda p: (1.0, 0.0)
    )
    assert one.choices == {"0": "replicate", "2": "replicate"} and "the split axis has one rank" in one.report()
    other = dist.ProcessMesh([0, 1], dim_names=["tp"])
    with pytest.raises(ValueError, match="auto_shard chose placements for mesh"):
        dist.shard_layer(_mlp(6, 2), other, plan)
    elsewhere = dist.shard_tensor(np.zeros((4, 6)), other, [dist.Shard(0)])
    with pytest.raises(ValueError, match=r"example input .* lives on mesh .* not on"):
        dist.auto_shard(_mlp(6, 2), mesh, (elsewhere,), price=lambda p: (1.0, 0.0))
    for bad in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match=rf"tolerance must be a fraction of the step in \[0, 1\), got {bad!r}"):
            dist.auto_shard(_mlp(6, 2), mesh, x, tolerance=bad)
    with pytest.raises(ValueError, match="rounds must be an int >= 1, got 0"):
        dist.auto_shard(_mlp(6, 2), mesh, x, rounds=0)
    with pytest.raises(ValueError, match=r"finite non-negative \(seconds, bytes\), got \(nan, 0.0\)"):
        dist.auto_shard(_mlp(6, 2), mesh, x, price=lambda p: (float("nan"), 0.0))
    with pytest.raises(ValueError, match="no hardware profile 'nope'"):
        dist.auto_shard(_mlp(6, 2), mesh, x, price=lambda p: price_plan(p, "nope"))
    with pytest.raises(TypeError, match=r"must return \(seconds, bytes\), got 'fast'"):
        dist.auto_shard(_mlp(6, 2), mesh, x, price=lambda p: "fast")


class _WithSpare(Layer):
    """A Linear the step never calls: nothing to price, it stays replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.used = Linear(6, 6)
        self.spare = Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def test_a_layer_the_step_does_not_use_stays_replicated() -> None:
    plan = dist.auto_shard(_WithSpare(), _mesh(), (Tensor(np.zeros((4, 6))),), price=lambda p: (1.0, 0.0))
    assert plan.choices["spare"] == "replicate"
    assert "spare (Linear): replicate [R; not used by the step]" in plan.report()


def test_data_parallel_axis_keeps_parameters_replicated_and_matches_one_device() -> None:
    mesh = dist.ProcessMesh(np.arange(4).reshape(2, 2), dim_names=["dp", "tp"])
    x = np.random.default_rng(0).standard_normal((256, 512))
    plan = dist.auto_shard(_mlp(512, 2), mesh, (dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]),))
    assert plan.choices == {"0": "column", "2": "row"}
    assert plan.placements()["2.bias"] == [dist.Replicate(), dist.Replicate()]

    def losses() -> list[float]:
        dist.seed(0)
        model = _mlp(512, 2)
        dist.shard_layer(model, mesh, plan)
        opt = dist.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        out = []
        for _ in range(2):
            loss = dist.mean(dist.square(model(dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]))))
            loss.backward()
            opt.step()
            opt.clear_grad()
            out.append(float(loss.full_tensor()))
        return out

    sharded = losses()
    with dist.use_backend(ReferenceBackend()):
        one_device = losses()
    np.testing.assert_allclose(sharded, one_device, rtol=1e-12)


@pytest.mark.mpi
def test_under_mpi_every_process_agrees_and_training_matches_one_device() -> None:
    from mpi_scripts.launch import mpirun

    run = mpirun(2, "tests/mpi_scripts/auto_shard_mlp.py", timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    assert run.lines_of(0)[-1].startswith("ok 0=column,2=row [")
