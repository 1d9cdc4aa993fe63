"""Signed webhooks (Standard Webhooks, signature v1) and one guarded delivery attempt; callers own retries.

A webhook URL is user input, so delivery must not reach the cluster's own network. The address is checked
while connecting (resolve, check every address, connect to a checked IP), so DNS rebinding between a check
and the connect cannot slip through. Redirects are reported (``redirect_not_followed``), never followed.
"""

from __future__ import annotations

import base64
import ipaddress
import random
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpcore
from standardwebhooks.webhooks import Webhook

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int, float | None], list[IPAddress]]

EVENT_TYPES = ("job.succeeded", "job.failed", "job.cancelled")
USER_AGENT = "vidq-webhooks/1"
MAX_URL_LENGTH = 2048
EXCERPT_CHARS = 512
# Metadata endpoints hand out cloud credentials: refused even when private addresses are allowed.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")  # the stdlib calls it neither private nor global
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # Linux delivers 0.x to the local host
_PRIVATE_KINDS = frozenset({"loopback", "link-local", "private", "carrier-grade NAT"})


class AddressNotAllowed(Exception):
    """The destination resolves to an address webhooks may not reach."""


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: int
    response_excerpt: str
    retryable: bool


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def build_event(*, event_type: str, job: dict[str, Any], at: datetime | None = None) -> dict[str, Any]:
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}; expected one of {', '.join(EVENT_TYPES)}")
    return {"type": event_type, "timestamp": (at or datetime.now(UTC)).isoformat(), "data": job}


def sign(secret: str, *, msg_id: str, body: bytes, timestamp: datetime) -> dict[str, str]:
    """Headers for one message. Keep ``msg_id`` the same across retries: receivers dedupe on it."""
    if timestamp.tzinfo is None:
        raise ValueError("timestamp must be timezone-aware")
    # The library replaces the zone with UTC instead of converting, which would shift the signed time.
    utc = timestamp.astimezone(UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(utc.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, utc, body.decode("utf-8")),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }


def _refusal(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a public unicast address; None when it is. Order matters: ::1 is also reserved."""
    checks = (
        (ip.is_unspecified or ip in _THIS_NETWORK, "unspecified"),
        (ip.is_loopback, "loopback"),
        (ip.is_multicast, "multicast"),
        (ip.is_link_local, "link-local"),
        (ip.is_reserved, "reserved"),
        (ip in _CGNAT, "carrier-grade NAT"),
        (ip.is_private, "private"),
        (not ip.is_global, "not globally routable"),
    )
    return next((reason for hit, reason in checks if hit), None)


def check_address(ip: IPAddress, *, allow_private: bool) -> None:
    """Raise AddressNotAllowed unless ``ip`` may receive webhooks. ``allow_private`` admits loopback, private,
    link-local and CGNAT ranges (development, in-cluster receivers), never metadata or unroutable ones."""
    # ::ffff:a.b.c.d reaches a.b.c.d. (NAT64's 64:ff9b::/96 sits in the reserved ::/8, so it is refused.)
    target = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
    if target in METADATA_ADDRESSES:
        raise AddressNotAllowed(f"{ip} is a cloud metadata address")
    reason = _refusal(target)
    if reason is not None and not (allow_private and reason in _PRIVATE_KINDS):
        raise AddressNotAllowed(f"{ip} is {reason}")


def validate_webhook_url(url: str, *, allow_private: bool | None = None) -> str:
    """Check a webhook URL with no network access. With ``allow_private`` given, an IP-literal host is checked
    too, so an obviously internal target gets a 4xx at submit time rather than failing at delivery."""
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"webhook URL is longer than {MAX_URL_LENGTH} characters")
    if not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError("webhook URL must be ASCII without spaces (percent-encode; punycode for IDN hosts)")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when not a number or out of range
    except ValueError as exc:
        raise ValueError(f"webhook URL is malformed: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("webhook URL must use http or https")
    if "@" in parts.netloc:
        raise ValueError("webhook URL must not contain credentials (user:password@)")
    if not parts.hostname:
        raise ValueError("webhook URL must have a host")
    if port == 0:
        raise ValueError("webhook URL port must be between 1 and 65535")
    if parts.fragment:
        raise ValueError("webhook URL must not have a #fragment (it is never sent to the server)")
    try:
        ip = ipaddress.ip_address(parts.hostname)
    except ValueError:
        if not all(ch.isalnum() or ch in "-._" for ch in parts.hostname):
            raise ValueError("webhook URL host is not a valid domain name") from None
        return url
    if allow_private is not None:
        try:
            check_address(ip, allow_private=allow_private)
        except AddressNotAllowed as exc:
            raise ValueError(f"webhook URL host is not allowed: {exc}") from None
    return url


def backoff_s(attempt: int, *, base_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Delay before retry ``attempt`` (0-based), uniform in [0, min(max_s, base_s * 2**attempt)]: full jitter
    spreads the retries of many failed deliveries instead of sending them in waves."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(max_s, base_s * 2.0 ** min(attempt, 64))  # capped so 2**attempt cannot overflow
    return (rng or random).uniform(0.0, ceiling)


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
