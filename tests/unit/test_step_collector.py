"""The garbage collector's one-time freeze after the warm-up steps (``MPIPAR_GC``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest

import mpipar as dist
from mpipar.runtime import collector


@pytest.fixture
def thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (the freeze is process-wide)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_mode_from_env() -> None:
    assert collector.mode_from_env({}) == "freeze"
    assert collector.mode_from_env({"MPIPAR_GC": " Off "}) == "off"
    assert collector.mode_from_env({"MPIPAR_GC": "freeze"}) == "freeze"
    with pytest.raises(ValueError, match=r"MPIPAR_GC='sometimes' is not one of freeze, off"):
        collector.mode_from_env({"MPIPAR_GC": "sometimes"})


@pytest.mark.usefixtures("thawed")
def test_freezes_once_after_the_warmup_steps() -> None:
    steps = collector.StepCollector(warmup_steps=2)
    steps.step_done({})
    assert not steps.frozen and gc.get_freeze_count() == 0
    steps.step_done({})
    assert steps.frozen and gc.get_freeze_count() > 0
    gc.unfreeze()
    steps.step_done({})  # once per process: later steps leave the collector alone
    assert gc.get_freeze_count() == 0


@pytest.mark.usefixtures("thawed")
def test_off_leaves_the_collector_alone() -> None:
    steps = collector.StepCollector(warmup_steps=1)
    for _ in range(3):
        steps.step_done({"MPIPAR_GC": "off"})
    assert not steps.frozen and gc.get_freeze_count() == 0


@pytest.mark.usefixtures("thawed")
def test_the_optimizer_step_is_the_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = collector.StepCollector(warmup_steps=2)
    monkeypatch.setattr(collector, "step_collector", counted)
    w = dist.Parameter(np.ones((2, 2), np.float32))
    opt = dist.optimizer.SGD(learning_rate=0.1, parameters=[w])
    for step in range(2):
        dist.sum(dist.multiply(w, w)).backward()
        opt.step()
        opt.clear_grad()
        assert counted.steps == step + 1
    assert counted.frozen and gc.get_freeze_count() > 0
