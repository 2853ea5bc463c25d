"""Loading Lychee-rerank-mm style rerankers and scoring with a 2-way (yes, no) head.

``load_reranker(ModelConfig(...), device)`` loads a checkpoint (hub id, local folder or ``builtin:tiny``) with
the class of its model family (``families/``, chosen by config.json's ``model_type``; Qwen2.5-VL:
``Qwen2_5_VLForConditionalGeneration``), safetensors only, no remote code, prepares it for LoRA / QLoRA / full
fine-tuning or frozen inference (the fast paths its family does not refuse), and wraps it in
:class:`LycheeReranker`, whose forward returns only the (yes, no) logits of the last position,
computed from the last hidden state and the two ``lm_head`` rows (no full-vocabulary logits).
"""

from __future__ import annotations

import json
import logging
import os
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from .families import family_of, family_of_model, refused, require_fast_path

if TYPE_CHECKING:
    from .processing import ProcessingConfig
    from .vision_cache import VisionFeatureCache

log = logging.getLogger(__name__)

FINETUNE_MODES = ("lora", "qlora", "full", "frozen")
# language-model attention projections only: anything under `visual` (the vision tower) is excluded
DEFAULT_LORA_TARGETS = r"^(?!.*visual).*\.(q_proj|k_proj|v_proj|o_proj)$"
METADATA_FILE = "lychee_reranker.json"
NON_MODEL_KEYS = ("labels", "group_size")


@dataclass
class LoraConfig:
    """LoRA adapter shape. ``target_modules``: a regex (peft full-match) or a list of module-name suffixes; the
    default matches the language model's q/k/v/o projections and nothing in the vision tower."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: str | list[str] = DEFAULT_LORA_TARGETS
    # the branch as one autograd function in training (reranker/lora_branch.py: keeps no mask nor dropped copy
    # of the input, draws the mask again in the backward); auto = on CUDA; False = peft's own forward
    fused: bool | Literal["auto"] = "auto"

    __pydantic_config__ = {"extra": "forbid"}

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0:
            raise ValueError("lora r and alpha must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")


@dataclass
class ModelConfig:
    """How to load and fine-tune the reranker: the one model config of the library, the pipeline's
    ``model:`` parameters (validated by pydantic, unknown keys refused) and a stage spec's ``model``.

    ``finetune``: ``lora``, ``qlora`` (CUDA), ``full`` or ``frozen``.
    ``activation_checkpointing``: ``True`` / ``False``, or ``"auto"``: a training stage checkpoints just
    enough decoder layers for ``training.memory_budget_gib`` (training/memory.py); loading alone treats
    ``auto`` as on for QLoRA only. ``checkpoint_layers``: with ``True``, how many decoder layers (None = all).
    ``dtype``: ``"auto"`` (bf16 on CUDA, fp32 on CPU), ``"bf16"``, ``"fp16"`` or ``"fp32"``.
    ``adapter``: a saved LoRA adapter folder to load on top of ``name_or_path``.
    ``freeze_vision``: in ``full`` mode, keep the vision tower frozen (always frozen in LoRA modes).
    ``fast_path``: the optimised step (docs/benchmarks.md); False = the plain Hugging Face forward.
    """

    name_or_path: str = "builtin:tiny"
    finetune: Literal["lora", "qlora", "full", "frozen"] = "lora"
    lora: LoraConfig = field(default_factory=LoraConfig)
    activation_checkpointing: bool | Literal["auto"] = "auto"
    checkpoint_layers: int | float | None = None
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    local_files_only: bool = False
    adapter: str | None = None
    freeze_vision: bool = True
    tiny_cache_dir: str | None = None
    fast_path: bool = True
    # one packed sequence per micro-batch, no padding tokens (reranker/packing.py); auto: where the family holds it
    pack_pairs: bool | Literal["auto"] = "auto"
    kernels: Literal["auto", "liger", "none"] = "auto"  # fused kernels at load: auto = liger on CUDA where installed
    compile_layers: bool = False  # torch.compile each decoder layer (reranker/kernels.py)
    fp8: bool = False  # FP8 matmuls in the language model's linear layers: Hopper + torchao only (reranker/fp8.py)

    # read by pydantic where the pipeline validates its `model:` parameters (no pydantic import needed here)
    __pydantic_config__ = {"extra": "forbid"}

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        if self.finetune not in FINETUNE_MODES:
            raise ValueError(f"finetune must be one of {FINETUNE_MODES}, got {self.finetune!r}")
        if self.trust_remote_code:
            raise ValueError("trust_remote_code=True is not allowed: Qwen2.5-VL is a native transformers model")
        if self.dtype not in ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.activation_checkpointing not in (True, False, "auto"):
            raise ValueError(f"activation_checkpointing must be true, false or auto, got {self.activation_checkpointing!r}")
        if self.pack_pairs not in (True, False, "auto"):
            raise ValueError(f"pack_pairs must be true, false or auto, got {self.pack_pairs!r}")

    def checkpointing_at_load(self) -> bool:
        """Whether ``load_reranker`` turns on checkpointing (``auto`` is decided later, by a training stage)."""
        if self.activation_checkpointing == "auto":
            return self.finetune == "qlora"
        return bool(self.activation_checkpointing)


# ----------------------------------------------------------------------------------------------
# paths and dtypes


def resolve_model_path(name_or_path: str, local_files_only: bool = False, tiny_cache_dir: str | None = None) -> str:
    """``builtin:tiny`` -> its (built on demand) cache folder; a local folder -> itself; else a hub id."""
    if name_or_path.startswith("builtin:"):  # builtin:tiny, builtin:tiny-qwen3-vl (tiny.TINY_MODELS)
        from .tiny import ensure_tiny

        return str(ensure_tiny(tiny_cache_dir, name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"model folder not found: {name_or_path}")
    return name_or_path  # a hub id such as vec-ai/lychee-rerank-mm


def family_of_config(cfg: ModelConfig) -> Any:
    """The model family of ``cfg.name_or_path`` (its config.json's ``model_type``), without loading the model."""
    return family_of(resolve_model_path(cfg.name_or_path, cfg.local_files_only, cfg.tiny_cache_dir),
                     cfg.local_files_only)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def single_token_id(tokenizer: Any, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{word!r} is not a single token in this tokenizer (got {ids}); cannot score yes/no")
    return int(ids[0])


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing; the non-deprecated API where this transformers has it."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers releases before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "config"):
        model.config.use_cache = False


def _check_qlora_possible(device: torch.device) -> None:
    import importlib.util

    problems = []
    if device.type != "cuda" or not torch.cuda.is_available():
        problems.append(f"no CUDA GPU (device is {device.type!r})")
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append("bitsandbytes is not installed (pip install 'lychee_pipeline[qlora]')")
    if problems:
        raise RuntimeError(
            "QLoRA (4-bit) needs a CUDA GPU and bitsandbytes: " + "; ".join(problems)
            + ". Use finetune='lora' (or 'full') on this machine."
        )


# ----------------------------------------------------------------------------------------------
# the module


class LycheeReranker(nn.Module):
    """A Qwen2.5-VL backbone scored by its ``yes`` / ``no`` logits at the last position.

    Attributes: ``backbone`` (the ``Qwen2_5_VLForConditionalGeneration``, or a peft model around it),
    ``processor``, ``yes_id``, ``no_id``, ``config`` (the :class:`ModelConfig`).
    Inputs must be left padded (the scored token is the last one of every row).
    """

    def __init__(self, backbone: nn.Module, processor: Any, config: ModelConfig, yes_id: int, no_id: int):
        super().__init__()
        self.backbone = backbone
        self.processor = processor
        self.config = config
        self.yes_id = int(yes_id)
        self.no_id = int(no_id)

    # -- structure -----------------------------------------------------------------------------
    @property
    def is_peft(self) -> bool:
        return hasattr(self.backbone, "peft_config")

    @property
    def base_model(self) -> nn.Module:
        """The ``Qwen2_5_VLForConditionalGeneration`` (inside peft if wrapped)."""
        return self.backbone.get_base_model() if self.is_peft else self.backbone

    @property
    def family(self) -> Any:
        """The model family of the backbone (``families.ModelFamily``), from its config's ``model_type``."""
        return family_of_model(self.backbone)

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    def head_weight(self) -> torch.Tensor:
        """The two ``lm_head`` rows [2, hidden]: (yes, no)."""
        weight = self.base_model.lm_head.weight
        # two row views stacked: indexing with a list would copy the ids to the device first, a copy that waits
        # for everything queued there (one wait per forward, the device idle until the next batch is launched)
        return torch.stack((weight[self.yes_id], weight[self.no_id]))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # -- scoring -------------------------------------------------------------------------------
    @staticmethod
    def _model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
        inputs = {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask[:, -1].all()):
            raise ValueError("inputs must be left padded: the last position of every row has to be a real token")
        return inputs

    def host_inputs(self, batch: dict[str, Any], share_prefixes: bool = False,
                    keyed_images: bool = False) -> dict[str, Any]:
        """``batch`` (processor outputs, on the CPU) as :meth:`forward` takes it, with the work that depends only
        on the inputs' shapes done here, on the host: for a model that packs pairs, the packed sequence, its
        positions and the vision tower's grid-derived inputs (a :class:`~.packing.PackedBatch` under
        ``"packed"``). Call it where the batch is prepared (the scorer's preparing thread), so that the forward
        never waits for the device to read them back; unchanged for a model that pads. ``share_prefixes``: pairs
        that begin alike share one prefix segment (``reranker/prefix.py``; packed models only). ``keyed_images``:
        each image's key for a vision feature cache (``reranker/vision_cache.py``; packed models only)."""
        if share_prefixes:
            self.require_prefix_reuse()
        if not self.config.pack_pairs:
            return batch
        from .packing import pack_batch

        model_inputs = {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}
        return {"packed": pack_batch(self.base_model.model, model_inputs, share_prefixes, keyed_images),
                **{k: v for k, v in batch.items() if k in NON_MODEL_KEYS}}

    def prefix_reuse_refusal(self) -> str | None:
        """Why prefix reuse (``reranker/prefix.py``) cannot run on this model, in one line, or None: it lives in the
        packed forward, and the family must not refuse it."""
        if not self.config.pack_pairs:
            return "prefix_reuse needs packed pairs (model.pack_pairs: true); set prefix_reuse: false"
        reason = refused(self.family, "prefix_reuse")
        if reason is not None:
            return (f"prefix_reuse: the {self.family.NAME} family does not support it: {reason}; "
                    "set prefix_reuse: false")
        return None

    def require_prefix_reuse(self) -> None:
        """:meth:`prefix_reuse_refusal` as an error."""
        refusal = self.prefix_reuse_refusal()
        if refusal is not None:
            raise ValueError(refusal)

    def forward(self, vision_cache: VisionFeatureCache | None = None, **batch: Any) -> torch.Tensor:
        """Tensor[N, 2] (fp32) of (yes, no) logits at the last position.

        Takes every processor output (input_ids, attention_mask, pixel_values, image_grid_thw,
        mm_token_type_ids, ...), or what :meth:`host_inputs` made of them; ``labels`` and ``group_size`` from the
        group collator are ignored. ``vision_cache``: a packed batch's images with keys take the features already
        computed for them (``reranker/vision_cache.py``; the scorer passes its own); ignored by a model that pads.
        """
        if self.config.pack_pairs:  # the pairs as one sequence without padding, scored at each pair's end
            from .packing import packed_last_hidden

            inputs = batch.get("packed") or {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}
            last = packed_last_hidden(self.base_model.model, inputs, vision_cache)
        else:
            inputs = self._model_inputs(batch)
            last = self.base_model.model(**inputs, use_cache=False, return_dict=True).last_hidden_state[:, -1, :]
        weight = self.head_weight()
        logits = last.float() @ weight.float().t()
        bias = getattr(self.base_model.lm_head, "bias", None)
        if bias is not None:
            logits = logits + torch.stack((bias[self.yes_id], bias[self.no_id])).float()
        return logits

    def full_logits(self, **batch: Any) -> torch.Tensor:
        """The same (yes, no) logits via the stock forward and full-vocabulary logits (for checks only)."""
        inputs = self._model_inputs(batch)
        logits = self.base_model(**inputs, use_cache=False, return_dict=True).logits
        return logits[:, -1, [self.yes_id, self.no_id]].float()

    @staticmethod
    def probabilities(logits: torch.Tensor) -> torch.Tensor:
        """p(yes) = softmax over (yes, no)."""
        return torch.softmax(logits.float(), dim=-1)[:, 0]

    # -- saving --------------------------------------------------------------------------------
    def _write_metadata(self, out: Path, kind: str, processing: ProcessingConfig | None) -> None:
        meta = {
            "format": kind,
            "base_model": self.config.name_or_path,
            "finetune": self.config.finetune,
            "yes_id": self.yes_id,
            "no_id": self.no_id,
            "config": asdict(self.config),
        }
        if processing is not None:  # what the model was trained with; Reranker.from_pretrained scores with it
            meta["processing"] = processing.as_dict()
        (out / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")

    def save_pretrained(self, out_dir: str | os.PathLike, processing: ProcessingConfig | None = None) -> Path:
        """LoRA: the adapter (peft, safetensors); otherwise the full weights (safetensors); plus the processor
        and the metadata (with the processing settings the model was trained with, when given)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.is_peft:
            self.backbone.save_pretrained(out, safe_serialization=True)
            kind = "adapter"
        else:
            self.backbone.save_pretrained(out)  # transformers 5 writes safetensors only
            kind = "full"
        self.family.save_processor(self.processor, out)
        self._write_metadata(out, kind, processing)
        return out

    def merge_and_save(self, out_dir: str | os.PathLike, processing: ProcessingConfig | None = None,
                       in_place: bool = False) -> Path:
        """Export a merged full model (LoRA folded into the weights) + processor; the module is unchanged, unless
        ``in_place``: the adapter is folded into this module's own weights, no copy (for a model loaded only to be
        exported: a 7B copy would double the host memory)."""
        import copy

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.is_peft:
            if self.config.finetune == "qlora":
                raise RuntimeError("merging a 4-bit QLoRA model is not supported; load the base in bf16 with the adapter and merge that")
            merged = (self.backbone if in_place else copy.deepcopy(self.backbone)).merge_and_unload()
            if in_place:
                self.backbone = merged
        else:
            merged = self.backbone
        merged.save_pretrained(out)
        self.family.save_processor(self.processor, out)
        if processing is None:  # a merged export keeps the processing settings of what it was loaded from
            processing = processing_of(self.config.adapter or self.config.name_or_path)
        self._write_metadata(out, "merged", processing)
        return out


# ----------------------------------------------------------------------------------------------
# loading


def _apply_lora(model: nn.Module, cfg: ModelConfig, device: torch.device | None = None) -> nn.Module:
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    lora = PeftLoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        bias="none",
        task_type=None,
    )
    model = get_peft_model(model, lora)
    _fuse_lora(model, cfg, device)
    return model


def _fuse_lora(model: nn.Module, cfg: ModelConfig, device: torch.device | None) -> None:
    from .lora_branch import fuse_lora_branches, wants_fused

    if wants_fused(cfg.lora.fused, device):
        log.info("lora.fused: the LoRA branch of %d layers runs as one autograd function", fuse_lora_branches(model))


def _freeze_vision(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if "visual" in name:
            param.requires_grad_(False)


def read_metadata(folder: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(folder) / METADATA_FILE
    if path.is_file():
        return json.loads(path.read_text())
    return None


def processing_of(folder: str | os.PathLike) -> ProcessingConfig | None:
    """The processing settings a saved folder was trained with (None for a hub id or an older folder)."""
    from .processing import ProcessingConfig

    meta = read_metadata(folder) if Path(folder).is_dir() else None
    if not meta or not meta.get("processing"):
        return None
    return ProcessingConfig.from_dict(meta["processing"])


def load_reranker(cfg: ModelConfig, device: str | torch.device | None = "auto") -> LycheeReranker:
    """Load ``cfg.name_or_path`` (+ ``cfg.adapter``) and prepare it for ``cfg.finetune``."""
    from .kernels import apply_kernels, resolve_kernels

    dev = resolve_device(device)
    if cfg.fp8:  # before the load: a CPU, another GPU or a missing torchao fails here in one line
        from .fp8 import require_fp8

        require_fp8(dev, cfg.finetune)
    if cfg.finetune == "qlora":
        _check_qlora_possible(dev)
    resolve_kernels(cfg.kernels, dev)  # a kernel choice this machine cannot run fails before the load
    path = resolve_model_path(cfg.name_or_path, cfg.local_files_only, cfg.tiny_cache_dir)
    family = family_of(path, cfg.local_files_only)  # the architecture's classes, processor and fast paths
    if cfg.pack_pairs == "auto":  # packed where the family holds it, padded batches where it refuses (logged)
        reason = refused(family, "pack_pairs")
        if reason is not None:
            log.info("pack_pairs auto: padded batches (the %s family does not pack pairs: %s)", family.NAME, reason)
        cfg = dataclasses.replace(cfg, pack_pairs=reason is None)
    for fast_path in ("fast_path", "pack_pairs"):  # a fast path the family refuses fails before the load
        if getattr(cfg, fast_path):
            require_fast_path(family, fast_path)
    resolve_kernels(cfg.kernels, dev, refused(family, "kernels"))
    dtype = resolve_dtype(cfg.dtype, dev)
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "attn_implementation": cfg.attn_implementation,
        "use_safetensors": True,
        "trust_remote_code": False,
        "local_files_only": cfg.local_files_only,
    }
    if cfg.finetune == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=["lm_head", "visual"],
        )
        kwargs["device_map"] = {"": dev.index if dev.index is not None else torch.cuda.current_device()}
    elif dev.type == "cuda":
        kwargs["device_map"] = {"": dev}  # load straight onto this process's GPU
    model = family.model_class().from_pretrained(path, **kwargs)
    if cfg.finetune != "qlora":
        model.to(dev)
    apply_kernels(model, cfg.kernels, dev, family)  # fused RMSNorm/SwiGLU/rope (liger) or the plain path; logged
    if cfg.fp8:  # the frozen base projections in FP8, before peft wraps them (the adapters stay in bf16)
        from .fp8 import apply_fp8

        apply_fp8(model, family.language_models(model))

    processor_path = path
    if cfg.adapter is not None and (Path(cfg.adapter) / "tokenizer_config.json").is_file():
        processor_path = cfg.adapter
    processor = family.load_processor(processor_path, cfg.local_files_only)

    if cfg.finetune == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.checkpointing_at_load(),
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif cfg.checkpointing_at_load():
        family.apply_selective_checkpointing(model, layers=cfg.checkpoint_layers)

    trainable = cfg.finetune in ("lora", "qlora", "full")
    if cfg.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.adapter, is_trainable=cfg.finetune in ("lora", "qlora"))
        if cfg.finetune == "full":  # fine-tune the merged weights
            model = model.merge_and_unload()
        else:
            _fuse_lora(model, cfg, dev)
    elif cfg.finetune in ("lora", "qlora"):
        model = _apply_lora(model, cfg, dev)

    if cfg.finetune == "frozen":
        for param in model.parameters():
            param.requires_grad_(False)
    elif cfg.finetune == "full":
        for param in model.parameters():
            param.requires_grad_(True)
        if cfg.freeze_vision:
            _freeze_vision(model)
    else:
        _freeze_vision(model)  # peft already froze the base; make sure nothing visual trains

    if cfg.fast_path:  # batched vision attention, frozen tower without autograd, patch embedding as a matmul
        family.enable_fast_path(model)
    if cfg.pack_pairs:  # the language model attends within each pair of a packed sequence
        from .packing import enable_packed_attention

        log.info("pack_pairs: pairs packed into one sequence, attention per pair (%d language model(s) switched)",
                 enable_packed_attention(model))
    if cfg.compile_layers:
        from .kernels import compile_decoder_layers

        log.info("torch.compile: %d decoder layers", compile_decoder_layers(model))
    tok = processor.tokenizer
    reranker = LycheeReranker(model, processor, cfg, single_token_id(tok, "yes"), single_token_id(tok, "no"))
    reranker.train(trainable)
    return reranker
