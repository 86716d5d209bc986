"""``dist.io``: Dataset, BatchSampler, DataLoader (Paddle's names), deterministic shuffling.

A ``DataLoader`` yields batches as lists of dense ``Tensor``s stacked from the samples, one per
field; a dataset whose samples are single arrays (not tuples) yields one ``Tensor`` per batch,
as Paddle's does, so ``dist.shard_tensor(x, ...)`` marks the very tensor the model runs on.
Shuffling uses the counter-based generator (``mpipar.random``), so every process -- and the
one-big-device reference -- sees the same order. ``DataLoader.state_dict()`` gives the
position for resumption.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpipar import random as mrandom
from mpipar.backend import get_rank, get_world_size
from mpipar.tensor import Tensor


class Dataset:
    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class BatchSampler:
    """Batches of indices; ``shuffle`` draws a permutation per epoch from the counter RNG."""

    def __init__(
        self,
        dataset: Dataset | None = None,
        sampler: Any = None,
        shuffle: bool = False,
        batch_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"BatchSampler batch_size must be positive, got {batch_size}")
        self.dataset, self.shuffle, self.batch_size, self.drop_last = dataset, shuffle, batch_size, drop_last
        self.num_samples = len(dataset) if dataset is not None else len(sampler)
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        order = (
            mrandom.permutation(mrandom.next_key(), self.num_samples) if self.shuffle else np.arange(self.num_samples)
        )
        self.epoch += 1
        for start in range(0, self.num_samples, self.batch_size):
            batch = order[start : start + self.batch_size].tolist()
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def __len__(self) -> int:
        n = self.num_samples // self.batch_size
        return n if self.drop_last or self.num_samples % self.batch_size == 0 else n + 1


class RandomBatchSampler:
    """Batches drawn with replacement, batch ``i`` a pure function of ``(seed, i)``.

    No generator state to save: resuming at batch ``k`` is ``RandomBatchSampler(..., start=k)``.
    """

    def __init__(
        self, num_samples: int, batch_size: int, seed: int = 0, start: int = 0, num_batches: int | None = None
    ) -> None:
        if num_samples <= 0 or batch_size <= 0:
            raise ValueError(f"RandomBatchSampler needs samples and a batch size > 0, got {num_samples}, {batch_size}")
        self.num_samples, self.batch_size, self.seed, self.start = num_samples, batch_size, seed, start
        self.num_batches = num_batches

    def batch(self, i: int) -> list[int]:
        u = mrandom.uniform_box(mrandom.key_for(self.seed, i), (self.batch_size,), ((0, self.batch_size),))
        return (u * self.num_samples).astype(np.int64).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        i = self.start
        while self.num_batches is None or i < self.num_batches:
            yield self.batch(i)
            i += 1

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an endless RandomBatchSampler has no length")
        return self.num_batches - self.start


class DistributedBatchSampler(BatchSampler):
    """The primer's manual data parallelism: rank ``rank`` of ``num_replicas`` takes every
    ``num_replicas``-th batch slice (the global batch is ``batch_size * num_replicas``)."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset, shuffle=shuffle, batch_size=batch_size * (num_replicas or get_world_size()), drop_last=drop_last
        )
        self.num_replicas = num_replicas or get_world_size()
        self.rank = get_rank() if rank is None else rank
        self.local_batch = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            yield batch[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]


def default_collate(samples: Sequence[Any]) -> list[Any]:
    first = samples[0]
    if isinstance(first, (tuple, list)):
        return [np.stack([np.asarray(s[i]) for s in samples]) for i in range(len(first))]
    return [np.stack([np.asarray(s) for s in samples])]


class DataLoader:
    """Iterate batches of a Dataset; ``loader()`` (as the seeds call it) is the same as ``iter(loader)``."""

    def __init__(
        self,
        dataset: Dataset,
        batch_sampler: BatchSampler | None = None,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[[Sequence[Any]], list[Any]] | None = None,
        num_workers: int = 0,
        return_list: bool = True,
        **_: Any,
    ) -> None:
        self.dataset = dataset
        self.batch_sampler = (
            batch_sampler
            if batch_sampler is not None
            else BatchSampler(dataset, shuffle=shuffle, batch_size=batch_size, drop_last=drop_last)
        )
        self.collate_fn = collate_fn or default_collate
        self.single_field: bool | None = None
        """Whether a sample is one array rather than a tuple of fields (known after the first load)."""
        self.batches_served = 0
        """Batches handed out since the loader was built (the resumption position)."""
        self._skip = 0

    def load_indices(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Collate the samples at ``indices`` into arrays (one per field)."""
        samples = [self.dataset[i] for i in indices]
        if samples and self.single_field is None:
            self.single_field = not isinstance(samples[0], (tuple, list))
        return self.collate_fn(samples)

    def index_batches(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0
        for i, batch in enumerate(self.batch_sampler):
            if i < skip:
                continue
            self.batches_served += 1
            yield batch

    def __iter__(self) -> Iterator[Tensor | list[Tensor]]:
        for batch in self.index_batches():
            fields = [Tensor(a) for a in self.load_indices(batch)]
            yield fields[0] if self.single_field and len(fields) == 1 else fields

    def __call__(self) -> Iterator[Tensor | list[Tensor]]:
        return iter(self)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def state_dict(self) -> dict[str, int]:
        return {"batches_served": self.batches_served, "epoch": getattr(self.batch_sampler, "epoch", 0)}

    def set_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration skips the batches already served in this epoch."""
        per_epoch = max(1, len(self.batch_sampler))
        if not isinstance(state, dict):
            raise ValueError(f"data loader state must be a dict with 'batches_served', got {state!r}")
        served = state.get("batches_served")
        if isinstance(served, bool) or not isinstance(served, int) or served < 0:
            raise ValueError(
                f"data loader state: batches_served must be a non-negative int (batches already served), got {served!r}"
            )
        self.batches_served = served
        self._skip = self.batches_served % per_epoch
