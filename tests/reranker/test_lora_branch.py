"""The one-function LoRA branch (reranker/lora_branch.py) against peft's own forward: same losses and gradients
(with dropout too, and under activation checkpointing), less kept for the backward, peft's forward wherever the
plain case does not hold."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig, get_peft_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from lychee_pipeline.reranker import GroupCollator, listwise_loss
from lychee_pipeline.reranker.lora_branch import fuse_lora_branches, unfuse_lora_branches, wants_fused


class TwoProjections(nn.Module):
    """q and k read the same input, as a decoder layer's q/k/v projections do."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 48, bias=False)
        self.k = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).tanh().sum() + (self.k(x) ** 2).mean()


def _peft_pair(dropout: float) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    peft_model = get_peft_model(TwoProjections(), PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                 target_modules=["q", "k"]))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the branch matter
            nn.init.normal_(param)
    fused = copy.deepcopy(peft_model)
    assert fuse_lora_branches(fused) == 2
    return peft_model.train(), fused.train()


def _loss_and_grads(model: nn.Module, x: torch.Tensor, seed: int, checkpointed: bool = False):
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    loss = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, x.grad.clone()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_losses_and_gradients_are_pefts(dropout):
    peft_model, fused = _peft_pair(dropout)
    x = torch.randn(2, 5, 32, requires_grad=True)
    loss_p, grads_p, gx_p = _loss_and_grads(peft_model, x, seed=1)
    loss_f, grads_f, gx_f = _loss_and_grads(fused, x, seed=1)
    assert set(grads_p) == set(grads_f) and len(grads_p) == 4  # A and B of q and k
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=1e-6)
    for name in grads_p:
        torch.testing.assert_close(grads_f[name], grads_p[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx_f, gx_p, rtol=1e-5, atol=1e-6)
    # the masks are drawn from the generator as peft's dropout draws them: another seed, another loss
    if dropout:
        assert not torch.equal(_loss_and_grads(fused, x, seed=2)[0], loss_f)


def test_checkpointing_replays_the_same_masks():
    _, fused = _peft_pair(0.3)
    x = torch.randn(2, 5, 32, requires_grad=True)
    loss, grads, gx = _loss_and_grads(fused, x, seed=3)
    loss_c, grads_c, gx_c = _loss_and_grads(fused, x, seed=3, checkpointed=True)
    assert torch.equal(loss, loss_c) and torch.equal(gx, gx_c)
    assert all(torch.equal(grads[name], grads_c[name]) for name in grads)


def test_the_backward_replay_leaves_the_generator_where_the_forward_left_it():
    peft_model, fused = _peft_pair(0.3)
    x = torch.randn(2, 5, 32, requires_grad=True)
    for model in (peft_model, fused):
        _loss_and_grads(model, x, seed=4)
        drawn_after = torch.rand(3)
        torch.manual_seed(4)
        model(x)  # the forward alone
        assert torch.equal(torch.rand(3), drawn_after)


def _kept_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of one forward."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    return sum(storages.values())


def test_the_backward_keeps_no_mask_nor_dropped_copy():
    peft_model, fused = _peft_pair(0.05)
    x = torch.randn(4, 64, 32, requires_grad=True)  # a decoder layer's input carries gradients
    x_bytes = x.numel() * x.element_size()
    kept_peft, kept_fused = _kept_bytes(peft_model, x), _kept_bytes(fused, x)
    # peft keeps, for each of the two projections, a dropped copy of x and the dropout's mask (on the CPU: its
    # scaled noise, x's size); the fused branch keeps x itself, once for both
    assert kept_peft - kept_fused >= 3 * x_bytes - 8192  # ... less the small adapter tensors the fused one keeps


def test_peft_runs_its_own_forward_outside_the_plain_training_case():
    peft_model, fused = _peft_pair(0.3)
    x = torch.randn(2, 5, 32)
    peft_model.eval(), fused.eval()
    assert torch.equal(peft_model(x), fused(x))  # eval: no dropout, peft's forward
    peft_model.train(), fused.train()
    with torch.no_grad():
        torch.manual_seed(5)
        expected = peft_model(x)
        torch.manual_seed(5)
        assert torch.equal(fused(x), expected)  # no gradients: peft's forward
    with fused.disable_adapter(), peft_model.disable_adapter():
        assert torch.equal(fused(x), peft_model(x))  # the base alone
    assert unfuse_lora_branches(fused) == 2 and unfuse_lora_branches(fused) == 0
    assert fuse_lora_branches(fused) == 2 and fuse_lora_branches(fused) == 2  # idempotent


def test_a_reranker_step_is_the_same_with_the_fused_branch(make_model, images):
    """builtin:tiny loaded as a LoRA fine-tune (default: fused), one listwise step with LoRA dropout on: the loss
    and every LoRA gradient equal those of ``model.lora.fused: false`` (peft's forward), with and without
    activation checkpointing."""
    rows = [{"record_id": "r0", "query": {"text": "red shoes", "image": images["red"]},
             "positives": [{"doc_id": "p0", "text": "red shoes", "image": None, "meta": "{}"}],
             "negatives": [{"doc_id": f"n{j}", "text": f"shoe {j}", "image": images["blue"] if j == 0 else None,
                            "hard": False, "meta": "{}"} for j in range(3)],
             "task_type": "i2t"}]
    for checkpointing in (False, True):
        results = {}
        for fused in (True, False):
            torch.manual_seed(0)
            model = make_model(finetune="lora", lora={"dropout": 0.1, "fused": fused},
                               activation_checkpointing=checkpointing)
            branches = [m for m in model.modules() if "forward" in m.__dict__ and hasattr(m, "lora_A")]
            assert bool(branches) == fused
            batch = GroupCollator(model.processor, group_size=4, max_length=256, seed=0)(rows)
            model.train()
            torch.manual_seed(1)
            loss = listwise_loss(model(**batch), batch["group_size"], temperature=1.0)
            loss.backward()
            results[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        (loss_f, grads_f), (loss_p, grads_p) = results[True], results[False]
        torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-6)
        assert set(grads_f) == set(grads_p) and all("lora_" in name for name in grads_f)
        for name in grads_p:
            torch.testing.assert_close(grads_f[name], grads_p[name], rtol=1e-4, atol=1e-6)


def test_auto_fuses_on_cuda_only(make_model):
    assert wants_fused("auto", torch.device("cuda", 0)) and not wants_fused("auto", torch.device("cpu"))
    assert wants_fused(True, torch.device("cpu")) and not wants_fused(False, torch.device("cuda"))
    model = make_model(finetune="lora")  # the default, auto, on this CPU: peft's forward
    assert not [m for m in model.modules() if "forward" in m.__dict__ and hasattr(m, "lora_A")]
