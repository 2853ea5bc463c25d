"""The epoch order: every record once per epoch on any N, padding that weighs nothing, the loss a mean over real groups."""

from __future__ import annotations

import pytest
import torch

from lychee_pipeline.reranker.losses import listwise_loss, pointwise_loss
from lychee_pipeline.training.sampling import EpochPermutation, loss_scale


def shard(slots, processes, batch):
    """Accelerate's default sharding of a batched loader: rank r takes batches r, r + N, r + 2N, ..."""
    batches = [slots[i:i + batch] for i in range(0, len(slots), batch)]
    return [batches[r::processes] for r in range(processes)]


@pytest.mark.parametrize("n, processes, batch", [(24, 1, 1), (24, 2, 1), (25, 3, 1), (24, 3, 3), (7, 4, 2), (2, 3, 1)])
def test_every_record_once_per_epoch_with_zero_weight_padding(n, processes, batch):
    sampler = EpochPermutation(n, seed=5, global_batch=processes * batch)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        slots = list(sampler)
        assert len(slots) == len(sampler) and len(slots) % (processes * batch) == 0
        assert sorted(s.record for s in slots if s.weight == 1.0) == list(range(n))
        assert all(s.weight == 0.0 for s in slots[n:]) and len(slots) - n < processes * batch
        ranks = shard(slots, processes, batch)
        assert len({len(r) for r in ranks}) == 1  # every rank runs the same number of micro-steps
        for step in zip(*ranks):
            real = sum(s.weight for b in step for s in b)
            assert all(s.real_in_batch == real for b in step for s in b)
    orders = []
    for epoch in (0, 1, 0):
        sampler.set_epoch(epoch)
        orders.append([s.record for s in sampler])
    assert orders[0] == orders[2] and (n < 3 or orders[0] != orders[1])


def test_padding_moves_no_weight_and_the_loss_is_the_mean_over_real_groups():
    """3 ranks, batch 1, 2 real groups: DDP's mean of the scaled local losses is the mean of the two real losses."""
    torch.manual_seed(0)
    group = 4
    logits = [torch.randn(group, 2, requires_grad=True) for _ in range(3)]
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    sampler = EpochPermutation(2, seed=1, global_batch=3)
    slots = list(sampler)
    for loss_fn in ("pointwise", "listwise"):
        local = []
        for rank, slot in enumerate(slots):
            weight = torch.tensor([slot.weight])
            if loss_fn == "pointwise":
                loss = pointwise_loss(logits[rank], labels, weight.repeat_interleave(group))
            else:
                loss = listwise_loss(logits[rank], group, weights=weight)
            local.append(loss * loss_scale([slot], processes=3))
        ddp_mean = sum(local) / 3
        if loss_fn == "pointwise":
            real = [pointwise_loss(logits[r], labels) for r in (0, 1)]
        else:
            real = [listwise_loss(logits[r], group) for r in (0, 1)]
        assert ddp_mean.item() == pytest.approx(sum(real).item() / 2, rel=1e-6)
        for t in logits:
            t.grad = None
        ddp_mean.backward()
        assert logits[2].grad.abs().max().item() == 0.0  # the padding slot
        assert logits[0].grad.abs().max().item() > 0.0


def test_weights_must_match_the_losses():
    with pytest.raises(ValueError, match="3 weights for 4 losses"):
        pointwise_loss(torch.zeros(4, 2), torch.zeros(4), torch.ones(3))
