"""The README's screenshots, taken from a real browser: the MLflow UI and kedro-viz of a project that has run.

    python scripts/screenshots.py --project-dir . --out docs/images

Needs a project that has run the smoke pipeline at least once (`kedro run --pipelines smoke`: its runs in
`mlflow.db`) and headless Chromium (Debian: `apt-get install chromium`). Starts `mlflow server` on the project's
sqlite store and `kedro viz run` on 127.0.0.1 (free ports, no browser), waits until both answer, drives
headless Chromium over the DevTools protocol (a pipe, so nothing beyond the standard library) to close
first-visit panels and pick the views below, takes 1400x900 screenshots, and always stops the browser and both
servers (by process group) before it returns, also on an error or Ctrl-C. Writes into --out:

- `mlflow_training_runs.png`: the experiment in MLflow's "Model training" view, the parent run expanded to
  its nested stage runs;
- `mlflow_stage_metrics.png`: the newest stage run's model metrics (loss, learning rate, pairs/s per step);
- `kedro_viz_<pipeline>.png`: the pipeline (default `full`) in kedro-viz (`?pid=<pipeline>`), its top-level
  groups collapsed (`expandAllPipelines=false`) and datasets hidden (`types=nodes`): the chain of groups,
  fitted to the page; a page 1800 px tall when it would fit 900 px only below 25% zoom. The script prints
  the zoom kedro-viz opens the pipeline at with its datasets (what `kedro viz` shows first) and this one.

Each PNG is kept under 300 KB (quantized to a palette when larger); a blank page fails the script.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

WINDOW = (1400, 900)
MAX_BYTES = 300 * 1024
START_TIMEOUT_S = 180.0  # kedro viz loads the whole project first


def free_port(start: int | None = None, end: int = 49151) -> int:
    """A free loopback port: any (the kernel's pick), or the first from `start` (kedro viz refuses ports
    above 49151, which the kernel picks from)."""
    for port in ([0] if start is None else range(start, end + 1)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise SystemExit(f"no free port from {start} to {end}")


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no headless Chromium found: install it (Debian/Ubuntu: apt-get install chromium)")


def experiment_name(project: Path) -> str:
    config = yaml.safe_load((project / "conf/base/mlflow.yml").read_text(encoding="utf-8")) or {}
    return config.get("tracking", {}).get("experiment", {}).get("name") or project.name


def runs_to_show(project: Path) -> tuple[str, str, str | None]:
    """(tracking URI, experiment id, newest stage run id) of the project's sqlite store."""
    db = project / "mlflow.db"
    if not db.is_file():
        raise SystemExit(f"{db} not found: run `kedro run --pipelines smoke` in {project} first")
    uri = f"sqlite:///{db}"
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    name = experiment_name(project)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        raise SystemExit(f"no MLflow experiment {name!r} in {db}: run `kedro run --pipelines smoke` first")
    stages = client.search_runs([experiment.experiment_id], filter_string="tags.stage != ''",
                                order_by=["attributes.start_time DESC"], max_results=1)
    return uri, experiment.experiment_id, stages[0].info.run_id if stages else None


def start(command: list[str], cwd: Path, log_path: Path) -> subprocess.Popen:
    """A server in its own process group (stopped as a whole), its output in a log file."""
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "1", "MLFLOW_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
    log_file = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed with the process in stop()
    process = subprocess.Popen(command, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    process.log_file = log_file  # type: ignore[attr-defined]
    return process


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError):  # workers that outlived their parent
        os.killpg(process.pid, signal.SIGKILL)
    process.log_file.close()  # type: ignore[attr-defined]


def wait_until_up(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the server exited with code {process.returncode}; its log: {log_path}\n"
                             + log_path.read_text(encoding="utf-8", errors="replace")[-2000:])
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s; the server's log: {log_path}")


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: stdlib only).

    `chromium --headless --screenshot=URL` alone cannot dismiss kedro-viz's feature tour, close MLflow's
    assistant panel or expand a parent run, so the page is prepared with a little JavaScript first.
    """

    def __init__(self, chromium: str, profile: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds_3_and_4() -> None:  # the protocol's pipe: the browser reads fd 3 and writes fd 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             f"--window-size={WINDOW[0]},{WINDOW[1]}", "about:blank"],
            # not close_fds: that would close fds 3 and 4 after the dup2; Python's own fds are close-on-exec anyway
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=fds_3_and_4,
            start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer, self._next_id, self.session = b"", 0, None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True, session=False)["sessionId"]
        self.resize(*WINDOW)
        self.call("Page.enable")

    def call(self, method: str, session: bool = True, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            ready, _, _ = select.select([self._from_browser], [], [], 1.0)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("the browser closed its pipe")
                self._buffer += chunk
        raise TimeoutError(f"no answer to {method} within 60 s")

    def resize(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        return result.get("result", {}).get("value")

    def open(self, url: str, settle_s: float) -> None:
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.js("document.readyState") != "complete":
            time.sleep(0.5)
        time.sleep(settle_s)  # the single-page app fetches its data and draws after the load event

    def wait_for(self, condition: str, timeout_s: float = 90.0, what: str = "") -> None:
        """Until the JavaScript `condition` is true (the page has drawn what the screenshot is for)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.js(condition):
                return
            time.sleep(0.5)
        raise SystemExit(f"the page did not show {what or condition} within {timeout_s:.0f} s "
                         f"({self.js('location.href')})")

    def screenshot(self, out: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        out.write_bytes(base64.b64decode(data))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", session=False)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # its renderer and GPU helper processes
            os.killpg(self.process.pid, signal.SIGKILL)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)


def check_rendered(path: Path) -> None:
    """A page that did not render is (nearly) one colour."""
    from PIL import Image

    with Image.open(path) as image:
        colours = image.convert("RGB").resize((140, 90)).getcolors(maxcolors=140 * 90)
    if colours is not None and len(colours) < 8:
        raise SystemExit(f"{path}: the page is blank")


def shrink(path: Path) -> Path:
    """Keep a PNG under MAX_BYTES: optimized first, then quantized to 256 colours (screenshots stay sharp)."""
    from PIL import Image

    if path.stat().st_size <= MAX_BYTES:
        return path
    with Image.open(path) as image:
        rgb = image.convert("RGB")
    rgb.save(path, optimize=True)
    if path.stat().st_size > MAX_BYTES:
        rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    if path.stat().st_size > MAX_BYTES:
        raise SystemExit(f"{path} is {path.stat().st_size // 1024} KB after quantizing (limit {MAX_BYTES // 1024} KB)")
    return path


CLICK = """(label) => {
  const found = [...document.querySelectorAll('button,[role=button]')]
    .find(e => (e.getAttribute('aria-label') || e.innerText || '').trim() === label);
  if (found) found.click();
  return !!found;
}"""


def click(browser: Browser, label: str) -> bool:
    """Click the button named `label` (its aria-label or text), if the page has one."""
    return bool(browser.js(f"({CLICK})({json.dumps(label)})"))


def mlflow_training_runs(browser: Browser, base: str, experiment_id: str, out: Path) -> Path:
    """The experiment's runs in MLflow's model-training view, the parent run expanded to its stage runs."""
    # the README's address: MLflow 3.17 takes the view (training or GenAI) from workflowType
    browser.open(f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning", 1)
    browser.wait_for("document.body.innerText.includes('matching runs')", what="the runs table")
    click(browser, "Close")  # the assistant panel MLflow 3 opens on the first visit
    click(browser, "Model training")  # the side bar's training view (Runs, Models, Traces)
    parent = "[...document.querySelectorAll('[role=row]')].find(r => r.querySelector('button') && r.innerText.includes('smoke'))"
    browser.wait_for(f"!!{parent}", what="the smoke run")
    browser.js(f"{parent}.querySelector('[col-id*=\"Run Name\"] button')?.click()")  # show its nested stage runs
    browser.wait_for("[...document.querySelectorAll('[role=row]')].some(r => r.innerText.includes('stage_'))",
                     what="the stage runs under the parent run")
    time.sleep(1)
    return browser.screenshot(out)


def mlflow_stage_metrics(browser: Browser, base: str, experiment_id: str, run_id: str, out: Path) -> Path:
    """A stage run's per-step charts (loss, learning rate, pairs/s)."""
    browser.open(f"{base}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics", 1)
    browser.wait_for("document.body.innerText.includes('Model metrics')", what="the model metrics tab")
    click(browser, "Close")
    browser.wait_for("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 3", what="the metric charts")
    time.sleep(2)
    return browser.screenshot(out)


KEDRO_VIZ_TALL = 1800  # a DAG that fits WINDOW only below READABLE_ZOOM gets a page this tall
READABLE_ZOOM = 25  # percent
ZOOM = "(() => { const e = [...document.querySelectorAll('*')].find(x => x.children.length === 0 && /^\\d+%$/.test((x.innerText || '').trim())); return e ? parseInt(e.innerText) : null; })()"


def fitted_zoom(browser: Browser, url: str) -> tuple[int | None, int | None]:
    """Open kedro-viz at `url` in the light theme, its menu hidden and the DAG fitted to the page:
    (the zoom it opened at, the zoom once fitted without the menu)."""
    browser.open(url, 1)
    browser.wait_for("document.querySelectorAll('.pipeline-node').length > 5", what="the pipeline's nodes")
    time.sleep(3)  # the first fit is animated
    opened_at = browser.js(ZOOM)
    click(browser, "Change to light theme")
    click(browser, "Dismiss")  # the "new version" banner (the version check cannot reach PyPI offline)
    browser.js("document.querySelector('.feature-hints__close')?.click()")  # the feature tour of a first visit
    click(browser, "Hide menu")  # the node list: the DAG gets the width
    time.sleep(2)
    click(browser, "Reset zoom")  # fit the DAG to the page now that the menu is gone
    time.sleep(3)  # the zoom is animated
    return opened_at, browser.js(ZOOM)


def kedro_viz_pipeline(browser: Browser, base: str, pipeline: str, out: Path) -> Path:
    """The pipeline's top level: its namespaced groups collapsed (`expandAllPipelines=false`), datasets hidden
    (`types=nodes`), so the picture is the chain of groups. Prints the zoom of the view `kedro viz` opens
    (groups collapsed, datasets and layers shown) first."""
    view = f"{base}/?pid={pipeline}&expandAllPipelines=false"
    opened_at, fitted = fitted_zoom(browser, f"{view}&types=nodes,datasets")
    print(f"kedro-viz: {pipeline} with its datasets opens at {opened_at}% zoom in a {WINDOW[0]}x{WINDOW[1]} page "
          f"({fitted}% with the menu hidden)", flush=True)
    _, zoom = fitted_zoom(browser, f"{view}&types=nodes")
    print(f"kedro-viz: {pipeline}'s groups alone (types=nodes): {zoom}% zoom", flush=True)
    if zoom is not None and zoom < READABLE_ZOOM:  # a long chain: a taller page
        browser.resize(WINDOW[0], KEDRO_VIZ_TALL)
        time.sleep(1)
        click(browser, "Reset zoom")
        time.sleep(3)
        print(f"kedro-viz: below {READABLE_ZOOM}%: the screenshot is {KEDRO_VIZ_TALL} px tall, at "
              f"{browser.js(ZOOM)}% zoom", flush=True)
    try:
        return browser.screenshot(out)
    finally:
        browser.resize(*WINDOW)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", type=Path, default=Path("."))
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--pipeline", default="full", help="the pipeline kedro-viz shows (default: full)")
    args = parser.parse_args(argv)
    project = args.project_dir.resolve()
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.mkdir(parents=True, exist_ok=True)
    chromium = find_chromium()
    uri, experiment_id, stage_run = runs_to_show(project)

    mlflow_port, viz_port = free_port(), free_port(start=4141)
    work = Path(tempfile.mkdtemp(prefix="screenshots-"))
    servers: list[subprocess.Popen] = []
    browser: Browser | None = None
    written = []
    try:
        mlflow_log, viz_log = work / "mlflow_server.log", work / "kedro_viz.log"
        servers.append(start([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                              "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"], project, mlflow_log))
        servers.append(start([sys.executable, "-m", "kedro", "viz", "run", "--host", "127.0.0.1", "--port",
                              str(viz_port), "--no-browser"], project, viz_log))
        mlflow_url, viz_url = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{viz_port}"
        wait_until_up(f"{mlflow_url}/health", servers[0], mlflow_log)
        wait_until_up(f"{viz_url}/api/main", servers[1], viz_log)
        browser = Browser(chromium, work / "profile")
        shots = [lambda: mlflow_training_runs(browser, mlflow_url, experiment_id, out / "mlflow_training_runs.png")]
        if stage_run:
            shots.append(lambda: mlflow_stage_metrics(browser, mlflow_url, experiment_id, stage_run,
                                                      out / "mlflow_stage_metrics.png"))
        shots.append(lambda: kedro_viz_pipeline(browser, viz_url, args.pipeline, out / f"kedro_viz_{args.pipeline}.png"))
        for shot in shots:
            path = shot()
            check_rendered(path)
            shrink(path)
            written.append(path)
            print(f"{path} ({path.stat().st_size // 1024} KB)", flush=True)
    finally:
        if browser is not None:
            browser.close()
        for server in servers:
            stop(server)
        shutil.rmtree(work / "profile", ignore_errors=True)
    print(f"{len(written)} screenshots in {out}; the servers and the browser are stopped (their logs: {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
