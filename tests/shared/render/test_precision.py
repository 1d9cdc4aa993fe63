"""One compute-dtype rule for workers and the prewarmer that encodes for them (their cache keys carry it)."""

from __future__ import annotations

import pytest
import torch

from services.prewarmer.service import workers_dtype
from shared.infra.config import Settings
from shared.render.precision import compute_dtype, resolve_device


def test_float32_off_cuda_and_the_configured_dtype_on_a_gpu_this_process_cannot_see() -> None:
    assert compute_dtype(torch.device("cpu"), cuda_dtype="bfloat16") == torch.float32
    if not torch.cuda.is_available():  # a prewarmer on a CPU node encoding for GPU workers
        assert compute_dtype(torch.device("cuda"), cuda_dtype="bfloat16") == torch.bfloat16
        assert compute_dtype(torch.device("cuda:1"), cuda_dtype="float16") == torch.float16


@pytest.mark.parametrize("device", [None, "cpu", "cuda"])
@pytest.mark.parametrize("cuda_dtype", ["bfloat16", "float16"])
def test_the_prewarmer_encodes_in_the_dtype_its_workers_compute_in(device: str | None, cuda_dtype: str) -> None:
    settings = Settings(device=device, cuda_dtype=cuda_dtype)
    try:
        _, worker = resolve_device(settings.device, cuda_dtype=settings.cuda_dtype)
    except RuntimeError:  # a CUDA worker cannot start here; the rule still names its dtype
        worker = compute_dtype(torch.device("cuda"), cuda_dtype=cuda_dtype)
    assert workers_dtype(settings) == worker
