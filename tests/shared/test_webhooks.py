"""Webhook signing and delivery against real HTTP(S) receivers on loopback. Nothing here sends traffic to any
address other than 127.0.0.1 or ::1: addresses outside loopback are only ever given to check_address, or to a
resolver whose answer is refused before any connection is made."""

from __future__ import annotations

import base64
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from shared.infra.config import Settings
from shared.infra.urls import AddressNotAllowed, IPAddress, check_address, validate_webhook_url
from shared.webhooks.schedule import message_id, next_delay_s
from shared.webhooks.signing import USER_AGENT, build_event, new_secret, sign
from shared.webhooks.transport import EXCERPT_CHARS, DeliveryResult, GuardedBackend, deliver


@dataclass
class Reply:
    status: int = 200
    body: bytes = b'{"received":true}'
    headers: dict[str, str] = field(default_factory=dict)
    # Takes over the whole response (writes raw bytes) when set.
    raw: Callable[[BaseHTTPRequestHandler], None] | None = None


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    def __init__(self, server: ThreadingHTTPServer, scheme: str, host: str) -> None:
        self.server, self.reply, self.requests = server, Reply(), list[Received]()
        self.port = server.server_address[1]
        self.url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/hooks"


def _start(host: str, *, scheme: str = "http", tls: ssl.SSLContext | None = None) -> Receiver:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            headers = {name.lower(): value for name, value in self.headers.items()}
            this.requests.append(Received(self.path, headers, body))
            reply = this.reply
            if reply.raw is not None:
                reply.raw(self)
                return
            self.send_response(reply.status)
            for name, value in {"content-length": str(len(reply.body)), **reply.headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        block_on_close = False  # a handler still waiting after a client timeout must not stall teardown

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # clients that hang up early (timeouts, refused certificates) are the point of some tests

    server = Server((host, 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    this = Receiver(server, scheme, host)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return this


@pytest.fixture
def start_receiver() -> Iterator[Callable[..., Receiver]]:
    started: list[Receiver] = []

    def start(host: str = "127.0.0.1", **kwargs: Any) -> Receiver:
        started.append(_start(host, **kwargs))
        return started[-1]

    yield start
    for receiver in started:
        receiver.server.shutdown()
        receiver.server.server_close()


@pytest.fixture
def receiver(start_receiver: Callable[..., Receiver]) -> Receiver:
    return start_receiver()


def _signed() -> tuple[str, bytes, dict[str, str]]:
    secret = new_secret()
    event = build_event(event_type="job.succeeded", job={"id": "j-1", "status": "succeeded"})
    body = json.dumps(event, separators=(",", ":")).encode()
    return secret, body, sign(secret, msg_id="msg_j-1_succeeded", body=body, timestamp=datetime.now(UTC))


def _post(url: str, *, allow_private: bool = True, timeout_s: float = 2.0, **kwargs: Any) -> DeliveryResult:
    _, body, headers = _signed()
    return deliver(url, body=body, headers=headers, timeout_s=timeout_s, allow_private=allow_private, **kwargs)


# --- signing ------------------------------------------------------------------------------------------------


def test_new_secret_is_32_random_bytes() -> None:
    first, second = new_secret(), new_secret()
    assert first.startswith("whsec_") and first != second
    assert len(base64.b64decode(first.removeprefix("whsec_"))) == 32


def test_build_event_shape_and_unknown_type() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    event = build_event(event_type="job.failed", job={"id": "j"}, at=at)
    assert event == {"type": "job.failed", "timestamp": "2026-01-02T03:04:05+00:00", "data": {"id": "j"}}
    assert datetime.fromisoformat(build_event(event_type="job.cancelled", job={})["timestamp"]).tzinfo
    with pytest.raises(ValueError, match="unknown event type"):
        build_event(event_type="job.exploded", job={})


def test_sign_headers_verify_and_detect_tampering() -> None:
    secret, body, headers = _signed()
    assert sorted(headers) == [
        "content-type",
        "user-agent",
        "webhook-id",
        "webhook-signature",
        "webhook-timestamp",
    ]
    assert headers["webhook-signature"].startswith("v1,") and headers["user-agent"] == USER_AGENT
    assert Webhook(secret).verify(body, headers)["data"]["id"] == "j-1"
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body.replace(b"j-1", b"j-2"), headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)


def test_sign_converts_other_zones_and_refuses_naive_timestamps() -> None:
    secret, body = new_secret(), b"{}"
    utc = datetime.now(UTC).replace(microsecond=0)
    plus_two = utc.astimezone(timezone(timedelta(hours=2)))
    assert sign(secret, msg_id="m", body=body, timestamp=plus_two) == sign(secret, msg_id="m", body=body, timestamp=utc)
    assert Webhook(secret).verify(body, sign(secret, msg_id="m", body=body, timestamp=plus_two)) == {}
    with pytest.raises(ValueError, match="timezone-aware"):
        sign(secret, msg_id="m", body=body, timestamp=datetime.now())


# --- address policy -----------------------------------------------------------------------------------------

REFUSED_UNLESS_PRIVATE = [
    "10.1.2.3", "172.16.0.1", "172.31.255.254", "192.168.1.1", "127.0.0.1", "127.8.9.10", "::1", "fe80::1",
    "fc00::1", "100.64.0.1", "100.127.255.254", "169.254.1.1", "::ffff:10.0.0.1", "::ffff:127.0.0.1",
]  # fmt: skip
ALWAYS_REFUSED = [
    "169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254", "100.100.100.200", "0.0.0.0", "0.1.2.3",
    "::", "224.0.0.1", "239.255.255.250", "ff02::1", "240.0.0.1", "255.255.255.255", "64:ff9b::a00:1",
]  # fmt: skip
PUBLIC = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:2800:220:1:248:1893:25c8:1946", "::ffff:93.184.216.34"]


@pytest.mark.parametrize("address", REFUSED_UNLESS_PRIVATE)
def test_private_addresses_refused_unless_allowed(address: str) -> None:
    with pytest.raises(AddressNotAllowed):
        check_address(ipaddress.ip_address(address), allow_private=False)
    check_address(ipaddress.ip_address(address), allow_private=True)


@pytest.mark.parametrize("address", ALWAYS_REFUSED)
def test_metadata_and_unroutable_addresses_always_refused(address: str) -> None:
    for allow_private in (False, True):
        with pytest.raises(AddressNotAllowed):
            check_address(ipaddress.ip_address(address), allow_private=allow_private)


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_allowed(address: str) -> None:
    check_address(ipaddress.ip_address(address), allow_private=False)


# --- URL validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["https://example.com/hooks", "http://example.com:8080/a?b=c", "HTTPS://Example.COM", "http://[2001:db8::1]/x",
     "https://xn--bcher-kva.example/", "http://10.0.0.5/in-cluster"],
)  # fmt: skip
def test_valid_urls(url: str) -> None:
    assert validate_webhook_url(url) == url


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://example.com/", "http or https"),
        ("file:///etc/passwd", "http or https"),
        ("example.com/hooks", "http or https"),
        ("https://user:pass@example.com/", "credentials"),
        ("https://token@example.com/", "credentials"),
        ("https:///path-only", "host"),
        ("https://example.com:99999/", "malformed"),
        ("https://example.com:0/", "port"),
        ("https://exa mple.com/", "ASCII without spaces"),
        ("https://example.com/\r\nX-Injected: 1", "ASCII without spaces"),
        ("https://bücher.example/", "ASCII"),
        ("https://example.com/#frag", "fragment"),
        ("https://exa<mple.com/", "domain name"),
        ("https://example.com/" + "a" * 2048, "longer than 2048"),
    ],
)
def test_invalid_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_webhook_url(url)


def test_ip_literal_checked_only_when_policy_given() -> None:
    validate_webhook_url("http://127.0.0.1:9/", allow_private=True)
    with pytest.raises(ValueError, match="not allowed"):
        validate_webhook_url("http://127.0.0.1:9/", allow_private=False)
    with pytest.raises(ValueError, match="metadata"):
        validate_webhook_url("http://169.254.169.254/latest/meta-data/", allow_private=True)


SVIX = [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0]


def test_default_schedule_is_standard_webhooks() -> None:
    # Immediately, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h: 8 attempts over about 28 hours.
    # The fields' own defaults: the test session's environment compresses the schedule for integration tests.
    fields = Settings.model_fields
    assert fields["webhook_schedule_s"].get_default(call_default_factory=True) == SVIX
    assert fields["webhook_schedule_jitter"].get_default() == 0.1


def test_schedule_delay_after_each_attempt_and_none_after_the_last() -> None:
    exact = [next_delay_s(a, schedule=SVIX, jitter=0.0) for a in range(1, len(SVIX) + 2)]
    assert exact == [*SVIX, None]
    assert next_delay_s(0, schedule=SVIX) is None  # there is no attempt 0
    assert next_delay_s(1, schedule=[]) is None  # an empty schedule: one attempt, no retry


def test_schedule_jitter_spreads_within_ten_percent() -> None:
    delays = [next_delay_s(2, schedule=SVIX) for _ in range(500)]
    assert all(d is not None and 270.0 <= d <= 330.0 for d in delays)
    assert max(d for d in delays if d is not None) - min(d for d in delays if d is not None) > 30.0  # not pinned
    assert next_delay_s(1, schedule=[10.0], jitter=0.1, uniform=lambda lo, hi: lo) == pytest.approx(9.0)
    assert next_delay_s(1, schedule=[10.0], jitter=0.1, uniform=lambda lo, hi: hi) == pytest.approx(11.0)


def test_message_id_is_one_per_job_and_event() -> None:
    job = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert message_id(job, "job.succeeded") == "msg_12345678123456781234567812345678_succeeded"
    assert message_id(job, "job.succeeded") != message_id(job, "job.failed")


# --- delivery -----------------------------------------------------------------------------------------------


def test_delivery_received_and_signature_verifies(receiver: Receiver) -> None:
    secret, body, headers = _signed()
    result = deliver(receiver.url, body=body, headers=headers, timeout_s=2.0, allow_private=True)
    assert (result.ok, result.status_code, result.error, result.retryable) == (True, 200, None, False)
    assert result.response_excerpt == '{"received":true}' and result.duration_ms >= 0
    [got] = receiver.requests
    assert got.path == "/hooks" and got.body == body
    assert got.headers["user-agent"] == USER_AGENT and got.headers["content-type"] == "application/json"
    assert Webhook(secret).verify(got.body, got.headers)["type"] == "job.succeeded"


def test_loopback_refused_when_private_not_allowed(receiver: Receiver) -> None:
    result = _post(receiver.url, allow_private=False)
    assert (result.ok, result.error, result.retryable, result.status_code) == (
        False, "address_not_allowed", False, None,
    )  # fmt: skip
    assert receiver.requests == []


def test_name_resolving_to_loopback_refused_at_connect(receiver: Receiver) -> None:
    url = receiver.url.replace("127.0.0.1", "localhost")
    assert _post(url, allow_private=False).error == "address_not_allowed"
    assert receiver.requests == []
    # The same name is fine when private targets are allowed (localhost may also answer ::1 first, where
    # nothing listens: the next address is tried).
    assert _post(url, allow_private=True).ok
    assert len(receiver.requests) == 1


def test_backend_checks_the_address_it_connects_to(receiver: Receiver) -> None:
    answers = [[ipaddress.ip_address("127.0.0.1")], [ipaddress.ip_address("169.254.169.254")]]
    calls: list[str] = []

    def rebinding_resolver(host: str, port: int, timeout: float | None) -> list[IPAddress]:
        calls.append(host)
        return answers[len(calls) - 1]

    backend = GuardedBackend(allow_private=True, deadline=time.monotonic() + 5, resolver=rebinding_resolver)
    stream = backend.connect_tcp("hooks.example", receiver.port, timeout=1.0)
    # Connected to the IP that was checked; the name was not looked up a second time.
    assert stream.get_extra_info("server_addr") == ("127.0.0.1", receiver.port)
    stream.close()
    # The next connection resolves again and gets the metadata address: refused before any connect.
    with pytest.raises(AddressNotAllowed):
        backend.connect_tcp("hooks.example", receiver.port, timeout=1.0)
    assert calls == ["hooks.example", "hooks.example"]


def test_one_forbidden_answer_refuses_the_name(receiver: Receiver) -> None:
    def mixed(host: str, port: int, timeout: float | None) -> list[IPAddress]:
        return [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("169.254.169.254")]

    backend = GuardedBackend(allow_private=True, deadline=time.monotonic() + 5, resolver=mixed)
    with pytest.raises(AddressNotAllowed, match="metadata"):
        backend.connect_tcp("hooks.example", receiver.port, timeout=1.0)


def test_redirect_not_followed(start_receiver: Callable[..., Receiver]) -> None:
    source, target = start_receiver(), start_receiver()
    source.reply = Reply(status=302, headers={"location": target.url}, body=b"moved")
    result = _post(source.url)
    assert (result.ok, result.status_code, result.error, result.retryable) == (
        False, 302, "redirect_not_followed", False,
    )  # fmt: skip
    assert len(source.requests) == 1 and target.requests == []


@pytest.mark.parametrize(
    ("status", "error", "retryable"),
    [(500, "http_5xx", True), (503, "http_5xx", True), (429, "http_4xx", True), (408, "http_4xx", True),
     (400, "http_4xx", False), (404, "http_4xx", False), (410, "http_4xx", False), (204, None, False)],
)  # fmt: skip
def test_status_classification(receiver: Receiver, status: int, error: str | None, retryable: bool) -> None:
    receiver.reply = Reply(status=status, body=b"" if status == 204 else b"oops")
    result = _post(receiver.url)
    assert (result.ok, result.status_code, result.error, result.retryable) == (
        error is None, status, error, retryable,
    )  # fmt: skip


# How long a receiver's handler waits for the test to release it: reached only when delivery is broken, so that no
# server thread waits for ever.
FALLBACK_S = 30.0


def test_slow_receiver_times_out(receiver: Receiver) -> None:
    """The receiver answers only once the test releases it, after the delivery returned: the delivery gave up
    (timeout) without waiting for the answer."""
    entered, release, answered = threading.Event(), threading.Event(), threading.Event()

    def late(handler: BaseHTTPRequestHandler) -> None:
        entered.set()
        release.wait(FALLBACK_S)
        answered.set()
        handler.send_response(200)
        handler.send_header("content-length", "0")
        handler.end_headers()

    receiver.reply = Reply(raw=late)
    try:
        result = _post(receiver.url, timeout_s=0.3)
        assert (result.ok, result.error, result.retryable) == (False, "timeout", True)
        assert not answered.is_set(), "the delivery waited for the receiver's answer"
        assert entered.wait(FALLBACK_S)  # the request did reach the receiver (it may read it after the timeout)
        assert len(receiver.requests) == 1
    finally:
        release.set()


def test_dripping_receiver_cannot_outlast_the_total_timeout(receiver: Receiver) -> None:
    """The receiver drips a byte every 50 ms, well within the per-read timeout, until the test stops it: only the
    total timeout can end the delivery, and it does while the receiver is still dripping."""
    release, drip_ended, hung_up = threading.Event(), threading.Event(), threading.Event()

    def drip(handler: BaseHTTPRequestHandler) -> None:
        try:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for _ in range(int(FALLBACK_S / 0.05)):  # the fallback: at least FALLBACK_S of dripping
                if release.wait(0.05):
                    break
                handler.wfile.write(b"X")
                handler.wfile.flush()
        except OSError:  # the client hung up: the next byte had nowhere to go
            hung_up.set()
            return
        drip_ended.set()

    receiver.reply = Reply(raw=drip)
    try:
        result = _post(receiver.url, timeout_s=0.4)
        assert (result.ok, result.error, result.retryable) == (False, "timeout", True)
        assert not drip_ended.is_set(), "the delivery lasted until the receiver stopped dripping"
        assert hung_up.wait(FALLBACK_S), "the delivery returned, but kept its connection open"
    finally:
        release.set()


def test_refused_connection_is_retryable() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _post(f"http://127.0.0.1:{port}/hooks")
    assert (result.ok, result.error, result.retryable) == (False, "connect_error", True)


def test_excerpt_is_capped(receiver: Receiver) -> None:
    receiver.reply = Reply(status=400, body=("é" * 5000).encode())
    result = _post(receiver.url)
    assert result.response_excerpt == "é" * EXCERPT_CHARS


def test_invalid_url_needs_no_network() -> None:
    result = _post("http://user:pw@127.0.0.1:9/")
    assert (result.ok, result.error, result.retryable) == (False, "invalid_url", False)


def test_ipv6_loopback(start_receiver: Callable[..., Receiver]) -> None:
    try:
        receiver = start_receiver("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    assert _post(receiver.url, allow_private=False).error == "address_not_allowed"
    assert _post(receiver.url, allow_private=True).ok and len(receiver.requests) == 1


# --- TLS: the connection goes to a checked IP, but SNI and certificate checks use the URL's name ------------


@pytest.fixture(scope="module")
def localhost_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


def test_tls_uses_the_url_host_for_sni_and_verification(
    start_receiver: Callable[..., Receiver], localhost_cert: tuple[Path, Path]
) -> None:
    cert, key = localhost_cert
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    sni: list[str | None] = []
    server_context.sni_callback = lambda sock, name, context: sni.append(name)
    receiver = start_receiver(scheme="https", tls=server_context)
    client_context = ssl.create_default_context(cafile=str(cert))

    by_name = _post(receiver.url.replace("127.0.0.1", "localhost"), ssl_context=client_context)
    assert by_name.ok and sni == ["localhost"] and len(receiver.requests) == 1
    # The certificate names localhost, not 127.0.0.1: verification is really on, and checks the URL's host.
    by_ip = _post(receiver.url, ssl_context=client_context)
    assert (by_ip.ok, by_ip.error, by_ip.retryable) == (False, "tls_error", True)
    assert len(receiver.requests) == 1
