"""Webhook URL policy: which URLs a tenant may give and which addresses delivery may reach. No network here.

A webhook URL is user input, so delivery must not reach the cluster's own network: ``check_address`` is applied
to every resolved address at connect time (shared/webhooks/transport.py), ``validate_webhook_url`` at submit time.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2048
# Metadata endpoints hand out cloud credentials: refused even when private addresses are allowed.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")  # the stdlib calls it neither private nor global
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # Linux delivers 0.x to the local host
_PRIVATE_KINDS = frozenset({"loopback", "link-local", "private", "carrier-grade NAT"})


class AddressNotAllowed(Exception):
    """The destination resolves to an address webhooks may not reach."""


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
