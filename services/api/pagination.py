"""What every list endpoint shares: the page size a caller may ask for, a page read as one row more than it shows
(the extra row says whether more follow), and the keyset cursor of ``/v1/jobs``.

Where a page continues is each API's own contract and stays so: an opaque cursor of (created_at, id) for
``/v1/jobs``, the last video's id for ``/v1/videos`` (OpenAI's ``after``), an attempt id for
``/v1/webhooks/deliveries``. All three are keyset pagination: stable while rows are added, O(page) at any depth."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import TypeVar

from shared.errors import InvalidRequest
from shared.infra.config import Settings

T = TypeVar("T")


def page_size(asked: int, settings: Settings) -> int:
    """The rows a page shows: what the caller asked for, at most ``page_size_max``."""
    return min(asked, settings.page_size_max)


def read_size(size: int) -> int:
    """The rows to read for a page of ``size``: one more, which says whether more follow."""
    return size + 1


def split(rows: Sequence[T], size: int) -> tuple[list[T], bool]:
    """Rows read with ``read_size(size)`` → (the page, whether more follow)."""
    return list(rows[:size]), len(rows) > size


def encode_cursor(created_at: datetime, row_id: uuid.UUID) -> str:
    """An opaque cursor for the keyset (created_at, id)."""
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{row_id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    """The keyset of a cursor from ``encode_cursor``; InvalidRequest (422) for anything else."""
    try:
        ts, _, rid = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        return datetime.fromisoformat(ts), uuid.UUID(rid)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("invalid cursor") from exc
