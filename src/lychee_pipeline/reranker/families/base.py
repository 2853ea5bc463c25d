"""The contract of a model family: what the reranker library needs from one backbone architecture.

A family is a module (``families/<name>.py`` or a package ``families/<name>/``) that provides the names of
:class:`ModelFamily`; ``families.FAMILIES`` maps the ``model_type`` of a checkpoint's config.json to it. The
library reaches an architecture only through these names: ``load_reranker`` (model class, processor, fast
paths, checkpointing), the collators (image token counts), packing (the vision tower's host-side inputs, the
language models to switch), ``builtin:tiny`` (the recipe) and saving (the processor).

A fast path that does not hold for a family is refused by the family in one line, in
:attr:`ModelFamily.REFUSED_FAST_PATHS`: the library then fails with that reason (or, for ``kernels: auto``,
keeps the plain path) instead of running a path that would give wrong numbers.

Importing this module costs nothing but the standard library.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# The fast paths a family may refuse, by the `model:` setting that turns each on: (what it is, the value off).
FAST_PATHS = {
    "fast_path": ("the fast vision path (batched vision attention, frozen tower without autograd, patch embedding "
                  "as a matmul)", "false"),
    "pack_pairs": ("pairs packed into one sequence (host-side vision inputs, features placed at the image rows)",
                   "false"),
    "kernels": ("liger-kernel's fused RMSNorm / SwiGLU / rope on the family's modules", "none"),
    "prefix_reuse": ("a query's shared prompt prefix run once per packed batch (reranker/prefix.py)", "false"),
}


@dataclass(frozen=True)
class FusedKernelTargets:
    """Where liger-kernel's kernels go in a family's modules (``model.kernels``, reranker/kernels.py)."""

    modeling: types.ModuleType  # transformers' modelling module: its rotary functions (text, vision) are replaced
    rms_norms: tuple[type, ...]  # RMSNorm classes: every instance runs liger's RMSNorm
    gated_mlps: tuple[type, ...]  # gate/up/down MLP classes: each SiLU-gated instance runs liger's SwiGLU


@runtime_checkable
class ModelFamily(Protocol):
    """The names a family module provides (a module satisfies this protocol structurally)."""

    NAME: str  # the family in messages, e.g. "qwen2_5_vl"
    REFUSED_FAST_PATHS: Mapping[str, str]  # fast path (a key of FAST_PATHS) -> why it does not hold here
    TINY_RECIPE: Mapping[str, Any]  # everything that decides the family's builtin:tiny folder (hashed)
    PROCESSING_DEFAULTS: Mapping[str, int]  # max_length, min_pixels, max_pixels the published model scores with
    DEFAULT_INSTRUCTIONS: Mapping[str, str]  # instruction per task type ("<q>2<d>"), "default" the fallback

    # -- the prompt
    def build_messages(self, query: Any, doc: Any, instruction: str | None = None) -> list[dict[str, Any]]:
        """The chat messages of one (query, document) pair in the layout the family's model was trained with."""

    # -- model and processor
    def model_class(self) -> type:
        """The transformers class a checkpoint is loaded with (``from_pretrained``, safetensors only)."""

    def load_processor(self, path: str, local_files_only: bool = False) -> Any:
        """The processor of a saved folder or hub id, left padding."""

    def save_processor(self, processor: Any, out_dir: str | os.PathLike) -> None:
        """Save a processor so that the folder loads with the stock classes."""

    def image_tokens(self, processor: Any, height: int, width: int, min_pixels: int, max_pixels: int) -> int:
        """Language-model tokens one image of this size becomes under the pixel budget."""

    def decoder_layers(self, model: Any) -> list[Any]:
        """The language model's decoder layers, in order (checkpointing, compiling, memory planning)."""

    def language_models(self, model: Any) -> list[Any]:
        """The language model modules inside ``model`` (packing switches their attention)."""

    # -- the tiny recipe
    def architecture_config(self, size: str, vocab_size: int | None = None, token_ids: dict | None = None) -> Any:
        """The transformers config of a published size, or ``"tiny"``: the miniature ``builtin:tiny`` is built with."""

    def build_tiny(self, out: Path, corpus: list[str], seed: int) -> None:
        """Write the random-weight miniature (weights, tokenizer trained on ``corpus``, processor) into ``out``."""

    # -- fast paths and memory
    def enable_fast_path(self, model: Any) -> Any:
        """Switch the model to the family's faster forward, equal up to summation order (idempotent)."""

    def disable_fast_path(self, model: Any) -> Any:
        """The stock forward again (benchmarks and tests compare the two on one model)."""

    def vision_inputs_on_host(self, vision_config: Any, image_grid_thw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """What the vision tower derives from the image grids alone, computed on the host for a packed forward:
        ``(to the device, stays on the host)``, passed to ``get_image_features`` as keyword arguments."""

    def apply_selective_checkpointing(self, model: Any, layers: int | float | None = None) -> int:
        """Activation checkpointing of the first ``layers`` decoder layers; returns how many."""

    def fused_kernel_targets(self) -> FusedKernelTargets:
        """The module classes liger-kernel's kernels replace (``model.kernels: liger``)."""


def contract_names() -> list[str]:
    """The names a family module must provide: the constants and functions of :class:`ModelFamily`."""
    functions = [n for n, v in vars(ModelFamily).items() if callable(v) and not n.startswith("_")]
    return list(ModelFamily.__annotations__) + functions


def refused(family: ModelFamily, fast_path: str) -> str | None:
    """Why ``family`` refuses ``fast_path`` (a key of :data:`FAST_PATHS`), or None where it holds."""
    if fast_path not in FAST_PATHS:
        raise ValueError(f"unknown fast path {fast_path!r}; known: {', '.join(FAST_PATHS)}")
    return family.REFUSED_FAST_PATHS.get(fast_path)


def require_fast_path(family: ModelFamily, fast_path: str) -> None:
    """A one-line error naming the setting to turn off where ``family`` refuses ``fast_path``."""
    reason = refused(family, fast_path)
    if reason is not None:
        what, off = FAST_PATHS[fast_path]
        raise ValueError(f"model.{fast_path}: the {family.NAME} family does not support {what}: {reason}; "
                         f"set model.{fast_path}: {off}")


def transformers_model(model: Any) -> Any:
    """The outermost transformers ``PreTrainedModel`` inside ``model`` (through LycheeReranker / peft)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"no transformers PreTrainedModel inside {type(model).__name__}")


ORIG_FORWARD = "_lychee_orig_forward"  # where a fast path keeps the forward it replaced on a module instance


def bind_forward(module: Any, forward: Callable[..., Any], key: str = ORIG_FORWARD) -> bool:
    """Give ``module`` (an instance) the forward ``forward(module, ...)``, keeping its class's forward under ``key``
    for :func:`restore_forward`; False, and nothing done, where a forward is kept under ``key`` already."""
    if key in module.__dict__:
        return False
    module.__dict__[key] = module.forward
    module.forward = types.MethodType(forward, module)
    return True


def restore_forward(module: Any, key: str = ORIG_FORWARD) -> bool:
    """Undo :func:`bind_forward`: ``module`` takes its class's forward again; False where nothing was bound."""
    if key not in module.__dict__:
        return False
    del module.__dict__["forward"]
    del module.__dict__[key]
    return True


def frozen_no_grad_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A frozen vision tower's forward (bound by both families' fast paths): the stock forward under
    ``torch.no_grad`` while none of the tower's parameters trains, checked at every call, so that a tower unfrozen
    later trains as usual; its activations are not kept for gradients nobody uses."""
    import torch

    original = getattr(self, ORIG_FORWARD)
    if torch.is_grad_enabled() and not any(p.requires_grad for p in self.parameters()):
        with torch.no_grad():
            return original(*args, **kwargs)
    return original(*args, **kwargs)
