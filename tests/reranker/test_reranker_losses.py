import math

import pytest
import torch

from lychee_pipeline.reranker.losses import listwise_loss, pointwise_loss


def test_pointwise_loss_hand_computed():
    # doc 1: (yes, no) = (2, 0), relevant -> -log(e^2 / (e^2 + 1)) = log(1 + e^-2)
    # doc 2: (yes, no) = (0, 1), not relevant -> -log(e^1 / (1 + e^1)) = log(1 + e^-1)
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([1.0, 0.0])
    expected = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-1))) / 2
    assert pointwise_loss(logits, labels).item() == pytest.approx(expected, abs=1e-6)


def test_pointwise_loss_equal_logits_is_log2_and_wrong_label_costs_more():
    logits = torch.zeros(3, 2)
    assert pointwise_loss(logits, torch.tensor([1.0, 0.0, 1.0])).item() == pytest.approx(math.log(2), abs=1e-6)
    confident_yes = torch.tensor([[3.0, -3.0]])
    assert pointwise_loss(confident_yes, torch.tensor([0.0])) > pointwise_loss(confident_yes, torch.tensor([1.0]))


def test_listwise_loss_hand_computed():
    # one group of 3, scores yes-no = (1, 0, -1): -log(e / (e + 1 + e^-1))
    logits = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    expected = -math.log(math.e / (math.e + 1 + math.exp(-1)))
    assert listwise_loss(logits, group_size=3).item() == pytest.approx(expected, abs=1e-6)
    # temperature 0.5 doubles the scores: -log(e^2 / (e^2 + 1 + e^-2))
    expected_t = -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-2)))
    assert listwise_loss(logits, group_size=3, temperature=0.5).item() == pytest.approx(expected_t, abs=1e-6)
    # raw yes logit scores (1, 0.5, 0)
    expected_yes = -math.log(math.e / (math.e + math.exp(0.5) + 1))
    assert listwise_loss(logits, 3, score="yes").item() == pytest.approx(expected_yes, abs=1e-6)


def test_listwise_loss_averages_groups():
    g1 = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # scores (1, 0): log(1 + e^-1)
    g2 = torch.tensor([[0.0, 0.0], [2.0, 0.0]])  # scores (0, 2): log(1 + e^2)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2))) / 2
    assert listwise_loss(torch.cat([g1, g2]), group_size=2).item() == pytest.approx(expected, abs=1e-6)


def test_losses_are_fp32_for_bf16_logits_and_check_shapes():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.bfloat16)
    assert pointwise_loss(logits, torch.tensor([1.0, 0.0])).dtype == torch.float32
    assert listwise_loss(logits, 2).dtype == torch.float32
    with pytest.raises(ValueError):
        listwise_loss(torch.zeros(5, 2), group_size=2)
    with pytest.raises(ValueError):
        pointwise_loss(torch.zeros(3, 3), torch.zeros(3))
    with pytest.raises(ValueError):
        pointwise_loss(torch.zeros(3, 2), torch.zeros(2))
