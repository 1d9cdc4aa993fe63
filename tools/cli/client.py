"""``vidq generate``: a REST client, as any user would write one: submit, follow progress, download the MP4."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from httpx_sse import SSEError, connect_sse
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)
TERMINAL = {"succeeded", "failed", "cancelled"}


def follow_events(
    http: httpx.Client, job_id: str, *, on_progress: Callable[[dict[str, Any]], None], timeout_s: float
) -> dict[str, Any]:
    """Read the job's Server-Sent Events until the final ``job`` event; returns the finished job."""
    timeout = httpx.Timeout(30.0, read=max(60.0, timeout_s))
    with connect_sse(http, "GET", f"/v1/jobs/{job_id}/events", timeout=timeout) as source:
        source.response.raise_for_status()
        for sse in source.iter_sse():
            if sse.event == "job":
                return dict(sse.json())
            if sse.event == "progress":
                on_progress(sse.json())
    raise httpx.ReadError("event stream ended before the job finished")


def submit_and_wait(
    *,
    api: str,
    key: str,
    body: dict[str, Any],
    out_dir: Path,
    timeout_s: float = 600.0,
    show_progress: bool = True,
) -> tuple[dict[str, Any], Path | None]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=api, headers=headers, timeout=30.0) as http:
        r = http.post("/v1/jobs", json=body)
        if r.status_code != 202:
            raise typer.BadParameter(f"submit refused ({r.status_code}): {r.text}")
        job = r.json()
        console.print(
            f"job [bold]{job['id']}[/] → {job['queue']} (score {job['score']['value']}, {job['priority_class']})"
        )
        deadline = time.monotonic() + timeout_s
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TimeElapsedColumn(),
            console=console,
            disable=not show_progress,
        ) as bar:
            task = bar.add_task("queued", total=job["progress"]["total"])

            def show(progress: dict[str, Any]) -> None:
                bar.update(task, description=progress["status"], completed=progress["step"], total=progress["total"])

            try:
                job = follow_events(http, job["id"], on_progress=show, timeout_s=timeout_s)
            except (httpx.HTTPError, SSEError):  # a proxy that buffers, cuts or rewrites streams: poll instead
                deadline = time.monotonic() + timeout_s
                while job["status"] not in TERMINAL:
                    if time.monotonic() > deadline:
                        raise typer.Exit(code=2) from None
                    time.sleep(0.3)
                    job = http.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
                    show({"status": job["status"], **job["progress"]})
        path = None
        if job["status"] == "succeeded":
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{job['id']}.mp4"
            with httpx.stream("GET", job["output"]["url"], timeout=60.0) as dl:
                dl.raise_for_status()
                with path.open("wb") as fh:
                    for chunk in dl.iter_bytes():
                        fh.write(chunk)
        return job, path


def generate(
    prompt: Annotated[str, typer.Argument(help="what the video shows")],
    api: Annotated[str, typer.Option(envvar="VIDQ_API_URL")] = "http://127.0.0.1:8000",
    key: Annotated[str, typer.Option(envvar="VIDQ_API_KEY", help="API key (vidq create-key)")] = "",
    duration_s: Annotated[float, typer.Option()] = 1.0,
    fps: Annotated[int, typer.Option()] = 8,
    width: Annotated[int, typer.Option()] = 256,
    height: Annotated[int, typer.Option()] = 256,
    steps: Annotated[int, typer.Option()] = 8,
    seed: Annotated[int | None, typer.Option()] = None,
    model: Annotated[str | None, typer.Option()] = None,
    cache: Annotated[bool, typer.Option(help="--no-cache renders even when an identical job already succeeded")] = True,
    out: Annotated[Path, typer.Option(help="folder for the MP4")] = Path("out"),
) -> None:
    """Submit a prompt, show progress, save the MP4, print the job JSON."""
    if not key:
        raise typer.BadParameter("give --key or set VIDQ_API_KEY (create one with `vidq create-key`)")
    body: dict[str, Any] = {
        "prompt": prompt,
        "duration_s": duration_s,
        "fps": fps,
        "width": width,
        "height": height,
        "steps": steps,
    }
    if seed is not None:
        body["seed"] = seed
    if model:
        body["model"] = model
    if not cache:
        body["cache"] = False
    job, path = submit_and_wait(api=api, key=key, body=body, out_dir=out)
    typer.echo(json.dumps(job, indent=2))
    if path is None:
        raise typer.Exit(code=1)
    console.print(f"saved [bold]{path}[/]\npresigned URL (until {job['output']['expires_at']}):")
    console.print(job["output"]["url"], soft_wrap=True)
