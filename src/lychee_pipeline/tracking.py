"""The MLflow calls kedro-mlflow does not cover: nested stage runs opened by rank 0, and the pyfunc model.

MLflow is optional in the training processes (the GPU benchmark machine has none): every call here is
guarded, and a tracking failure (store locked, server gone) is logged once and never stops training.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from lychee_pipeline.runtime.errors import UserInputError

log = logging.getLogger(__name__)

ENV_PARENT_RUN = "LYCHEE_MLFLOW_PARENT_RUN_ID"
ENV_EXPERIMENT = "LYCHEE_MLFLOW_EXPERIMENT_ID"
ENV_TRACKING_URI = "MLFLOW_TRACKING_URI"
#: Requests to a tracking server: MLflow's default (7 retries, about 4 minutes of back-off per call) is made for
#: rate-limited hosted services; a stage process waiting that long per logged step stalls training, and a run
#: whose server is gone only learns it minutes later. A user's own value of these wins.
SERVER_REQUEST_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
HEALTH_TIMEOUT_S = 5.0

# URIs that `MLFLOW_TRACKING_URI` held because the user set it (see configured_tracking_uri)
_user_uris: set[str] = set()


class TrackingServerUnavailable(UserInputError, RuntimeError):
    """The MLflow tracking server does not answer (one line, naming the URI without its credentials)."""


def is_server_uri(uri: str | None) -> bool:
    return bool(uri) and uri.split(":", 1)[0].lower() in ("http", "https")


def redact_uri(uri: str) -> str:
    """The URI without a password in it (`http://user:secret@host` -> `http://user:***@host`)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return redact_text(uri)
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


_URL_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")


def redact_text(text: str) -> str:
    """A message with any password of a URL in it, and the value of MLFLOW_TRACKING_PASSWORD/TOKEN, masked."""
    text = _URL_CREDENTIALS.sub(r"\1:***@", text)
    for name in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


class RedactingFilter(logging.Filter):
    """Masks URL passwords and the MLflow password/token in log records (an MLflow error names the URI it
    called, with the password a user wrote into MLFLOW_TRACKING_URI)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact_text(message)
        if masked != message:
            record.msg, record.args = masked, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


def redact_logs() -> None:
    """Put RedactingFilter on the root logger's handlers (where every propagated record passes), once each."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def _uri_set_by_mlflow() -> str | None:
    """The URI this process's MLflow was told with `set_tracking_uri` (it copies it into MLFLOW_TRACKING_URI)."""
    try:
        from mlflow.tracking._tracking_service import utils
    except ImportError:
        return None
    return getattr(utils, "_tracking_uri", None)


def configured_tracking_uri(default_store: str) -> str:
    """The store a `kedro run` logs to: MLFLOW_TRACKING_URI where the user set it, else the project's sqlite file.

    The `tracking_uri` resolver of conf/base/mlflow.yml (settings.py); conf/local/mlflow.yml's
    `server.mlflow_tracking_uri` replaces it. MLflow's `set_tracking_uri` writes the variable too: a value equal
    to what this process's MLflow was told is ignored unless the user had set it, so a second project opened in
    the same process (a notebook, the tests) logs to its own store, not to the first one's.
    """
    from_env = os.environ.get(ENV_TRACKING_URI, "").strip()
    if from_env and (from_env in _user_uris or from_env != _uri_set_by_mlflow()):
        _user_uris.add(from_env)
        return from_env
    return f"sqlite:///{default_store}"


def server_problem(uri: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why the tracking server at `uri` does not answer its health check, or None when it does."""
    import base64
    import urllib.error
    import urllib.request

    parts = urlsplit(uri)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    url = urlunsplit(parts._replace(netloc=netloc, query="", fragment="")).rstrip("/") + "/health"
    request = urllib.request.Request(url)
    user = parts.username or os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = parts.password or os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if response.status == 200:
                return None
            return f"answered its health check with HTTP {response.status}"
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            return None  # it is there; the credentials are MLflow's business (it says so on the first call)
        return f"answered its health check with HTTP {error.code}"
    except urllib.error.URLError as error:
        reason = error.reason
        return f"does not answer ({redact_text(str(getattr(reason, 'strerror', None) or reason))})"
    except (OSError, ValueError) as error:
        return f"does not answer ({redact_text(str(error)) or type(error).__name__})"


def use_server_request_defaults() -> None:
    """Shorter MLflow request retries for a tracking server (SERVER_REQUEST_DEFAULTS), where not set already."""
    for name, value in SERVER_REQUEST_DEFAULTS.items():
        os.environ.setdefault(name, value)


def check_tracking_server(uri: str | None) -> None:
    """Refuse a run whose tracking server does not answer, before any work: one line naming the URI."""
    if not is_server_uri(uri):
        return
    use_server_request_defaults()
    if urlsplit(uri).password is not None:
        # MLflow prints "View run ... at: <tracking URI>/#/..." when a run ends: the password with it
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    problem = server_problem(uri)
    if problem:
        raise TrackingServerUnavailable(
            f"MLflow tracking server {redact_uri(uri)} {problem}: nothing was run. Start it (make tracking-server) "
            f"or point MLFLOW_TRACKING_URI (or server.mlflow_tracking_uri in conf/local/mlflow.yml) at one that "
            f"runs")


def check_stage_tracking(failures: list[str], stage: str, stage_dir: str) -> None:
    """After a stage whose MLflow logging failed: stop the run in one line if the tracking server is gone.

    The stage's result is on disk (and is reused by the next run); a store that answers again (a locked sqlite
    file, a server that restarted) only gets the warning the caller logs."""
    if not failures:
        return
    try:
        import mlflow
    except ImportError:
        return
    uri = mlflow.get_tracking_uri()
    if not is_server_uri(uri):
        return
    problem = server_problem(uri)
    if problem:
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # closing the run must not wait on it again
        raise TrackingServerUnavailable(
            f"MLflow tracking server {redact_uri(uri)} {problem}: the stage {stage} finished and its result is on "
            f"disk in {stage_dir} (its logging failures in result.json); start the server again and re-run: "
            f"finished stages are reused")


class StageTracker:
    """A nested MLflow run for one training stage, written by rank 0 only."""

    def __init__(self, enabled: bool, run_name: str, tags: dict[str, str] | None = None):
        self.run_id: str | None = None
        self.failures: list[str] = []
        self._mlflow = None
        self._server = False
        uri = os.environ.get(ENV_TRACKING_URI)
        if not enabled or not uri:
            return
        self._server = is_server_uri(uri)
        if self._server:
            use_server_request_defaults()
        try:
            import mlflow
        except ImportError:
            log.warning("mlflow is not installed in the training environment: stage metrics go to result.json only")
            return
        self._mlflow = mlflow
        self._call(
            "start_run",
            lambda: self._start(run_name, tags or {}),
        )

    def _start(self, run_name: str, tags: dict[str, str]) -> None:
        client = self._mlflow.MlflowClient()
        parent = os.environ.get(ENV_PARENT_RUN)
        experiment_id = os.environ.get(ENV_EXPERIMENT)
        if experiment_id is None:
            experiment_id = self._mlflow.set_experiment("lychee_pipeline").experiment_id
        all_tags = dict(tags)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
        self.run_id = run.info.run_id
        self._client = client

    def _call(self, what: str, fn) -> Any:
        if self._mlflow is None:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a tracking failure must never stop training
            message = redact_text(f"MLflow {what} failed: {type(exc).__name__}: {exc}")
            if not self.failures:
                log.warning("%s (training continues; figures are also in result.json)", message)
            self.failures.append(message)
            if self._server and server_problem(os.environ[ENV_TRACKING_URI]):
                # gone: every later call would wait out its retries again, once per logged step
                log.warning("MLflow tracking server %s does not answer: no more MLflow logging in this stage",
                            redact_uri(os.environ[ENV_TRACKING_URI]))
                self._mlflow = None
            return None

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def log_params(self, params: dict[str, Any]) -> None:
        if self.active:
            flat = flatten(params)
            self._call("log_params", lambda: self._mlflow.log_params(flat, run_id=self.run_id))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.active:
            self._call("log_metrics", lambda: self._mlflow.log_metrics(metrics, step=step, run_id=self.run_id))

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        if self.active:
            self._call(
                "log_artifacts", lambda: self._client.log_artifacts(self.run_id, local_dir, artifact_path)
            )

    def end(self, status: str = "FINISHED") -> None:
        if self.active:
            self._call("end_run", lambda: self._client.set_terminated(self.run_id, status))


def flatten(params: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, str]:
    """Flatten nested parameters to `a.b.c` keys, values as short strings (MLflow's 6000-char limit)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = str(value)[:6000]
    return flat


#: Distributions the logged model imports (pinned to the installed versions). The project itself is not on
#: PyPI: serve with `--env-manager local` from its environment (docs/serving.md).
MODEL_REQUIREMENTS = ("mlflow", "torch", "transformers", "peft", "safetensors", "pillow", "pandas", "numpy")


def model_requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in MODEL_REQUIREMENTS:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def log_reranker_model(
    adapter_dir: str, base: str, artifact_name: str = "reranker", serving: dict[str, Any] | None = None
) -> str | None:
    """Log the fine-tuned reranker to the active MLflow run as a pyfunc model; returns its URI.

    ``serving`` adds serving settings to the model's ``reranker.json`` (scoring options, instructions,
    image roots: see ``mlflow_model.py``)."""
    import json
    import tempfile
    import warnings
    from pathlib import Path

    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    if mlflow.active_run() is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "reranker.json"
        config.write_text(json.dumps({**(serving or {}), "base": base}))
        # Any of the item columns may be empty; `task_type` (optional) is the record's, as in training.
        columns = [ColSpec("string", name) for name in ("query_text", "query_image", "doc_text", "doc_image")]
        with warnings.catch_warnings():
            # the signature is given: MLflow's advice to add an input example (it would load and run the model
            # to check it) is not needed
            warnings.filterwarnings("ignore", message=r".*An input example was not provided", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name=artifact_name,
                python_model=str(Path(__file__).with_name("mlflow_model.py")),
                artifacts={"adapter": adapter_dir, "config": str(config)},
                signature=ModelSignature(inputs=Schema([*columns, ColSpec("string", "task_type", required=False)]),
                                         outputs=Schema([ColSpec("double")])),
                # Listed, not inferred: inference loads the model in a subprocess (about 30 s on a small CPU).
                pip_requirements=model_requirements(),
            )
    return info.model_uri
