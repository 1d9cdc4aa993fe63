"""`vidq worker --gpus`: the GPU list from NVML (faked here: CI has no GPU), the per-GPU environment and CPU
pinning, and the supervisor that runs one real process per GPU, restarts one that dies and stops them all."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.worker.gpus import Gpu, GpuWorkers, apply_affinity, cpus_from_mask, list_gpus, select, worker_env


class FakeNvml:
    """The few pynvml calls list_gpus makes, for a machine with two GPUs on two NUMA nodes."""

    class NVMLError(Exception):
        pass

    def __init__(self, masks: list[list[int] | None]) -> None:
        self.masks = masks
        self.initialised = 0

    def nvmlInit(self) -> None:  # noqa: N802
        self.initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.masks)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # noqa: N802
        return f"GPU-{handle}aaaa-0000".encode()

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return "NVIDIA H200"

    def nvmlDeviceGetCpuAffinity(self, handle: int, words: int) -> list[int]:  # noqa: N802
        mask = self.masks[handle]
        if mask is None:
            raise self.NVMLError("not supported")
        return mask


def test_cpus_from_mask() -> None:
    assert cpus_from_mask([0b1011]) == (0, 1, 3)
    assert cpus_from_mask([0, 1]) == (64,)


def test_list_gpus_reads_nvml_and_honours_cuda_visible_devices() -> None:
    nvml = FakeNvml([[0x0F], [0xF0], None])
    everything = list_gpus(nvml, visible="0,1,2")
    assert [(g.index, g.uuid, g.cpus) for g in everything] == [
        (0, "GPU-0aaaa-0000", (0, 1, 2, 3)),
        (1, "GPU-1aaaa-0000", (4, 5, 6, 7)),
        (2, "GPU-2aaaa-0000", ()),  # NVML does not say: no pinning
    ]
    assert [g.index for g in list_gpus(nvml, visible="2,0")] == [2, 0]  # the order CUDA_VISIBLE_DEVICES gives
    assert [g.index for g in list_gpus(nvml, visible="GPU-1aaaa")] == [1]  # a UUID (prefix)
    assert list_gpus(nvml, visible="") == []
    assert nvml.initialised == 0  # shut down every time


def test_select() -> None:
    gpus = [Gpu(0, "a", "x", ()), Gpu(1, "b", "x", ())]
    assert select(gpus, "all") == gpus
    assert select(gpus, "1") == [gpus[1]]
    with pytest.raises(ValueError, match="not one of"):
        select(gpus, "0,5")
    with pytest.raises(ValueError, match="no GPU visible"):
        select([], "all")


def test_each_worker_gets_its_gpu_cpus_port_and_liveness_file() -> None:
    env = worker_env(
        Gpu(3, "GPU-3", "H200", (8, 9)), {"PATH": "/bin"}, ordinal=1, metrics_port=9808, liveness_file="/tmp/alive"
    )
    assert env == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "GPU-3",
        "VIDQ_DEVICE": "cuda",
        "VIDQ_WORKER_CPU_AFFINITY": "8,9",
        "VIDQ_WORKER_METRICS_PORT": "9809",
        "VIDQ_WORKER_LIVENESS_FILE": "/tmp/alive.gpu3",
    }
    assert (
        worker_env(Gpu(0, "u", "n", ()), {}, ordinal=0, metrics_port=0, liveness_file="f")["VIDQ_WORKER_METRICS_PORT"]
        == "0"
    )


# The children import services.* from the repository: tests/services/worker/ is three levels below it.
REPO_ROOT = Path(__file__).resolve().parents[3]

# A stand-in for `vidq worker`: pins itself as the real one does, reports, and stops on SIGTERM (exit 0).
CHILD = """
import json, os, signal, sys, time
from services.worker.gpus import apply_affinity
apply_affinity([int(c) for c in os.environ["VIDQ_WORKER_CPU_AFFINITY"].split(",") if c])
out = os.path.join(sys.argv[1], f"{os.getpid()}.json")
report = {"gpu": os.environ["CUDA_VISIBLE_DEVICES"], "cpus": sorted(os.sched_getaffinity(0)),
          "port": os.environ["VIDQ_WORKER_METRICS_PORT"]}
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
open(out, "w").write(json.dumps(report))
while not stop:
    time.sleep(0.05)
"""


def reports(folder: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem): json.loads(p.read_text()) for p in folder.glob("*.json") if p.stat().st_size}


def wait_for(check: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_the_supervisor_runs_one_pinned_process_per_gpu_restarts_a_dead_one_and_stops_all(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    gpus = [Gpu(0, "GPU-A", "H200", (cpus[0],)), Gpu(1, "GPU-B", "H200", tuple(cpus[-1:]))]
    root = str(REPO_ROOT)
    workers = GpuWorkers(
        gpus,
        argv=lambda gpu: [sys.executable, "-c", CHILD, str(tmp_path)],
        env=lambda gpu, i: {
            **worker_env(gpu, os.environ, ordinal=i, metrics_port=9900, liveness_file=str(tmp_path / "alive")),
            "PYTHONPATH": root,
        },
        restart_s=0.1,
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(workers.run(install_signals=False)), daemon=True)
    thread.start()
    wait_for(lambda: len(reports(tmp_path)) == 2)
    first = reports(tmp_path)
    assert sorted((r["gpu"], r["cpus"], r["port"]) for r in first.values()) == [
        ("GPU-A", [cpus[0]], "9900"),
        ("GPU-B", [cpus[-1]], "9901"),
    ]

    dead = next(pid for pid, r in first.items() if r["gpu"] == "GPU-B")
    os.kill(dead, signal.SIGKILL)
    wait_for(lambda: len(reports(tmp_path)) == 3)  # GPU-B's worker again, a new process
    (new,) = set(reports(tmp_path)) - set(first)
    assert reports(tmp_path)[new]["gpu"] == "GPU-B"

    workers.stop()
    thread.join(30)
    assert result == [0]  # every worker stopped on SIGTERM, cleanly
    assert all(child.proc.poll() == 0 for child in workers.children)


def test_apply_affinity_ignores_cpus_this_process_may_not_use() -> None:
    before = os.sched_getaffinity(0)
    try:
        apply_affinity([10_000])  # not a CPU here: left as is
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)


GPU_CHILD = """
import json, os, sys, torch
from services.worker.gpus import apply_affinity
apply_affinity([int(c) for c in os.environ["VIDQ_WORKER_CPU_AFFINITY"].split(",") if c])
props = torch.cuda.get_device_properties(0)
report = {"visible": os.environ["CUDA_VISIBLE_DEVICES"], "count": torch.cuda.device_count(),
          "uuid": str(props.uuid), "cpus": sorted(os.sched_getaffinity(0))}
open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w").write(json.dumps(report))
"""


@pytest.mark.gpu
def test_on_real_gpus_each_worker_sees_exactly_its_own_gpu_and_runs_on_its_numa_cpus(tmp_path: Path) -> None:
    gpus = list_gpus()
    root = str(REPO_ROOT)
    workers = GpuWorkers(
        gpus,
        argv=lambda gpu: [sys.executable, "-c", GPU_CHILD, str(tmp_path)],
        env=lambda gpu, i: {
            **worker_env(gpu, os.environ, ordinal=i, metrics_port=0, liveness_file=str(tmp_path / "alive")),
            "PYTHONPATH": root,
        },
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(workers.run(install_signals=False)), daemon=True)
    thread.start()
    wait_for(lambda: len(reports(tmp_path)) == len(gpus), timeout_s=120)
    workers.stop()
    thread.join(30)
    seen = sorted(reports(tmp_path).values(), key=lambda r: r["visible"])
    print(json.dumps({"gpus": [g.__repr__() for g in gpus], "workers": seen}, indent=1))
    assert [r["count"] for r in seen] == [1] * len(gpus)  # one GPU each
    assert sorted(r["visible"] for r in seen) == sorted(g.uuid for g in gpus)
    for r in seen:
        assert r["visible"].removeprefix("GPU-") == r["uuid"]  # the GPU it sees is the one it was given
        gpu = next(g for g in gpus if g.uuid == r["visible"])
        if gpu.cpus:
            assert set(r["cpus"]) <= set(gpu.cpus)


def test_the_supervisor_imports_no_torch() -> None:
    """`vidq worker --gpus` forks and execs one worker per GPU: what it imports itself (the CLI, the supervisor, the
    settings) must not touch CUDA either, or a GPU it hands on could be left in a state a child cannot use."""
    import subprocess

    code = (
        "import sys, tools.cli, services.worker.gpus, shared.infra.config, shared.infra.logs; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
