"""A job's precision tier and step cache through the real stack: asked for on the request, rendered by a worker
that warmed up its shapes before it took a job, and named on the job's result."""

from __future__ import annotations

import json

from tests.integration.helpers import TINY, submit, wait_job


def test_a_warmed_up_worker_renders_each_job_in_its_tier_and_says_which(client, start_worker, procs):
    shape = f"{TINY['height']}x{TINY['width']}x9"  # the tiny job's shape: 1 s at 8 fps is 9 frames
    procs.env["VIDQ_WORKER_WARMUP_SHAPES"] = json.dumps([shape])
    try:
        name = start_worker("video")
    finally:
        procs.env.pop("VIDQ_WORKER_WARMUP_SHAPES")
    log = procs.log_path(name).read_text()
    # Ready only after the warm-up: the shape rendered before the pipeline was reported loaded.
    assert f'"shape": "{shape}"' in log and log.index('"warmed up"') < log.index('"pipeline loaded"')

    asked_fast = submit(client, precision="fast", step_cache="taylor3", steps=8)
    by_default = submit(client, seed=2)
    fast = wait_job(client, asked_fast["id"], {"succeeded"})
    plain = wait_job(client, by_default["id"], {"succeeded"})

    assert fast["precision"] == "fast" and fast["step_cache"] == "taylor3"
    assert plain["precision"] is None and plain["step_cache"] == "off"
    record, default_record = fast["timings"]["precision"], plain["timings"]["precision"]
    assert record["requested"] == "fast" and record["tier"] == "fast" and "note" not in record
    assert default_record["requested"] is None and default_record["tier"] == "exact" and "note" not in default_record
    # The CPU has no fp8: the fast tier's 8-bit layers ran as int8 weights, and the record says so and why.
    (linear,) = record["linear"]
    assert linear["asked"] == "linear8" and linear["runs"] == "int8_weight_only" and linear["layers"] > 0
    assert "no fp8 tensor cores" in linear["reason"]
    assert ["transformer.blocks.*.ffn.net.*.weight", "int8_weight_only"] in record["modules"]
    assert ["transformer.proj_out.*", "float32"] in record["modules"]
    assert "linear" not in default_record and "step_cache" not in default_record
    # The step cache ran the transformer on 6 of the 8 steps (the first four, every third after them, the last).
    assert record["step_cache"] == {"preset": "taylor3", "computed_steps": 6, "steps": 8}
    assert fast["progress"]["step"] == 8  # progress counts every step, computed or predicted
    # The levers and the attention kernel that ran are on the record (the CPU computes in float32, uncompiled).
    assert record["compute_dtype"] == "float32" and record["policy"]["compile_blocks"] is False
    assert record["attention"] in {"FLASH_ATTENTION", "MATH"}
    assert ["transformer.*", "float32"] in default_record["modules"]
