"""Project hooks: the parent MLflow run says how a run ended (KILLED on Ctrl-C / SIGTERM, FAILED on error).

kedro-mlflow ends its run as FAILED from `on_pipeline_error`, but Kedro calls that hook for an `Exception` only:
on Ctrl-C (KeyboardInterrupt) nothing ended the run and MLflow's own exit handler marked it FINISHED. Here:

- for the whole pipeline run, SIGTERM raises `StageInterrupted` (a KeyboardInterrupt) in the main thread, so
  it unwinds like Ctrl-C (a running training stage stops its processes on the way);
- on an error, the run gets a `failure_reason` tag before kedro-mlflow ends it as FAILED;
- on an interrupt, an exit handler (it runs before MLflow's) tags the run and ends it as KILLED.

`ParameterCheckHooks` validates the training parameters before any run is opened: its `before_pipeline_run` runs
first (tryfirst) and a bad parameter raises there, so kedro-mlflow's `before_pipeline_run` never starts the parent
run: a one-line parameter error leaves no MLflow run at all.
"""

from __future__ import annotations

import atexit
import difflib
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from lychee_pipeline.runtime.errors import InvalidParameter, UserInputError, install_refusal_report

log = logging.getLogger(__name__)

PLAIN_LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class ProjectRootHooks:
    """Runs work in the project root, whichever folder `kedro run` started in (see `lychee_pipeline.project`)."""

    @hook_impl(tryfirst=True)  # before kedro-mlflow resolves the tracking URI and creates the experiment
    def after_context_created(self, context) -> None:
        from lychee_pipeline import quiet_library_warnings
        from lychee_pipeline.project import enter_project_root

        quiet_library_warnings()
        root, left = enter_project_root(context.project_path)
        if left is not None:
            _reload_project_logging(root)
        plain_console_log_when_not_a_terminal()
        drop_runner_echoes()
        quiet_child_output()
        install_refusal_report()  # after the logging set-up above, which installs Rich's exception hook
        if left is not None:
            log.info("started in %s: working in the project root %s (every relative path is relative to it)",
                     left, root)


class MlflowTypeHintNotice(logging.Filter):
    """Drops MLflow's "Add type hints to the `predict` method" notice from the log (Kedro logs warnings).

    MLflow prints it when a `PythonModel` subclass is defined without type hints on `predict`: kedro-mlflow's
    `KedroPipelineModel`, imported by the `kedro` command line with kedro-mlflow's commands, before any project
    code runs (the project's own model has them: `mlflow_model.RerankerModel`). MLflow raises the notice inside
    its own `catch_warnings()` with a `once` filter, which overrides any `ignore` filter, so only the log can
    drop it.
    """

    MESSAGE = "Add type hints to the `predict` method"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.MESSAGE not in record.getMessage()


def quiet_kedro_startup() -> None:
    """Run by `kedro` as it starts, before it imports its plugins (entry point `kedro.init` in pyproject.toml)."""
    from lychee_pipeline import quiet_library_warnings

    quiet_library_warnings()
    warnings_log = logging.getLogger("py.warnings")  # where Kedro's log handler sends warnings
    if not any(isinstance(f, MlflowTypeHintNotice) for f in warnings_log.filters):
        warnings_log.addFilter(MlflowTypeHintNotice())


def _reload_project_logging(root: Path) -> None:
    """Kedro read `conf/logging.yml` relative to the folder it started in; read the project's own now."""
    config = root / "conf" / "logging.yml"
    if os.environ.get("KEDRO_LOGGING_CONFIG") or not config.is_file():
        return
    try:
        import yaml
        from kedro.framework.project import LOGGING

        LOGGING.configure(yaml.safe_load(config.read_text(encoding="utf-8")))
    except Exception as exc:  # noqa: BLE001 - logging set-up never stops a run
        log.warning("could not load %s: %s", config, exc)


def _to_a_file() -> bool:
    """stderr is a file or a pipe (not a terminal, not a notebook, which renders bars and rich itself)."""
    return not sys.stderr.isatty() and "ipykernel" not in sys.modules


# A transformers deprecation the stage processes trigger through a library property, not through project code.
CHILD_WARNING_FILTERS = ("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",)


def quiet_child_output() -> None:
    """Stage processes (they inherit this environment) skip a known library warning; no MLflow progress bar
    while it copies a few small local artifacts; in a log file, no weight-loading progress bars (a bar redrawn
    in a file is one long line per update)."""
    current = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    os.environ["PYTHONWARNINGS"] = ",".join(current + [f for f in CHILD_WARNING_FILTERS if f not in current])
    # "Downloading artifacts: 100%|...| 9/9" when the logged model is built from local files; read per call
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if _to_a_file():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # "Generating train split" in the stages
        try:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()  # this process too (the evaluation loads the models here)
            if "transformers" in sys.modules:  # it read the setting when it was imported
                sys.modules["transformers"].utils.logging.disable_progress_bar()
        except Exception:  # noqa: BLE001 - cosmetic
            pass


def plain_console_log_when_not_a_terminal() -> None:
    """Rich wraps its log at 80 columns when stderr is a file or a pipe: write plain, unwrapped lines there."""
    if not _to_a_file():
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__name__ == "RichHandler":
            plain = logging.StreamHandler(sys.stderr)
            plain.setLevel(handler.level)
            plain.setFormatter(logging.Formatter(PLAIN_LOG_FORMAT))
            root.removeHandler(handler)
            root.addHandler(plain)


class RunnerEchoFilter(logging.Filter):
    """Two lines per node instead of three from Kedro's SequentialRunner, and no `--async` advice.

    The runner logs "Completed node: X" and then "Completed 5 out of 39 tasks" for every node; here they become
    one line, "Completed node: X (5 out of 39 tasks)", X with its namespace (`training.train_stage_1.run_stage`:
    the name `--from-nodes` takes; the "Running node" line shows the node's short name only).
    """

    ECHO = "Using synchronous mode for loading and saving data"
    DONE = "Completed node: "
    TASKS = re.compile(r"^Completed (\d+ out of \d+ tasks)$")

    def __init__(self) -> None:
        super().__init__()
        self._done: str | None = None  # the node the runner just said it completed

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.ECHO):
            return False
        if message.startswith(self.DONE):
            self._done = message.removeprefix(self.DONE)
            return False
        tasks = self.TASKS.match(message)
        if tasks and self._done is not None:
            record.msg, record.args = "%s%s (%s)", (self.DONE, self._done, tasks[1])
            self._done = None
        return True


RUNNER_ECHO_FILTER = RunnerEchoFilter()


def drop_runner_echoes() -> None:
    """Install the echo filter on the logger of the runner `kedro run` uses (once)."""
    runner_log = logging.getLogger("kedro.runner.sequential_runner")
    if RUNNER_ECHO_FILTER not in runner_log.filters:
        runner_log.addFilter(RUNNER_ECHO_FILTER)


EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
DEFAULT_PIPELINE = "smoke"  # what pipeline_registry's __default__ runs


class MlflowStoreHooks:
    """A copied project's sqlite store gets its artifact locations back inside the project."""

    @hook_impl(trylast=True)  # after kedro-mlflow has set the tracking URI and the experiment
    def after_context_created(self, context) -> None:
        try:
            import mlflow

            from lychee_pipeline.project import relocate_mlflow_store

            experiment = context.config_loader["mlflow"]["tracking"]["experiment"]["name"]
            old = relocate_mlflow_store(mlflow.get_tracking_uri(), experiment, context.project_path)
        except Exception as exc:  # noqa: BLE001 - tracking never stops a run
            log.warning("could not check the MLflow store's artifact location: %s", exc)
            return
        if old:
            log.info("the MLflow store was copied from %s: its artifact locations now point into %s/mlruns",
                     old, Path(context.project_path).resolve())
        # Earlier MLflow 3 UIs read this tag to open an experiment on its training runs instead of its GenAI
        # view; 3.17's UI reads the address's `workflowType` parameter (or a browser setting, "genai" at first)
        # instead: the README's address carries `workflowType=machine_learning`. The tag stays for the others.
        try:
            client = mlflow.MlflowClient()
            found = client.get_experiment_by_name(experiment)
            if found is not None and found.tags.get(EXPERIMENT_KIND_TAG) is None:
                client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not set the MLflow experiment's kind: %s", exc)

    @hook_impl(trylast=True)  # after kedro-mlflow has started the run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        """`kedro run` without --pipelines is recorded as `__default__`: name the run after the pipeline it ran."""
        try:
            import mlflow

            run = mlflow.active_run()
            if run is not None and run.info.run_name == "__default__":
                mlflow.set_tag("mlflow.runName", DEFAULT_PIPELINE)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not name the MLflow run: %s", exc)


def typed_blocks() -> dict[str, type]:
    """The parameter blocks that have a typed model, by their top-level key (defined beside their library)."""
    from lychee_pipeline.data.params import DataParams, DataProcessingParams, RerankParams
    from lychee_pipeline.export import ExportParams
    from lychee_pipeline.mining import MiningParams
    from lychee_pipeline.registry import RegistryParams, ServingParams

    return {"data": DataParams, "data_processing": DataProcessingParams, "mining": MiningParams,
            "rerank": RerankParams, "registry": RegistryParams, "serving": ServingParams, "export": ExportParams}


def check_typed_blocks(inputs: set[str], load) -> None:
    """Validate, before anything runs, each typed block the pipeline reads (``load("params:<block>")``): a
    mistyped nested key (``--params data_processing.split.sed=7``) fails here, one line per bad key, naming
    the closest known key."""
    from lychee_pipeline.runtime.errors import typed

    blocks = typed_blocks()
    read = sorted({i[len("params:"):].split(".")[0] for i in inputs if i.startswith("params:")} & set(blocks))
    errors = []
    for block in read:
        try:
            typed(blocks[block], block, load(f"params:{block}"))
        except ValueError as error:
            errors.append(str(error))
    if errors:
        raise InvalidParameter("\n".join(errors))


class TypedBlocksHooks:
    """The typed parameter blocks the chosen pipeline reads are validated before the run opens (a bad key
    fails in one line); `--params` keys it does not read are named in a warning, with the key it does read."""

    def __init__(self) -> None:
        self._context = None

    @hook_impl
    def after_context_created(self, context) -> None:
        self._context = context

    def _configured_parameters(self, catalog) -> dict:
        """The parameters of conf/ alone (the catalog's `parameters` include the --params themselves)."""
        try:
            loader = self._context.config_loader
            fresh = type(loader)(conf_source=loader.conf_source, env=loader.env, base_env=loader.base_env,
                                 default_run_env=loader.default_run_env, config_patterns=loader.config_patterns)
            return fresh["parameters"]
        except Exception:  # noqa: BLE001 - fall back to the merged parameters
            try:
                return catalog.load("parameters")
            except Exception:  # noqa: BLE001
                return {}

    @hook_impl(tryfirst=True)  # before kedro-mlflow opens the parent run: a bad parameter leaves no run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        check_typed_blocks(pipeline.inputs(), catalog.load)
        runtime = run_params.get("runtime_params") or {}
        if not runtime:
            return
        parameters = self._configured_parameters(catalog)
        names = run_params.get("pipeline_names") or [run_params.get("pipeline_name") or "__default__"]
        names = [names] if isinstance(names, str) else names
        for message in unread_params(runtime, parameters, pipeline.inputs(), "+".join(map(str, names))):
            log.warning(message)


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(values, dict) or not values:
        return {prefix: values} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def unread_params(runtime: dict, parameters: dict, inputs: set[str], pipeline_name: str) -> list[str]:
    """Warnings for the runtime parameters that no node of the pipeline reads (or that another key overrides)."""
    read = {i[len("params:"):] for i in inputs if i.startswith("params:")}
    if "parameters" in inputs:
        return []
    flat_params = _flatten(parameters)

    def is_read(key: str) -> bool:
        return any(key == r or key.startswith(r + ".") or r.startswith(key + ".") for r in read)

    messages = []
    for key in sorted(_flatten(runtime)):
        if is_read(key):
            if "smoke" in read and not key.startswith("smoke.") and f"smoke.{key}" in flat_params:
                messages.append(
                    f"--params {key} is not used by the {pipeline_name} pipeline: smoke.{key} "
                    f"(= {flat_params[f'smoke.{key}']!r}) overrides it; set smoke.{key} instead")
            continue
        instead = [k for k in flat_params if k.endswith("." + key) and is_read(k)]
        if instead:
            messages.append(f"--params {key} is not read by the {pipeline_name} pipeline; it reads "
                            + " or ".join(instead))
        elif key in flat_params or any(k.startswith(key + ".") for k in flat_params):
            messages.append(f"--params {key} is not read by the {pipeline_name} pipeline (no node of it takes it)")
        else:
            close = difflib.get_close_matches(key, list(flat_params), n=1, cutoff=0.8)
            messages.append(f"--params {key} is not a parameter of this project (see conf/base/parameters_*.yml)"
                            + (f"; did you mean {close[0]}?" if close else ""))
    return messages


class RunOutcomeHooks:
    def __init__(self) -> None:
        self._run_id: str | None = None
        self._previous_sigterm = None
        self._finished = True

    @hook_impl(trylast=True)  # after kedro-mlflow's before_pipeline_run has opened its run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        from lychee_pipeline.runtime.processes import raise_interrupted

        self._finished = False
        self._run_id = _active_run_id()
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, raise_interrupted)
        atexit.register(self._at_exit)

    @hook_impl
    def after_pipeline_run(self, run_params, run_result, pipeline, catalog) -> None:
        self._done()

    @hook_impl(tryfirst=True)  # before kedro-mlflow ends the run as FAILED: the run is still active here
    def on_pipeline_error(self, error, run_params, pipeline, catalog) -> None:
        self._done()
        try:
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.set_tag("failure_reason", f"{type(error).__name__}: {error}"[:5000])
        except Exception as exc:  # noqa: BLE001 - tracking never hides the pipeline's error
            log.warning("could not tag the MLflow run with the failure: %s", exc)

    def _done(self) -> None:
        self._finished = True
        atexit.unregister(self._at_exit)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _at_exit(self) -> None:
        """The pipeline neither finished nor failed with an Exception: it was interrupted."""
        if self._finished or not self._run_id:
            return
        try:
            import mlflow

            active = mlflow.active_run()
            client = mlflow.MlflowClient()
            from lychee_pipeline.runtime.processes import interrupt_reason

            client.set_tag(self._run_id, "failure_reason", interrupt_reason())
            if active is not None and active.info.run_id == self._run_id:
                mlflow.end_run("KILLED")  # MLflow's own exit handler then finds no run to mark FINISHED
            else:
                client.set_terminated(self._run_id, "KILLED")
            while mlflow.active_run() is not None:  # nested runs of this process, if any
                mlflow.end_run("KILLED")
        except Exception as exc:  # noqa: BLE001
            log.warning("could not mark the MLflow run %s as KILLED: %s", self._run_id, exc)


def _active_run_id() -> str | None:
    try:
        import mlflow
    except ImportError:
        return None
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


# the nodes that validate the training parameters, by their own name (`training.plan_training_stages` in the
# registered pipelines, `plan_training_stages` in training.create_pipeline())
PLAN_NODES = ("plan_training_stages", "plan_smoke_training")


class ParameterCheckHooks:
    @hook_impl(tryfirst=True)  # before kedro-mlflow opens the parent run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        for node in pipeline.nodes:
            if node.name.rsplit(".", 1)[-1] not in PLAN_NODES or not all(i.startswith("params:") for i in node.inputs):
                continue
            # The planning node itself, on the same parameters: no files, no processes, no run. Quietly: the
            # node logs its plan when it runs.
            quiet = logging.getLogger("lychee_pipeline.training.planning")
            level = quiet.level
            quiet.setLevel(logging.WARNING)
            try:
                node.func(*(catalog.load(name) for name in node.inputs))
            except ValueError as error:  # pydantic's ValidationError is one: every refusal of the plan
                if isinstance(error, UserInputError):
                    raise
                raise InvalidParameter(str(error)) from error
            finally:
                quiet.setLevel(level)


class RefusalEchoFilter(logging.Filter):
    """After a node refused the user's input (`lychee_pipeline.runtime.errors.UserInputError`), the log leaves out
    Kedro's advice to resume with `--from-nodes` (the fix is new input and a new run, not a resume) and
    kedro-mlflow's repeats of "The run ... was closed because of an error" (one per entry of MLflow's run stack,
    the same run each time): the refusal's own line stays the last one on the terminal."""

    RESUME = re.compile(r"^(There are \d+ nodes that have not run|No nodes ran)")
    CLOSED = "was closed because of an error"

    def __init__(self) -> None:
        super().__init__()
        self.refused = False
        self._closed: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.CLOSED in message:
            if message in self._closed:
                return False
            self._closed.add(message)
            return True
        return not (self.refused and self.RESUME.match(message))


REFUSAL_ECHO_FILTER = RefusalEchoFilter()


class RefusalHooks:
    """Notes a node's refusal of the user's input for `RefusalEchoFilter` (the runner logs its advice after)."""

    @hook_impl
    def after_context_created(self, context) -> None:
        REFUSAL_ECHO_FILTER.refused = False  # a new session (a notebook or a test may run several)
        for name in ("kedro.runner.sequential_runner", "kedro_mlflow.framework.hooks.mlflow_hook"):
            if REFUSAL_ECHO_FILTER not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(REFUSAL_ECHO_FILTER)

    @hook_impl
    def on_node_error(self, error, node, catalog, inputs, is_async, run_id) -> None:
        from lychee_pipeline.runtime.errors import refusal_in

        REFUSAL_ECHO_FILTER.refused = refusal_in(error) is not None


class EmptyTestSplitHooks:
    """A run that evaluates (`smoke`, `full`) stops in one line as the split comes out when the test split has no
    query, before training spends its time on a model nothing can rank; `--pipelines data` only warns."""

    def __init__(self) -> None:
        self._evaluates = False

    @hook_impl
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        self._evaluates = any(node.name.rsplit(".", 1)[-1] == "score_test_set" for node in pipeline.nodes)

    @hook_impl
    def after_node_run(self, outputs) -> None:
        if not self._evaluates or "test_records" not in outputs:
            return
        from lychee_pipeline.data.split import refuse_an_empty_test_split

        try:
            refuse_an_empty_test_split(outputs["test_records"], outputs.get("split_counts"))
        except UserInputError:
            REFUSAL_ECHO_FILTER.refused = True  # on_node_error does not see a hook's refusal
            raise


class TrackingServerHooks:
    """A run that logs to an MLflow tracking server (README "For a team") checks it answers before any work, and
    a run stopped because the server went away ends on that one line, not on the hooks' failed goodbyes to it."""

    @hook_impl(tryfirst=True)  # before kedro-mlflow's after_context_created talks to the store
    def after_context_created(self, context) -> None:
        from lychee_pipeline.tracking import ENV_TRACKING_URI, check_tracking_server

        try:
            uri = (context.config_loader["mlflow"].get("server") or {}).get("mlflow_tracking_uri")
        except Exception:  # noqa: BLE001 - no mlflow.yml: kedro-mlflow's defaults
            uri = None
        check_tracking_server(uri or os.environ.get(ENV_TRACKING_URI))

    @hook_impl(tryfirst=True)  # the log handlers are final by now (ProjectRootHooks may replace Kedro's)
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        from lychee_pipeline.tracking import redact_logs

        redact_logs()

    @hook_impl(wrapper=True)
    def on_pipeline_error(self, error, run_params, pipeline, catalog):
        from lychee_pipeline.tracking import TrackingServerUnavailable

        if not isinstance(error, TrackingServerUnavailable):
            return (yield)
        # the other hooks' calls (a failure tag, ending the runs as FAILED) cannot reach the server: no retries,
        # and their errors are not raised over the run's own one-line error
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        try:
            return (yield)
        except Exception as exc:  # noqa: BLE001
            from lychee_pipeline.tracking import redact_text

            log.warning("the MLflow run could not be ended on the server (%s); it stays RUNNING there",
                        redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:300])
            return []
