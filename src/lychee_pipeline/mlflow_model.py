"""The trained reranker as an MLflow pyfunc model, logged "from code" (no pickled objects).

`mlflow.pyfunc.load_model(uri).predict(df)` scores (query, document) pairs: columns `query_text`,
`query_image`, `doc_text`, `doc_image` (any may be empty), and optionally `task_type` (the record's task type,
whose instruction every document of a record was trained with), one p(yes) per row. The same model answers
`mlflow models serve` (`POST /invocations`, see docs/serving.md).

The model's `reranker.json` artifact carries what scoring needs besides the weights:

- `base`: the base model (used when no adapter folder is logged);
- `reranker`: keyword arguments of `Reranker.from_pretrained` (batch size, pixel budget, max length),
  the same the evaluation scored with, so served scores equal the evaluation's;
- `instructions`: the evaluation's instruction overrides, if any;
- `image_roots`: the folders request image paths must lie in. The environment variable
  `LYCHEE_IMAGE_ROOTS` (roots separated by `os.pathsep`) replaces them where the model is served.
  An image path outside every root (symlinks resolved first), or any image path when no root is
  configured, is refused with an error naming the row and the path; nothing is read. The roots are parsed
  and a path is confined by the data layer's one rule (`lychee_pipeline.data.images`), the rule ingestion
  used on the training data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd

from lychee_pipeline.data import images

ENV_IMAGE_ROOTS = "LYCHEE_IMAGE_ROOTS"
COLUMNS = ("query_text", "query_image", "doc_text", "doc_image", "task_type")
#: `Reranker.from_pretrained` options a logged config may carry (anything else is ignored).
RERANKER_OPTIONS = ("batch_size", "max_length", "min_pixels", "max_pixels", "dtype", "attn_implementation", "device",
                    "vision_cache_gib", "prefix_reuse")


class ImagePathError(ValueError):
    """A request's image path lies outside the configured image roots, or no root is configured."""


class RequestRefused(mlflow.exceptions.MlflowException):
    """An HTTP 400 of `mlflow models serve` whose message stays the refusal's one line.

    MLflow's scoring server rewrites the message of an MlflowException raised by `predict` into
    "Failed to predict data '<the whole request as a DataFrame>'. Error: <message>" (by assigning `.message`),
    so a client got a dump of its own request around the line; here the first message set is kept.
    """

    @property
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_line"):
            self._line = value


def _clean(value: Any) -> Any:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    if isinstance(value, str) and not value.strip():
        return None
    return value


def _item(text: Any, image: Any) -> dict:
    return {"text": _clean(text), "image": _clean(image)}


def image_roots_from(config: dict[str, Any], environ: dict[str, str] | None = None) -> list[str]:
    """The serving image roots: `LYCHEE_IMAGE_ROOTS` if set, else the model's logged `image_roots`."""
    env = (environ if environ is not None else os.environ).get(ENV_IMAGE_ROOTS)
    return images.parse_image_roots(env if env else config.get("image_roots"))


def confine_image(path: Any, resolver: images.Resolver | None) -> str:
    """The resolved absolute path of a request image inside the resolver's roots, or :class:`ImagePathError`.

    The data layer's rule (`Resolver.confine`): relative paths are looked up under each root in order,
    a name in the other Unicode normalization form is found, symlinks are resolved before the check (a
    link inside a root that points outside is refused), and only a file is accepted.
    """
    if resolver is None:
        raise ImagePathError(f"image paths are not accepted: no image roots are configured (set {ENV_IMAGE_ROOTS})")
    try:
        return resolver.confine(str(path))
    except images.ImagePathError as refused:
        if refused.kind == images.ESCAPES_ROOTS:
            raise ImagePathError(f"image path outside the allowed image roots: {path}") from None
        if refused.kind == images.NOT_FOUND:
            raise ImagePathError(f"image not found under the allowed image roots: {path}") from None
        raise ImagePathError(f"{refused.kind}: {path}") from None  # a folder, a URL, a '~' path


def pairs_from_frame(model_input: pd.DataFrame, roots: list[str]) -> list[tuple[dict, dict]]:
    """(query, document) items of each row, image paths confined to `roots`; errors name the row."""
    unknown = [c for c in model_input.columns if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; expected some of {list(COLUMNS)}")
    # one resolver per request: its cache must not keep a file that appears or goes between requests
    resolver = images.Resolver(roots) if roots else None
    pairs = []
    for i, row in enumerate(model_input.to_dict("records")):
        query = _item(row.get("query_text"), row.get("query_image"))
        doc = _item(row.get("doc_text"), row.get("doc_image"))
        for side, item in (("query", query), ("document", doc)):
            if item["text"] is None and item["image"] is None:
                raise ValueError(f"row {i}: the {side} has neither text nor image")
            if item["image"] is not None:
                try:
                    item["image"] = confine_image(item["image"], resolver)
                except ImagePathError as exc:
                    raise ImagePathError(f"row {i}: {exc}") from None
        pairs.append((query, doc))
    return pairs


class RerankerModel(mlflow.pyfunc.PythonModel):
    """Loads the base model and the stage's adapter; predicts p(yes) per pair."""

    def load_context(self, context) -> None:
        from lychee_pipeline.reranker import Reranker

        self.config = json.loads(Path(context.artifacts["config"]).read_text(encoding="utf-8"))
        options = {k: v for k, v in (self.config.get("reranker") or {}).items() if k in RERANKER_OPTIONS}
        options.setdefault("device", self.config.get("device", "auto"))
        if self.config.get("instructions"):
            options["instructions"] = self.config["instructions"]
        # The saved stage folder (adapter or full weights) records its base model in its metadata.
        saved = context.artifacts.get("adapter")
        self.reranker = Reranker.from_pretrained(saved or self.config["base"], **options)
        self.image_roots = image_roots_from(self.config)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[float]:
        from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

        try:
            pairs = pairs_from_frame(model_input, self.image_roots)
        except ValueError as exc:  # served as HTTP 400 with this message
            raise RequestRefused(str(exc), error_code=INVALID_PARAMETER_VALUE) from None
        # An optional `task_type` column scores a pair under its record's task type, as training did.
        task_types = [_item(t, None)["text"] for t in model_input.get("task_type", pd.Series([None] * len(pairs)))]
        return self.reranker.score_pairs(pairs, task_types)


mlflow.models.set_model(RerankerModel())
