"""Learning-rate schedules (Paddle's ``paddle.optimizer.lr``): call ``scheduler.step()`` once per step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mpipar import _capture_hooks


class LRScheduler:
    def __init__(self, learning_rate: float = 0.1, last_epoch: int = -1) -> None:
        self.base_lr = float(learning_rate)
        self.last_epoch = last_epoch
        self.last_lr = self.base_lr
        self.step()

    def get_lr(self) -> float:
        raise NotImplementedError

    def step(self, epoch: int | None = None) -> None:
        if _capture_hooks.capture_tracers and (tr := _capture_hooks.capture_tracer()) is not None:
            # A Python effect a captured program would not repeat: step the scheduler outside the step.
            tr.refuse("an LRScheduler steps inside the step (step it between calls: the program reads the rate live)")
        self.last_epoch = self.last_epoch + 1 if epoch is None else int(epoch)
        self.last_lr = self.get_lr()

    def __call__(self) -> float:
        return self.last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "last_lr": self.last_lr}

    def set_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self.last_lr = float(state["last_lr"])


class StepDecay(LRScheduler):
    def __init__(self, learning_rate: float, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size, self.gamma = step_size, gamma
        super().__init__(learning_rate, last_epoch)

    def get_lr(self) -> float:
        return self.base_lr * self.gamma ** (self.last_epoch // self.step_size)


class MultiStepDecay(LRScheduler):
    def __init__(
        self, learning_rate: float, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        self.milestones, self.gamma = sorted(milestones), gamma
        super().__init__(learning_rate, last_epoch)

    def get_lr(self) -> float:
        return self.base_lr * self.gamma ** sum(1 for m in self.milestones if self.last_epoch >= m)


class CosineAnnealingDecay(LRScheduler):
    def __init__(self, learning_rate: float, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(learning_rate, last_epoch)

    def get_lr(self) -> float:
        t = min(self.last_epoch, self.T_max)
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2


class LinearWarmup(LRScheduler):
    """Linear warm-up from ``start_lr`` to ``end_lr`` over ``warmup_steps``, then ``learning_rate``
    (a float or another scheduler, stepped from then on)."""

    def __init__(
        self,
        learning_rate: float | LRScheduler,
        warmup_steps: int,
        start_lr: float,
        end_lr: float,
        last_epoch: int = -1,
    ) -> None:
        self.after = learning_rate
        self.warmup_steps, self.start_lr, self.end_lr = warmup_steps, start_lr, end_lr
        super().__init__(end_lr, last_epoch)

    def get_lr(self) -> float:
        if self.last_epoch < self.warmup_steps:
            return self.start_lr + (self.end_lr - self.start_lr) * self.last_epoch / max(1, self.warmup_steps)
        if isinstance(self.after, LRScheduler):
            self.after.step(self.last_epoch - self.warmup_steps)
            return self.after()
        return float(self.after)
