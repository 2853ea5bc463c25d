"""Fixtures of the ship tests (registry, champion gate, serving, batch rerank).

Real parts only: tiny models with real, different weights, the evaluation's own scoring, a real sqlite MLflow
store in a project copy, and the registry node of `full`. A model "wins" a test split because the split's
labels are the documents that model ranks first; that is what makes the gate's outcome known in advance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from project_runs import make_project_copy
from ship_support import candidate_queries, make_test_records, mlflow_store, register_run, score_pairs

torch.set_num_threads(1)  # tiny matrices: one thread is fastest and shares the CPU with other tests


@pytest.fixture(scope="session")
def ship_models(tmp_path_factory) -> dict[str, str]:
    """builtin:tiny (the base) and two models with other random weights ("a", "b"), as saved stage folders."""
    from lychee_pipeline.reranker.model import ModelConfig, load_reranker
    from lychee_pipeline.reranker.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("ship_models")
    base = ensure_tiny(root / "builtin_tiny")
    models = {"base": str(base)}
    for name, seed in (("a", 1), ("b", 2)):
        model = load_reranker(ModelConfig(name_or_path=str(base), finetune="full"), device="cpu")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.add_(torch.randn(param.shape, generator=generator) * float(param.std()))
        models[name] = str(model.save_pretrained(root / name))
        del model
    return models


@pytest.fixture(scope="session")
def ship_images(tmp_path_factory) -> Path:
    """A folder of six small PNG images (the allowed image root of the ship tests)."""
    folder = tmp_path_factory.mktemp("ship_images")
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (40 + 8 * i, 48, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


@pytest.fixture(scope="session")
def champion_project(tmp_path_factory, ship_models, ship_images) -> dict[str, Any]:
    """A project copy whose MLflow store holds `lychee-reranker` version 1 (model "a") as champion: it beat
    the base model on a test split whose labels are model "a"'s first choices."""
    root = make_project_copy(tmp_path_factory.mktemp("champion_project"))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with mlflow_store(root):
        queries = candidate_queries(ship_images)
        records = make_test_records(queries, score_pairs(ship_models["a"], queries))
        outcome, scores = register_run(records, ship_models["a"], ship_models["base"], ship_images)
    assert outcome["promoted"] and outcome["version"] == 1, outcome
    return {"root": root, "tracking_uri": uri, "queries": queries, "records": records, "scores": scores,
            "outcome": outcome, "images": ship_images}
