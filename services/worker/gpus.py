"""One video worker process per GPU (``vidq worker --gpus all``): which GPUs this machine shows, how each worker is
pinned, and a small supervisor that runs them.

Each worker sees exactly one GPU (``CUDA_VISIBLE_DEVICES`` set to that GPU's UUID, so device numbering cannot
shift), runs on the CPUs of that GPU's NUMA node (NVML's CPU affinity of the device; the worker applies it to itself
with ``sched_setaffinity`` before Celery starts, so its pool process inherits it), and has its own metrics port and
liveness file. The supervisor forwards SIGTERM/SIGINT to every worker (each stops warmly, as a single worker does),
restarts a worker that dies with a back-off, and exits when all have stopped: 0 if all stopped cleanly.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

log = logging.getLogger("vidq.worker.gpus")


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int  # NVML's index (the machine's numbering, not CUDA_VISIBLE_DEVICES')
    uuid: str
    name: str
    cpus: tuple[int, ...]  # the CPUs of its NUMA node; empty when NVML does not say


def cpus_from_mask(words: Sequence[int], *, word_bits: int = 64) -> tuple[int, ...]:
    """NVML's CPU affinity (an array of bit masks, CPU 0 = bit 0 of word 0) as CPU numbers."""
    return tuple(w * word_bits + b for w, word in enumerate(words) for b in range(word_bits) if word >> b & 1)


def list_gpus(nvml: Any = None, *, visible: str | None = None) -> list[Gpu]:
    """The GPUs this process may use, in NVML's order: all of them, or those ``CUDA_VISIBLE_DEVICES`` names (indices
    or UUIDs). ``nvml`` is the pynvml module (a test passes a fake)."""
    if nvml is None:
        import pynvml

        nvml = pynvml
    nvml.nvmlInit()
    try:
        cpu_words = max(1, ((os.cpu_count() or 1) + 63) // 64)
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            try:
                cpus = cpus_from_mask(nvml.nvmlDeviceGetCpuAffinity(handle, cpu_words))
            except nvml.NVMLError:
                cpus = ()  # not reported (some virtual machines): the worker keeps the CPUs it has
            gpus.append(Gpu(index, uuid, _text(nvml.nvmlDeviceGetName(handle)), cpus))
    finally:
        nvml.nvmlShutdown()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None or visible.strip() == "":
        return gpus if visible is None else []
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    picked = []
    for item in wanted:
        match = [g for g in gpus if g.uuid == item or g.uuid.startswith(item) or str(g.index) == item]
        if match and match[0] not in picked:
            picked.append(match[0])
    return picked


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def select(gpus: Sequence[Gpu], spec: str) -> list[Gpu]:
    """``all``, or a comma list of indices among ``gpus`` (``0,2``)."""
    if spec.strip().lower() == "all":
        if not gpus:
            raise ValueError("no GPU visible (NVML lists none, or CUDA_VISIBLE_DEVICES hides them all)")
        return list(gpus)
    chosen = []
    by_index = {g.index: g for g in gpus}
    for part in spec.split(","):
        try:
            chosen.append(by_index[int(part)])
        except (ValueError, KeyError):
            raise ValueError(f"--gpus {spec!r}: {part!r} is not one of {sorted(by_index)} (or use 'all')") from None
    return chosen


def worker_env(
    gpu: Gpu, base: Mapping[str, str], *, ordinal: int, metrics_port: int, liveness_file: str
) -> dict[str, str]:
    """The environment of the worker for ``gpu`` (the ``ordinal``-th started)."""
    return {
        **base,
        "CUDA_VISIBLE_DEVICES": gpu.uuid,
        "VIDQ_DEVICE": "cuda",
        "VIDQ_WORKER_CPU_AFFINITY": ",".join(map(str, gpu.cpus)),
        "VIDQ_WORKER_METRICS_PORT": str(metrics_port + ordinal if metrics_port else 0),
        "VIDQ_WORKER_LIVENESS_FILE": f"{liveness_file}.gpu{gpu.index}",
    }


def apply_affinity(cpus: Sequence[int]) -> None:
    """Run this process (and what it forks later) on ``cpus`` — those of them this process may use at all."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    allowed = os.sched_getaffinity(0) & set(cpus)
    if allowed:
        os.sched_setaffinity(0, allowed)
    else:
        log.warning("none of the GPU's CPUs is available to this process; affinity left as is", extra={"cpus": cpus})


@dataclass(slots=True)
class _Child:
    gpu: Gpu
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    restarts: int = 0


class GpuWorkers:
    """Start one worker per GPU, restart one that dies (back-off ``restart_s`` doubling to 60 s), and on SIGTERM or
    SIGINT forward it to every worker and wait for all of them."""

    def __init__(
        self,
        gpus: Sequence[Gpu],
        *,
        argv: Callable[[Gpu], list[str]],
        env: Callable[[Gpu, int], dict[str, str]],
        restart_s: float = 1.0,
    ) -> None:
        self.gpus = list(gpus)
        self.argv = argv
        self.env = env
        self.restart_s = restart_s
        self.stopping = threading.Event()
        self.children: list[_Child] = []

    def _spawn(self, gpu: Gpu, ordinal: int) -> _Child:
        argv, env = self.argv(gpu), self.env(gpu, ordinal)
        log.info("starting the worker of a GPU", extra={"gpu": gpu.index, "uuid": gpu.uuid, "cpus": len(gpu.cpus)})
        return _Child(gpu, argv, env, subprocess.Popen(argv, env=env))

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signum)

    def run(self, *, install_signals: bool = True) -> int:
        if install_signals:
            signal.signal(signal.SIGTERM, self._forward)
            signal.signal(signal.SIGINT, self._forward)
        self.children = [self._spawn(gpu, i) for i, gpu in enumerate(self.gpus)]
        due: dict[int, float] = {}  # ordinal → when to restart it
        while True:
            for ordinal, child in enumerate(self.children):
                code = child.proc.poll()
                if code is None or self.stopping.is_set():
                    continue
                if ordinal not in due:
                    delay = min(60.0, self.restart_s * 2**child.restarts)
                    log.warning(
                        "a GPU's worker exited; restarting it",
                        extra={"gpu": child.gpu.index, "exit_code": code, "restart_in_s": delay},
                    )
                    due[ordinal] = time.monotonic() + delay
                elif time.monotonic() >= due.pop(ordinal):
                    restarts = child.restarts + 1
                    self.children[ordinal] = self._spawn(child.gpu, ordinal)
                    self.children[ordinal].restarts = restarts
            if self.stopping.is_set():
                codes = [child.proc.wait() for child in self.children]
                return 0 if all(code == 0 for code in codes) else 1
            self.stopping.wait(0.2)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self._forward(signum, None)
