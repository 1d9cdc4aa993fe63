"""An S3 outage at upload time delays the job; it does not spend an attempt. The outage is real from the worker's
view: its S3 endpoint is a TCP proxy that the test cuts (refused connections, reset streams), then restores."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.infra.db import session_scope
from shared.models import JobTransition
from tests.integration.helpers import TINY, free_port, submit, transitions, wait_job
from tools.processes import ProcessGroup, vidq_argv, wait_for_log


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``cut()`` closes the listener and every open pair."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, free_port()
        self._open: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self.group: ProcessGroup | None = None  # the processes behind it, whose logs the test reads
        self.restore()

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            if self._listener is not None:
                # shutdown first: a close alone leaves the accept() blocked in the other thread holding the
                # listening socket open, and the next connection would still be accepted and forwarded.
                with contextlib.suppress(OSError):
                    self._listener.shutdown(socket.SHUT_RDWR)
                self._listener.close()
                self._listener = None
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


@pytest.fixture
def worker_behind_proxy(procs: ProcessGroup, tmp_path: Path) -> Iterator[CuttableProxy]:
    host, _, port = procs.env["VIDQ_S3_ENDPOINT"].partition(":")
    proxy = CuttableProxy((host, int(port)))
    env = {**procs.env, "VIDQ_S3_ENDPOINT": f"127.0.0.1:{proxy.port}", "VIDQ_WORKER_UPLOAD_RETRY_S": "60"}
    group = ProcessGroup(env=env, log_dir=tmp_path, spawn=procs.spawn)
    group.start("worker-s3", vidq_argv("worker", "--role", "video", "--name", f"s3-{proxy.port}"))
    wait_for_log(group, "worker-s3", "pipeline loaded", timeout_s=120)
    proxy.group = group
    yield proxy
    group.stop_all(timeout_s=15)
    proxy.cut()


def test_upload_waits_out_an_s3_outage_and_succeeds_at_attempt_1(client, settings, worker_behind_proxy, hold):
    hold.on()
    job = submit(client)
    wait_job(client, job["id"], {"running"}, min_step=1)  # held after its first step
    worker_behind_proxy.cut()  # S3 gone before the render reaches its upload
    hold.release()
    done_rendering = wait_job(client, job["id"], {"running"}, min_step=TINY["steps"], timeout_s=120)
    assert done_rendering["status"] == "running"
    assert worker_behind_proxy.group is not None
    # The upload really meets the outage (no connection slips through) and is retried, not failed.
    wait_for_log(worker_behind_proxy.group, "worker-s3", "S3 unreachable at upload; retrying", timeout_s=60)
    worker_behind_proxy.restore()
    finished = wait_job(client, job["id"], {"succeeded", "failed"}, timeout_s=120)
    history = _history(settings, job["id"])  # with each transition's reason: why an attempt ended, if one did
    assert finished["status"] == "succeeded", (finished["error"], history)
    assert finished["attempt"] == 1, history
    assert [t for t in transitions(settings, job["id"]) if t[1] == "running"] == [("queued", "running", 1)]


def _history(settings, job_id: str) -> list[tuple[str | None, str, int, str]]:
    import uuid

    with session_scope(settings) as session:
        rows = session.query(JobTransition).filter_by(job_id=uuid.UUID(job_id)).order_by(JobTransition.id)
        return [(r.from_status, r.to_status, r.attempt, r.reason) for r in rows]
