"""The merged export: a trained LoRA adapter (or a registered version of one) as a standalone folder that stock
transformers loads and scores exactly as the project does.

Real parts: builtin:tiny (and, for the stock reload, builtin:tiny-qwen3-vl) with a LoRA adapter of non-zero weights
saved by the training's own save_pretrained, stock transformers classes in a separate Python process
(tests/ship/stock_score.py, no project import), a real sqlite MLflow store in a project copy with the registry node of `full`, and `kedro run` as a user types it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from project_runs import kedro_run, make_cli_project
from ship_support import candidate_queries, make_test_records, mlflow_store, register_run, score_pairs

STOCK_SCORE = Path(__file__).with_name("stock_score.py")
PROCESSING = {"max_length": 512, "min_pixels": 3136, "max_pixels": 12544, "instructions": {"t2t": "Find the item"}}


#: The built-in model of each family: its folder name, its model_type, and the stock model and processor classes its
#: export names (what AutoModelForImageTextToText and AutoProcessor pick)
BUILTIN = {"builtin:tiny": ("builtin_tiny", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
           "builtin:tiny-qwen3-vl": ("builtin_tiny_qwen3_vl", "qwen3_vl", "Qwen3VLForConditionalGeneration",
                                     "Qwen3VLProcessor")}


def _train_adapter(root: Path, name: str) -> dict[str, Path]:
    """The built-in model `name` (the base) and a LoRA adapter with non-zero weights, saved as a training stage
    saves one, with the ship tests' six images."""
    from lychee_pipeline.reranker.model import ModelConfig, load_reranker
    from lychee_pipeline.reranker.processing import ProcessingConfig
    from lychee_pipeline.reranker.tiny import ensure_tiny

    base = ensure_tiny(root / BUILTIN[name][0], name=name)
    model = load_reranker(ModelConfig(name_or_path=str(base), finetune="lora"), device="cpu")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA's B starts at zero: a merge of an untrained adapter would change nothing
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    adapter = model.save_pretrained(root / "stage_1cpu_final", processing=ProcessingConfig.from_dict(PROCESSING))
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):  # the ship tests' candidate set reads img0..img5
        Image.fromarray(rng.integers(0, 255, (36 + 8 * i, 52, 3), dtype=np.uint8)).save(images / f"img{i}.png")
    return {"base": base, "adapter": adapter, "images": images, "name": name}


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory) -> dict[str, Path]:
    """builtin:tiny (the base) and a LoRA adapter with non-zero weights."""
    return _train_adapter(tmp_path_factory.mktemp("export_models"), "builtin:tiny")


@pytest.fixture(scope="module", params=list(BUILTIN))
def family_adapter(request, tmp_path_factory, trained_adapter) -> dict[str, Path]:
    """The trained adapter of each family's built-in model (builtin:tiny's is the module's `trained_adapter`)."""
    if request.param == "builtin:tiny":
        return trained_adapter
    return _train_adapter(tmp_path_factory.mktemp("export_models_qwen3_vl"), request.param)


def _pairs(images: Path, empty_side: bool = False) -> list[tuple[dict, dict]]:
    """Each pair kind: text/text, text/image, image/text, image+text on both sides; with `empty_side` (a family
    whose prompt has one, as Qwen3-VL-Reranker's `NULL`) also an empty query and an empty document."""
    pairs = [
        ({"text": "red silk dress", "image": None}, {"text": "a red dress in stock", "image": None}),
        ({"text": "blue shoes", "image": None}, {"text": None, "image": str(images / "img0.png")}),
        ({"text": None, "image": str(images / "img1.png")}, {"text": "leather bag", "image": None}),
        ({"text": "like this hat", "image": str(images / "img2.png")},
         {"text": "green hat with pictures", "image": str(images / "img0.png")}),
    ]
    if empty_side:
        pairs += [({"text": None, "image": None}, {"text": "leather bag", "image": str(images / "img3.png")}),
                  ({"text": None, "image": str(images / "img4.png")}, {"text": None, "image": None})]
    return pairs


def _stock_scores(folder: Path, pairs: list[tuple[dict, dict]], work: Path) -> list[float]:
    """The pairs scored by tests/ship/stock_score.py in its own Python process (stock transformers only)."""
    import subprocess

    pairs_file, out_file = work / "pairs.json", work / "stock_scores.json"
    pairs_file.write_text(json.dumps([{"query": q, "doc": d} for q, d in pairs]))
    proc = subprocess.run([sys.executable, str(STOCK_SCORE), str(folder), str(pairs_file), str(out_file)],
                          capture_output=True, text=True, timeout=600, cwd=work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_file.read_text())


def test_the_export_reloads_with_stock_transformers_at_the_projects_scores(family_adapter, tmp_path):
    """For each family's built-in model: the merged folder, loaded in another process by the stock class its
    config.json names (Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration), scores every pair kind
    as the project scores the adapter, within 1e-5 in fp32."""
    from lychee_pipeline.reranker import Reranker
    from lychee_pipeline.reranker.export import ExportSource, export_merged

    adapter = family_adapter["adapter"]
    _, model_type, architecture, processor_class = BUILTIN[family_adapter["name"]]
    out = export_merged(ExportSource(adapter, str(adapter)), tmp_path / "lychee-export")
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "chat_template.jinja", "tokenizer.json", "preprocessor_config.json",
            "reranker_scoring.json", "README.md", "lychee_reranker.json"} <= files
    assert not [f for f in files if f.startswith("adapter_") or f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary folder is gone
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"] == model_type  # stock generative class
    # AutoProcessor picks the stock processor class, not the project's torchvision-free shim (LycheeQwen3VLProcessor);
    # it is not loaded here: the stock Qwen-VL processors need torchvision for their video processor
    for name in ("processor_config.json", "tokenizer_config.json"):
        assert json.loads((out / name).read_text())["processor_class"] == processor_class, name
    scoring = json.loads((out / "reranker_scoring.json").read_text())
    project_model = Reranker.from_pretrained(str(adapter), device="cpu").model
    assert scoring["family"] == model_type and scoring["architectures"] == [architecture]
    assert (scoring["yes_token_id"], scoring["no_token_id"]) == (project_model.yes_id, project_model.no_id)
    assert scoring["processing"] == PROCESSING and scoring["prompt"]["instructions"]["t2t"] == "Find the item"
    assert "not evaluated" in (out / "README.md").read_text().lower()

    empty_side = scoring["prompt"]["empty_side"] is not None
    assert empty_side == (model_type == "qwen3_vl")  # Qwen3-VL-Reranker writes NULL; Lychee refuses an empty side
    pairs = _pairs(family_adapter["images"], empty_side=empty_side)
    project = Reranker.from_pretrained(str(adapter), device="cpu").score_pairs(pairs)
    stock = _stock_scores(out, pairs, tmp_path)
    assert len(stock) == len(pairs) and max(abs(a - b) for a, b in zip(project, stock)) <= 1e-5, (project, stock)
    # the adapter mattered: the base model scores the same pairs differently
    base = Reranker.from_pretrained(str(family_adapter["base"]), device="cpu", **PROCESSING).score_pairs(pairs)
    assert max(abs(a - b) for a, b in zip(base, stock)) > 1e-3, (base, stock)
    # and the project itself loads the folder as a merged model with the trained settings
    merged = Reranker.from_pretrained(str(out), device="cpu")
    assert not merged.model.is_peft and merged.processing.as_dict() == PROCESSING
    assert max(abs(a - b) for a, b in zip(project, merged.score_pairs(pairs))) <= 1e-5


@pytest.fixture(scope="module")
def registered_adapter_project(tmp_path_factory, trained_adapter) -> dict:
    """A CLI project copy whose sqlite MLflow store holds `lychee-reranker` version 1: the adapter, registered by
    the registry node of `full` after the evaluation scored it (test labels are its first choices)."""
    root = make_cli_project(tmp_path_factory.mktemp("export_project"))
    adapter, base, images = (str(trained_adapter[k]) for k in ("adapter", "base", "images"))
    queries = candidate_queries(Path(images))
    with mlflow_store(root):
        records = make_test_records(queries, score_pairs(adapter, queries))
        outcome, _ = register_run(records, adapter, base, Path(images))
    assert outcome["version"] == 1, outcome
    return {"root": root, **trained_adapter}


def test_kedro_run_exports_a_registered_version_and_a_folder(registered_adapter_project, tmp_path):
    root = registered_adapter_project["root"]
    log = kedro_run(root, "--pipelines", "export", "--params", "export.model=models:/lychee-reranker/1")
    out = root / "data" / "06_models" / "exports" / "lychee-reranker-v1"
    assert (out / "model.safetensors").is_file(), log[-3000:]
    summary = json.loads((root / "data" / "08_reporting" / "export_summary.json").read_text())
    assert summary["model_version"] == 1 and summary["source_format"] == "adapter" and summary["evaluated"]
    card = (out / "README.md").read_text()
    # the version's figure: the gate's metric tagged on it (this test's registration logs no run metrics)
    assert re.search(r"\| test\.mrr_at_10 \| [01]\.\d{4} \|", card) and "models:/lychee-reranker/1" in card, card
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # download and temp folder gone

    # the path form, to an output folder of its own
    adapter = registered_adapter_project["adapter"]
    kedro_run(root, "--pipelines", "export", "--params",
              f"export.model={adapter},export.output_dir=data/06_models/exports/from-folder")
    folder_summary = json.loads((root / "data" / "08_reporting" / "export_summary.json").read_text())
    assert folder_summary["source_format"] == "adapter" and not folder_summary["evaluated"]
    assert "Not evaluated" in (root / "data" / "06_models" / "exports" / "from-folder" / "README.md").read_text()
    # the registered and the folder export are the same weights
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(root / "data/06_models/exports/from-folder/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- refusals


def test_refusals_are_one_line(trained_adapter, tmp_path):
    from lychee_pipeline.export import ExportParams, export_model
    from lychee_pipeline.reranker.export import ExportError, ExportSource, export_merged

    def refusal(call) -> str:
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message, message
        return message

    with mlflow_store(tmp_path):  # an empty sqlite store
        message = refusal(lambda: export_model(ExportParams(model="models:/lychee-reranker/7"), tmp_path))
        assert message.startswith("models:/lychee-reranker/7: no registered model 'lychee-reranker'"), message
    no_adapter = tmp_path / "not_a_model"
    no_adapter.mkdir()
    (no_adapter / "notes.txt").write_text("x")
    assert "not a reranker saved by a training stage" in refusal(
        lambda: export_model(ExportParams(model=str(no_adapter)), tmp_path))
    assert "no such folder" in refusal(lambda: export_model(ExportParams(model=str(tmp_path / "nope")), tmp_path))
    assert "pass a registered version" in refusal(lambda: export_model(ExportParams(model="runs:/abc/reranker"), tmp_path))
    taken = tmp_path / "taken"
    taken.mkdir()
    adapter = trained_adapter["adapter"]
    assert "already exists" in refusal(lambda: export_merged(ExportSource(adapter, str(adapter)), taken))
    assert list(taken.iterdir()) == []  # untouched
    assert "leaves the project" in refusal(lambda: export_model(
        ExportParams(model=str(adapter), output_dir="../elsewhere"), tmp_path))
    assert "one folder name" in refusal(lambda: export_model(ExportParams(model=str(adapter), name="a/b"), tmp_path))
    assert issubclass(ExportError, ValueError)


def test_overwrite_replaces_a_finished_export(trained_adapter, tmp_path):
    from lychee_pipeline.export import ExportParams, export_model

    params = ExportParams(model=str(trained_adapter["adapter"]), output_dir=str(tmp_path / "out"))
    export_model(params, tmp_path)
    (tmp_path / "out" / "stale.txt").write_text("old")
    summary = export_model(params.model_copy(update={"overwrite": True}), tmp_path)
    assert "stale.txt" not in summary["files"] and "model.safetensors" in summary["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------------------------------------- the prompt as data


def _pair_kinds() -> list[tuple[dict, dict]]:
    text, image, both = {"text": "red dress", "image": None}, {"text": None, "image": "a.png"}, {"text": "hat", "image": "b.png"}
    return [(q, d) for q in (text, image, both) for d in (text, image, both)]


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_the_prompt_description_rebuilds_the_familys_messages_for_every_pair_kind(model_type):
    """reranker_scoring.json's prompt, read by the stock script, gives the messages the project builds, for each
    family: Lychee's (no empty side, an instruction per task type) and Qwen3-VL-Reranker's (`NULL` for an empty
    side, one default instruction)."""
    from stock_score import messages_of

    from lychee_pipeline.reranker import prompt
    from lychee_pipeline.reranker.export import prompt_description
    from lychee_pipeline.reranker.families import family_for

    family = family_for(model_type)
    overrides = {"t2i": "Find the picture"}
    description = prompt_description(family, {"instructions": overrides})
    # Lychee's prompt has no empty side (the project refuses one); Qwen3-VL-Reranker's writes NULL
    assert description["empty_side"] == {"qwen2_5_vl": None, "qwen3_vl": "NULL"}[model_type]
    empty = {"text": None, "image": None}
    kinds = _pair_kinds() + ([(empty, {"text": "hat", "image": "b.png"}), ({"text": "red dress", "image": None}, empty)]
                             if description["empty_side"] else [])
    for query, doc in kinds:
        # the collator's rule: the pair's task type ("default" where a side is empty), overrides over the defaults
        instruction = prompt.instruction_for(prompt.task_type_or_default(query, doc), overrides,
                                             family.DEFAULT_INSTRUCTIONS)
        expected = family.build_messages(query, doc, instruction)
        built, images = messages_of(description, query, doc)
        # the stock script leaves an image part's path out (the chat template only places the image token)
        assert built == [{**m, "content": m["content"] if isinstance(m["content"], str) else
                          [{"type": "image"} if c["type"] == "image" else c for c in m["content"]]} for m in expected]
        assert images == [item["image"] for item in (query, doc) if item["image"]]


def test_a_family_prompt_with_an_empty_side_is_described_with_its_text():
    """A stand-in family with a layout neither real family has (text before image, 'NULL' for an empty side, one
    default instruction): the description follows the family's own build_messages."""
    from types import SimpleNamespace

    from stock_score import messages_of

    def build_messages(query, doc, instruction=None):
        def side(item):
            parts = ([{"type": "text", "text": item["text"]}] if item.get("text") else []) + (
                [{"type": "image", "image": item["image"]}] if item.get("image") else [])
            return parts or [{"type": "text", "text": "NULL"}]

        return [{"role": "system", "content": "judge"},
                {"role": "user", "content": [{"type": "text", "text": f"<Instruct>: {instruction or 'find'}"},
                                             {"type": "text", "text": "<Query>:"}, *side(query),
                                             {"type": "text", "text": "\n<Document>:"}, *side(doc)]}]

    from lychee_pipeline.reranker.export import prompt_description

    family = SimpleNamespace(build_messages=build_messages, DEFAULT_INSTRUCTIONS={"default": "find"})
    description = prompt_description(family, {"instructions": None})
    assert description["empty_side"] == "NULL" and description["side_content"] == ["text", "image"]
    empty = {"text": None, "image": None}
    for query, doc in [*_pair_kinds(), (empty, {"text": "x", "image": None})]:
        built, _ = messages_of(description, query, doc)
        expected = build_messages(query, doc, "find")
        assert built == [{**m, "content": m["content"] if isinstance(m["content"], str) else
                          [{"type": "image"} if c["type"] == "image" else c for c in m["content"]]} for m in expected]
