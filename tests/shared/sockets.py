"""A loopback listener that counts the connections reaching it. Tests prove "no retry" or "no second attempt" by
how many connections a client made, never by how long it took."""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class ClosingListener:
    """Accepts every connection and closes it at once, as a server that dies mid-request, counting them.

    A connection is counted before it is closed, so once a client has seen its connection closed, the count includes
    it: reading ``accepted`` after the client's call returned needs no waiting."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        # Polled accept: closing a socket does not wake a thread blocked in accept() on every platform.
        self._sock.settimeout(0.05)
        self.port: int = self._sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._accepted = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="closing-listener", daemon=True)
        self._thread.start()

    @property
    def accepted(self) -> int:
        with self._lock:
            return self._accepted

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> ClosingListener:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
