"""Start-up sizing: checkpointed layers from the memory budget, DataLoader settings from `auto`."""

from __future__ import annotations

import pytest

from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.training.config import DataLoaderParams, TrainingParams
from lychee_pipeline.training.memory import (PACKED_FUSED, PACKED_FUSED_LORA, PADDED, activation_costs, choose_checkpoint_layers,
                                             predicted_peak_gib, resolve_dataloader)

SEVEN_B = dict(hidden=3584, num_layers=28, weight_bytes=int(8.292e9 * 2))  # bf16 weights of the 7B


# The activation model's constants (training/memory.py) were FITTED on: the isolated step's layer sweep at 7,770
# padded tokens (20.4 / 39.9 / 50.6 GiB with 28 / 16 / 10 layers checkpointed -> KEPT) and two real stages with
# 17/28 layers checkpointed (33.3 GiB at 867 and 44.3 GiB at 1409 tokens/pair -> BASE). The peaks below were
# measured later, by runs whose `auto` plan chose other layer counts; none of them was used for fitting.
# (tokens of the longest micro-batch, layers checkpointed, measured peak GiB), from benchmarks/results/:
PADDED_STAGES_H200 = [  # 2026-12-03_h200_train_stage*.txt: padded batches, no fused kernels (what the model models)
    (7136, 15, 35.9),   # 851 tokens/pair
    (11752, 20, 37.7),  # 1391 tokens/pair
    (11760, 20, 37.7),  # 1391 tokens/pair, main after that day's merges
]
PACKED_LIGER_STAGES_H200 = [  # 2026-12-03_h200_train_stage_pack_liger_nocudnn.txt, 2026-12-04_..._hostpack.txt
    (7133, 15, 29.5),   # 851 tokens/pair, model.pack_pairs + liger kernels
    (11752, 20, 30.8),  # 1391 tokens/pair (also the H100 field runs of 2026-12-05: 29.5 and 30.8 GiB)
]


def test_the_model_predicts_peaks_it_was_not_fitted_on():
    """Padded stages (the regime the model describes) within 1 GiB; packed stages with liger kernels (less
    memory: no padding tokens, fused rotary and loss) at or below the prediction, so the plan stays in budget."""
    for tokens, layers, measured in PADDED_STAGES_H200:
        assert predicted_peak_gib(tokens, checkpointed=layers, **SEVEN_B) == pytest.approx(measured, abs=1.0), (
            tokens, layers)
    for tokens, layers, measured in PACKED_LIGER_STAGES_H200:
        predicted = predicted_peak_gib(tokens, checkpointed=layers, **SEVEN_B)
        assert measured <= predicted <= measured + 8.0, (tokens, layers, predicted)
    # the layer count the plan chose in those runs, for a 40 GiB budget (the runs logged 15 and 20)
    assert [choose_checkpoint_layers(t, budget_gib=40, **SEVEN_B).layers for t, _, _ in PADDED_STAGES_H200] == [
        15, 20, 20]


# Real stages with model.pack_pairs and liger kernels on one H100 (benchmarks/results/2026-12-05_h100_train_stage_
# {22,38,70}gib.txt), 851 tokens/pair: (tokens of the longest micro-batch, layers checkpointed, measured peak GiB).
# PACKED_FUSED was fitted on these; PACKED_LIGER_STAGES_H200 above were not used for it.
PACKED_LIGER_STAGES_H100 = [(7123, 26, 19.2), (7123, 16, 28.3), (7123, 0, 42.8)]


def test_packed_fused_constants_predict_the_packed_stages_within_a_gib():
    """The packed-and-fused regime: the points it was fitted on within 0.7 GiB, never below them (rounded up), and
    the stages it was not fitted on within 0.6 GiB."""
    for tokens, layers, measured in PACKED_LIGER_STAGES_H100:
        predicted = predicted_peak_gib(tokens, checkpointed=layers, costs=PACKED_FUSED, **SEVEN_B)
        assert measured <= predicted <= measured + 0.7, (tokens, layers, predicted)
    # ... and the stage the new plan ran at 1,391 tokens/pair within 40 GiB on the H100, after the fit
    # (2026-12-05_h100_train_stage_40gib_1400_packed_fused.txt: 16/28 layers, 36.6 GiB)
    for tokens, layers, measured in PACKED_LIGER_STAGES_H200 + [(11733, 16, 36.6)]:
        predicted = predicted_peak_gib(tokens, checkpointed=layers, costs=PACKED_FUSED, **SEVEN_B)
        assert predicted == pytest.approx(measured, abs=0.6), (tokens, layers, predicted)


def test_packed_fused_plans_fewer_checkpointed_layers_within_the_same_budget():
    """At 851 tokens/pair and 40 GiB the padded constants checkpoint 15 layers (what the H100 stage ran, 28.3-32.9
    GiB measured); the packed-and-fused ones 6, still predicted within the budget's 95%."""
    padded = choose_checkpoint_layers(7123, budget_gib=40, **SEVEN_B)
    packed = choose_checkpoint_layers(7123, budget_gib=40, costs=PACKED_FUSED, **SEVEN_B)
    assert padded.layers == 15 and packed.layers == 6
    assert packed.fits and packed.predicted_peak_gib <= 40 * 0.95
    assert "packed pairs with fused kernels" in packed.describe() and "padded batches" in padded.describe()
    # the regime a stage runs in picks the constants: only packed and fused together take the smaller ones
    assert activation_costs(packed=True, fused=True) is PACKED_FUSED
    assert {activation_costs(packed=p, fused=f) for p, f in ((True, False), (False, True), (False, False))} == {PADDED}
    assert activation_costs(packed=True, fused=True, lora_branch=True) is PACKED_FUSED_LORA
    assert activation_costs(packed=False, fused=True, lora_branch=True) is PADDED


# The one-function LoRA branch (reranker/lora_branch.py) on one H100, 851 tokens/pair, packed + liger
# (benchmarks/results/2026-12-06_h100_*lora_branch*.txt): real stages at 7,123 tokens a micro-batch with 0, 1 and 23 of
# 28 layers checkpointed peaked at 37.7, 37.0 and 21.0 GiB (42.8 with peft's forward at 0); the isolated step
# (7,199 tokens) at 39.3 GiB with 0/28 layers checkpointed and 34.8 with 6/28. PACKED_FUSED_LORA was fitted on these.
LORA_BRANCH_STAGES_H100 = [(7123, 0, 37.7), (7123, 1, 37.0), (7123, 23, 21.0)]
LORA_BRANCH_STEP_PER_LAYER_H100 = (7199, 6, 39.3 - 34.8)


def test_the_lora_branch_constants_predict_its_stages_from_above():
    for tokens, layers, measured in LORA_BRANCH_STAGES_H100:
        predicted = predicted_peak_gib(tokens, checkpointed=layers, costs=PACKED_FUSED_LORA, **SEVEN_B)
        assert measured <= predicted <= measured + 0.5, (tokens, layers, predicted)
    tokens, layers, gib = LORA_BRANCH_STEP_PER_LAYER_H100
    per_layers = tokens * SEVEN_B["hidden"] * PACKED_FUSED_LORA.kept * layers / 2**30
    assert per_layers == pytest.approx(gib, abs=0.2)
    # what it buys: within 40 GiB at 851 tokens/pair the plan keeps 27 of 28 layers (6 with PACKED_FUSED); a 24 GB
    # card's 22 GiB: 24 checkpointed, predicted within its 95%
    choice = choose_checkpoint_layers(7123, budget_gib=40, costs=PACKED_FUSED_LORA, **SEVEN_B)
    assert choice.fits and choice.layers == 1 and choice.predicted_peak_gib <= 40 * 0.95
    small = choose_checkpoint_layers(7123, budget_gib=22, costs=PACKED_FUSED_LORA, **SEVEN_B)
    assert small.fits and small.layers == 24 and small.predicted_peak_gib <= 22 * 0.95


def test_the_constants_reproduce_the_points_they_were_fitted_on():
    """Kept as the record of the calibration (it fails only if the constants change): real stages with 17/28
    layers checkpointed, groups of 8 (field notes, 2026-12-03)."""
    assert predicted_peak_gib(8 * 867, checkpointed=17, **SEVEN_B) == pytest.approx(33.3, abs=1.0)
    assert predicted_peak_gib(8 * 1409, checkpointed=17, **SEVEN_B) == pytest.approx(44.3, abs=1.0)
    # one more kept layer costs what the isolated step's sweep measured (1.68 GiB at 7,770 padded tokens)
    one_layer = (predicted_peak_gib(7770, checkpointed=16, **SEVEN_B)
                 - predicted_peak_gib(7770, checkpointed=17, **SEVEN_B))
    assert one_layer == pytest.approx(1.68, abs=0.25)


def test_long_pairs_get_more_checkpointed_layers_and_stay_in_the_budget():
    short = choose_checkpoint_layers(8 * 853, budget_gib=40, **SEVEN_B)
    long = choose_checkpoint_layers(8 * 1409, budget_gib=40, **SEVEN_B)
    assert short.fits and long.fits
    assert long.layers > 17  # the fixed 17 of the field run overshot 40 GiB at 1409 tokens/pair
    assert short.layers < long.layers
    for choice in (short, long):
        assert choice.predicted_peak_gib <= 40 * 0.95
        # the fewest layers that fit: one fewer would not
        assert predicted_peak_gib(choice.tokens, checkpointed=choice.layers - 1, **SEVEN_B) > 40 * 0.95
    assert "decoder layers checkpointed" in long.describe() and "40.0 GiB budget" in long.describe()


def test_a_large_budget_turns_checkpointing_off_and_an_impossible_one_checkpoints_everything():
    assert choose_checkpoint_layers(8 * 853, budget_gib=140, **SEVEN_B).layers == 0
    tight = choose_checkpoint_layers(8 * 3200, budget_gib=20, **SEVEN_B)
    assert tight.layers == 28 and not tight.fits and "OVER budget" in tight.describe()
    tiny = choose_checkpoint_layers(552, hidden=64, num_layers=4, weight_bytes=40_000_000, budget_gib=40)
    assert tiny.layers == 0 and tiny.fits
    with pytest.raises(ValueError):
        choose_checkpoint_layers(100, hidden=0, num_layers=4, weight_bytes=1, budget_gib=40)


def test_dataloader_auto_uses_workers_on_cuda_only():
    auto = DataLoaderParams().model_dump()
    assert resolve_dataloader(auto, "cuda", cpus=16, local_processes=1) == {
        "num_workers": 4, "pin_memory": True, "prefetch_factor": 2, "persistent_workers": True}
    assert resolve_dataloader(auto, "cuda", cpus=16, local_processes=8)["num_workers"] == 1  # 2 CPUs per GPU
    assert resolve_dataloader(auto, "cuda", cpus=8, local_processes=8) == {"num_workers": 0, "pin_memory": True}
    assert resolve_dataloader(auto, "cpu", cpus=2, local_processes=1) == {"num_workers": 0, "pin_memory": False}
    explicit = resolve_dataloader({"num_workers": 2, "prefetch_factor": 3, "persistent_workers": False,
                                   "pin_memory": True}, "cpu", cpus=2, local_processes=1)
    assert explicit == {"num_workers": 2, "pin_memory": False, "prefetch_factor": 3, "persistent_workers": False}


def test_parameters_accept_auto_and_refuse_nonsense():
    assert ModelConfig().activation_checkpointing == "auto"
    assert ModelConfig(activation_checkpointing=True).activation_checkpointing is True
    assert TrainingParams().memory_budget_gib == 40.0
    assert TrainingParams(dataloader={"num_workers": 3}).dataloader.num_workers == 3
    for bad in ({"dataloader": {"num_workers": -1}}, {"dataloader": {"workers": 2}}, {"memory_budget_gib": 0}):
        with pytest.raises(ValueError):
            TrainingParams(**bad)
    with pytest.raises(ValueError):
        ModelConfig(activation_checkpointing="sometimes")
