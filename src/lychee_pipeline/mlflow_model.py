"""The trained reranker as an MLflow pyfunc model, logged "from code" (no pickled objects).

`mlflow.pyfunc.load_model(uri).predict(df)` scores (query, document) pairs: columns `query_text`,
`query_image`, `doc_text`, `doc_image` (any may be empty), and optionally `task_type` (the record's task type,
whose instruction every document of a record was trained with), one p(yes) per row.
"""

from __future__ import annotations

import json

import mlflow
import pandas as pd


def _item(text, image) -> dict:
    clean = lambda v: None if v is None or (isinstance(v, float) and pd.isna(v)) or v == "" else v  # noqa: E731
    return {"text": clean(text), "image": clean(image)}


class RerankerModel(mlflow.pyfunc.PythonModel):
    """Loads the base model and the stage's adapter; predicts p(yes) per pair."""

    def load_context(self, context) -> None:
        from lychee_pipeline.reranker import Reranker

        config = json.loads(open(context.artifacts["config"], encoding="utf-8").read())
        # The saved stage folder (adapter or full weights) records its base model in its metadata.
        saved = context.artifacts.get("adapter")
        self.reranker = Reranker.from_pretrained(saved or config["base"], device=config.get("device", "auto"))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[float]:
        rows = model_input.to_dict("records")
        pairs = [
            (_item(row.get("query_text"), row.get("query_image")), _item(row.get("doc_text"), row.get("doc_image")))
            for row in rows
        ]
        # An optional `task_type` column scores a pair under its record's task type, as training did.
        task_types = [_item(row.get("task_type"), None)["text"] for row in rows]
        return self.reranker.score_pairs(pairs, task_types)


mlflow.models.set_model(RerankerModel())
