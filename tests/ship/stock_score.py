"""Score (query, document) pairs with an exported folder through stock transformers classes alone.

    python stock_score.py <exported folder> <pairs.json> <scores.json>

What a runtime without lychee-pipeline does: the model class its config names (AutoModelForImageTextToText:
Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration), the tokenizer and the image processor of the
folder (AutoTokenizer, AutoImageProcessor: no torchvision here, so not AutoProcessor, whose Qwen2.5-VL and Qwen3-VL
video sub-processors need it), the prompt rendered from reranker_scoring.json with
the folder's chat_template.jinja, image placeholders expanded as that file says, one plain forward per pair, and
the yes/no rule. It never imports lychee_pipeline (checked at the end).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from PIL import Image, ImageOps
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer


def modality(item: dict) -> str:
    return ("i" if item.get("image") else "") + ("t" if item.get("text") else "")


def messages_of(prompt: dict, query: dict, doc: dict) -> tuple[list[dict], list[str]]:
    """The chat messages of one pair from the prompt description, and its image paths in prompt order."""
    sides = {"query": query, "document": doc}
    table = prompt["instructions"]
    instruction = table.get(f"{modality(query)}2{modality(doc)}", table["default"])
    content, images = [], []
    for part in prompt["user_content"]:
        if "side" not in part:
            content.append({"type": "text", "text": part["text"].replace("{instruction}", instruction)})
            continue
        item = sides[part["side"]]
        present = [kind for kind in prompt["side_content"] if item.get(kind)]
        for kind in present:
            content.append({"type": "image"} if kind == "image" else {"type": "text", "text": item["text"]})
            if kind == "image":
                images.append(item["image"])
        if not present:
            assert prompt["empty_side"] is not None, "this family's prompt has no empty side"
            content.append({"type": "text", "text": prompt["empty_side"]})
    return [{"role": "system", "content": prompt["system"]}, {"role": "user", "content": content}], images


def main(folder: Path, pairs_file: Path, out_file: Path) -> None:
    torch.set_num_threads(1)
    spec = json.loads((folder / "reranker_scoring.json").read_text(encoding="utf-8"))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, use_safetensors=True,
                                                        trust_remote_code=False).eval()
    assert type(model).__name__ in spec["architectures"], (type(model).__name__, spec["architectures"])
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    image_processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=False)
    template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    placeholder, placeholder_id = spec["images"]["placeholder"], spec["images"]["placeholder_id"]
    yes, no = spec["yes_token_id"], spec["no_token_id"]
    scores = []
    for pair in json.loads(pairs_file.read_text(encoding="utf-8")):
        messages, paths = messages_of(spec["prompt"], pair["query"], pair["doc"])
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        inputs = {}
        if paths:
            pictures = [ImageOps.exif_transpose(Image.open(p)).convert("RGB") for p in paths]
            inputs = dict(image_processor(images=pictures, return_tensors="pt"))
            merge = image_processor.merge_size ** 2
            pieces = text.split(placeholder)
            assert len(pieces) == len(paths) + 1
            text = pieces[0] + "".join(placeholder * (int(grid.prod()) // merge) + rest
                                       for grid, rest in zip(inputs["image_grid_thw"], pieces[1:]))
        encoded = tokenizer(text, return_tensors="pt")
        ids = encoded["input_ids"]
        with torch.no_grad():
            logits = model(**encoded, **inputs, mm_token_type_ids=(ids == placeholder_id).long(),
                           use_cache=False).logits[0, -1]
        scores.append(float(torch.softmax(torch.stack((logits[yes], logits[no])).float(), dim=0)[0]))
    assert not any(name.startswith("lychee_pipeline") for name in sys.modules), "the project was imported"
    out_file.write_text(json.dumps(scores), encoding="utf-8")


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
