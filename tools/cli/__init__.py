"""The ``vidq`` command: one entry point for every process vidq runs (compose and k8s use these too)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from tools.cli import client, pools, stack
from tools.processes import vidq_argv

app = typer.Typer(no_args_is_help=True, add_completion=False, help="vidq: asynchronous text-to-video service.")
app.command("up")(stack.up)
app.command("demo")(stack.demo)
app.command("generate")(client.generate)


@app.command()
def migrate() -> None:
    """Apply database migrations (Alembic) up to head."""
    from shared.infra.config import get_settings
    from shared.infra.migrate import upgrade

    upgrade(get_settings())
    typer.echo("database at head")


@app.command("create-key")
def create_key(
    tenant: Annotated[str, typer.Option(help="tenant name (created if new)")],
    name: Annotated[str, typer.Option(help="a label for this key")] = "",
) -> None:
    """Issue an API key for a tenant; prints the key (shown once) and the tenant's webhook secret as JSON."""
    from shared.infra.config import get_settings
    from shared.infra.db import session_scope
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
    from services.api.main import run
    from shared.infra.config import get_settings

    settings = get_settings()
    run(
        settings,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers or settings.api_workers,
        migrate=migrate_first,
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
    pool: Annotated[
        str | None, typer.Option(help="the worker pool to join (default VIDQ_WORKER_POOL, 'stable')")
    ] = None,
) -> None:
    """Run a Celery worker. Video workers take video.high, then video.medium, then video.low (strict order); in a pool
    other than stable, that pool's video.high.<pool>, video.medium.<pool>, video.low.<pool>."""
    from services.worker.main import Role, run, run_gpus
    from shared.infra.config import get_settings
    from shared.queues import POOL_NAME

    if role not in set(Role):
        raise typer.BadParameter(f"role must be one of {sorted(Role)}")
    settings = get_settings()
    if metrics_port is not None:
        settings = settings.model_copy(update={"worker_metrics_port": metrics_port})
    if pool is not None:
        if not POOL_NAME.match(pool):
            raise typer.BadParameter(
                "a pool name is 1-32 of a-z, 0-9 and '-', starting with a letter", param_hint="--pool"
            )
        settings = settings.model_copy(update={"worker_pool": pool})
    if gpus:
        if role != Role.VIDEO:
            raise typer.BadParameter("--gpus runs video workers: use it with --role video")
        try:
            code = run_gpus(settings, gpus, name=name or "video", preload=preload, vidq=vidq_argv)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        raise typer.Exit(code=code)
    code = run(settings, role=Role(role), concurrency=concurrency, name=name, preload=preload)
    if code:
        raise typer.Exit(code=code)


@app.command("worker-alive")
def worker_alive(
    gpus: Annotated[str, typer.Option(help="the --gpus the workers were started with: checks each one's files")] = "",
) -> None:
    """Liveness probe for a worker: exit 0 if its consumer loop touched the liveness file recently and a pool
    process can take a job (ready, or loading its models for less than VIDQ_WORKER_MODEL_LOAD_TIMEOUT_S)."""
    from pathlib import Path

    from shared.infra.config import get_settings
    from shared.infra.liveness import is_alive, pool_path, pool_problem

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
    from shared.infra.config import get_settings
    from shared.messaging.celery_app import make_celery

    celery = make_celery(get_settings())
    args = ["flower", f"--port={port}", "--address=127.0.0.1" if not basic_auth else "--address=0.0.0.0"]
    if basic_auth:
        args.append(f"--basic-auth={basic_auth}")
    celery.start(args)


@app.command()
def sweep(once: Annotated[bool, typer.Option("--once/--forever")] = False) -> None:
    """Run the sweeper (re-sends lost jobs, recovers dead workers' jobs, ages low jobs up). One process is enough;
    more are safe (one at a time acts, under a Postgres advisory lock). SIGTERM ends it after the current tick."""
    from services.sweeper.main import run
    from shared.infra.config import get_settings

    report = run(get_settings(), once=once)
    if report is not None:
        typer.echo(json.dumps(report.__dict__, default=str))


@app.command("sweep-alive")
def sweep_alive() -> None:
    """Liveness probe for `vidq sweep --forever`: exit 0 if its loop touched the liveness file recently (it does
    after every tick, failed ones too, so a database outage does not restart it)."""
    from pathlib import Path

    from shared.infra.config import get_settings
    from shared.infra.liveness import is_alive

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
    from services.prewarmer.main import run
    from shared.infra.config import get_settings

    report = run(get_settings(), once=once)
    if report is not None:
        typer.echo(json.dumps(report.as_dict()))


@app.command("prewarmer-alive")
def prewarmer_alive() -> None:
    """Liveness probe for `vidq prewarmer`: exit 0 if its loop touched the liveness file recently (after every
    cycle, failed ones too)."""
    from pathlib import Path

    from shared.infra.config import get_settings
    from shared.infra.liveness import is_alive

    settings = get_settings()
    if not is_alive(Path(settings.prewarmer_liveness_file), max_age_s=settings.prewarmer_liveness_max_age_s):
        typer.echo(f"stale or missing: {settings.prewarmer_liveness_file}", err=True)
        raise typer.Exit(code=1)
    typer.echo("alive")


@app.command("motion-refit")
def motion_refit(
    every: Annotated[
        float | None, typer.Option(min=1.0, help="refit every this many seconds until SIGTERM (default: once)")
    ] = None,
    seed: Annotated[int, typer.Option(min=0, help="k-means seed (the same videos and seed: the same set)")] = 0,
) -> None:
    """Fit a new motion prototype set (64 global prototypes, then up to 8 variants per motion label) from every
    described video and assign each of them; new videos are assigned to the newest set as they finish. Older sets
    stay readable until more than VIDQ_MOTION_SETS_KEPT exist. Deployments run it periodically."""
    from services.motion.main import run
    from shared.infra.config import get_settings

    report = run(get_settings(), every_s=every, seed=seed)
    if report is not None:
        typer.echo(json.dumps(report.__dict__))


app.add_typer(pools.app, name="pools")

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

    from shared.infra.config import get_settings
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
