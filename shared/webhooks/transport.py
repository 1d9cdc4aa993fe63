"""One guarded delivery attempt; callers own retries.

The address is checked while connecting (resolve, check every address, connect to a checked IP), so DNS rebinding
between a check and the connect cannot slip through. Redirects are reported (``redirect_not_followed``), never
followed.

``deliver_retrying`` is one attempt of the webhook schedule: a POST is not idempotent for its receiver, so within
the attempt it is repeated (the non-idempotent policy of shared/infra/retries.py: at most 2 retries, backoff from
100 ms to 1 s) only when it failed before the request could reach the receiver (refused connection, unresolvable
name), and only within the attempt's one total timeout. Anything else (a 5xx, a timeout after sending) waits for
the schedule's next attempt.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
from tenacity import retry_if_result

from shared.infra.retries import RetryPolicy
from shared.infra.urls import AddressNotAllowed, IPAddress, check_address, validate_webhook_url

Resolver = Callable[[str, int, float | None], list[IPAddress]]

EXCERPT_CHARS = 512


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: int
    response_excerpt: str
    retryable: bool


class _ResolveError(httpcore.ConnectError): ...


def resolve(host: str, port: int, timeout: float | None) -> list[IPAddress]:
    """All addresses of ``host`` in resolver order. getaddrinfo has no timeout, so it runs in a daemon thread
    that is abandoned (it ends on the system resolver's own timeout) when it takes too long."""
    found: list[IPAddress] = []
    failure: list[OSError] = []

    def lookup() -> None:
        try:
            for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                if (ip := ipaddress.ip_address(sockaddr[0])) not in found:
                    found.append(ip)
        except OSError as exc:
            failure.append(exc)

    worker = threading.Thread(target=lookup, name="vidq-webhook-dns", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise httpcore.ConnectTimeout(f"resolving {host!r} timed out")
    if failure or not found:
        raise _ResolveError(f"cannot resolve {host!r}: {failure[0] if failure else 'no addresses'}")
    return found


def _time_left(deadline: float, timeout: float | None, error: type[httpcore.TimeoutException]) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("webhook delivery deadline reached")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """Caps each read/write at the time left: per-read timeouts alone let a receiver that drips one byte at a
    time hold the worker indefinitely."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self._inner, self._deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _time_left(self._deadline, timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _time_left(self._deadline, timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        left = _time_left(self._deadline, timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left), self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class GuardedBackend(httpcore.NetworkBackend):
    """Resolves once, checks every address, connects only to a checked IP. httpcore passes the URL's host as
    ``server_hostname`` to start_tls, so SNI and certificate checks still use the name, not the IP."""

    def __init__(self, *, allow_private: bool, deadline: float, resolver: Resolver = resolve) -> None:
        self._inner = httpcore.SyncBackend()
        self._allow_private, self._deadline, self._resolver = allow_private, deadline, resolver

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        addresses = self._resolver(host, port, _time_left(self._deadline, timeout, httpcore.ConnectTimeout))
        for ip in addresses:  # every one: a name with one forbidden answer is not to be trusted
            check_address(ip, allow_private=self._allow_private)
        last: Exception = httpcore.ConnectError(f"no address for {host!r}")
        for ip in addresses:
            left = _time_left(self._deadline, timeout, httpcore.ConnectTimeout)
            try:
                stream = self._inner.connect_tcp(
                    str(ip), port, timeout=left, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc  # try the next address, e.g. IPv4 when IPv6 is unreachable
                continue
            return _DeadlineStream(stream, self._deadline)
        raise last


def _error_code(exc: Exception) -> str:
    if isinstance(exc, httpcore.TimeoutException):
        return "timeout"
    if isinstance(exc, _ResolveError):
        return "dns_error"
    if isinstance(exc, httpcore.ConnectError):  # httpcore maps ssl.SSLError to ConnectError
        return "tls_error" if isinstance(exc.__cause__ or exc.__context__, ssl.SSLError) else "connect_error"
    return "protocol_error" if isinstance(exc, httpcore.ProtocolError) else "network_error"


def deliver(
    url: str,
    *,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    allow_private: bool,
    ssl_context: ssl.SSLContext | None = None,
) -> DeliveryResult:
    """One POST, no redirects; DNS, connect, TLS, send and response all fit in ``timeout_s``. Never raises for
    anything the receiver or the network does: the result says what happened."""
    started = time.monotonic()

    def result(status: int | None, error: str | None, retryable: bool, excerpt: str = "") -> DeliveryResult:
        duration_ms = int((time.monotonic() - started) * 1000)
        return DeliveryResult(error is None, status, error, duration_ms, excerpt, retryable)

    try:
        validate_webhook_url(url)
    except ValueError:
        return result(None, "invalid_url", False)
    backend = GuardedBackend(allow_private=allow_private, deadline=started + timeout_s)
    timeouts = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}
    raw = bytearray()
    # A fresh pool per delivery: no connection outlives its address check, and httpcore, unlike httpx, takes
    # no proxy from the environment. It never follows redirects.
    with httpcore.ConnectionPool(ssl_context=ssl_context, retries=0, network_backend=backend) as pool:
        try:
            with pool.stream(
                "POST", url, headers=list(headers.items()), content=body, extensions={"timeout": timeouts}
            ) as response:
                status = response.status
                try:
                    for chunk in response.iter_stream():
                        raw += chunk
                        if len(raw) >= 4 * EXCERPT_CHARS:  # enough for 512 chars of UTF-8; the rest is unread
                            break
                except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError):
                    pass  # the status line already answered; the excerpt is only diagnostics
        except AddressNotAllowed:
            return result(None, "address_not_allowed", False)
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError, OSError) as exc:
            # The receiver may have acted already; retrying is safe as it dedupes on webhook-id. A local
            # protocol error (say, a header with a newline) would fail the same way again.
            return result(None, _error_code(exc), not isinstance(exc, httpcore.LocalProtocolError))
    excerpt = bytes(raw).decode("utf-8", errors="replace")[:EXCERPT_CHARS]
    if 200 <= status < 300:
        return result(status, None, False, excerpt)
    if 300 <= status < 400:
        return result(status, "redirect_not_followed", False, excerpt)
    return result(status, f"http_{status // 100}xx", status >= 500 or status in (408, 429), excerpt)


# Failures where the request never reached the receiver: repeating them at once cannot deliver an event twice.
NOT_SENT = frozenset({"connect_error", "dns_error"})


def deliver_retrying(
    url: str,
    *,
    policy: RetryPolicy,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    allow_private: bool,
    ssl_context: ssl.SSLContext | None = None,
) -> DeliveryResult:
    """``deliver``, repeated under ``policy`` while the request could not be sent (``NOT_SENT``), every try within
    the one ``timeout_s`` of the attempt. The last try's result, with the whole attempt's duration."""
    started = time.monotonic()

    def once() -> DeliveryResult:
        left = max(0.001, timeout_s - (time.monotonic() - started))
        return deliver(
            url, body=body, headers=headers, timeout_s=left, allow_private=allow_private, ssl_context=ssl_context
        )

    retrying = policy.retrying(retry=retry_if_result(lambda r: r.error in NOT_SENT), within_s=timeout_s)
    result: DeliveryResult = retrying(once)
    return dataclasses.replace(result, duration_ms=int((time.monotonic() - started) * 1000))
