"""The batch table a worker uses: ``auto`` picks the one shipped for its GPU, none on the CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.worker import batch_table
from shared.spec import GenerationSpec


def spec(height: int, width: int, frames: int, model: str = "wan2.1-1.3b-arch") -> GenerationSpec:
    return GenerationSpec(
        model=model,
        prompt="p",
        negative_prompt="",
        seed=0,
        width=width,
        height=height,
        num_frames=frames,
        fps=16,
        steps=4,
        guidance_scale=5.0,
    )


@pytest.fixture(autouse=True)
def fresh_tables() -> Iterator[None]:
    batch_table.load.cache_clear()
    yield
    batch_table.load.cache_clear()


def test_gpu_names_become_file_names() -> None:
    assert batch_table.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert batch_table.gpu_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert batch_table.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_auto_on_the_cpu_renders_alone() -> None:
    assert batch_table.load("auto", "cpu").max_batch(spec(64, 64, 9, "tiny-wan")) == 1


def test_auto_on_a_gpu_reads_the_table_shipped_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = [
        {"model": "wan2.1-1.3b-arch", "frames": 17, "height": 240, "width": 416, "max_batch": 4},
        {"model": "wan2.1-1.3b-arch", "frames": 33, "height": 480, "width": 832, "max_batch": 1},
    ]
    (tmp_path / "nvidia-h200.json").write_text(json.dumps({"device": "NVIDIA H200", "gain": 1.3, "shapes": shapes}))
    monkeypatch.setattr(batch_table, "SHIPPED", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    table = batch_table.load("auto", None)
    assert table.max_batch(spec(240, 416, 17)) == 4
    assert table.max_batch(spec(480, 832, 33)) == 1
    assert table.max_batch(spec(720, 1280, 33)) == 1  # larger than any measured: alone
    batch_table.load.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")  # nothing shipped for it
    assert batch_table.load("auto", "cuda").max_batch(spec(240, 416, 17)) == 1


def test_every_shipped_table_reads() -> None:
    for path in batch_table.SHIPPED.glob("*.json"):
        assert batch_table.BatchTable.from_json(json.loads(path.read_text()))._entries, path
