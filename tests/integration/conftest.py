"""Real processes: the API (uvicorn), Celery workers, and an HTTP receiver for webhooks."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.helpers import free_port, kill_after_test
from tests.integration.launcher import Launcher
from tools.processes import ProcessGroup, vidq_argv, wait_for_log, wait_http

CHILD_ENV = {"PYTHONUNBUFFERED": "1"}

# Every test here is marked integration by tests/conftest.py (it sits in tests/integration/ and reaches the
# session stack); a pytestmark in a conftest would mark nothing.


@pytest.fixture(scope="session")
def launcher(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """Forks the `vidq` processes the tests start, their heavy imports done once (tests/integration/launcher.py)."""
    started = Launcher(workdir=tmp_path_factory.mktemp("launcher"), env={**os.environ, **stack_env, **CHILD_ENV})
    try:
        started.wait_ready(timeout_s=120)
        yield started
    finally:
        started.close()


@pytest.fixture(scope="session")
def procs(
    stack_env: dict[str, str], launcher: Launcher, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessGroup]:
    group = ProcessGroup(
        env={**os.environ, **stack_env, **CHILD_ENV}, log_dir=tmp_path_factory.mktemp("logs"), spawn=launcher.spawn
    )
    yield group
    group.stop_all(timeout_s=10)


@pytest.fixture(scope="session")
def api_url(procs: ProcessGroup) -> str:
    port = free_port()
    procs.env["VIDQ_PUBLIC_BASE_URL"] = f"http://127.0.0.1:{port}"
    procs.start("api", vidq_argv("api", "--no-migrate", "--port", str(port)))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", timeout_s=60, group=procs)
    return url


WorkerFactory = Callable[..., str]


@pytest.fixture
def start_worker(procs: ProcessGroup) -> Iterator[WorkerFactory]:
    """Start a real Celery worker process; waits until it is consuming. Stopped after the test."""
    started: list[str] = []

    def start(role: str = "all", name: str | None = None, wait: bool = True, extra: tuple[str, ...] = ()) -> str:
        name = name or f"{role}-{len(started)}-{os.urandom(2).hex()}"
        procs.start(name, vidq_argv("worker", "--role", role, "--name", name, *extra))
        started.append(name)
        if wait:
            wait_for_log(procs, name, "ready.", timeout_s=120)
            if role != "webhooks":
                wait_for_log(procs, name, "pipeline loaded", timeout_s=120)
        return name

    yield start
    for name in started:
        if name in procs.procs:
            kill_after_test(procs, name)


class Hold:
    """While on, every render of the session's workers holds after each denoising step, its progress recorded, until
    released or cancelled (VIDQ_WORKER_FAULT_HOLD_FILE): a kill, a SIGTERM, a cancel or an outage then surely lands
    mid-render, however fast or slow this machine is."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on(self) -> None:
        self.path.touch()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


@pytest.fixture
def hold(settings: Any) -> Iterator[Hold]:
    held = Hold(Path(settings.worker_fault_hold_file))
    yield held
    held.release()


@pytest.fixture
def tenant_key(settings: Any, clean_state: None) -> dict[str, str]:
    from shared.infra.db import session_scope
    from shared.tenants import issue_key

    with session_scope(settings) as session:
        issued = issue_key(session, tenant_name=f"t-{os.urandom(3).hex()}")
    return issued.__dict__


@pytest.fixture
def client(api_url: str, tenant_key: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {tenant_key['api_key']}"}, timeout=30) as c:
        yield c


class Receiver:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.event = threading.Event()
        received = self.requests
        event = self.event

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append({"headers": dict(self.headers.items()), "body": body})
                event.set()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def json_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r["body"]) for r in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def logs_dir(procs: ProcessGroup) -> Path:
    return procs.log_dir
