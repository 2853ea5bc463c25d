"""The memory model's one-line advice (training/memory.py ``over_budget_advice``) and the stage benchmark's
refusal through it (``benchmarks/train_stage.py --memory-budget-gib N``): when a stage cannot fit the budget even
with every decoder layer checkpointed, one line names the setting to change instead of a run out of memory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from lychee_pipeline.training import memory

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
WEIGHTS_7B = int(8.29e9 * 2)  # Qwen2.5-VL-7B in bf16
HIDDEN, LAYERS = 3584, 28


def _plan(tokens_per_pair: int, budget: float, pairs: int = 8):
    choice = memory.choose_checkpoint_layers(tokens_per_pair * pairs, HIDDEN, LAYERS, WEIGHTS_7B, budget)
    return choice, memory.over_budget_advice(choice, HIDDEN, WEIGHTS_7B, pairs)


@pytest.mark.parametrize("budget", [22.0, 38.0, 70.0])
def test_a_7b_lora_stage_at_851_tokens_a_pair_is_planned_within_22_38_and_70_gib(budget):
    choice, advice = _plan(851, budget)
    assert choice.fits and advice is None
    assert choice.predicted_peak_gib <= budget
    if budget == 70.0:
        assert choice.layers == 0  # room for every layer's activations: nothing recomputed


def test_too_many_tokens_a_pair_for_the_budget_names_the_tokens_that_fit():
    choice, advice = _plan(6000, 22.0)
    assert not choice.fits
    assert "\n" not in advice
    assert advice.startswith("memory budget 22 GiB: even with all 28 decoder layers checkpointed the memory model "
                             "predicts ")
    fit = int(advice.split("at most ~")[1].split(" ")[0])
    assert 3000 < fit < 6000
    assert "a smaller training.max_pixels or max_length" in advice and "qlora" in advice
    assert _plan(fit, 22.0)[0].fits and not _plan(int(fit * 1.1), 22.0)[0].fits


def test_weights_that_fill_the_budget_point_to_qlora():
    choice, advice = _plan(851, 16.0)
    assert not choice.fits
    assert "the weights leave no room for activations: set model.finetune: qlora" in advice
    assert "smaller model" not in advice  # QLoRA's ~6 GiB of weights fit 16 GiB
    assert "smaller model" in _plan(851, 4.0)[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from lychee_pipeline.reranker.tiny import ensure_tiny

    return str(ensure_tiny(tmp_path_factory.mktemp("tiny") / "builtin_tiny"))


def test_the_stage_benchmark_refuses_in_one_line_through_the_memory_model(tiny_dir):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_stage
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = argparse.Namespace(checkpoint_layers="auto", group_size=4, pack_pairs=True, kernels="auto",
                              lora_fused="auto", memory_budget_gib=0.001)
    refusal = train_stage.budget_refusal(Path(tiny_dir), [150, 160, 170, 180], args, "cpu")
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("memory budget 0 GiB: even with all ")
    args.memory_budget_gib = 40.0
    assert train_stage.budget_refusal(Path(tiny_dir), [150, 160, 170, 180], args, "cpu") is None
    args.checkpoint_layers = "4"  # a fixed count: the stage is run as asked
    args.memory_budget_gib = 0.001
    assert train_stage.budget_refusal(Path(tiny_dir), [150, 160, 170, 180], args, "cpu") is None
