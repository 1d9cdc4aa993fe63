"""The ``vidq`` command: one entry point for every process vidq runs (compose and k8s use these too)."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer

from tools.cli import client, stack
from tools.processes import vidq_argv

app = typer.Typer(no_args_is_help=True, add_completion=False, help="vidq: asynchronous text-to-video service.")
app.command("up")(stack.up)
app.command("demo")(stack.demo)
app.command("generate")(client.generate)

WORKER_ROLES = {
    "video": ["video.high", "video.medium", "video.low"],
    "webhooks": ["vidq.webhooks"],
    "all": ["video.high", "video.medium", "video.low", "vidq.webhooks"],
}


@app.command()
def migrate() -> None:
    """Apply database migrations (Alembic) up to head."""
    from shared.config import get_settings
    from shared.migrate import upgrade

    upgrade(get_settings())
    typer.echo("database at head")


@app.command("create-key")
def create_key(
    tenant: Annotated[str, typer.Option(help="tenant name (created if new)")],
    name: Annotated[str, typer.Option(help="a label for this key")] = "",
) -> None:
    """Issue an API key for a tenant; prints the key (shown once) and the tenant's webhook secret as JSON."""
    from shared.config import get_settings
    from shared.db import session_scope
    from shared.tenants import issue_key

    with session_scope(get_settings()) as session:
        issued = issue_key(session, tenant_name=tenant, key_name=name)
    typer.echo(json.dumps(issued.__dict__))


@app.command()
def api(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    migrate_first: Annotated[bool, typer.Option("--migrate/--no-migrate")] = True,
    workers: Annotated[int | None, typer.Option(help="API processes (default VIDQ_API_WORKERS); ~1 per core")] = None,
) -> None:
    """Run the REST API (uvicorn): one process, or several sharing the port."""
    import tempfile

    import uvicorn

    from shared.config import get_settings

    settings = get_settings()
    if migrate_first:
        from shared.migrate import upgrade

        upgrade(settings)
    processes = workers or settings.api_workers
    if processes > 1:
        # Each process writes its metrics to files here; /metrics of any one of them serves the sum.
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="vidq-api-metrics-"))
    uvicorn.run(
        "services.api.app:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=processes,
        log_config=None,
        timeout_graceful_shutdown=10,
    )


@app.command()
def worker(
    role: Annotated[str, typer.Option(help="video | webhooks | all")] = "video",
    concurrency: Annotated[int, typer.Option(help="1 per GPU for video; more for webhooks")] = 1,
    name: Annotated[str, typer.Option(help="Celery node name")] = "",
    preload: Annotated[bool, typer.Option(help="build the default model when the process starts")] = True,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port (0 = off; default from settings)")] = None,
    gpus: Annotated[
        str, typer.Option(help="'all' or GPU indices ('0,2'): one video worker per GPU, pinned to it and its CPUs")
    ] = "",
) -> None:
    """Run a Celery worker. Video workers take video.high, then video.medium, then video.low (strict order)."""
    if role not in WORKER_ROLES:
        raise typer.BadParameter(f"role must be one of {sorted(WORKER_ROLES)}")
    import tempfile

    from shared.config import get_settings

    if gpus:
        if role != "video":
            raise typer.BadParameter("--gpus runs video workers: use it with --role video")
        raise typer.Exit(code=_gpu_workers(gpus, name=name or "video", preload=preload, metrics_port=metrics_port))

    # Pool children write their metrics here; the main process serves them (prometheus multiprocess mode).
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="vidq-metrics-"))
    if metrics_port is not None:
        os.environ["VIDQ_WORKER_METRICS_PORT"] = str(metrics_port)
    get_settings.cache_clear()
    settings = get_settings()
    if settings.worker_cpu_affinity:
        from services.worker.gpus import apply_affinity

        apply_affinity([int(c) for c in settings.worker_cpu_affinity.split(",") if c.strip()])
    if role != "webhooks" and preload and not settings.worker_preload_models:
        # Passed to the pool child (worker_process_init reads it through Settings).
        os.environ["VIDQ_WORKER_PRELOAD_MODELS"] = json.dumps([settings.default_model])
        get_settings.cache_clear()
    if role == "webhooks":  # the CPU-only worker: never imports the render code
        from services.webhooks.app import celery
    else:
        from services.worker.app import celery

    argv = [
        "worker",
        "--loglevel=INFO",
        f"--queues={','.join(WORKER_ROLES[role])}",
        f"--concurrency={concurrency}",
        "--pool=prefork",
        "--prefetch-multiplier=1",
        "--without-gossip",
        "--without-mingle",
        "-E",
        f"--hostname={name or role}@%h",
    ]
    celery.worker_main(argv)  # returns when the worker has stopped, whatever its exit code
    if role != "webhooks":
        from services.worker.app import was_hard_stopped

        if was_hard_stopped():  # the pool was killed mid-job: that must not look like a clean stop
            raise typer.Exit(code=1)


def _gpu_workers(spec: str, *, name: str, preload: bool, metrics_port: int | None) -> int:
    """`vidq worker --gpus`: one pinned video worker per GPU, supervised (services/worker/gpus.py)."""
    from services.worker.gpus import GpuWorkers, list_gpus, select, worker_env
    from shared.config import get_settings
    from shared.logs import configure_logging

    settings = get_settings()
    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    try:
        chosen = select(list_gpus(), spec)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    port = settings.worker_metrics_port if metrics_port is None else metrics_port
    extra = [] if preload else ["--no-preload"]
    workers = GpuWorkers(
        chosen,
        argv=lambda gpu: vidq_argv("worker", "--role", "video", "--name", f"{name}-gpu{gpu.index}", *extra),
        env=lambda gpu, i: worker_env(
            gpu, os.environ, ordinal=i, metrics_port=port, liveness_file=settings.worker_liveness_file
        ),
    )
    return workers.run()


@app.command("worker-alive")
def worker_alive(
    gpus: Annotated[str, typer.Option(help="the --gpus the workers were started with: checks each one's files")] = "",
) -> None:
    """Liveness probe for a worker: exit 0 if its consumer loop touched the liveness file recently and a pool
    process can take a job (ready, or loading its models for less than VIDQ_WORKER_MODEL_LOAD_TIMEOUT_S)."""
    from pathlib import Path

    from shared.config import get_settings
    from shared.liveness import is_alive, pool_path, pool_problem

    settings = get_settings()
    paths = [Path(settings.worker_liveness_file)]
    if gpus:
        from services.worker.gpus import list_gpus, select

        paths = [Path(f"{settings.worker_liveness_file}.gpu{g.index}") for g in select(list_gpus(), gpus)]
    for path in paths:
        if not is_alive(path, max_age_s=settings.worker_liveness_max_age_s):
            typer.echo(f"stale or missing: {path}", err=True)
            raise typer.Exit(code=1)
        problem = pool_problem(
            pool_path(path),
            max_age_s=settings.worker_liveness_max_age_s,
            load_timeout_s=settings.worker_model_load_timeout_s,
        )
        if problem:
            typer.echo(f"{pool_path(path)}: {problem}", err=True)
            raise typer.Exit(code=1)
    typer.echo("alive")


@app.command()
def flower(
    port: Annotated[int, typer.Option()] = 5555,
    basic_auth: Annotated[str, typer.Option(help="user:password (recommended outside localhost)")] = "",
) -> None:
    """Run Flower on the vidq broker."""
    from shared.celery_app import make_celery
    from shared.config import get_settings

    celery = make_celery(get_settings())
    args = ["flower", f"--port={port}", "--address=127.0.0.1" if not basic_auth else "--address=0.0.0.0"]
    if basic_auth:
        args.append(f"--basic-auth={basic_auth}")
    celery.start(args)


@app.command()
def sweep(once: Annotated[bool, typer.Option("--once/--forever")] = False) -> None:
    """Run the sweeper (re-sends lost jobs, recovers dead workers' jobs, ages low jobs up). One process is enough;
    more are safe (one at a time acts, under a Postgres advisory lock). SIGTERM ends it after the current tick."""
    import signal
    import threading

    from services.sweeper.sweeper import Sweeper
    from shared.celery_app import make_celery
    from shared.config import get_settings
    from shared.db import session_factory
    from shared.logs import configure_logging
    from shared.tracing import setup_tracing

    settings = get_settings()
    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    setup_tracing("vidq-sweeper", settings)  # its re-sends join their jobs' traces (nothing when tracing is off)
    sweeper = Sweeper(settings, celery=make_celery(settings), sessions=session_factory(settings))
    if once:
        typer.echo(json.dumps(sweeper.sweep_once().__dict__, default=str))
        return
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sweeper.run_forever(stop)


@app.command("sweep-alive")
def sweep_alive() -> None:
    """Liveness probe for `vidq sweep --forever`: exit 0 if its loop touched the liveness file recently (it does
    after every tick, failed ones too, so a database outage does not restart it)."""
    from pathlib import Path

    from shared.config import get_settings
    from shared.liveness import is_alive

    settings = get_settings()
    if not is_alive(Path(settings.sweeper_liveness_file), max_age_s=settings.sweeper_liveness_max_age):
        typer.echo(f"stale or missing: {settings.sweeper_liveness_file}", err=True)
        raise typer.Exit(code=1)
    typer.echo("alive")


@app.command()
def prewarmer(once: Annotated[bool, typer.Option("--once/--forever")] = False) -> None:
    """Run the prewarmer: loads the text encoder (GPU if there is one), fills the L2/L3 embedding caches with the
    prompts of queued jobs and the hottest prompts, answers encoder-free workers, and switches to cold-start
    compensation when the hit-rate monitors fall. SIGTERM ends it after the current cycle."""
    import signal
    import threading

    from prometheus_client import start_http_server

    from services.prewarmer.service import Prewarmer, load_encoders
    from shared.config import get_settings
    from shared.logs import configure_logging
    from shared.tracing import setup_tracing

    settings = get_settings()
    configure_logging(level=settings.log_level, json_logs=settings.log_json)
    setup_tracing("vidq-prewarmer", settings)  # nothing when tracing is off
    service = Prewarmer(settings, encoders=load_encoders(settings))
    if once:
        report = service.cycle()
        typer.echo(json.dumps(report.as_dict()))
        return
    if settings.prewarmer_metrics_port:
        try:
            start_http_server(settings.prewarmer_metrics_port)
        except OSError as exc:  # a second prewarmer on this host: keep working, say why there are no metrics
            typer.echo(f"metrics port {settings.prewarmer_metrics_port} unavailable: {exc}", err=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service.run_forever(stop)


@app.command("prewarmer-alive")
def prewarmer_alive() -> None:
    """Liveness probe for `vidq prewarmer`: exit 0 if its loop touched the liveness file recently (after every
    cycle, failed ones too)."""
    from pathlib import Path

    from shared.config import get_settings
    from shared.liveness import is_alive

    settings = get_settings()
    if not is_alive(Path(settings.prewarmer_liveness_file), max_age_s=settings.prewarmer_liveness_max_age_s):
        typer.echo(f"stale or missing: {settings.prewarmer_liveness_file}", err=True)
        raise typer.Exit(code=1)
    typer.echo("alive")


cache_app = typer.Typer(no_args_is_help=True, help="The text-embedding cache.")
app.add_typer(cache_app, name="cache")


@cache_app.command("stats")
def cache_stats(
    windows: Annotated[int, typer.Option(help="complete windows to show, newest last")] = 6,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Cluster-wide hit rates per tier in the last windows, and the prewarmer's mode."""
    import redis
    from rich.console import Console
    from rich.table import Table

    from shared.config import get_settings
    from shared.textcache.stats import stats_for

    try:
        data = stats_for(get_settings(), windows=windows)
    except redis.RedisError as exc:  # the counts live in the broker's Redis
        typer.echo(f"the broker's Redis did not answer: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(data))
        return

    def cell(t: dict[str, Any]) -> str:
        if t["hit_rate"] is None:
            return "-"
        return f"{t['hit_rate']:.1%} ({t['hits']}/{t['hits'] + t['misses']})"

    table = Table(title=f"embedding cache — mode {data['mode']}, {data['window_s']:g} s windows")
    for column in ("window start (UTC)", "l1", "l2", "l3", "overall"):
        table.add_column(column)
    import datetime as dt

    for w in data["windows"]:
        start = dt.datetime.fromtimestamp(w["start"], dt.UTC).strftime("%H:%M:%S")
        table.add_row(start, *(cell(w[t]) for t in ("l1", "l2", "l3", "overall")))
    table.add_row("total", *(cell(data["totals"][t]) for t in ("l1", "l2", "l3", "overall")))
    Console().print(table)
