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
import logging
import signal
import threading

from kedro.framework.hooks import hook_impl

log = logging.getLogger(__name__)


class RunOutcomeHooks:
    def __init__(self) -> None:
        self._run_id: str | None = None
        self._previous_sigterm = None
        self._finished = True

    @hook_impl(trylast=True)  # after kedro-mlflow's before_pipeline_run has opened its run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        from lychee_pipeline.training.launch import _raise_interrupted

        self._finished = False
        self._run_id = _active_run_id()
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupted)
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
            from lychee_pipeline.training.launch import interrupt_reason

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


PLAN_NODES = ("plan_training_stages", "plan_smoke_training")  # the nodes that validate the training parameters


class ParameterCheckHooks:
    @hook_impl(tryfirst=True)  # before kedro-mlflow opens the parent run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        for node in pipeline.nodes:
            if node.name not in PLAN_NODES or not all(i.startswith("params:") for i in node.inputs):
                continue
            # The planning node itself, on the same parameters: no files, no processes, no run. Quietly: the
            # node logs its plan when it runs.
            quiet = logging.getLogger("lychee_pipeline.pipelines.training.nodes")
            level = quiet.level
            quiet.setLevel(logging.WARNING)
            try:
                node.func(*(catalog.load(name) for name in node.inputs))
            finally:
                quiet.setLevel(level)
