"""Which store a run logs to, the server check's one line, and credentials kept out of messages (no server process
of MLflow's: a plain HTTP server on loopback plays the health endpoint)."""

from __future__ import annotations

import http.server
import os
import threading

import pytest

from lychee_pipeline import tracking
from team_support import free_port


@pytest.fixture
def health_server():
    """A loopback HTTP server answering /health like `mlflow server` (200 OK), anything else 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        seen_auth: list[str | None] = []

        def do_GET(self):  # noqa: N802 - the standard library's name
            Handler.seen_auth.append(self.headers.get("Authorization"))
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"uri": f"http://127.0.0.1:{server.server_address[1]}", "auth": Handler.seen_auth}
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(autouse=True)
def _restored_mlflow_settings(monkeypatch):
    """The checks set MLflow's variables in this process (as in a run): each test gets them back as they were,
    and MLflow's own tracking URI too."""
    from mlflow.tracking._tracking_service import utils

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", *tracking.SERVER_REQUEST_DEFAULTS):
        monkeypatch.delenv(name, raising=False)
    saved = utils._tracking_uri
    yield
    import mlflow

    mlflow.set_tracking_uri(saved)


def test_redaction_masks_passwords_in_uris_and_messages(monkeypatch):
    assert tracking.redact_uri("http://ann:s3cr3t@10.1.2.3:5000/x") == "http://ann:***@10.1.2.3:5000/x"
    assert tracking.redact_uri("https://ann@mlflow.example:443") == "https://ann@mlflow.example:443"
    assert tracking.redact_uri("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "env-secret-1")
    text = ("API request to http://ann:s3cr3t@127.0.0.1:5000/api/2.0/mlflow/runs/create failed; "
            "token env-secret-1 refused")
    assert tracking.redact_text(text) == ("API request to http://ann:***@127.0.0.1:5000/api/2.0/mlflow/runs/create "
                                          "failed; token *** refused")


def test_the_environment_names_the_store_unless_this_process_mlflow_wrote_it(monkeypatch, tmp_path):
    import mlflow

    default = str(tmp_path / "mlflow.db")
    mlflow.set_tracking_uri(None)
    assert tracking.configured_tracking_uri(default) == f"sqlite:///{default}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")  # the user's
    assert tracking.configured_tracking_uri(default) == "http://127.0.0.1:5999"
    mlflow.set_tracking_uri("http://127.0.0.1:5999")  # kedro-mlflow's set-up writes it back: still the user's
    assert tracking.configured_tracking_uri(default) == "http://127.0.0.1:5999"
    # another project's store, set by this process's MLflow (a notebook, the tests): not taken for the user's
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}")
    assert tracking.configured_tracking_uri(default) == f"sqlite:///{default}"


def test_a_server_that_answers_passes_and_gets_the_credentials(health_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ann")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    tracking.check_tracking_server(health_server["uri"])
    assert health_server["auth"] == ["Basic YW5uOnB3"]  # ann:pw
    assert tracking.SERVER_REQUEST_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"  # shorter retries for a server, user's value wins
    tracking.check_tracking_server(f"sqlite:///{health_server['uri']}")  # not a server: not checked


def test_an_unreachable_server_is_one_line_naming_it_without_the_password(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    with pytest.raises(tracking.TrackingServerUnavailable) as error:
        tracking.check_tracking_server(f"http://ann:pa55word@127.0.0.1:{port}")
    text = str(error.value)
    assert "\n" not in text and "pa55word" not in text
    assert text.startswith(f"MLflow tracking server http://ann:***@127.0.0.1:{port} does not answer (")
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"


def test_a_stage_whose_server_is_gone_stops_the_run_in_one_line(monkeypatch, tmp_path):
    import mlflow

    port = free_port()
    mlflow.set_tracking_uri(f"http://ann:pa55word@127.0.0.1:{port}")
    tracking.check_stage_tracking([], "stage_1cpu", str(tmp_path))  # nothing failed: nothing to check
    with pytest.raises(tracking.TrackingServerUnavailable) as error:
        tracking.check_stage_tracking(
            [f"MLflow log_metrics failed: MlflowException: API request to http://ann:pa55word@127.0.0.1:{port}"
             "/api/2.0/mlflow/runs/log-batch failed"], "stage_1cpu", str(tmp_path))
    text = str(error.value)
    assert "\n" not in text and "pa55word" not in text and str(tmp_path) in text
    assert text.startswith(f"MLflow tracking server http://ann:***@127.0.0.1:{port} does not answer")
