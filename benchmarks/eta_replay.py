"""How close ETA quotes come: a mixed workload replayed against the whole stack (``vidq up``), each job's quote at
submit compared with what happened.

First each kind of job in the mix renders ``--calibrate`` times, one at a time (the workers' measured costs the
quotes stand on). Then ``--jobs`` jobs of the mix are submitted in bursts of ``--burst`` on a fixed schedule (open
loop) at ``--load`` × the service rate that calibration measured, so the later jobs of a burst wait behind the
earlier ones, and each submit response's ``estimate`` is kept. Once all finished, per job:

- finish error = |actual − quoted| / actual, with actual = finished_at − created_at and quoted = finish_at −
  created_at;
- start error the same with started_at and start_at.

It reports p50 and p90 of both (the target: finish p90 ≤ 25%, judged on a quiet machine), and how many jobs got no
quote.

    python -m benchmarks.eta_replay [--jobs 40] [--load 0.8]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.realstack import machine, open_loop, real_stack, wait_finished, when, write_report

MIX: list[dict[str, Any]] = [
    {"prompt": "a red fox runs through snow", "width": 64, "height": 64, "duration_s": 1.0, "fps": 8, "steps": 4},
    {"prompt": "a boat on a lake at dawn", "width": 128, "height": 128, "duration_s": 1.0, "fps": 8, "steps": 4},
    {"prompt": "rain over a city at night", "width": 64, "height": 64, "duration_s": 2.0, "fps": 8, "steps": 8},
]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--load", type=float, default=0.8, help="offered rate as a share of the service rate")
    parser.add_argument("--calibrate", type=int, default=3)
    parser.add_argument("--burst", type=int, default=6, help="jobs submitted together, bursts spaced by the rate")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    with real_stack() as stack:
        seconds: list[float] = []
        for kind in MIX:
            for i in range(args.calibrate):
                (sub,) = asyncio.run(open_loop(stack, [{**kind, "seed": 50_000 + i}], rate=1.0))
                job = wait_finished(stack, [sub.body["id"]], timeout_s=180)[sub.body["id"]]
                if i > 0:  # the first of a kind pays its warm-up
                    seconds.append(float(job["timings"]["worker"]))
        rate = args.load / statistics.mean(seconds)
        time.sleep(2.0)  # the API's views have read the last calibration render
        bodies = [{**MIX[i % len(MIX)], "seed": i} for i in range(args.jobs)]
        answers = []
        start = time.time()
        for first in range(0, len(bodies), args.burst):  # bursts on a fixed schedule: later jobs of a burst wait
            due = start + first / rate
            if due > time.time():
                time.sleep(due - time.time())
            answers += asyncio.run(open_loop(stack, bodies[first : first + args.burst], rate=1000.0))
        ids = [a.body["id"] for a in answers if a.status == 202]
        finished = wait_finished(stack, ids, timeout_s=60 + 10 * len(ids) / rate)
    quotes = {a.body["id"]: a.body.get("estimate") for a in answers if a.status == 202}
    finish_err, start_err, unquoted = [], [], 0
    rows: list[dict[str, Any]] = []
    for job_id, job in finished.items():
        quote = quotes[job_id]
        if job.get("status") != "succeeded":
            continue
        if quote is None:
            unquoted += 1
            continue
        created = when(job["created_at"])
        actual_finish = when(job["finished_at"]) - created
        actual_start = when(job["started_at"]) - created
        finish_err.append(abs(actual_finish - (when(quote["finish_at"]) - created)) / actual_finish)
        rows.append(
            {
                "shape": f"{job['height']}x{job['width']}x{job['num_frames']}/{job['steps']}",
                "actual_start_s": round(actual_start, 3),
                "quoted_start_s": round(when(quote["start_at"]) - created, 3),
                "actual_finish_s": round(actual_finish, 3),
                "quoted_finish_s": round(when(quote["finish_at"]) - created, 3),
                "worker_s": job["timings"].get("worker"),
                "quoted_gpu_s": quote["gpu_seconds"],
            }
        )
        if actual_start > 0.5:  # a job that started at once has no wait worth a ratio
            start_err.append(abs(actual_start - (when(quote["start_at"]) - created)) / actual_start)
    report = {
        "benchmark": "eta_replay",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.eta_replay " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "mix": MIX,
        "service_rate_per_s": round(1 / statistics.mean(seconds), 3),
        "offered_per_s": round(rate, 3),
        "jobs": len(ids),
        "succeeded": sum(1 for j in finished.values() if j.get("status") == "succeeded"),
        "unquoted": unquoted,
        "finish_error": {"p50": pct(finish_err, 0.5), "p90": pct(finish_err, 0.9), "n": len(finish_err)},
        "start_error": {"p50": pct(start_err, 0.5), "p90": pct(start_err, 0.9), "n": len(start_err)},
        "jobs_detail": rows,
    }
    write_report(args.out, "eta_replay", report, markdown(report))
    return 0


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]

    def share(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.0f}%"

    return "\n".join(
        [
            "# ETA quotes: a mixed workload replayed against the whole stack",
            "",
            f"`{r['command']}` — {r['date']}, commit {m['commit']}; {m['cpu']}, {m['cores']} cores, "
            f"{m['memory_gib']} GiB, Python {m['python']}; one tiny-wan worker on the CPU; three kinds of job.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| service rate / offered | {r['service_rate_per_s']}/s / {r['offered_per_s']}/s |",
            f"| jobs (succeeded, without a quote) | {r['jobs']} ({r['succeeded']}, {r['unquoted']}) |",
            f"| finish error p50 / p90 (n) | {share(r['finish_error']['p50'])} / {share(r['finish_error']['p90'])} "
            f"({r['finish_error']['n']}) |",
            f"| start error p50 / p90 (n, jobs that waited > 0.5 s) | {share(r['start_error']['p50'])} / "
            f"{share(r['start_error']['p90'])} ({r['start_error']['n']}) |",
            "",
            "error = |actual − quoted| / actual, both from the job's created_at.",
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
