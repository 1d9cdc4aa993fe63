"""``GET /console``: a browser console for one tenant, served by the API itself (plain HTML, CSS and JS from
services/api/console/; no build step, nothing fetched from elsewhere, so it works offline).

The page calls the same /v1 endpoints as any client, with the key the user pastes, from this origin. Its responses
carry a Content-Security-Policy that allows scripts, styles and requests from this origin only; images and media
also from the S3 origin that presigned URLs point at (posters and MP4s are read straight from S3, never through the
API).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from shared.errors import NotFound
from shared.infra.storage import Storage

router = APIRouter(prefix="/console", tags=["console"], include_in_schema=False)

CONSOLE_DIR = Path(__file__).resolve().parent
# The only files served: a fixed list, so no request path ever reaches the file system.
ASSETS = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",  # the page's state and flow (an ES module)
    "api.js": "text/javascript; charset=utf-8",  # requests and progress streams
    "form.js": "text/javascript; charset=utf-8",  # the submit form and its errors
    "views.js": "text/javascript; charset=utf-8",  # rendering
    "icon.svg": "image/svg+xml",
}


def _s3_origin(storage: Storage) -> str:
    """The scheme and host of presigned URLs (VIDQ_S3_PUBLIC_ENDPOINT's, or the bucket's virtual host on AWS).
    Presigning is a local computation: nothing is contacted."""
    parts = urlsplit(storage.presign("console/origin-probe", expiry_s=60).url)
    return f"{parts.scheme}://{parts.netloc}"


def security_headers(s3_origin: str) -> dict[str, str]:
    csp = "; ".join(
        [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            f"img-src 'self' {s3_origin}",
            f"media-src {s3_origin}",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        # The page's address never leaks to S3 or anywhere else it loads from.
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",  # revalidated (ETag): an upgraded API serves its own page at once
    }


def _headers(request: Request) -> dict[str, str]:
    state = request.app.state
    if not hasattr(state, "console_s3_origin"):
        state.console_s3_origin = _s3_origin(state.storage)
    return security_headers(state.console_s3_origin)


@router.get("")
def console_page(request: Request) -> FileResponse:
    return FileResponse(CONSOLE_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_headers(request))


@router.get("/{name}")
def console_asset(name: str, request: Request) -> FileResponse:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound("no such console file", details={"name": name[:100]})
    return FileResponse(CONSOLE_DIR / name, media_type=media_type, headers=_headers(request))
