"""A real SGLang 0.5.23 server with HiCache on the CPU, as a context manager.

``SGLangServer`` starts ``python -m sglang.launch_server`` from the SGLang server venv
(``requirements/sglang-server.txt``; ``$FLATCAKE_SGLANG_PYTHON``, default ``.venv/sglang-server``) in its
own process group, with ``--device cpu --attention-backend torch_native``, HiCache (``--hicache-io-backend
direct``, the given ``--hicache-mem-layout``) and an L3 storage backend, and waits until
``/health_generate`` answers (a one-token generation through the scheduler). The server's
``PYTHONPATH`` holds ``sglang_cpu/`` (the CPU compatibility layer: its ``sitecustomize`` patches the
server and the scheduler and detokenizer processes it spawns) and this source tree as ``flatcake``, so
``--hicache-storage-backend dynamic`` can load ``flatcake.node_agent.sglang.FlatCakeStorage``.

    with SGLangServer(make_model(tmp / "model"), workdir=tmp / "sglang") as server:
        server.warm_up()
        cold = server.generate(input_ids=prompt)
        server.wait_backed_up(len(prompt) // 64 * 64)
        server.flush_cache()                     # device and host tiers emptied; L3 keeps the pages
        warm = server.generate(input_ids=prompt) # warm.cached_storage == 1984 of 2048 (31 pages)

Numerics: greedy logprobs of a prompt restored from L3 equal, bit for bit, those of the same prompt
computed cold. That needs kernels whose results do not depend on the shapes: oneDNN's AMX bf16 kernels
(Sapphire Rapids and later) make extending a cached prefix differ from a whole prefill in the fifth
digit, from the device tier as from storage and with SGLang's own file backend (measured), so the
server runs with oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, ``DETERMINISTIC_ENV``;
a cap, so a CPU without AVX-512 is unaffected; an ``ONEDNN_MAX_CPU_ISA`` already set wins). The first
request a fresh server decodes may differ by ~1e-2 from its fourth output token on (seen on 3 of 5
fresh servers); ``warm_up`` spends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from flatcake.net import free_port

ROOT = Path(__file__).resolve().parents[2]  # the source tree (loadgen/serve/server.py)
COMPAT_DIR = Path(__file__).resolve().parent / "sglang_cpu"
PYTHON_ENV = "FLATCAKE_SGLANG_PYTHON"
DEFAULT_PYTHON = ROOT / ".venv" / "sglang-server" / "bin" / "python"
LAYOUTS = ("layer_first", "page_first_direct")  # what --hicache-io-backend direct moves (pool_host/mha.py)
BACKUP_METRIC = "sglang:backuped_tokens_total"
DETERMINISTIC_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}  # no AMX: results independent of the shapes


def server_python() -> Path:
    """The SGLang server venv's interpreter: ``$FLATCAKE_SGLANG_PYTHON``, else ``.venv/sglang-server``."""
    path = Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    if not path.exists():
        raise FileNotFoundError(
            f"no SGLang server venv at {path}: build one as requirements/sglang-server.txt says, "
            f"or point ${PYTHON_ENV} at its bin/python"
        )
    return path


def flatcake_import_root(directory: Path) -> Path:
    """A folder that makes ``import flatcake`` work with plain ``PYTHONPATH``, in another venv.

    In a source tree the folders map to import names through ``[tool.setuptools] package-dir``
    (``node_agent/`` is ``flatcake.node_agent``; the editable install's finder does it in ``.venv``), so a
    tree of symlinks is built under ``directory`` from that mapping, as ``bin/typecheck-tree`` does. An
    installed (non-editable) flatcake already has that layout: its parent folder is returned."""
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        import flatcake

        return Path(flatcake.__file__).resolve().parent.parent
    mapping: dict[str, str] = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    top = directory / "flatcake"
    top.mkdir(parents=True, exist_ok=True)
    for name, folder in sorted(mapping.items()):
        if name == "flatcake":
            links = [(top / item.name, item) for item in (ROOT / folder).iterdir() if item.suffix == ".py"]
        else:
            links = [(directory.joinpath(*name.split(".")), ROOT / folder)]
        for link, target in links:
            if link.is_symlink() and link.resolve() == target.resolve():
                continue
            link.unlink(missing_ok=True)
            link.symlink_to(target, target_is_directory=target.is_dir())
    return directory


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux ``/proc``; 0 for one that is gone)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return total


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (a server and the scheduler and detokenizer it spawned)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


@dataclass(frozen=True)
class Generation:
    """One ``/generate`` answer: greedy output, its logprobs, and where the prompt's cached tokens came from."""

    output_ids: list[int]
    logprobs: list[float]  # output_token_logprobs, one per output token
    prompt_logprobs: list[float | None]  # input_token_logprobs from logprob_start_len on (empty if not asked)
    cached_tokens: int  # meta_info.cached_tokens: prompt tokens not computed
    cached_device: int  # meta_info.cached_tokens_details (absent when nothing was cached: all 0)
    cached_host: int
    cached_storage: int | None  # None: the server has no L3 storage backend
    storage_backend: str | None  # the backend's class name (HiCacheFile, FlatCakeStorage, ...)
    prompt_tokens: int
    text: str
    meta_info: dict[str, Any] = field(repr=False)

    @classmethod
    def parse(cls, answer: Mapping[str, Any]) -> Generation:
        meta: dict[str, Any] = dict(answer["meta_info"])
        pairs = meta.get("output_token_logprobs") or []  # [logprob, token id, text or None] per token
        details: Mapping[str, Any] = meta.get("cached_tokens_details") or {}
        return cls(
            output_ids=[int(p[1]) for p in pairs] or list(answer.get("output_ids") or []),
            logprobs=[float(p[0]) for p in pairs],
            prompt_logprobs=[None if p[0] is None else float(p[0]) for p in meta.get("input_token_logprobs") or []],
            cached_tokens=int(meta.get("cached_tokens", 0)),
            cached_device=int(details.get("device", 0)),
            cached_host=int(details.get("host", 0)),
            cached_storage=None if details.get("storage") is None else int(details["storage"]),
            storage_backend=details.get("storage_backend"),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            text=str(answer.get("text", "")),
            meta_info=meta,
        )


class ServerError(RuntimeError):
    """The server did not start, died, or refused a request; the message ends with its log's tail."""


class ServerProcess:
    """A serving engine's server as a child process group: started, waited for until its health endpoint
    answers (while its log grows), asked over HTTP, stopped. Subclasses give the command and environment."""

    NAME = "server"
    HEALTH = "/health"

    def __init__(self, model_dir: Path, *, workdir: Path, port: int | None, extra_args: Sequence[str],
                 env: Mapping[str, str] | None, python: Path, start_timeout_s: float,
                 stall_timeout_s: float) -> None:  # fmt: skip
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.python = Path(python)
        self.start_timeout_s = start_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.log_path = self.workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds = 0.0

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """Folders the server needs before it starts."""
        self.workdir.mkdir(parents=True, exist_ok=True)

    def start(self) -> Self:
        self.prepare()
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, env=self.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _wait_ready(self, started: float) -> None:
        """Poll the health endpoint while the log grows; give up when it stalls or the process exits."""
        size, progressed = -1, time.monotonic()
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerError(f"the {self.NAME} server exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.HEALTH, timeout=30) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            now = time.monotonic()
            grown = self.log_path.stat().st_size if self.log_path.exists() else 0
            if grown != size:
                size, progressed = grown, now
            if now - progressed > self.stall_timeout_s or now - started > self.start_timeout_s:
                raise ServerError(f"the {self.NAME} server was not ready after {now - started:.0f} s (log silent "
                                  f"for {now - progressed:.0f} s)\n{self.log_tail()}")  # fmt: skip
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group (its engine's processes too), SIGKILL after 30 s."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)

    def cpu_seconds(self) -> float:
        """CPU seconds the server's processes (its process group) have used so far."""
        return cpu_seconds(group_pids(self.proc.pid)) if self.proc is not None else 0.0

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no server log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(["--- server log tail:", *text[-lines:]])

    def _request(self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float = 600.0) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                payload: bytes = reply.read()
                return payload
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ServerError(f"{path}: HTTP {exc.code}: {detail}\n{self.log_tail(20)}") from None


class SGLangServer(ServerProcess):
    """``python -m sglang.launch_server`` on the CPU with HiCache and an L3 backend; see the module doc.

    ``storage_backend``: ``"file"`` (SGLang's HiCacheFile, in ``file_dir``, default ``workdir/hicache``),
    ``"dynamic"`` (``storage_config`` names the class: FlatCake's is ``module_path``
    ``flatcake.node_agent.sglang``, ``class_name`` ``FlatCakeStorage``, ``socket``), any other SGLang
    backend name, or None for HiCache without L3. ``storage_config`` becomes
    ``--hicache-storage-backend-extra-config``. The device pool holds ``max_total_tokens`` tokens and the
    host pool ``hicache_ratio`` times that (SGLang's defaults size both from this machine's RAM).
    ``prefetch_policy`` ``wait_complete`` makes an L3 hit whole however slow the restore (SGLang's
    default, ``timeout``, may cut it short).

    ``linker_config`` runs the unified-cache external linker instead of HiCache (SGLang makes them exclusive):
    ``--enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic`` with this
    ``--unified-cache-external-linker-config`` (FlatCake's: ``linker`` ``FlatCakeLinker``,
    ``linker_module_path`` ``flatcake.node_agent.sglang.linker``, ``linker_extra_config``); no host tier, so
    ``storage_backend`` must be None. ``extra_paths`` go on the server's ``PYTHONPATH`` after this tree.
    """

    NAME = "SGLang"
    HEALTH = "/health_generate"

    def __init__(
        self,
        model_dir: Path,
        *,
        workdir: Path,
        port: int | None = None,
        mem_layout: str = "layer_first",
        storage_backend: str | None = "file",
        storage_config: Mapping[str, Any] | None = None,
        file_dir: Path | None = None,
        page_size: int = 64,
        max_total_tokens: int = 32_768,
        hicache_ratio: float = 2.0,
        prefetch_policy: str = "wait_complete",
        linker_config: Mapping[str, Any] | None = None,
        extra_paths: Sequence[Path] = (),
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: Path | None = None,
        start_timeout_s: float = 900.0,
        stall_timeout_s: float = 240.0,
    ) -> None:
        if mem_layout not in LAYOUTS:
            raise ValueError(f"mem_layout {mem_layout!r}: one of {LAYOUTS}")
        super().__init__(model_dir, workdir=workdir, port=port, extra_args=extra_args, env=env,
                         python=Path(python) if python else server_python(), start_timeout_s=start_timeout_s,
                         stall_timeout_s=stall_timeout_s)  # fmt: skip
        self.mem_layout = mem_layout
        self.storage_backend = storage_backend
        self.storage_config = dict(storage_config or {})
        self.file_dir = Path(file_dir) if file_dir else self.workdir / "hicache"
        self.page_size = page_size
        self.max_total_tokens = max_total_tokens
        self.hicache_ratio = hicache_ratio
        self.prefetch_policy = prefetch_policy
        if linker_config is not None and storage_backend is not None:
            raise ValueError("linker_config: SGLang runs the linker without HiCache; pass storage_backend=None")
        self.linker_config = dict(linker_config) if linker_config is not None else None
        self.extra_paths = [Path(p) for p in extra_paths]

    # --- process ------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        args = [
            str(self.python), "-m", "sglang.launch_server",
            "--model-path", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--attention-backend", "torch_native", "--page-size", str(self.page_size),
            "--max-total-tokens", str(self.max_total_tokens), "--enable-metrics", "--sleep-on-idle",
        ]  # fmt: skip
        if self.linker_config is not None:
            return [*args, "--enable-unified-cache-external-linker", "--unified-cache-external-linker-backend",
                    "dynamic", "--unified-cache-external-linker-config", json.dumps(self.linker_config),
                    *self.extra_args]  # fmt: skip
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(self.hicache_ratio),
                 "--hicache-io-backend", "direct", "--hicache-mem-layout", self.mem_layout]  # fmt: skip
        if self.storage_backend:
            args += ["--hicache-storage-backend", self.storage_backend,
                     "--hicache-storage-prefetch-policy", self.prefetch_policy]  # fmt: skip
            if self.storage_config:
                args += ["--hicache-storage-backend-extra-config", json.dumps(self.storage_config)]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        paths = [str(COMPAT_DIR), str(flatcake_import_root(self.workdir / "pythonpath")), *map(str, self.extra_paths)]
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONSAFEPATH="1",  # the working directory is not on sys.path
            SGLANG_USE_CPU_ENGINE="1",
            HF_HUB_OFFLINE="1",
            SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(self.file_dir),
        )
        for name, value in DETERMINISTIC_ENV.items():
            env.setdefault(name, value)
        env.update(self.extra_env)
        return env

    def prepare(self) -> None:
        super().prepare()
        self.file_dir.mkdir(parents=True, exist_ok=True)

    # --- requests -----------------------------------------------------------------------------------

    def generate(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        max_new_tokens: int = 8,
        return_logprob: bool = True,
        temperature: float = 0.0,
        timeout_s: float = 600.0,
        logprob_start_len: int | None = None,
    ) -> Generation:
        """``/generate`` (greedy by default) for ``text`` or ``input_ids``. ``logprob_start_len``: also the
        prompt's logprobs from that token on (SGLang matches a cached prefix only up to it, so the tokens
        after it are computed, over whatever KV came before)."""
        if (text is None) == (input_ids is None):
            raise ValueError("generate: give exactly one of text and input_ids")
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
            "return_logprob": return_logprob,
        }
        if logprob_start_len is not None:
            body["logprob_start_len"] = int(logprob_start_len)
        if text is not None:
            body["text"] = text
        else:
            body["input_ids"] = [int(t) for t in input_ids or ()]
        return Generation.parse(json.loads(self._request("/generate", body, timeout_s)))

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Empty the device and host tiers (the radix tree); L3 storage keeps its pages. SGLang refuses while
        requests run, so this retries until ``timeout_s``. Pages still queued for L3 are dropped: call
        ``wait_backed_up`` first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("/flush_cache", {})
                return
            except ServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def backed_up_tokens(self) -> int:
        """Tokens HiCache has written to L3 storage so far (``sglang:backuped_tokens_total``)."""
        total = 0.0
        for line in self._request("/metrics").decode().splitlines():
            if line.startswith(BACKUP_METRIC):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def wait_backed_up(self, tokens: int, timeout_s: float = 120.0) -> int:
        """Wait until at least ``tokens`` tokens have been written to L3 since the server started. Pages L3
        already holds (from an earlier server on the same storage) are not written again, so not counted."""
        deadline = time.monotonic() + timeout_s
        while (done := self.backed_up_tokens()) < tokens:
            if time.monotonic() > deadline:
                raise ServerError(f"only {done} of {tokens} tokens reached L3 storage in {timeout_s:.0f} s")
            time.sleep(0.1)
        return done

    def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(self._request("/model_info"))
        return info

    def warm_up(self, tokens: int = 2048, seed: int = 1 << 20) -> None:
        """One request of ``tokens`` seeded prompt tokens, then ``flush_cache``: a fresh server's first
        decode may round differently (see the module doc); the prompt differs from any a test sends."""
        vocab = int(json.loads((self.model_dir / "config.json").read_text())["vocab_size"])
        rng = random.Random(seed)
        self.generate(input_ids=[rng.randrange(3, vocab) for _ in range(tokens)], max_new_tokens=8)
        self.flush_cache()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m flatcake.loadgen.serve.server MODEL_DIR WORKDIR [--layout L] [--backend B]``: start a
    server and keep it up until interrupted (for trying things by hand)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--layout", default="layer_first", choices=LAYOUTS)
    parser.add_argument("--backend", default="file")
    parser.add_argument("--config", default="{}", help="storage backend extra config (JSON)")
    a = parser.parse_args(argv)
    server = SGLangServer(a.model_dir, workdir=a.workdir, port=a.port or None, mem_layout=a.layout,
                          storage_backend=a.backend or None, storage_config=json.loads(a.config))  # fmt: skip
    with server:
        print(f"{server.url} ready in {server.start_seconds:.1f} s; log {server.log_path}", file=sys.stderr)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
