"""The admission watermark under a submit storm, against the whole stack (``vidq up``: API, worker, sweeper,
prewarmer, webhooks): open-loop submits at ``--overload`` × the measured service rate for ``--seconds``.

It measures the service rate first (a burst of ``--calibrate`` jobs drained by the worker), then storms,
sampling every 100 ms each class's backlog (its queue's messages plus the admissions whose message is not out
yet) and W. It reports the answers by status, whether every refusal was a 429 ``queue_full`` with
``Retry-After``, the largest backlog against the largest W, 5xx, and whether every accepted job finished (none
lost).

The watermark's levels are scaled down (``--levels``: idle, normal, busy; min and max follow) so that a storm of
``--seconds`` on a CPU worker reaches them; the rule that moves W is the same.

    python -m benchmarks.watermark_storm [--seconds 30] [--overload 5] [--levels 16 24 32]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.realstack import Stack, machine, open_loop, real_stack, wait_finished, when, write_report

BODY = {"prompt": "a red fox runs through snow", "width": 64, "height": 64, "duration_s": 1.0, "fps": 8, "steps": 4}
CLASSES = ("high", "medium", "low")


def sample_depths(stack: Stack, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    client = stack.redis()
    while not stop.is_set():
        pipe = client.pipeline(transaction=False)
        for c in CLASSES:
            pipe.llen(f"{stack.prefix}video.{c}")
            pipe.zcard(f"{stack.prefix}vidq:sched:admitted:{c}")
        pipe.hgetall(f"{stack.prefix}vidq:sched:state")
        raw = pipe.execute()
        state = {k.decode(): v.decode() for k, v in raw[-1].items()}
        out.append(
            {
                "t": time.time(),
                **{f"backlog_{c}": int(raw[2 * i]) + int(raw[2 * i + 1]) for i, c in enumerate(CLASSES)},
                **{f"w_{c}": float(state.get(f"w:{c}", "nan")) for c in CLASSES},
                "util": float(state.get("util", "nan")),
            }
        )
        stop.wait(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--overload", type=float, default=5.0)
    parser.add_argument("--calibrate", type=int, default=12, help="jobs in the burst that measures the service rate")
    parser.add_argument("--levels", nargs=3, type=int, default=[16, 24, 32], metavar=("IDLE", "NORMAL", "BUSY"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    idle, normal, busy = args.levels
    env = {
        "VIDQ_WATERMARK_IDLE": str(idle),
        "VIDQ_WATERMARK_NORMAL": str(normal),
        "VIDQ_WATERMARK_BUSY": str(busy),
        "VIDQ_WATERMARK_MIN": str(min(args.levels)),
        "VIDQ_WATERMARK_MAX": str(max(args.levels)),
    }
    with real_stack(env) as stack:
        # Service rate: a first job (the warm-up), then a burst drained by the worker: jobs over the time from the
        # burst's first start to its last finish, by the database's clock.
        (first,) = asyncio.run(open_loop(stack, [{**BODY, "seed": 9_999}], rate=1.0))
        wait_finished(stack, [first.body["id"]], timeout_s=180)
        burst = asyncio.run(open_loop(stack, [{**BODY, "seed": 10_000 + i} for i in range(args.calibrate)], rate=100))
        taken = [b.body["id"] for b in burst if b.status == 202]  # the burst stays under the idle watermark
        drained = wait_finished(stack, taken, timeout_s=300).values()
        span = max(when(j["finished_at"]) for j in drained) - min(when(j["started_at"]) for j in drained)
        job_s = span / len(taken)
        rate = args.overload / job_s
        total = int(rate * args.seconds)
        depths: list[dict[str, Any]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_depths, args=(stack, stop, depths), daemon=True)
        sampler.start()
        answers = asyncio.run(open_loop(stack, [{**BODY, "seed": i} for i in range(total)], rate=rate))
        accepted = [a.body["id"] for a in answers if a.status == 202]
        finished = wait_finished(stack, accepted, timeout_s=max(120.0, 4 * job_s * len(accepted)))
        stop.set()
        sampler.join()

    statuses = Counter(a.status for a in answers)
    refused = [a for a in answers if a.status == 429]
    well_formed = sum(
        1 for a in refused if a.body.get("error", {}).get("code") == "queue_full" and "retry-after" in a.headers
    )
    retry_after = [int(a.headers["retry-after"]) for a in refused if "retry-after" in a.headers]
    latencies = sorted(a.answered - a.scheduled for a in answers if a.answered)
    report = {
        "benchmark": "watermark_storm",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.watermark_storm " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "levels": env,
        "job_s": round(job_s, 3),
        "service_rate_per_s": round(1 / job_s, 3),
        "offered_per_s": round(rate, 2),
        "offered": total,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "client_errors": Counter(a.error for a in answers if a.error),
        "refused": len(refused),
        "refusals_well_formed": well_formed,
        "retry_after_s": {"min": min(retry_after, default=0), "max": max(retry_after, default=0)},
        "answer_s": {
            "p50": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "p99": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None,
            "max": round(latencies[-1], 3) if latencies else None,
        },
        "five_xx": sum(v for k, v in statuses.items() if k >= 500),
        "accepted": len(accepted),
        "accepted_succeeded": sum(1 for j in finished.values() if j.get("status") == "succeeded"),
        "max_backlog": {c: max((d[f"backlog_{c}"] for d in depths), default=0) for c in CLASSES},
        "max_w": {c: max((d[f"w_{c}"] for d in depths), default=0) for c in CLASSES},
        "min_w": {c: min((d[f"w_{c}"] for d in depths), default=0) for c in CLASSES},
    }
    write_report(args.out, "watermark_storm", report, markdown(report))
    return 0


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    return "\n".join(
        [
            "# Admission watermark: a submit storm against the whole stack",
            "",
            f"`{r['command']}` — {r['date']}, commit {m['commit']}; {m['cpu']}, {m['cores']} cores, "
            f"{m['memory_gib']} GiB, Python {m['python']}; one tiny-wan worker on the CPU; levels {r['levels']}.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| service rate (a burst drained) | {r['service_rate_per_s']}/s ({r['job_s']} s a job) |",
            f"| offered (open loop) | {r['offered']} submits at {r['offered_per_s']}/s |",
            f"| answers by status | {r['statuses']} |",
            f"| refusals that are 429 `queue_full` with Retry-After | {r['refusals_well_formed']} of {r['refused']} |",
            f"| Retry-After | {r['retry_after_s']['min']}–{r['retry_after_s']['max']} s |",
            f"| answer time from schedule, p50 / p99 / max | {r['answer_s']['p50']} / {r['answer_s']['p99']} / "
            f"{r['answer_s']['max']} s |",
            f"| 5xx | {r['five_xx']} |",
            "| largest backlog vs largest W, per class | "
            + ", ".join(f"{c} {r['max_backlog'][c]} ≤ {r['max_w'][c]:.0f}" for c in CLASSES)
            + " |",
            f"| accepted jobs that finished succeeded | {r['accepted_succeeded']} of {r['accepted']} |",
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
