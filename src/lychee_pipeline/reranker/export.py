"""A trained reranker as a standalone model folder that stock runtimes load: the merged export.

``export_merged(source, out)`` loads a saved folder (a stage's LoRA adapter on its base model, or full weights),
folds the adapter into the base weights (peft ``merge_and_unload``) and writes, atomically (a hidden temporary
folder renamed into place once complete):

- the merged weights, safetensors only, with the family's stock generative class in ``architectures``: the score
  comes from the language-model head's ``yes`` / ``no`` logits, so no classification head is added;
- the processor as a stock folder (the family's ``save_processor``), its image budget set to the one the model was
  trained with, and the chat template;
- ``lychee_reranker.json``: the project's metadata (format ``merged``, the trained processing settings), so
  ``Reranker.from_pretrained`` scores the folder exactly as the adapter;
- ``reranker_scoring.json`` (:data:`SCORING_FILE`): what a runtime needs to score as the project does, without the
  project: the yes / no token ids, the rule, the prompt layout and instructions, the image budget, the image
  placeholder expansion;
- ``README.md``: a model card with the source, the evaluation figures (or "not evaluated") and the scoring rule.

The family is reached only through :class:`~.families.base.ModelFamily` (``LycheeReranker.family``): its model class
and processor saving, and its prompt (``build_messages`` and ``DEFAULT_INSTRUCTIONS`` where the family has them,
else the Lychee ones of ``prompt.py``), described by calling it with placeholder items.

Kedro-free and MLflow-free: a registry source is resolved by ``lychee_pipeline.export`` into an
:class:`ExportSource` first.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCORING_FILE = "reranker_scoring.json"
CARD_FILE = "README.md"
SCORING_FORMAT = "lychee-reranker-scoring/1"
SCORE_RULE = ("p(yes) = exp(z_yes) / (exp(z_yes) + exp(z_no)) = sigmoid(z_yes - z_no), where z are the language-model "
              "head's logits at the last position of the prompt (chat template with the generation prompt added; "
              "with a batch, left padding so that every row ends at its last real token)")
DTYPES = ("auto", "fp32", "bf16", "fp16")


class ExportError(ValueError):
    """A merged export refused, in one line (what, where, what to do)."""


@dataclass(frozen=True)
class ExportSource:
    """What to export: a saved folder (``LycheeReranker.save_pretrained``: ``adapter`` or ``full``), what it is
    (the registry URI or the folder, for the card), and its evaluation figures (None: not evaluated)."""

    folder: Path
    description: str
    figures: Mapping[str, float] | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)


def saved_format(folder: Path) -> str:
    """``adapter``, ``full`` or ``merged``: the kind of saved folder, or :class:`ExportError` for a folder that is
    none (no project metadata, or an adapter folder without its adapter files)."""
    from .model import METADATA_FILE, read_metadata

    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder (expected a saved adapter folder or a models:/ URI)")
    meta = read_metadata(folder)
    if meta is None:
        what = "a peft adapter without" if (folder / "adapter_config.json").is_file() else "no"
        raise ExportError(f"{folder}: {what} {METADATA_FILE}: not a reranker saved by a training stage "
                          "(its adapters/ folder or a registered model version)")
    kind = meta.get("format")
    if kind == "adapter" and not (folder / "adapter_config.json").is_file():
        raise ExportError(f"{folder}: {METADATA_FILE} says adapter but there is no adapter_config.json")
    if kind not in ("adapter", "full", "merged"):
        raise ExportError(f"{folder}: unknown saved format {kind!r} in {METADATA_FILE}")
    return str(kind)


def output_folder_free(out: Path, overwrite: bool) -> None:
    """:class:`ExportError` where ``out`` exists and ``overwrite`` is off, or where it is a file."""
    if out.exists() and (not overwrite or not out.is_dir()):
        raise ExportError(f"{out}: already exists; choose another export.output_dir or set export.overwrite=true"
                          if out.is_dir() else f"{out}: a file is in the way of the export folder")


SIDES = {"query": {"text": "{query text}", "image": "{query image}"},
         "document": {"text": "{document text}", "image": "{document image}"}}


def prompt_description(family: Any, processing: Mapping[str, Any]) -> dict[str, Any]:
    """The family's prompt as data, read off its own ``build_messages`` with placeholder items (so a family with
    another layout describes itself): the system message, the user content (fixed texts and the two sides), the
    order of a side's parts, the text of an empty side (None: the family refuses one) and the instruction of each
    task type (the trained overrides over the family's defaults). Families without a prompt of their own use the
    Lychee one (``prompt.py``)."""
    from . import prompt

    build = getattr(family, "build_messages", prompt.build_messages)
    defaults = getattr(family, "DEFAULT_INSTRUCTIONS", prompt.DEFAULT_INSTRUCTIONS)
    placeholders = {value: (side, kind) for side, item in SIDES.items() for kind, value in item.items()}
    messages = build(SIDES["query"], SIDES["document"], "{instruction}")
    user_content: list[dict[str, Any]] = []
    side_parts: list[str] = []
    for part in messages[-1]["content"]:
        found = placeholders.get(part.get(part["type"]))
        if found is None:
            user_content.append({"type": "text", "text": part["text"]})
            continue
        side, kind = found
        if not user_content or user_content[-1].get("side") != side:
            user_content.append({"side": side})
        if side == "query":
            side_parts.append(kind)
    try:  # an empty side: its text, where the family's prompt has one
        empty = build({"text": None, "image": None}, SIDES["document"], "{instruction}")
        fixed = {part.get("text") for part in user_content}
        extra = [part["text"] for part in empty[-1]["content"]
                 if part["type"] == "text" and part["text"] not in fixed and part["text"] not in placeholders]
        empty_side = extra[0] if len(extra) == 1 else None
    except (TypeError, ValueError):
        empty_side = None
    return {
        "system": messages[0]["content"],
        "user_content": user_content,
        "side_content": side_parts,
        "empty_side": empty_side,
        "add_generation_prompt": True,
        "task_type": "'<q>2<d>', q and d each 't' (text only), 'i' (image only) or 'it' (image and text)",
        "instructions": {**dict(defaults), **dict(processing.get("instructions") or {})},
        "instruction_rule": "the instruction of the pair's task type; 'default' where the table has none",
    }


def scoring_description(model: Any, processing: Mapping[str, Any]) -> dict[str, Any]:
    """The content of :data:`SCORING_FILE` for a loaded :class:`~.model.LycheeReranker`."""
    tok = model.processor.tokenizer
    config = model.base_model.config
    image_pad = getattr(model.processor, "image_token", None) or "<|image_pad|>"
    merge = getattr(model.processor.image_processor, "merge_size", None)
    return {
        "format": SCORING_FORMAT,
        "family": model.family.NAME,
        "model_type": config.model_type,
        "architectures": list(config.architectures or []),
        "yes_token": tok.convert_ids_to_tokens(model.yes_id), "yes_token_id": model.yes_id,
        "no_token": tok.convert_ids_to_tokens(model.no_id), "no_token_id": model.no_id,
        "score": SCORE_RULE,
        # the order a 2-class classifier built from two vocabulary rows needs for p(yes) as its last class
        "classifier_from_token": ["no", "yes"],
        "prompt": prompt_description(model.family, processing),
        "processing": dict(processing),
        "images": {
            "placeholder": image_pad,
            "placeholder_id": int(tok.convert_tokens_to_ids(image_pad)),
            "expansion": f"each {image_pad} of the rendered prompt becomes grid_t*grid_h*grid_w/merge_size**2 "
                         f"copies (image_grid_thw from the image processor, merge_size {merge})",
            "mm_token_type_ids": "1 at image placeholder tokens, 0 elsewhere (multimodal rotary positions)",
            "resize": f"min_pixels {processing['min_pixels']}, max_pixels {processing['max_pixels']} (already the "
                      "saved image processor's size: shortest_edge / longest_edge); images read as RGB, upright by "
                      "their EXIF orientation",
        },
        "max_length": f"{processing['max_length']} tokens per pair; a longer text-only pair is cut in its texts by "
                      "the project, image tokens are never cut",
    }


def _figure_rows(figures: Mapping[str, float] | None) -> list[str]:
    if figures is None:
        return ["Not evaluated: exported from a plain folder, not from a registered model version with its run's "
                "evaluation."]
    if not figures:
        return ["The registered version carries no evaluation figures."]
    rows = ["| metric | value |", "|---|---|"]
    rows += [f"| {name} | {value:.4f} |" for name, value in sorted(figures.items())]
    return rows


def model_card(name: str, source: ExportSource, scoring: Mapping[str, Any], base_model: str) -> str:
    """The folder's README.md."""
    yes, no = scoring["yes_token_id"], scoring["no_token_id"]
    processing = scoring["processing"]
    lines = [
        f"# {name}", "",
        f"A multimodal reranker of the `{scoring['family']}` family (`{scoring['model_type']}`), fine-tuned with "
        "lychee-pipeline and exported as one standalone folder: the LoRA adapter is folded into the base weights "
        "(safetensors), with the processor, the chat template and the reranker's prompt and processing settings.",
        "",
        "## Source", "",
        f"- exported from: `{source.description}`",
        f"- base model: `{base_model}`",
        *[f"- {key}: `{value}`" for key, value in source.provenance.items() if value is not None],
        "",
        "## Evaluation", "",
        *_figure_rows(source.figures),
        "",
        "## Scoring", "",
        f"`architectures` stays `{', '.join(scoring['architectures'])}`: there is no classification head. The "
        f"score of a (query, document) pair is read from the language-model head at the last position: "
        f"{scoring['score']}. Token ids: `yes` = {yes}, `no` = {no}. `{SCORING_FILE}` holds the rule, the ids, the "
        "prompt layout and instructions, and the image settings as data.",
        "",
        f"Processing the model was trained with: max_length {processing['max_length']}, min_pixels "
        f"{processing['min_pixels']}, max_pixels {processing['max_pixels']}"
        + (f", instruction overrides {dict(processing['instructions'])}" if processing.get("instructions") else "")
        + ".",
        "",
        "## Loading", "",
        "With transformers alone (no remote code): the model class of `architectures`, the tokenizer and the image "
        "processor from this folder; render the prompt of `reranker_scoring.json` with `chat_template.jinja`, expand "
        "each image placeholder as described there, run one forward and apply the rule above. With "
        "lychee-pipeline: `Reranker.from_pretrained(\"<this folder>\")`. Serving with a yes/no scoring mode: "
        "the project's docs/serving.md.",
        "",
    ]
    return "\n".join(lines)


def set_image_budget(processor: Any, min_pixels: int, max_pixels: int) -> None:
    """The processor's default image budget set to the trained one, so a stock load resizes as training did."""
    image_processor = processor.image_processor
    image_processor.size = {"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)}
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if getattr(image_processor, name, None) is not None:
            setattr(image_processor, name, int(value))


def export_merged(source: ExportSource, out_dir: str | os.PathLike, *, name: str | None = None,
                  overwrite: bool = False, dtype: str = "auto", device: str = "cpu",
                  tiny_cache_dir: str | None = None) -> Path:
    """Write the standalone folder of ``source`` at ``out_dir`` (see the module docstring); returns it.

    ``dtype``: ``auto`` keeps the base checkpoint's stored dtype; ``fp32`` / ``bf16`` / ``fp16`` cast.
    ``overwrite``: replace an existing folder (only once the new one is complete).
    """
    from .model import ModelConfig, load_reranker, read_metadata
    from .processing import ProcessingConfig

    out = Path(out_dir).absolute()
    folder = Path(source.folder)
    kind = saved_format(folder)
    output_folder_free(out, overwrite)
    if dtype not in DTYPES:
        raise ExportError(f"export.dtype {dtype!r}: one of {', '.join(DTYPES)}")
    meta = read_metadata(folder) or {}
    if kind == "adapter":
        base, adapter = str(meta.get("base_model")), str(folder)
        if meta.get("finetune") == "qlora":
            log.info("a QLoRA adapter: merged into the base loaded unquantised (%s)", dtype)
    else:
        base, adapter = str(folder), None
    if dtype == "auto":
        dtype = stored_dtype(base, tiny_cache_dir)
    cfg = ModelConfig(name_or_path=base, adapter=adapter, finetune="frozen", dtype=dtype,
                      fast_path=False, pack_pairs=False, kernels="none", activation_checkpointing=False,
                      tiny_cache_dir=tiny_cache_dir)
    model = load_reranker(cfg, device)
    processing = ProcessingConfig.from_dict(meta["processing"]) if meta.get("processing") else ProcessingConfig()
    set_image_budget(model.processor, processing.min_pixels, processing.max_pixels)
    scoring = scoring_description(model, processing.as_dict())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        model.merge_and_save(tmp, processing, in_place=True)
        leftovers = sorted(p.name for p in tmp.iterdir()
                           if p.suffix in (".bin", ".pt", ".pth", ".pkl") or p.name.startswith("adapter_"))
        if leftovers:  # the folder must load as a plain model, from safetensors only
            raise ExportError(f"{out}: the merged folder would hold {leftovers}; nothing was written")
        (tmp / SCORING_FILE).write_text(json.dumps(scoring, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        card = model_card(name or out.name, source, scoring, meta.get("base_model") or base)
        (tmp / CARD_FILE).write_text(card, encoding="utf-8")
        if out.exists():  # overwrite: the old folder goes only once the new one is complete
            old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("merged export of %s written to %s (%s, %s)", source.description, out, scoring["family"], dtype)
    return out


def stored_dtype(name_or_path: str, tiny_cache_dir: str | None = None) -> str:
    """The dtype a checkpoint's config.json says its weights are stored in (``fp32`` where it says nothing)."""
    from .model import resolve_model_path

    path = Path(resolve_model_path(name_or_path, tiny_cache_dir=tiny_cache_dir))
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    stored = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"bfloat16": "bf16", "float16": "fp16"}.get(stored, "fp32")
