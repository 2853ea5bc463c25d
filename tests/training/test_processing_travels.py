"""The processing settings a model was trained with travel with it (the train/serve contract).

A real stage trains at a non-default pixel budget; then the evaluation node, `Reranker.from_pretrained` on the
saved adapter and the logged MLflow model score the same pairs with those settings and agree.
"""

from __future__ import annotations

import math

import mlflow
import pandas as pd
import pytest
from PIL import Image

from lychee_pipeline.evaluation.scoring import candidate_table
from lychee_pipeline.pipelines.evaluation.nodes import score_test_set
from lychee_pipeline.training.planning import plan_training, run_training_stage
from lychee_pipeline.reranker import GroupCollator, PairCollator, ProcessingConfig, Reranker
from lychee_pipeline.reranker.collate import DEFAULT_MAX_PIXELS
from lychee_pipeline.reranker.model import read_metadata
from lychee_pipeline.reranker.prompt import instruction_for
from lychee_pipeline.tracking import log_reranker_model

TRAINED_PIXELS = 56 * 56  # far below the library default (1280 × 28 × 28), so the two settings score differently


@pytest.fixture(scope="module")
def trained_stage(tmp_path_factory, training_table_path):
    tmp = tmp_path_factory.mktemp("processing")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        plan = plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 8}},
                             dict(group_size=4, learning_rate=5e-3, scheduler="constant", warmup_ratio=0.0,
                                  max_steps=3, max_length=512, min_pixels=784, max_pixels=TRAINED_PIXELS, seed=3),
                             {}, 1, "cpu", {"name": "p", "output_root": str(tmp)})
        result = run_training_stage(training_table_path, plan, devices=1, final=True)
    return tmp, result


def _test_records(root):
    """Two test queries whose documents carry 224×224 photos: bigger than the trained budget, within the default."""
    paths = {}
    for colour, rgb in {"red": (200, 30, 30), "blue": (30, 30, 200), "mix": (120, 60, 160)}.items():
        image = Image.new("RGB", (224, 224), rgb)
        for x in range(0, 224, 16):  # some structure, so resizing changes the pixels
            image.paste((255, 255, 255), (x, x, x + 8, x + 8))
        paths[colour] = str(root / f"{colour}.png")
        image.save(paths[colour])

    def doc(doc_id, text, image):
        return {"doc_id": doc_id, "text": text, "image": image, "hard": False, "meta": "{}"}

    return [
        {"record_id": "q-red", "query": {"text": "red dress", "image": None},
         "positives": [doc("d-red", "a red dress", paths["red"])],
         "negatives": [doc("d-blue", "a blue dress", paths["blue"]), doc("d-text", "a green hat", None)],
         "task_type": "t2it", "language": "en", "split": "test"},
        {"record_id": "q-img", "query": {"text": None, "image": paths["mix"]},
         "positives": [doc("d-mix", None, paths["mix"])],
         "negatives": [doc("d-red2", "a red dress", paths["red"])],
         "task_type": "i2i", "language": "en", "split": "test"},
    ]


def test_the_adapter_records_its_processing_settings(trained_stage):
    _, result = trained_stage
    saved = read_metadata(result.adapter_dir)["processing"]
    assert saved == {"max_length": 512, "min_pixels": 784, "max_pixels": TRAINED_PIXELS, "instructions": None}
    assert result.model_dump()["processing"] == saved


def test_evaluation_the_reranker_and_the_mlflow_model_score_with_the_trained_settings(trained_stage, tmp_path,
                                                                                       monkeypatch):
    tmp, result = trained_stage
    records = _test_records(tmp_path)
    evaluation = {"seed": 0, "reranker": {"batch_size": 4, "device": "cpu"}, "score_cache": {"enabled": False},
                  "scoring": {"work_dir": str(tmp_path / "scoring")}}
    table, _ = score_test_set(records, [result], {"name_or_path": "builtin:tiny"}, evaluation, 1, "cpu")
    stage = table[table["model"] != "base"]
    from_node = {(r.query_id, r.doc_id): r.score for r in stage.itertuples()}

    reranker = Reranker.from_pretrained(result.adapter_dir, device="cpu")
    assert reranker.processing == ProcessingConfig(512, 784, TRAINED_PIXELS, None)
    queries = candidate_table(records, 0)
    keys = [(q["query_id"], c["doc_id"]) for q in queries for c in q["candidates"]]
    pairs = [(q["query"], c["item"]) for q in queries for c in q["candidates"]]
    task_types = [q["task_type"] for q in queries for _ in q["candidates"]]
    direct = dict(zip(keys, reranker.score_pairs(pairs, task_types)))
    assert set(direct) == set(from_node)
    for key in keys:
        assert direct[key] == pytest.approx(from_node[key], abs=1e-6), key

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("LYCHEE_IMAGE_ROOTS", str(tmp_path))  # the served model reads images only under its roots
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("processing-parity")  # not an experiment id another test's store left active
    with mlflow.start_run():
        uri = log_reranker_model(result.adapter_dir, base="builtin:tiny")
    served = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame([
        {"query_text": q["text"] or "", "query_image": q["image"] or "", "doc_text": d["text"] or "",
         "doc_image": d["image"] or "", "task_type": task} for (q, d), task in zip(pairs, task_types)]))
    for key, value in zip(keys, served):
        assert value == pytest.approx(direct[key], abs=1e-5), key

    # The settings matter for these pairs: the library default budget scores them differently.
    default = Reranker.from_pretrained(result.adapter_dir, device="cpu", max_pixels=DEFAULT_MAX_PIXELS)
    assert default.processing.max_pixels == DEFAULT_MAX_PIXELS and default.processing.max_length == 512
    changed = default.score_pairs(pairs, task_types)
    assert max(abs(a - direct[k]) for a, k in zip(changed, keys)) > 1e-4
    assert all(math.isfinite(v) for v in changed)


def test_training_and_scoring_give_each_pair_the_same_instruction(tiny_processor_and_images):
    """A mixed group (image+text positive, text-only negative): the training batch equals the scoring batch
    when scoring is given the record's task type (as the evaluation nodes and the MLflow model's column do)."""
    processor, image = tiny_processor_and_images
    row = {"record_id": "r", "query": {"text": "red dress", "image": None},
           "positives": [{"doc_id": "p", "text": "a red dress", "image": image, "meta": "{}"}],
           "negatives": [{"doc_id": "n", "text": "a green hat", "image": None, "hard": True, "meta": "{}"}],
           "task_type": "t2it", "language": "en", "split": "train"}
    trained = GroupCollator(processor, group_size=2, max_pixels=TRAINED_PIXELS)([row])
    pairs = [(row["query"], {"text": d["text"], "image": d["image"]}) for d in row["positives"] + row["negatives"]]
    instruction = instruction_for(row["task_type"])
    scored = PairCollator(processor, max_pixels=TRAINED_PIXELS)([(q, d, instruction) for q, d in pairs])
    assert trained["input_ids"].tolist() == scored["input_ids"].tolist()
    # Without the task type the text-only negative would get another instruction (t2t), so this can fail.
    per_pair = PairCollator(processor, max_pixels=TRAINED_PIXELS)(pairs)
    assert per_pair["input_ids"].tolist() != trained["input_ids"].tolist()


@pytest.fixture(scope="module")
def tiny_processor_and_images(tmp_path_factory):
    from lychee_pipeline.reranker import ModelConfig, load_reranker

    root = tmp_path_factory.mktemp("instr")
    Image.new("RGB", (56, 56), (200, 30, 30)).save(root / "red.png")
    model = load_reranker(ModelConfig(name_or_path="builtin:tiny", finetune="frozen"), "cpu")
    return model.processor, str(root / "red.png")
