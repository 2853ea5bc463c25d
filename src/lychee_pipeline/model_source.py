"""Is the model a run starts from there? Checked before any data work, in one line when it is not.

`model.name_or_path` is a built-in model (`builtin:tiny`), a local folder, or a Hugging Face hub id. A hub id
is found in the local hub cache (a downloaded model needs no network), else on the hub with ONE request of a
few seconds (`HUB_TIMEOUT_S`); with `HF_HUB_OFFLINE=1` the hub is not asked. Without this check a run with an
unreachable model did all its data work, then each training process retried the hub several times and the
cause ended up in the middle of hundreds of log lines.

`ModelSourceHooks.before_pipeline_run` runs the check for the model(s) a pipeline reads, before any node and
before the MLflow run opens (like the parameter check in hooks.py).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from lychee_pipeline.runtime.errors import MissingInput

log = logging.getLogger(__name__)

HUB_TIMEOUT_S = 8.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# the smoke pipeline's training plan merges `smoke.model` over `model` (pipelines/training/nodes.py)
SMOKE_PLAN_NODE = "plan_smoke_training"


class ModelNotFound(MissingInput):
    """The model a run starts from is nowhere it was looked for."""


def _hub_cache_hit(repo_id: str) -> str | None:
    """The cached config.json of `repo_id` (a downloaded model), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return found if isinstance(found, str) else None


def _ask_hub(repo_id: str, timeout: float) -> str | None:
    """None when the hub has `repo_id`; else why not, in a few words."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=timeout)
    except GatedRepoError:
        return None  # it exists; the download says whether this token may read it
    except RepositoryNotFoundError:
        return "no such model there (or a private one this machine's token cannot see: set HF_TOKEN)"
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS failure, timeout, proxy: all "unreachable"
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"unreachable ({type(exc).__name__}: {reason[:160]})"
    return None


def locate_model(name_or_path: str, parameter: str = "model.name_or_path", timeout: float = HUB_TIMEOUT_S) -> str:
    """Where `name_or_path` will be loaded from, in a few words, or ModelNotFound naming the places looked."""
    from huggingface_hub import constants

    if name_or_path.startswith("builtin:"):
        return "a model built into the project"
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return f"the folder {folder.resolve()}"
    if not _HUB_ID.match(name_or_path) or name_or_path.startswith((".", "/", "~")):
        raise ModelNotFound(f"model {name_or_path!r} ({parameter}) not found: no such folder "
                            f"{folder.resolve()} (and not a hub id of the form org/name)")
    looked = [f"no folder {folder.resolve()}"]
    if _hub_cache_hit(name_or_path):
        return f"in the Hugging Face cache {constants.HF_HUB_CACHE}"
    looked.append(f"not in the Hugging Face cache {constants.HF_HUB_CACHE}")
    if constants.HF_HUB_OFFLINE:
        looked.append("the hub not asked (HF_HUB_OFFLINE=1)")
    else:
        why = _ask_hub(name_or_path, timeout)
        if why is None:
            return f"on the hub {constants.ENDPOINT} (downloaded into {constants.HF_HUB_CACHE} on first use)"
        looked.append(f"hub {constants.ENDPOINT}: {why}")
    raise ModelNotFound(f"model {name_or_path!r} ({parameter}) not found: " + "; ".join(looked)
                        + f". Download it first (`hf download {name_or_path}`, with network) or set {parameter} "
                        "to a model folder")


def models_read_by(pipeline: Any, load) -> dict[str, str]:
    """{parameter: name_or_path} of the base models the pipeline's nodes load (`load(name)` reads a dataset)."""
    inputs = pipeline.inputs()
    if "params:model" not in inputs:
        return {}
    model = load("params:model") or {}
    found = {"model.name_or_path": str(model.get("name_or_path") or "")}
    smoke_plan = any(n.name.rsplit(".", 1)[-1] == SMOKE_PLAN_NODE for n in pipeline.nodes)
    if smoke_plan and "params:smoke" in inputs:
        override = ((load("params:smoke") or {}).get("model") or {}).get("name_or_path")
        if override:
            found["smoke.model.name_or_path"] = str(override)
    return {k: v for k, v in found.items() if v}


class ModelSourceHooks:
    @hook_impl(tryfirst=True)  # before kedro-mlflow opens the run and before any node: no data work for nothing
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        for parameter, name in models_read_by(pipeline, catalog.load).items():
            where = locate_model(name, parameter)
            log.info("%s %s: %s", parameter, name, where)
