"""Project settings: configuration loading and hooks."""

from pathlib import Path

from kedro.config import OmegaConfigLoader

from lychee_pipeline import quiet_library_warnings
from lychee_pipeline.project import project_root
from lychee_pipeline.tracking import configured_tracking_uri

quiet_library_warnings()

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # keys of conf/local/ and of --params are merged into conf/base/ key by key: with Kedro's default
    # (destructive), a `data:` block in conf/local/parameters.yml made `--params smoke.training.max_steps=3`
    # replace the whole `smoke:` block, and the run stopped on a missing params:smoke.sample_size
    "merge_strategy": {"parameters": "soft"},
    "config_patterns": {
        # kedro-mlflow reads conf/<env>/mlflow.yml through this pattern.
        "mlflow": ["mlflow*", "mlflow*/**"],
    },
    # ${abspath:mlflow.db}: an absolute store path in the project root (wherever `kedro run` started), so a
    # process that opens two projects (a notebook, the tests) never reuses the first project's cached store.
    # ${tracking_uri:mlflow.db}: MLFLOW_TRACKING_URI where the user set it (a team's server), else that sqlite
    # file in the project root
    "custom_resolvers": {
        "abspath": lambda path: (project_root() / Path(path)).resolve().as_posix(),
        "tracking_uri": lambda path: configured_tracking_uri((project_root() / Path(path)).resolve().as_posix()),
    },
}

from lychee_pipeline.hooks import (  # noqa: E402
    EmptyTestSplitHooks,
    MlflowStoreHooks,
    ParameterCheckHooks,
    TypedBlocksHooks,
    ProjectRootHooks,
    RefusalHooks,
    RunOutcomeHooks,
    TrackingServerHooks,
)
from lychee_pipeline.model_source import ModelSourceHooks  # noqa: E402

# ModelSourceHooks before ParameterCheckHooks: pluggy calls the later one of two tryfirst hooks first, so the
# parameters are checked before the model is looked for
HOOKS = (ProjectRootHooks(), MlflowStoreHooks(), ModelSourceHooks(), ParameterCheckHooks(), TypedBlocksHooks(),
         RunOutcomeHooks(), RefusalHooks(), TrackingServerHooks(), EmptyTestSplitHooks())
