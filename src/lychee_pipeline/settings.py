"""Project settings: configuration loading and hooks."""

from pathlib import Path

from kedro.config import OmegaConfigLoader

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {
        # kedro-mlflow reads conf/<env>/mlflow.yml through this pattern.
        "mlflow": ["mlflow*", "mlflow*/**"],
    },
    # ${abspath:mlflow.db}: an absolute store path, so a process that opens two projects (a notebook, the
    # tests) never reuses the first project's cached sqlite store for the second.
    "custom_resolvers": {"abspath": lambda path: Path(path).resolve().as_posix()},
}

from lychee_pipeline.hooks import ParameterCheckHooks, RunOutcomeHooks  # noqa: E402

HOOKS = (ParameterCheckHooks(), RunOutcomeHooks())
