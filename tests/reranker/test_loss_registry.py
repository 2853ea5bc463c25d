"""The loss registry: a loss is one function under a name, picked by `training.loss` the way train.py picks it."""

import pytest
import torch
from pydantic import ValidationError

from lychee_pipeline.reranker import GroupCollator
from lychee_pipeline.reranker.losses import (
    LOSSES,
    LossOptions,
    get_loss,
    listwise_loss,
    pointwise_loss,
    register_loss,
)
from lychee_pipeline.training.config import TrainingParams


@pytest.fixture
def margin_loss():
    """A pairwise hinge loss, registered for one test by one decorated function."""

    @register_loss("test_margin")
    def margin(logits, labels, group_weight, options: LossOptions):
        scores = (logits[:, 0] - logits[:, 1]).view(-1, options.group_size)
        hinge = torch.relu(1.0 - (scores[:, :1] - scores[:, 1:])).mean(dim=1)
        return (group_weight.to(hinge) * hinge).mean()

    yield margin
    del LOSSES["test_margin"]


def test_a_registered_loss_trains_the_tiny_model_by_its_name(make_model, margin_loss):
    with pytest.raises(ValidationError, match="Input should be 'pointwise', 'listwise' or 'test_margin'"):
        TrainingParams(loss="triplet")  # a registered loss is named among the known ones
    params = TrainingParams(loss="test_margin", group_size=3, temperature=0.5)
    compute_loss = get_loss(params.loss)  # train.py's selection, from the validated parameters
    assert compute_loss is margin_loss
    torch.manual_seed(0)
    model = make_model(finetune="lora", lora={"dropout": 0.0})
    collator = GroupCollator(model.processor, group_size=params.group_size, max_length=128, seed=0)
    rows = [
        {"record_id": f"r{i}", "query": {"text": f"{c} shoes", "image": None},
         "positives": [{"doc_id": f"p{i}", "text": f"{c} shoes", "image": None}],
         "negatives": [{"doc_id": f"n{i}{j}", "text": f"{o} hat", "image": None, "hard": True}
                       for j, o in enumerate(("green", "black"))],
         "task_type": "t2t"}
        for i, c in enumerate(("red", "blue"))
    ]
    batch = collator(rows)
    labels, group_weight = batch.pop("labels"), torch.tensor([1.0, 0.0])  # the second group: a padding slot
    batch.pop("group_size")
    before = [p.detach().clone() for p in model.trainable_parameters()]
    logits = model(**batch)
    loss = compute_loss(logits, labels, group_weight, params.loss_options())
    scores = (logits[:, 0] - logits[:, 1]).detach()
    expected = torch.relu(1.0 - (scores[0] - scores[1:3])).mean() / 2  # mean over 2 groups, the padding adds 0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    torch.optim.SGD(model.trainable_parameters(), lr=1.0).step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.trainable_parameters()))


def test_an_unknown_loss_is_a_one_line_error_naming_the_known_ones():
    with pytest.raises(ValueError) as error:
        get_loss("triplet")
    message = str(error.value)
    assert "\n" not in message and message.startswith("unknown loss 'triplet'")
    assert "pointwise" in message and "listwise" in message
    with pytest.raises(ValidationError, match="Input should be 'pointwise' or 'listwise'"):
        TrainingParams(loss="triplet")


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="'pointwise' is already registered"):
        register_loss("pointwise")(lambda logits, labels, group_weight, options: logits.sum())


def test_the_builtin_losses_by_name_give_the_numbers_of_the_loss_functions():
    torch.manual_seed(0)
    logits, labels = torch.randn(8, 2), torch.tensor([1.0, 0, 0, 0] * 2)
    weight = torch.tensor([1.0, 0.0])
    options = LossOptions(group_size=4, temperature=0.05)
    assert torch.equal(get_loss("pointwise")(logits, labels, weight, options),
                       pointwise_loss(logits, labels, torch.tensor([1.0] * 4 + [0.0] * 4)))
    assert torch.equal(get_loss("listwise")(logits, labels, weight, options),
                       listwise_loss(logits, 4, 0.05, weights=weight))


# A loss in a user's module: registered in the stage processes by `training.loss_modules`, not by losses.py.
USER_LOSS_MODULE = '''
from lychee_pipeline.reranker.losses import LossOptions, pointwise_loss, register_loss


@register_loss("offset_pointwise")
def offset_pointwise(logits, labels, group_weight, options: LossOptions):
    # the pointwise loss plus 100: the gradient is pointwise's, the logged losses show which loss ran
    weights = group_weight.to(logits.device).repeat_interleave(options.group_size)
    return pointwise_loss(logits, labels, weights) + 100.0
'''


@pytest.fixture
def user_loss_module(tmp_path, monkeypatch):
    """`offset_pointwise` in a module on the PYTHONPATH of this process and of the stage processes it starts."""
    import os
    import sys

    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "user_losses_for_test.py").write_text(USER_LOSS_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    for name in ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    yield "user_losses_for_test"
    LOSSES.pop("offset_pointwise", None)
    sys.modules.pop("user_losses_for_test", None)


def test_a_loss_from_a_user_module_trains_a_real_stage(tmp_path, user_loss_module):
    from lychee_pipeline.training.planning import plan_training, run_training_stage
    from lychee_pipeline.training.stage import StageSpec
    from lychee_pipeline.training.synthetic import write_colour_item_table

    assert "offset_pointwise" not in LOSSES  # known only once its module is imported
    table = str(write_colour_item_table(tmp_path / "data"))
    plan = plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 4}},
                         dict(loss_modules=[user_loss_module], loss="offset_pointwise", group_size=4, max_steps=2,
                              warmup_ratio=0.0, max_length=512, min_pixels=784, max_pixels=56 * 56),
                         {}, 1, "cpu", {"name": "loss", "output_root": str(tmp_path / "runs")})
    result = run_training_stage(table, plan, devices=1, final=True)
    spec = StageSpec.read(tmp_path / "runs/loss/stage_1cpu_final/spec.json")
    assert spec.training.loss_modules == [user_loss_module] and spec.training.loss == "offset_pointwise"
    # the stage process imported the module and trained with its loss: every logged loss carries the offset
    assert result.steps == 2 and len(result.losses) == 2
    assert all(100.0 < loss < 110.0 for _, loss in result.losses)


def test_a_loss_module_that_does_not_import_is_a_one_line_error_naming_it(tmp_path):
    from lychee_pipeline.training.planning import plan_training

    with pytest.raises(ValueError) as error:
        plan_training({"name_or_path": "builtin:tiny"}, {"loss_modules": ["no_such_losses_module"]}, {}, 1, "cpu",
                      {"name": "x", "output_root": str(tmp_path)})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("invalid parameter training.loss_modules: ")
    assert "loss module 'no_such_losses_module' does not import: ModuleNotFoundError" in message
