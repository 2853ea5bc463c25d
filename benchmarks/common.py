"""Shared pieces of the GPU benchmarks: a published architecture with random weights (Qwen2.5-VL-7B, the default;
Qwen3-VL-2B / -8B with ``--family qwen3_vl --size 2b|8b``), synthetic Lychee-shaped inputs, timing and MFU.

Needs only torch, transformers, peft (and the project's reranker package on ``PYTHONPATH=src``).
``tiny=True`` gives the miniature of the same architecture that ``builtin:tiny`` is built with, so every code
path runs on a CPU in seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from lychee_pipeline.reranker.families import family_for
from lychee_pipeline.reranker.families.qwen2_5_vl.recipe import TOKEN_IDS
from lychee_pipeline.runtime.processes import StageInterrupted, sigterm_raises

# The architecture the benchmark builds: family (a model_type of families.FAMILIES) and published size;
# ``--family`` / ``--size`` (add_run_args) set it. Qwen3-VL uses the same special token ids as Qwen2.5-VL.
SIZES = {"qwen2_5_vl": ("7b",), "qwen3_vl": ("2b", "8b")}
ARCHITECTURE = {"family": "qwen2_5_vl", "size": "7b"}


def select_architecture(family: str = "qwen2_5_vl", size: str | None = None) -> None:
    """Build ``family`` at ``size`` (its first published size when None) from here on; one-line error otherwise."""
    if family not in SIZES:
        raise SystemExit(f"--family: unknown family {family!r}; known: {', '.join(SIZES)}")
    size = size or SIZES[family][0]
    if size not in SIZES[family]:
        raise SystemExit(f"--size: {family} has sizes {', '.join(SIZES[family])}, not {size!r}")
    ARCHITECTURE.update(family=family, size=size)


def family():
    """The family module of the selected architecture (decoder layers, checkpointing, fast path, model class)."""
    return family_for(ARCHITECTURE["family"])


def architecture_name(tiny: bool = False) -> str:
    return f"{ARCHITECTURE['family']} {'tiny' if tiny else ARCHITECTURE['size']}"


def disable_fast_path(model) -> None:
    """The selected family's stock vision path again (benchmarks switch variants on one model)."""
    family().disable_fast_path(model)


def tiny_name() -> str:
    """The built-in tiny model of the selected family (its processor stands in for the published one's)."""
    from lychee_pipeline.reranker.tiny import TINY_MODELS

    return next(name for name, (model_type, _) in TINY_MODELS.items() if model_type == ARCHITECTURE["family"])


def patch_size() -> int:
    """The vision patch of the selected architecture (14 for Qwen2.5-VL, 16 for Qwen3-VL)."""
    return int(family().architecture_config("tiny").vision_config.patch_size)

# Qwen2.5-VL-7B-Instruct's token ids (the synthetic inputs are in its vocabulary)
IMAGE_TOKEN_ID = TOKEN_IDS["image_token_id"]
VISION_START_ID = TOKEN_IDS["vision_start_token_id"]
VISION_END_ID = TOKEN_IDS["vision_end_token_id"]
PAD_ID = TOKEN_IDS["pad_token_id"]  # <|endoftext|>
IM_END_ID = TOKEN_IDS["eos_token_id"]
IM_START_ID = 151644
TEXT_ID_RANGE = (0, 151000)  # ordinary BPE ids
# "yes" / "no" in Qwen2's vocabulary (any two ordinary ids would do for random weights)
YES_ID = 9693
NO_ID = 2152


@dataclass
class Shape:
    """The input shape of one benchmark: groups of ``group_size`` pairs."""

    group_size: int = 8
    text_tokens: int = 600  # mean text tokens per pair (template + query + document)
    text_jitter: float = 0.25  # uniform +-25%
    image_side: int = 448  # one document image per pair, image_side x image_side pixels
    query_tokens: int = 60  # shared by the pairs of a group (system prompt, instruction, query)

    @staticmethod
    def tiny() -> "Shape":
        return Shape(group_size=8, text_tokens=60, text_jitter=0.25, image_side=224, query_tokens=12)


# Product-like words of the generated texts (train_stage.py, inference.py).
WORDS = (
    "red running shoes for women with a breathable mesh upper stainless steel water bottle that keeps drinks "
    "cold wireless headphones noise cancelling long battery life wooden desk lamp warm light adjustable arm "
    "cotton t-shirt blue size medium machine washable leather wallet six card slots coin pocket price free "
    "shipping stars reviews black backpack many pockets product matches query same colour shape"
).split()


def log(msg: str) -> None:
    """A progress line, flushed at once (the reply of a device run carries the end of the output)."""
    print(msg, flush=True)


def build_config(tiny: bool = False, **token_ids: int):
    """The selected family's config at its published size (Qwen2.5-VL: 7B), or with ``tiny`` the miniature its
    built-in tiny model is built with (the family's recipe); random init only. ``token_ids`` override Qwen's ids
    (e.g. to match a tokenizer)."""
    return family().architecture_config("tiny" if tiny else ARCHITECTURE["size"], token_ids=token_ids)


def build_model(config, device: torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa", seed: int = 0):
    """The family's model class (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``) with
    random weights created directly on ``device``."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = family().model_class()._from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype)
    model.config.use_cache = False
    return model


def count_params(model) -> tuple[int, int, int]:
    """(language model, vision tower, total) parameter counts of a Qwen2.5-VL (peft-wrapped or not)."""
    lm = vis = total = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        total += p.numel()
        if ".visual." in f".{name}" or name.startswith("visual."):
            vis += p.numel()
        elif "language_model" in name:
            lm += p.numel()
    return lm, vis, total


def _pair_ids(rng: torch.Generator, query: list[int], n_text: int, image_tokens: int) -> tuple[list[int], list[int]]:
    """One pair's token ids and mm_token_type_ids (1 on image tokens)."""
    lo, hi = TEXT_ID_RANGE
    suffix = [IM_END_ID, 198, IM_START_ID, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n
    n_doc = max(1, n_text - len(query) - len(suffix) - 2)
    doc = torch.randint(lo, hi, (n_doc,), generator=rng).tolist()
    ids = query + [VISION_START_ID] + [IMAGE_TOKEN_ID] * image_tokens + [VISION_END_ID] + doc + suffix
    types = [0] * (len(query) + 1) + [1] * image_tokens + [0] * (1 + len(doc) + len(suffix))
    return ids, types


def synthetic_group(shape: Shape, seed: int, patch: int | None = None, merge: int = 2, temporal: int = 2) -> dict[str, Any]:
    """One group of ``shape.group_size`` pairs as processor-like outputs (left padded, CPU tensors).

    Keys: input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw, labels (1.0 on the
    positive, first), group_size. The query part is shared by the group, the document text and the
    document image differ per pair.
    """
    rng = torch.Generator().manual_seed(seed)
    patch = patch or patch_size()
    lo, hi = TEXT_ID_RANGE
    query = [IM_START_ID] + torch.randint(lo, hi, (shape.query_tokens - 1,), generator=rng).tolist()
    grid = shape.image_side // patch
    image_tokens = (grid // merge) ** 2
    rows, types = [], []
    for _ in range(shape.group_size):
        jitter = (torch.rand((), generator=rng).item() * 2 - 1) * shape.text_jitter
        n_text = int(round(shape.text_tokens * (1 + jitter)))
        ids, tt = _pair_ids(rng, query, n_text, image_tokens)
        rows.append(ids)
        types.append(tt)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    mm_types = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, (ids, tt) in enumerate(zip(rows, types)):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
        mm_types[i, width - len(ids):] = torch.tensor(tt, dtype=torch.int32)
    patches = grid * grid
    pixel_values = torch.randn((shape.group_size * patches, 3 * temporal * patch * patch), generator=rng)
    image_grid_thw = torch.tensor([[1, grid, grid]] * shape.group_size, dtype=torch.long)
    labels = torch.zeros(shape.group_size)
    labels[0] = 1.0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_types,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "labels": labels,
        "group_size": shape.group_size,
    }


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from lychee_pipeline.reranker.inference import to_device as batch_to_device

    return batch_to_device(batch, device)


def batch_stats(batch: dict[str, Any]) -> dict[str, int]:
    mask = batch["attention_mask"]
    return {
        "pairs": int(mask.shape[0]),
        "tokens": int(mask.sum()),
        "padded_tokens": int(mask.numel()),
        "patches": int(batch["image_grid_thw"].prod(dim=1).sum()) if "image_grid_thw" in batch else 0,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int = 8192, warmup: int = 3, iters: int = 20) -> float:
    """Measured dense bf16 matmul rate (median of ``iters`` products of n x n x n, random data)."""
    if device.type != "cuda":
        n, iters = 512, 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        a @ b
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n**3 / statistics.median(times) / 1e12


def time_steps(step: Callable[[int], Any], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Run ``step(i)`` ``warmup`` times untimed, then ``steps`` times, synchronising around each."""
    for i in range(warmup):
        step(i)
    sync(device)
    times = []
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step(warmup + i)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# Datasheet dense bf16 tensor-core peaks (TFLOP/s, without sparsity), by a part of the device name; the first
# match wins, so the specific names come before the general ones
DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0),
                         ("A100", 312.0), ("L40S", 362.0), ("RTX 4090", 165.0))


def datasheet_tflops(device: torch.device) -> tuple[float, str]:
    """(the datasheet's dense bf16 peak, the part it is for) for a CUDA device; (nan, why) elsewhere."""
    if device.type != "cuda":
        return float("nan"), "no datasheet peak for a CPU"
    name = torch.cuda.get_device_name(device)
    for part, peak in DATASHEET_BF16_TFLOPS:
        if part.lower() in name.lower():
            return peak, f"{part} datasheet dense bf16"
    return float("nan"), f"no datasheet peak known for {name}"


def mfu(useful_flops_per_s: float, tflops: float) -> float:
    return useful_flops_per_s / (tflops * 1e12) if tflops > 0 and math.isfinite(tflops) else float("nan")


def environment(device: torch.device) -> dict[str, str]:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
        try:
            import subprocess

            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )
            info["driver"] = out.stdout.strip()
        except Exception:  # noqa: BLE001 - informational only
            info["driver"] = "unknown"
    else:
        info["gpu"] = "none (CPU)"
    return info


@contextlib.contextmanager
def scratch_folder(prefix: str, given: str | Path | None = None, keep: bool = False) -> Iterator[Path]:
    """A benchmark's working folder (model weights, JPEGs, stage folders): ``given`` is the caller's and stays;
    otherwise a new temporary folder, removed when the block ends, by an error or a SIGTERM (``timeout``) too.
    A 7B model folder with random weights is ~16 GiB: one left in /tmp per run fills a GPU box's disk.
    ``keep`` keeps the temporary folder too (a benchmark's ``--keep``)."""
    path = Path(given) if given is not None else Path(tempfile.mkdtemp(prefix=prefix))
    if given is not None or keep:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    try:
        with sigterm_raises():  # the stage launcher's own: SIGTERM raises, so the folder goes below
            yield path
    except StageInterrupted as stop:  # then the exit a signal gives, without a traceback
        raise SystemExit(128 + signal.Signals[stop.signal_name]) from None
    finally:
        shutil.rmtree(path, ignore_errors=True)


def add_run_args(parser, seed: int) -> None:
    """Arguments every benchmark takes: the seed and the folder its output files go to ($OUT on the lent GPU)."""
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="weights and activations on CUDA (default bfloat16; float32 for exactness checks)")
    parser.add_argument("--family", choices=tuple(SIZES), default="qwen2_5_vl",
                        help="the architecture's family: qwen2_5_vl (Lychee-rerank-mm) or qwen3_vl (Qwen3-VL-Reranker)")
    parser.add_argument("--size", default=None, help="published size: 7b (qwen2_5_vl); 2b or 8b (qwen3_vl)")


def pick_device(parser, args) -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16 (or --dtype) when there is a GPU; the CPU in fp32 only for the --tiny code-path check."""
    select_architecture(args.family, args.size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error(f"the {architecture_name()} benchmark needs a CUDA GPU; use --tiny on a CPU")
    dtype = args.dtype
    if device.type == "cpu":
        return device, torch.float32
    if dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False  # true fp32: the point of asking for it
        torch.backends.cudnn.allow_tf32 = False
    return device, getattr(torch, dtype or "bfloat16")

