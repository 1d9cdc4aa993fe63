"""``vidq pools``: worker pools and canary release from the command line, on Postgres directly (the same operations
as ``/v1/admin/pools``, shared/pools/store.py). Every API process routes by a change within
``VIDQ_POOL_RULES_REFRESH_S``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

T = TypeVar("T")

app = typer.Typer(no_args_is_help=True, help="Worker pools: routing rules, canary release, side-by-side figures.")
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON")]


def _transaction(work: Callable[..., T]) -> T:
    """``work(session, celery)`` in one committed transaction; a refused change exits 1 with its reason."""
    from shared.errors import VidqError
    from shared.infra.config import get_settings
    from shared.infra.db import session_scope
    from shared.messaging.celery_app import make_celery
    from shared.messaging.dispatch import flush_send_records

    settings = get_settings()
    celery = make_celery(settings)
    try:
        with session_scope(settings) as session:
            result = work(session, celery)
        flush_send_records(celery)  # the moved jobs' sends on record before this process exits
        return result
    except VidqError as exc:
        typer.echo(f"refused: {exc.message}", err=True)
        raise typer.Exit(code=1) from None


def _live() -> dict[str, int] | None:

    from shared.infra.config import get_settings
    from shared.infra.redis_clients import broker_client
    from shared.pools.live import live_workers_or_none

    settings = get_settings()
    return live_workers_or_none(broker_client(settings, retries=0), settings)


@app.command("show")
def show(as_json: JsonOption = False) -> None:
    """Every pool: split, state (and why), live workers, queued and running jobs, tenant rules."""
    from rich.console import Console
    from rich.table import Table

    from shared.pools.store import overview

    live = _live()
    views = _transaction(lambda session, _: overview(session, live=live))
    if as_json:
        typer.echo(json.dumps([v.to_dict() for v in views]))
        return
    table = Table(title="worker pools")
    for column in ("pool", "split", "state", "live workers", "queued", "running", "tenants assigned", "reason"):
        table.add_column(column)
    for v in views:
        table.add_row(
            v.name,
            f"{v.split_percent:g}%",
            v.state,
            "?" if v.live_workers is None else str(v.live_workers),
            str(v.queued),
            str(v.running),
            ", ".join(v.tenants_assigned) or "-",
            v.state_reason or "-",
        )
    Console().print(table)
    choosing = next((v.tenants_choosing for v in views if v.tenants_choosing), [])
    if choosing:
        typer.echo(f"tenants allowed to choose with X-Vidq-Pool: {', '.join(choosing)}")


@app.command("set-split")
def set_split(
    pool: Annotated[str, typer.Argument(help="the pool (its rule is created if new)")],
    percent: Annotated[float, typer.Argument(min=0, max=100, help="its share of the jobs, 0-100")],
) -> None:
    """Give a pool a share of the jobs no header or tenant rule routes (by a stable hash of the job id), and put it
    back in routing if it was rolled back or tripped."""
    from shared.pools.store import set_split as do

    _transaction(lambda session, _: do(session, pool, percent))
    typer.echo(f"{pool}: {percent:g}% of the split")


@app.command()
def promote(pool: Annotated[str, typer.Argument()]) -> None:
    """The pool takes every job no header or tenant rule routes elsewhere (100%)."""
    from shared.pools.store import promote as do

    _transaction(lambda session, _: do(session, pool))
    typer.echo(f"{pool}: 100% of the split. Once stable runs the same, `vidq pools set-split {pool} 0`.")


@app.command()
def rollback(pool: Annotated[str, typer.Argument()]) -> None:
    """Take the pool out of routing and move its queued jobs to stable (its running jobs finish there)."""
    from shared.pools.store import rollback as do

    moved = _transaction(lambda session, celery: do(session, celery, pool))
    typer.echo(f"{pool}: rolled back; {len(moved)} queued jobs moved to stable")


@app.command()
def assign(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    pool: Annotated[str, typer.Argument(help="the pool; '' to clear the assignment")],
) -> None:
    """Send every job of a tenant (without a header of its own) to a pool."""
    from shared.pools.store import set_tenant

    _transaction(lambda session, _: set_tenant(session, tenant, pool=pool))
    typer.echo(f"{tenant}: {'assigned to ' + pool if pool else 'no assignment (the split decides)'}")


@app.command()
def allow(
    tenant: Annotated[str, typer.Argument(help="tenant name or id")],
    revoke: Annotated[bool, typer.Option("--revoke", help="take the permission away")] = False,
) -> None:
    """Let a tenant choose a pool per request with the X-Vidq-Pool header (others get 403)."""
    from shared.pools.store import set_tenant

    _transaction(lambda session, _: set_tenant(session, tenant, may_choose=not revoke))
    typer.echo(f"{tenant}: {'may not' if revoke else 'may'} choose a pool with X-Vidq-Pool")


@app.command()
def compare(
    window: Annotated[float, typer.Option(min=1, help="the last this many seconds")] = 3600,
    as_json: JsonOption = False,
) -> None:
    """The pools side by side over a window: success rate, queue wait, errors by code, seconds per step per shape."""
    from rich.console import Console
    from rich.table import Table

    from shared.pools.store import compare as do

    data: dict[str, Any] = _transaction(lambda session, _: do(session, window_s=window))
    if as_json:
        typer.echo(json.dumps(data))
        return
    pools = data["pools"]
    names = list(pools)

    def cell(value: Any, fmt: str = "{}") -> str:
        return "-" if value is None else fmt.format(value)

    table = Table(title=f"pools over the last {window:g} s")
    table.add_column("")
    for name in names:
        table.add_column(name)
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("succeeded", lambda f: str(f["succeeded"])),
        ("failed", lambda f: str(f["failed"])),
        ("cancelled", lambda f: str(f["cancelled"])),
        ("success rate", lambda f: cell(f["success_rate"], "{:.1%}")),
        ("queue wait p50 (s)", lambda f: cell(f["queue_wait_p50_s"], "{:.2f}")),
        ("queue wait p90 (s)", lambda f: cell(f["queue_wait_p90_s"], "{:.2f}")),
        ("errors", lambda f: ", ".join(f"{c} {n}" for c, n in sorted(f["errors"].items())) or "-"),
    ]
    for label, value in rows:
        table.add_row(label, *(value(pools[n]) for n in names))
    shapes = sorted({(r["model"], r["shape"]) for f in pools.values() for r in f["render_step_s"]})
    for model, shape in shapes:
        cells = []
        for n in names:
            match = [r for r in pools[n]["render_step_s"] if (r["model"], r["shape"]) == (model, shape)]
            cells.append(f"{match[0]['p50']:.3f} ({match[0]['jobs']})" if match else "-")
        table.add_row(f"s/step p50 {model} {shape}", *cells)
    Console().print(table)
