"""Project settings: configuration loading and hooks."""

from kedro.config import OmegaConfigLoader

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {
        # kedro-mlflow reads conf/<env>/mlflow.yml through this pattern.
        "mlflow": ["mlflow*", "mlflow*/**"],
    },
}
