"""The training step (training/step.py) on one process with real torch optimizers: the non-finite skip on the
device and on the host, padding slots that weigh nothing, and the step's imports (the benchmarks' GPU box has
neither Kedro nor MLflow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lychee_pipeline.reranker.losses import LossOptions, get_loss
from lychee_pipeline.training.step import MicroBatch, OneProcess, TrainStep

GROUP_SIZE = 4
ROOT = Path(__file__).resolve().parents[2]


class TinyScorer(torch.nn.Module):
    """(yes, no) logits from 3 features per document: the shape of the reranker's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)


def micro_batch(weights: list[float], seed: int = 0, second_group_seed: int | None = None) -> MicroBatch:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(len(weights) * GROUP_SIZE, 3, generator=generator)
    if second_group_seed is not None:  # another second group, the first unchanged
        other = torch.Generator().manual_seed(second_group_seed)
        features[GROUP_SIZE: 2 * GROUP_SIZE] = torch.randn(GROUP_SIZE, 3, generator=other)
    labels = torch.zeros(len(weights) * GROUP_SIZE)
    labels[::GROUP_SIZE] = 1.0
    return MicroBatch({"features": features}, labels, torch.tensor(weights), 1.0, 0, {}, None)


def make_step(skip_on_device: bool) -> tuple[TrainStep, TinyScorer, torch.optim.lr_scheduler.LambdaLR]:
    model = TinyScorer()
    trainable = list(model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=0.1, **({"fused": True} if skip_on_device else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    step = TrainStep(OneProcess(torch.device("cpu")), model, optimizer, scheduler, trainable, get_loss("listwise"),
                     LossOptions(GROUP_SIZE, 1.0), max_grad_norm=1.0, skip_on_device=skip_on_device)
    return step, model, scheduler


# the skipped first step is the point: torch warns that the schedule stepped before the optimizer did
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
@pytest.mark.parametrize("skip_on_device", [True, False], ids=["fused-found_inf", "host-check"])
def test_a_non_finite_step_never_reaches_the_weights_and_the_schedule_moves_on(skip_on_device):
    step, model, scheduler = make_step(skip_on_device)
    before = [p.detach().clone() for p in model.parameters()]
    figures = step(micro_batch([1.0, 1.0]), nan_fault=True)
    assert figures.shape == (2,) and not torch.isfinite(figures).any()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # skipped
    assert scheduler.last_epoch == 1 and all(p.grad is None for p in model.parameters())
    figures = step(micro_batch([1.0, 1.0]))
    assert torch.isfinite(figures).all()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # this one stepped
    assert scheduler.last_epoch == 2


def test_a_padding_slot_weighs_nothing_in_the_step():
    """Weight 0 on the second group: whatever that group holds, the step moves the weights the same way."""
    results = []
    for weights, other in (([1.0, 0.0], 1), ([1.0, 0.0], 2), ([1.0, 1.0], 2)):
        step, model, _ = make_step(skip_on_device=False)
        step(micro_batch(weights, second_group_seed=other))
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[1], results[2])  # with weight 1 the same group does count


def test_the_step_and_the_benchmarks_import_without_kedro_or_mlflow():
    code = (
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('kedro', 'kedro_mlflow', 'mlflow'):\n"
        "            raise ImportError(f'{name} is not installed on the GPU box')\n"
        "sys.meta_path.insert(0, Absent())\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import train_stage, train_step\n"
        "from lychee_pipeline.training.step import TrainStep\n"
        "assert train_step.TrainStep is TrainStep\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]
