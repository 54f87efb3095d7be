"""Whether ``bench serve``'s slice weighs a restore against a prefill as a GPU deployment does (issue 43).

A backend's restore speed shows in TTFT only as far as restoring a prefix costs time next to
computing it. The ratio that decides it, for a prefix of ``tokens``:

    restore / prefill = (tokens x KV bytes per token / storage read rate) / prefill seconds(tokens)

On a GPU deployment (``gpu_reference``) both sides come from one source each: the model preset's KV
bytes and its modelled prefill (``loadgen/models.py``: FLOPs over the GPU's datasheet rate at the
preset's MFU), the storage's read rate from a device profile (``simulate/devices.py``, passed in by the
CLI). On this machine (``measure``) the prefill is timed in the real vLLM CPU server, cold, for the serve
slice's model and for shapes with more KV bytes per FLOP (``SHAPES``), and the read rate is this VM's.
``factor`` is how many times cheaper a restore is here, relative to its prefill, than on the GPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flatcake.loadgen import models
from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.vllm import VLLMServer

# The slice's model (loadgen/serve/model.py defaults) and shapes that keep its FLOPs but hold more KV.
SHAPES: dict[str, dict[str, int]] = {
    "slice": {},
    "mha": {"kv_heads": 10},  # every query head has its own KV head: 5x the KV, the same attention
    "mha-small-mlp": {"kv_heads": 10, "intermediate": 640},  # and 0.4x the MLP's FLOPs
}
PROMPTS = (1024, 4096)  # cold prompt lengths: the slope between them is the prefill's cost per token


def where_here(shape: str) -> str:
    """The ``where`` of ``shape``'s row measured on this machine (how readers of the JSON find it)."""
    return f"this machine, {shape}"


def ratio(kv_bytes_per_token: float, read_bytes_per_s: float, prefill_s_per_token: float) -> float:
    """Seconds restoring a token's KV takes per second of prefilling it."""
    return kv_bytes_per_token / read_bytes_per_s / prefill_s_per_token


def gpu_reference(preset: str, gpu: str, read_bytes_per_s: float, tokens: int = 4096) -> dict[str, Any]:
    """The ratio on a GPU deployment: ``preset``'s KV (all ranks: one node's storage serves them all) and its
    modelled prefill of ``tokens`` on ``gpu``, restored at ``read_bytes_per_s``."""
    p = models.preset(preset)
    ranks = p.calibration(gpu)["ranks"]
    assert isinstance(ranks, int)
    kv = p.kv_bytes_per_token * (1 if p.mla else ranks)
    per_token = p.prefill_s(tokens, gpu=gpu) / tokens
    return {"where": f"{preset} on {gpu}", "kv_bytes_per_token": kv, "prefill_s_per_token": per_token,
            "read_bytes_per_s": read_bytes_per_s, "tokens": tokens,
            "restore_over_prefill": ratio(kv, read_bytes_per_s, per_token)}  # fmt: skip


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer, from the generated model's config.json (bfloat16)."""
    c = json.loads((model_dir / "config.json").read_text())
    return 2 * int(c["num_hidden_layers"]) * int(c["num_key_value_heads"]) * int(c["head_dim"]) * 2


def measure(shape: str, workdir: Path, read_bytes_per_s: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ratio on this machine for ``shape``: cold prefills of ``PROMPTS`` tokens in a real vLLM server."""
    given = SHAPES[shape]
    model = make_model(workdir / shape / "model", kv_heads=given.get("kv_heads", 2),
                       intermediate=given.get("intermediate"))  # fmt: skip
    kv = kv_bytes_per_token(model)
    ttft: dict[int, float] = {}
    with VLLMServer(model, workdir=workdir / shape / "vllm") as server:
        server.complete("warm up " * 50, max_tokens=1)
        for n in PROMPTS:  # token ids no other prompt shares: nothing cached
            prompt = [5 + (i * 7919 + n) % 8000 for i in range(n)]
            started = time.monotonic()
            server.complete(prompt, max_tokens=1)
            ttft[n] = time.monotonic() - started
    short, long = PROMPTS
    per_token = (ttft[long] - ttft[short]) / (long - short)
    if per_token <= 0:
        raise RuntimeError(f"{shape}: a {long}-token prefill took no longer than a {short}-token one ({ttft})")
    row = {"where": where_here(shape), "shape": SHAPES[shape], "kv_bytes_per_token": kv,
           "ttft_s": {str(n): t for n, t in ttft.items()}, "prefill_s_per_token": per_token,
           "read_bytes_per_s": read_bytes_per_s,
           "restore_over_prefill": ratio(kv, read_bytes_per_s, per_token)}  # fmt: skip
    log(f"  {shape}: {kv} B of KV a token, {per_token * 1e3:.3f} ms a token of prefill")
    return row


def calibrate(out: Path, *, here_read_bytes_per_s: float, gpu_read_bytes_per_s: float,
              preset: str = "llama3-70b-tp4", gpu: str = "h200", shapes: Mapping[str, Any] = SHAPES,
              log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Measure every shape, compare each with the GPU reference; ``out/serve-calibration.json``."""
    out.mkdir(parents=True, exist_ok=True)
    reference = gpu_reference(preset, gpu, gpu_read_bytes_per_s)
    rows = [measure(s, out, here_read_bytes_per_s, log) for s in shapes]
    for row in rows:
        row["factor"] = reference["restore_over_prefill"] / row["restore_over_prefill"]
    note = "factor: how many times cheaper a restore is here, next to its prefill, than on the GPU"
    report = {"reference": reference, "here": rows, "note": note}
    (out / "serve-calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
