"""Fixtures for the reranker tests: the built-in tiny model (built once per session into a temp
folder) and small images written on the fly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from lychee_pipeline.reranker.model import ModelConfig, load_reranker
from lychee_pipeline.reranker.tiny import ensure_tiny

# The tiny model's matrices are small: one intra-op thread is fastest, and it avoids thread
# oversubscription when other test processes share the CPU (many times slower otherwise).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return str(ensure_tiny(tmp_path_factory.mktemp("tiny") / "builtin_tiny"))


@pytest.fixture
def make_model(tiny_dir):
    def make(**overrides):
        cfg = ModelConfig(name_or_path="builtin:tiny", tiny_cache_dir=tiny_dir, **overrides)
        return load_reranker(cfg, device="cpu")

    return make


QWEN3 = "builtin:tiny-qwen3-vl"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return str(ensure_tiny(tmp_path_factory.mktemp("tiny") / "qwen3", QWEN3))


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def family_model(request, make_model):
    """``make_model`` for the tiny model of each family."""
    if request.param == "qwen2_5_vl":
        return make_model
    directory = request.getfixturevalue("qwen3_dir")
    return lambda **overrides: load_reranker(ModelConfig(name_or_path=QWEN3, tiny_cache_dir=directory, **overrides),
                                             device="cpu")


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> dict[str, str]:
    """A few distinct images 56x56 .. 112x112 (and one non-square), plus a truncated PNG."""
    folder = Path(tmp_path_factory.mktemp("images"))
    paths = {}
    gen = torch.Generator().manual_seed(0)
    specs = {"red": (56, 56), "blue": (112, 112), "wide": (112, 70), "green": (84, 84)}
    for name, (w, h) in specs.items():
        pixels = (torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()
        path = folder / f"{name}.png"
        Image.fromarray(pixels).save(path)
        paths[name] = str(path)
    broken = folder / "broken.png"
    broken.write_bytes(Path(paths["blue"]).read_bytes()[:200])  # a file cut short
    paths["broken"] = str(broken)
    return paths
