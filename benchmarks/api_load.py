"""Control-plane load: an open-loop generator against real API processes, this tree against a baseline commit.

    python -m benchmarks.api_load [--baseline-ref f68bf14] [--workers 2] [--quick]

For each target (the baseline commit, checked out into a temporary worktree, and this working tree) it makes a
database of its own on the local Postgres (where that offers pgvector, which vidq's schema needs; else on one
embedded PostgreSQL 16 started for the run, the same for every target), migrates it with that target's code, issues
an API key, and starts
``vidq api`` from that target's source with the sweeper off and a broker key prefix of its own (nothing else on
this Redis sees the messages; they are deleted at the end). No worker runs: a submit ends in the queue.

Open loop: request i is *scheduled* at t0 + i/rate and its latency is measured from that scheduled time, so a
server that falls behind is charged for the queue it builds (a closed loop would hide it). Scenarios:
  submit   POST /v1/jobs at fixed rates
  read     GET /v1/jobs/{id} at fixed rates
  overload POST at 5× the submit rate the target sustained, for 30 s; then: 5xx count, goodput (2xx/s) against
           the peak, how fast every request was answered (refusals too), the CPU per 503 refusal, and recovery
           (time from the burst's end until a fresh request is answered 2xx in < 100 ms)
  queue full  POST at the same rate with every priority class at its admission watermark (W = 1): all 429, and
           the CPU per refusal
CPU ms per request is the API processes' CPU time (user+sys, all workers) over the requests they answered.
Results: benchmarks/results/api_load_<date>.md (with the machine, versions and the command).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
import psycopg
import redis

from tools.devstack import libpq_url, postgres_with_vector

ROOT = Path(__file__).resolve().parent.parent
# Used where it offers pgvector; otherwise an embedded server stands in for it.
PG = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/14"
BODY = {"prompt": "a red fox runs through snow, cinematic", "width": 64, "height": 64, "duration_s": 0.5, "fps": 8}


@dataclass
class Run:
    name: str
    rate: float
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)  # the 2xx answers'
    answered_ms: list[float] = field(default_factory=list)  # every answer's, refusals too
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    cpu_ms: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.statuses.values()) + sum(self.errors.values())

    @property
    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if 200 <= s < 300)

    @property
    def server_errors(self) -> int:
        """5xx other than 503 (a 503 with Retry-After is load shed on purpose; it is counted apart)."""
        return sum(n for s, n in self.statuses.items() if s >= 500 and s != 503)

    def pct(self, q: float, of: list[float] | None = None) -> float:
        values = self.latencies_ms if of is None else of
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def answers(self) -> str:
        """How fast every request was answered, refusals included (a request never answered counts as late)."""
        within = sum(1 for ms in self.answered_ms if ms <= 1000.0)
        worst = max(self.answered_ms, default=float("nan"))
        return (
            f"every answer p99 {self.pct(0.99, self.answered_ms):.0f} ms, max {worst:.0f} ms; {within} of "
            f"{self.sent} ({100 * within / max(1, self.sent):.1f}%) answered within 1 s"
        )

    def row(self) -> str:
        per_req = self.cpu_ms / max(1, self.ok)
        codes = " ".join(f"{s}×{n}" for s, n in sorted(self.statuses.items()))
        errs = " ".join(f"{e}×{n}" for e, n in self.errors.items())
        return (
            f"| {self.name} | {self.rate:.0f} | {self.ok / self.seconds:.0f} | {self.pct(0.5):.1f} | "
            f"{self.pct(0.99):.1f} | {self.server_errors} | {codes} {errs} | {per_req:.2f} |"
        )


class Target:
    """One API under test: its source tree, database (on ``server``, a maintenance URL), key and process."""

    def __init__(self, name: str, src: Path, *, workers: int, server: str, pool_split: float = 0.0) -> None:
        self.name, self.src, self.workers, self.server = name, src, workers, server
        # A target with worker pools routes every submit through them: with a canary split set, each submit's route
        # is decided (and, no canary worker being live, falls back to stable: the longest path through routing).
        self.pool_split = pool_split if (src / "shared" / "pools").is_dir() else 0.0
        if self.pool_split:
            self.name += f" (worker pools: canary split {self.pool_split:g}%)"
        self.db = f"vidq_bench_{uuid.uuid4().hex[:8]}"
        self.prefix = f"vidq-bench-{uuid.uuid4().hex[:8]}:"
        self.port = 0  # chosen at start: a port picked before another target's load may be taken by then
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.key = ""
        self.log = Path(tempfile.mkstemp(prefix=f"vidq-bench-{name}-", suffix=".log")[1])

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": str(self.src),
            "VIDQ_ENV": "test",
            "VIDQ_DATABASE_URL": self.server.rsplit("/", 1)[0] + f"/{self.db}",
            "VIDQ_BROKER_URL": REDIS,
            "VIDQ_BROKER_KEY_PREFIX": self.prefix,
            "VIDQ_SWEEPER_IN_API": "false",
            "VIDQ_LOG_LEVEL": "WARNING",
            "VIDQ_PUBLIC_BASE_URL": self.url,
            # No worker drains the queue here: the admission watermark is checked on every submit (its cost is
            # measured) but set far above what a run queues, so a submit is refused only for capacity (503).
            **{f"VIDQ_WATERMARK_{level}": "10000000" for level in ("IDLE", "NORMAL", "BUSY", "MAX")},
        }

    def start(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with psycopg.connect(libpq_url(self.server), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.db}"')
        run = [sys.executable, "-m", _cli_module(self.src)]
        subprocess.run([*run, "migrate"], env=self.env(), cwd=self.src, check=True, capture_output=True, timeout=120)
        out = subprocess.run(
            [*run, "create-key", "--tenant", "bench"], env=self.env(), cwd=self.src, check=True, capture_output=True
        )
        self.key = json.loads(out.stdout.decode().strip().splitlines()[-1])["api_key"]
        if self.pool_split:
            subprocess.run(
                [*run, "pools", "set-split", "canary", f"{self.pool_split:g}"],
                env=self.env(),
                cwd=self.src,
                check=True,
                capture_output=True,
                timeout=60,
            )
        self.serve()

    def serve(self, **extra_env: str) -> None:
        """Start the API processes (with ``extra_env`` over the target's environment) and wait until they answer."""
        argv = [sys.executable, "-m", _cli_module(self.src), "api", "--no-migrate", "--port", str(self.port)]
        if self.workers > 1:
            argv += ["--workers", str(self.workers)]
        env = {**self.env(), **extra_env}
        self.proc = subprocess.Popen(argv, env=env, cwd=self.src, stdout=self.log.open("ab"), stderr=-2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} API did not start: {self.log.read_text()[-2000:]}")

    def cpu_s(self) -> float:
        assert self.proc is not None
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        return float(sum(p.cpu_times().user + p.cpu_times().system for p in procs if p.is_running()))

    def halt(self) -> None:
        """Stop the API processes (the database and the key stay)."""
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
            self.proc.kill()
            self.proc = None

    def stop(self) -> None:
        self.halt()
        client = redis.Redis.from_url(REDIS)
        for key in client.scan_iter(match=f"{self.prefix}*", count=1000):
            client.delete(key)
        with psycopg.connect(libpq_url(self.server), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')


def _cli_module(src: Path) -> str:
    return "tools.cli" if (src / "tools" / "cli").is_dir() else "shared.cli"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RawHttp:
    """A minimal HTTP/1.1 client over a stack of keep-alive connections (a new one when none is free). httpx's
    async pool spends CPU that grows with the number of waiting requests, which on the API's own cores would
    throttle the generator exactly when the server falls behind; this costs a few tens of microseconds."""

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, method: str, path: str, body: bytes = b"") -> int:
        if self.idle:
            try:
                return await self._exchange(self.idle.pop(), method, path, body)
            except (OSError, asyncio.IncompleteReadError, IndexError):
                pass  # the server closed an idle connection (keep-alive timeout): once more on a fresh one
        return await self._exchange(await asyncio.open_connection("127.0.0.1", self.port), method, path, body)

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], method: str, path: str, body: bytes
    ) -> int:
        reader, writer = conn
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {self.key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        status_line = await reader.readline()
        length, close = 0, False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and "close" in value.lower():
                close = True
        await reader.readexactly(length)
        if close or not status_line:
            writer.close()
        else:
            self.idle.append(conn)
        return int(status_line.split()[1])


async def open_loop(target: Target, run: Run, *, method: str, path: str | list[str]) -> Run:
    http = RawHttp(target.port, target.key)
    body = json.dumps(BODY).encode() if method == "POST" else b""
    total = int(run.rate * run.seconds)
    cpu0 = target.cpu_s()
    t0 = time.perf_counter() + 0.05

    async def one(i: int, scheduled: float) -> None:
        url = path[i % len(path)] if isinstance(path, list) else path
        try:
            status = await asyncio.wait_for(http.request(method, url, body), timeout=10.0)
            run.statuses[status] += 1
            took_ms = (time.perf_counter() - scheduled) * 1000
            run.answered_ms.append(took_ms)
            if 200 <= status < 300:
                run.latencies_ms.append(took_ms)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            run.errors[type(exc).__name__] += 1

    tasks = []
    for i in range(total):
        scheduled = t0 + i / run.rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, scheduled)))
    await asyncio.gather(*tasks)
    run.cpu_ms = (target.cpu_s() - cpu0) * 1000
    for _, writer in http.idle:
        writer.close()
    return run


async def recovery_s(target: Target) -> float:
    """From now until a fresh submit is answered 2xx within 100 ms."""
    headers = {"Authorization": f"Bearer {target.key}"}
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=target.url, headers=headers, timeout=10.0) as http:
        while time.perf_counter() - start < 60:
            sent = time.perf_counter()
            with contextlib.suppress(httpx.HTTPError):
                r = await http.post("/v1/jobs", json=BODY)
                if 200 <= r.status_code < 300 and time.perf_counter() - sent < 0.1:
                    return time.perf_counter() - start
            await asyncio.sleep(0.05)
    return float("inf")


def job_ids(target: Target, n: int) -> list[str]:
    headers = {"Authorization": f"Bearer {target.key}"}
    with httpx.Client(base_url=target.url, headers=headers, timeout=10) as http:
        return [f"/v1/jobs/{http.post('/v1/jobs', json=BODY).json()['id']}" for _ in range(n)]


def bench(target: Target, *, submit_rates: list[float], read_rates: list[float], seconds: float) -> list[str]:
    lines = [
        f"### {target.name}",
        "",
        "| scenario | offered/s | 2xx/s | p50 ms | p99 ms | 5xx | statuses | CPU ms/2xx |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    notes: list[str] = []

    def record(run: Run) -> bool:
        """Adds the row; False when the API did not recover within 60 s (a wedged process: stop here)."""
        lines.append(run.row())
        print(lines[-1], flush=True)
        recovered = asyncio.run(recovery_s(target))
        if recovered > 1.0:
            notes.append(f"after {run.name} at {run.rate:.0f}/s the API took {recovered:.1f} s to answer again")
        return recovered != float("inf")

    paths = job_ids(target, 50)
    best, ok_cpu_ms = 0.0, 0.0
    alive = True
    for rate in read_rates:
        alive = alive and record(asyncio.run(open_loop(target, Run("read", rate, seconds), method="GET", path=paths)))
    for rate in submit_rates:
        if not alive:
            break
        run = asyncio.run(open_loop(target, Run("submit", rate, seconds), method="POST", path="/v1/jobs"))
        if run.server_errors == 0 and not run.errors and run.ok / seconds > best:
            best = run.ok / seconds  # the peak: the most 2xx/s a run sustained without failures
            ok_cpu_ms = run.cpu_ms / max(1, run.ok)
        alive = record(run)
    if not alive:
        return [*lines, "", "The API stopped answering (wedged) — " + "; ".join(notes), ""]
    peak = best or submit_rates[0]
    burst = Run("overload 5×", 5 * peak, 30.0 if seconds >= 10 else seconds)
    asyncio.run(open_loop(target, burst, method="POST", path="/v1/jobs"))
    lines.append(burst.row())
    recovered = asyncio.run(recovery_s(target))
    lines += [
        "",
        f"Peak submit goodput (no 5xx but 503, no client error): {peak:.0f}/s. Overload at {burst.rate:.0f}/s for "
        f"{burst.seconds:.0f} s: {burst.server_errors} 5xx other than 503, {burst.statuses[503]} shed with 503, "
        f"{sum(burst.errors.values())} client timeouts, goodput {burst.ok / burst.seconds:.0f}/s = "
        f"{100 * burst.ok / burst.seconds / peak:.0f}% of peak, recovery {recovered:.2f} s; {burst.answers()}.",
        f"CPU per 503 refusal (the run's CPU less its 2xx at the peak's {ok_cpu_ms:.2f} ms each, over the 503s): "
        f"{1000 * (burst.cpu_ms - burst.ok * ok_cpu_ms) / max(1, burst.statuses[503]):.0f} µs.",
        *(f"- {n}" for n in notes),
        "",
    ]
    print("\n".join(lines[-4:]), flush=True)
    return [*lines, *queue_full(target, rate=burst.rate, seconds=seconds)]


# Every class at W = 1, with score thresholds under which these three bodies fall in three classes: after one job of
# each, every submit is refused by the watermark.
FULL_ENV = {
    **{f"VIDQ_WATERMARK_{level}": "1" for level in ("IDLE", "NORMAL", "BUSY", "MIN", "MAX")},
    "VIDQ_SCORE_HIGH": "0.40",
    "VIDQ_SCORE_MEDIUM": "0.30",
}
BY_CLASS = [
    {**BODY, "prompt": "a tiny red boat drifts across a misty golden lake, cinematic and dramatic, while birds fly"},
    BODY,
    {**BODY, "duration_s": 4.0},
]


def queue_full(target: Target, *, rate: float, seconds: float) -> list[str]:
    """Submits at ``rate`` while every class is at its watermark: all 429, and the CPU each refusal costs."""
    target.halt()
    target.serve(**FULL_ENV)
    headers = {"Authorization": f"Bearer {target.key}"}
    with httpx.Client(base_url=target.url, headers=headers, timeout=10) as http:
        for body in BY_CLASS:  # fill each class (it may be full already): until its first refusal
            for _ in range(3):
                if http.post("/v1/jobs", json=body).status_code == 429:
                    break
    run = asyncio.run(open_loop(target, Run("queue full", rate, seconds), method="POST", path="/v1/jobs"))
    refused = run.statuses[429]
    per_refusal = (
        f"CPU per 429 refusal {1000 * run.cpu_ms / refused:.0f} µs"
        if refused
        else "no 429: this target has no admission watermark"
    )
    line = (
        f"Every class full, submits at {rate:.0f}/s for {seconds:.0f} s: {refused} refused with 429, statuses "
        f"{dict(sorted(run.statuses.items()))}, {sum(run.errors.values())} client timeouts; {run.answers()}; "
        f"{per_refusal}."
    )
    print(line, flush=True)
    return [line, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-ref", default="f68bf14", help="git ref to compare against ('' = none)")
    parser.add_argument("--workers", type=int, default=2, help="API processes for this tree")
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test of the benchmark)")
    parser.add_argument(
        "--pool-split",
        type=float,
        default=0.0,
        help="give a canary pool this share of the split in every target that has worker pools (routing's cost)",
    )
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    args = parser.parse_args()
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # a write to a connection the server closed is expected here
    seconds = 3.0 if args.quick else 10.0
    submit_rates = [100.0, 250.0, 500.0, 750.0]
    read_rates = [500.0, 1000.0, 1500.0]
    sections: list[str] = []
    worktree = None
    with postgres_with_vector(PG) as server:
        targets: list[Target] = []
        if args.baseline_ref:
            worktree = Path(tempfile.mkdtemp(prefix="vidq-baseline-"))
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(worktree), args.baseline_ref], cwd=ROOT, check=True
            )
            targets.append(
                Target(f"baseline {args.baseline_ref}", worktree, workers=1, server=server, pool_split=args.pool_split)
            )
        targets.append(Target("this tree", ROOT, workers=args.workers, server=server, pool_split=args.pool_split))
        try:
            for target in targets:
                target.start()
                try:
                    sections += bench(target, submit_rates=submit_rates, read_rates=read_rates, seconds=seconds)
                finally:
                    target.stop()
        finally:
            if worktree is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)
                shutil.rmtree(worktree, ignore_errors=True)
        _write(sections, args, server)


def _write(sections: list[str], args: argparse.Namespace, server: str) -> None:
    versions = {}
    for pkg in ("fastapi", "uvicorn", "sqlalchemy", "psycopg", "celery", "kombu", "redis", "httpx"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[pkg] = version(pkg)
    with psycopg.connect(libpq_url(server)) as conn:
        pg_version = conn.execute("SHOW server_version").fetchone()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    tag = f"_{args.tag}" if args.tag else ""
    out = ROOT / "benchmarks" / "results" / f"api_load_{datetime.now(UTC):%Y%m%d}{tag}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = [
        "# Control-plane load (open loop)",
        "",
        f"- command: `python -m benchmarks.api_load {' '.join(sys.argv[1:])}` at {head.stdout.strip()}",
        f"- machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB; the generator runs on the same cores",
        f"- Postgres {pg_version[0] if pg_version else '?'}, Python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; each rate runs {'3' if args.quick else '10'} s; latency "
        "is from the scheduled send; CPU ms is the API processes' CPU time per 2xx",
        "",
        *sections,
    ]
    out.write_text("\n".join(text) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
