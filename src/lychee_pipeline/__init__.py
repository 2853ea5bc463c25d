"""lychee-pipeline
"""

import warnings as _warnings

__version__ = "0.1"


def quiet_library_warnings() -> None:
    """Hide library deprecation notices every `kedro run` would print, none of them actionable in this project.

    Kedro and kedro-mlflow register their resolvers with OmegaConf's deprecated call, and MLflow asks for type
    hints on kedro-mlflow's and the project's pyfunc models (the project's model is logged with an explicit
    signature). Called again from settings.py and the hooks: a `catch_warnings()` block around an import drops
    filters added inside it.
    """
    _warnings.filterwarnings("ignore", message=r"register_new_resolver\(\) is deprecated", category=UserWarning)
    _warnings.filterwarnings("ignore", message=r".*Add type hints to the `predict` method", category=UserWarning)
    # transformers deprecated a property that libraries still read while they wrap the model (not project code)
    _warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


quiet_library_warnings()
