"""A team's MLflow tracking server on this machine: PostgreSQL as the backend store, a local artifact root.

    make tracking-server            # or: .venv/bin/python scripts/tracking_server.py [--port 5000]

Runs in the foreground until Ctrl-C (or SIGTERM), then stops both servers. The first start creates, under
--root (default `.tracking/`, ignored by git):

- `postgres/`: a PostgreSQL cluster (`initdb`), owner `mlflow`, password authentication on 127.0.0.1 only
  (no Unix socket); the password is generated once and kept in `postgres.pgpass` (mode 600), which the
  servers read through libpq's PGPASSFILE, so it is on no command line and in no URI;
- `artifacts/`: the artifact root `mlflow server --serve-artifacts` writes: clients upload and download
  artifacts through the server (`mlflow-artifacts:/`), they never need this folder;
- `postgres.log`, `mlflow.log`: the servers' own logs.

Later starts reuse the same cluster and artifacts. PostgreSQL's server programs (initdb, postgres, createdb)
are looked up in $PG_BIN, on PATH, then under /usr/lib/postgresql/<version>/bin (Debian and Ubuntu:
`apt-get install postgresql`). PostgreSQL refuses to run as root: started by root, it runs as the system user
`postgres` (which that package creates), and --root must be a folder that user can reach.

When both answer, it prints the one line a user exports (`export MLFLOW_TRACKING_URI=http://127.0.0.1:5000`).
"""

from __future__ import annotations

import argparse
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PG_USER = "mlflow"
PG_DATABASE = "mlflow"
SYSTEM_USER = "postgres"  # who runs PostgreSQL when this script is started by root
STARTUP_LIMIT_S = 180
STOP_LIMIT_S = 30


class SetupError(RuntimeError):
    """A missing piece, said in one line."""


def postgres_bin() -> Path:
    """The folder of PostgreSQL's server programs."""
    candidates = [os.environ.get("PG_BIN", "")]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent))
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                      if Path(p).parent.name.isdigit() else 0, reverse=True)
    candidates += versions
    for folder in candidates:
        if folder and all((Path(folder) / name).is_file() for name in ("initdb", "postgres", "createdb")):
            return Path(folder)
    raise SetupError("PostgreSQL server programs (initdb, postgres) not found in $PG_BIN, on PATH or under "
                     "/usr/lib/postgresql/*/bin: install them (Debian/Ubuntu: apt-get install postgresql)")


def postgres_driver() -> None:
    try:
        import psycopg  # noqa: F401 - MLflow's store opens postgresql+psycopg:// URIs through SQLAlchemy with it
    except ImportError:
        raise SetupError("the PostgreSQL driver psycopg is not installed in this environment: "
                         "pip install -e '.[team]' (make install installs it)") from None


def _run_as() -> dict:
    """Popen arguments that run PostgreSQL as a non-root user (it refuses root)."""
    if os.geteuid() != 0:
        return {}
    try:
        user = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise SetupError(f"started as root, and there is no system user {SYSTEM_USER!r} to run PostgreSQL as "
                         "(Debian's postgresql package creates it); or start this as a normal user") from None
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _chown_for_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        user = pwd.getpwnam(SYSTEM_USER)
        os.chown(path, user.pw_uid, user.pw_gid)


def _write_private(path: Path, text: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    os.chmod(path, 0o600)
    path.write_text(text)
    _chown_for_postgres(path)


def init_cluster(root: Path, pg_bin: Path) -> Path:
    """Create the PostgreSQL cluster once (initdb); returns the pgpass file of its `mlflow` user."""
    data, pgpass = root / "postgres", root / "postgres.pgpass"
    if (data / "PG_VERSION").is_file() and pgpass.is_file():
        return pgpass
    if data.exists():
        shutil.rmtree(data)  # an initdb cut short: start over
    data.mkdir(mode=0o700, parents=True)
    _chown_for_postgres(data)
    password = secrets.token_urlsafe(24)
    password_file = root / "postgres.password.tmp"
    _write_private(password_file, password + "\n")
    try:
        as_user = _run_as()
        if as_user:  # the cluster's folder must be reachable by that user, not only owned
            probe = subprocess.run(["test", "-w", str(data)], **as_user)
            if probe.returncode != 0:
                raise SetupError(f"the system user {SYSTEM_USER!r} cannot reach {data}: choose a --root it can "
                                 "enter (every folder above it readable and searchable by others)")
        result = subprocess.run(
            [str(pg_bin / "initdb"), "-D", str(data), "-U", PG_USER, "--pwfile", str(password_file),
             "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "--encoding=UTF8", "--no-instructions"],
            capture_output=True, text=True, **as_user)
        if result.returncode != 0:
            raise SetupError(f"initdb failed: {(result.stderr or result.stdout).strip().splitlines()[-1]}")
    finally:
        password_file.unlink(missing_ok=True)
    # host:port:database:user:password, any host and port (the port may change between starts)
    _write_private(pgpass, f"*:*:*:{PG_USER}:{password}\n")
    return pgpass


def wait_until(check, proc: subprocess.Popen, what: str, log: Path, limit_s: float = STARTUP_LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            raise SetupError(f"{what} exited with code {proc.returncode} while starting"
                             + (f": {tail[0]}" if tail else "") + f" (log: {log})")
        if time.monotonic() > deadline:
            raise SetupError(f"{what} did not answer within {limit_s:.0f} s (log: {log})")
        time.sleep(0.3)


def start_postgres(root: Path, pg_bin: Path, port: int, pgpass: Path) -> subprocess.Popen:
    log = root / "postgres.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(pg_bin / "postgres"), "-D", str(root / "postgres"), "-p", str(port), "-h", "127.0.0.1",
             "-c", "unix_socket_directories=", "-c", "max_connections=50"],
            stdout=out, stderr=subprocess.STDOUT, **_run_as())
    env = dict(os.environ, PGPASSFILE=str(pgpass))

    def accepts() -> bool:  # createdb both checks the server and makes the database the first time
        made = subprocess.run([str(pg_bin / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", PG_USER,
                               "-w", PG_DATABASE], env=env, capture_output=True, text=True)
        return made.returncode == 0 or "already exists" in made.stderr

    wait_until(accepts, proc, f"PostgreSQL on 127.0.0.1:{port}", log)
    return proc


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_mlflow(root: Path, host: str, port: int, pg_port: int, pgpass: Path, workers: int) -> subprocess.Popen:
    (root / "artifacts").mkdir(exist_ok=True)
    log = root / "mlflow.log"
    env = dict(os.environ, PGPASSFILE=str(pgpass), MLFLOW_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
               # MLflow's job runner (GenAI scorers: eight more processes) is of no use to training runs
               MLFLOW_SERVER_ENABLE_JOB_EXECUTION=os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"),
               # the server execs `uvicorn`/`gunicorn` from PATH: this environment's bin folder first
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_TRACKING")}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server",
             "--backend-store-uri", f"postgresql+psycopg://{PG_USER}@127.0.0.1:{pg_port}/{PG_DATABASE}",
             "--serve-artifacts", "--artifacts-destination", str((root / "artifacts").resolve()),
             "--host", host, "--port", str(port), "--workers", str(workers)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: `mlflow server` runs uvicorn/gunicorn as children
    base = f"http://{host}:{port}"
    wait_until(lambda: healthy(base), proc, f"mlflow server on {base}", log)
    return proc


def stop(proc: subprocess.Popen | None, sig: int, group: bool = False) -> None:
    """Stop one server by its PID (``group``: its whole process group) and wait for it; SIGKILL after
    STOP_LIMIT_S. A group is killed after its leader exits too: no worker is left behind."""
    if proc is None:
        return

    def send(signum: int) -> None:
        try:
            os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        except ProcessLookupError:
            pass

    if proc.poll() is None:
        send(sig)
        try:
            proc.wait(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait(timeout=10)
    if group:
        send(signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".tracking", help="folder of the cluster, artifacts and logs")
    parser.add_argument("--host", default="127.0.0.1", help="address mlflow server listens on")
    parser.add_argument("--port", type=int, default=5000, help="mlflow server's port")
    parser.add_argument("--pg-port", type=int, default=0, help="PostgreSQL's port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--workers", type=int, default=1, help="mlflow server's worker processes")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    servers: list[subprocess.Popen] = []

    def on_signal(signum, frame):  # unwind through the finally below, stopping both servers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        postgres_driver()
        pg_bin = postgres_bin()
        pgpass = init_cluster(root, pg_bin)
        pg_port = args.pg_port or _free_port()
        servers.append(start_postgres(root, pg_bin, pg_port, pgpass))
        servers.append(start_mlflow(root, args.host, args.port, pg_port, pgpass, args.workers))
        uri = f"http://{args.host}:{args.port}"
        print(f"MLflow tracking server on {uri}: backend store PostgreSQL on 127.0.0.1:{pg_port}, "
              f"artifacts in {root / 'artifacts'}, logs in {root}. Ctrl-C stops both.", flush=True)
        print(f"(PIDs: PostgreSQL {servers[0].pid}, mlflow server {servers[1].pid} with its process group)",
              flush=True)
        print(f"export MLFLOW_TRACKING_URI={uri}", flush=True)
        while all(p.poll() is None for p in servers):
            time.sleep(1)
        gone = next(p for p in servers if p.poll() is not None)
        name = "PostgreSQL" if gone is servers[0] else "mlflow server"
        print(f"{name} exited with code {gone.returncode} (logs in {root}); stopping", file=sys.stderr)
        return 1
    except SetupError as error:
        print(f"tracking server: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if len(servers) > 1:
            stop(servers[1], signal.SIGTERM, group=True)  # mlflow server and its workers
        if servers:
            stop(servers[0], signal.SIGINT)  # PostgreSQL's fast shutdown


if __name__ == "__main__":
    sys.exit(main())
