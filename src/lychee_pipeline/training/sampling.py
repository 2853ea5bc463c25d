"""The order in which a stage's ranks see the training records: every record exactly once per epoch, on any N.

Accelerate shards a loader's batches over N ranks and, when the records do not fill the last global batch,
repeats records from the start of the epoch (`even_batches`), so on N = 3 some records count twice. Here the
epoch is padded to whole global batches with zero-weight slots instead: every rank still runs the same number
of forward/backward passes (DDP needs that), the padding never moves the weights, and the loss of a global
batch is the mean over its real groups whatever the padding.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.utils.data import Sampler


class Slot(NamedTuple):
    """One place in an epoch's sequence, as the loader hands it to the collate function."""

    record: int  # row of the training table (for a padding slot: a real row, so shapes stay normal)
    weight: float  # 1.0 for a real slot, 0.0 for padding
    real_in_batch: int  # real slots in this slot's global batch (all ranks together)
    epoch: int = 0  # with the position: the optimizer step the slot's batch belongs to, known in any worker
    position: int = 0  # place in the epoch's (padded) sequence


class EpochPermutation(Sampler[Slot]):
    """A fresh permutation of the records each epoch, from (seed, epoch) only, so a resumed run sees the same order.

    `global_batch` is the number of slots one micro-step takes over all ranks (processes × per-device batch);
    the epoch is padded with zero-weight slots to a whole number of global batches.
    """

    def __init__(self, n: int, seed: int, global_batch: int = 1):
        if n < 1 or global_batch < 1:
            raise ValueError(f"need at least one record and a global batch >= 1, got {n} and {global_batch}")
        self.n, self.seed, self.global_batch, self.epoch = n, seed, global_batch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.n / self.global_batch) * self.global_batch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        for position in range(len(self)):
            real = min(self.global_batch, self.n - (position // self.global_batch) * self.global_batch)
            if position < self.n:
                yield Slot(order[position], 1.0, real, self.epoch, position)
            else:
                yield Slot(order[(position - self.n) % self.n], 0.0, real, self.epoch, position)


class SlotDataset(torch.utils.data.Dataset):
    """The loader's dataset: hands each slot to the collate function as it is (the records are read there)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, slot: Slot) -> Slot:
        return slot


def loss_scale(slots: list[Slot], processes: int) -> float:
    """Factor that makes DDP's mean over ranks of the local weighted loss the mean over the real groups.

    Local loss = mean over local slots of weight × loss; DDP averages the N ranks' gradients. With R real slots
    in the global batch of N × B, scaling each rank's loss by N × B / R gives (1/R) × sum of the real losses.
    """
    return processes * len(slots) / slots[0].real_in_batch
