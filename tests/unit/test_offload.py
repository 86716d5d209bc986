"""Optimizer offload: states on the host between steps, the same update, exact byte accounting.

The oracle is the same optimizer without offload: parameters and states must be equal bit for
bit, ``memory_report`` must move exactly the state bytes from the device to the host, and the
bytes counted per rank must be the states' local bytes once per move. The NCCL path (CuPy ->
NumPy and back) runs here with a fake device array module standing in for CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.backend import current_backend
from mpipar.optimizer.offload import OffloadConfig, move_states

SHAPE = (8, 6)


def _train(
    offload: bool,
    zero: bool = False,
    steps: int = 3,
    dtype: str = "float64",
    multi_precision: bool = False,
    master_weight: bool = False,
) -> tuple[np.ndarray, Any, dist.Tensor]:
    """A (8, 6) weight on a 2 x 2 (dp, tp) mesh, split over tp, trained ``steps`` steps with AdamW."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    rng = np.random.default_rng(7)
    w = dist.Parameter(rng.standard_normal(SHAPE), dtype=dtype, name="w")
    dist.shard_tensor(w, mesh, [dist.Replicate(), dist.Shard(1)])
    opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=[w], multi_precision=multi_precision)
    if zero:
        opt = dist.shard_optimizer(opt, dist.ShardingStage1("dp"))
    if offload:
        opt = dist.offload_optimizer(opt, master_weight=master_weight)
    for step in range(steps):
        x = dist.shard_tensor(
            dist.Tensor(np.random.default_rng(step).standard_normal((4, 8)).astype(dtype)),
            mesh,
            [dist.Shard(0), dist.Replicate()],
        )
        dist.sum(dist.multiply(dist.matmul(x, w), dist.matmul(x, w))).backward()
        opt.step()
        opt.clear_grad()
    return w.full_tensor(), opt, w


@pytest.mark.parametrize("zero", [False, True])
def test_offload_changes_no_value(zero: bool) -> None:
    plain, plain_opt, _ = _train(offload=False, zero=zero)
    moved, moved_opt, _ = _train(offload=True, zero=zero)
    np.testing.assert_array_equal(moved, plain)
    for (name, a), (name_b, b) in zip(
        plain_opt.state_tensors().items(), moved_opt.state_tensors().items(), strict=True
    ):
        assert name == name_b
        np.testing.assert_array_equal(b.full_tensor(), a.full_tensor())


@pytest.mark.parametrize("zero", [False, True])
def test_memory_report_moves_exactly_the_state_bytes_to_the_host(zero: bool) -> None:
    _, plain_opt, w = _train(offload=False, zero=zero, steps=1)
    on_device = dist.memory_report(parameters=[w], optimizer=plain_opt)
    _, opt, w2 = _train(offload=True, zero=zero, steps=1)
    split = dist.memory_report(parameters=[w2], optimizer=opt)
    # AdamW: two float64 moments of the rank's update shard (tp halves the columns, ZeRO-1 the rows too).
    local = 8 * 6 // 2 // (2 if zero else 1)
    for r in range(4):
        states = on_device.per_rank[r]["optimizer_state"]
        assert states == 2 * local * 8
        assert split.per_rank[r]["optimizer_state"] == 0
        assert split.host[r]["optimizer_state"] == states
        assert split.total(r) == on_device.total(r) - states
        assert split.host_total(r) == states
        assert split.to_dict()["ranks"][r]["host"]["optimizer_state"] == states
    assert "host (offload)" in split.table() and "host" not in on_device.table()
    assert "host" not in on_device.to_dict()["ranks"][0]


def test_bytes_moved_per_rank_are_counted_per_step() -> None:
    steps = 3
    _, opt, _ = _train(offload=True, zero=True, steps=steps)
    state_bytes = 2 * (8 * 6 // 4) * 8  # two moments of a (4, 3) float64 shard
    # Step 0 makes the states on the device (nothing to fetch); every step puts them back.
    assert opt.offload.moved == {
        r: {"to_device": (steps - 1) * state_bytes, "to_host": steps * state_bytes} for r in range(4)
    }


def test_master_weights_move_only_when_asked() -> None:
    _, states_only, w = _train(offload=True, dtype="float16", multi_precision=True, steps=1)
    _, with_master, w2 = _train(offload=True, dtype="float16", multi_precision=True, master_weight=True, steps=1)
    local = 8 * 6 // 2 * 4  # float32 elements of the rank's tp shard
    only = dist.memory_report(parameters=[w], optimizer=states_only)
    both = dist.memory_report(parameters=[w2], optimizer=with_master)
    assert (only.host[0]["optimizer_state"], only.per_rank[0]["optimizer_state"]) == (2 * local, local)
    assert (both.host[0]["optimizer_state"], both.per_rank[0]["optimizer_state"]) == (3 * local, 0)


class DeviceArray(np.ndarray):
    """An array in "device memory": what a CuPy array is to the NCCL backend."""


class FakeCuPy:
    """CuPy's stand-in: NumPy for the kernels, and the two copies offload makes, counted."""

    def __init__(self) -> None:
        self.copies = {"asarray": 0, "asnumpy": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def asarray(self, a: np.ndarray) -> DeviceArray:
        self.copies["asarray"] += 1
        return np.array(a).view(DeviceArray)

    def asnumpy(self, a: np.ndarray) -> np.ndarray:
        self.copies["asnumpy"] += 1
        return np.array(a)


def test_device_arrays_go_to_the_host_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a device array module the states really leave the device between steps (the NCCL path)."""
    fake = FakeCuPy()
    plain, plain_opt, _ = _train(offload=False)
    monkeypatch.setattr(type(current_backend()), "xp", property(lambda self: fake))
    seen: list[type] = []
    update = dist.optimizer.AdamW._update

    def spy(self: Any, p: Any, g: Any, states: dict[str, Any], lr: float, meta: dict[str, Any]) -> Any:
        if meta["step"] > 0:  # states fetched from the host must be device arrays in the update
            seen.extend(type(a) for a in states.values())
        return update(self, p, g, states, lr, meta)

    monkeypatch.setattr(dist.optimizer.AdamW, "_update", spy)
    moved, opt, _ = _train(offload=True)
    assert seen and set(seen) == {DeviceArray}
    np.testing.assert_array_equal(moved, plain)
    for t in opt.state_tensors().values():
        shards = t._shards
        assert all(type(a) is np.ndarray for a in shards.values())  # on the host between steps
        # Replicas (dp) share one host copy, as they shared one device array.
        assert shards[0] is shards[2] and shards[1] is shards[3]
    # Two states of two distinct tp shards: 4 device -> host copies per step, 3 steps (only offload
    # calls asnumpy; asarray also places inputs, so the fetches are checked by the spy above).
    assert fake.copies["asnumpy"] == 3 * 4
    for a, b in zip(plain_opt.state_tensors().values(), opt.state_tensors().values(), strict=True):
        np.testing.assert_array_equal(b.full_tensor(), a.full_tensor())


def test_move_states_on_a_dense_state_counts_every_rank() -> None:
    config = OffloadConfig()
    state = {"moment1": dist.Tensor(np.zeros((3, 5), np.float32)), "step": 2}
    move_states(state, ["moment1", "absent"], config, "to_host", ranks=(0, 1, 2))
    assert config.moved == {r: {"to_device": 0, "to_host": 60} for r in range(3)}
    with pytest.raises(ValueError, match="direction 'sideways'"):
        move_states(state, ["moment1"], config, "sideways", ranks=(0,))


def test_offload_refuses_what_is_not_an_optimizer() -> None:
    with pytest.raises(TypeError, match="offload_optimizer: list is not an mpipar optimizer"):
        dist.offload_optimizer([])
    w = dist.Parameter(np.zeros(3), name="w")
    with pytest.raises(TypeError, match="master_weight must be True or False, got 'yes'"):
        dist.offload_optimizer(dist.optimizer.SGD(parameters=[w]), master_weight="yes")  # type: ignore[arg-type]
