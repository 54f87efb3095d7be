"""One measurement per process, for the benches that compare storage systems (context, peers).

Each system runs in a fresh Python process, so one system's page cache use, threads and memory
high-water mark do not colour the next. The orchestrator (``run``) sends a JSON job on the worker's
stdin; the worker (``main``, a bench module's ``__main__``) prints one JSON line, ``{"ran": false,
"why_not": ...}`` when the measurement raised, so the orchestrator reports it and goes on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def config(cls: type[C], fields: dict[str, Any]) -> C:
    """A frozen config dataclass rebuilt from its ``dataclasses.asdict`` (JSON made its tuples lists)."""
    return cls(**{name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()})


def main(measure: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The worker: ``measure`` the job read from stdin and print its result as one JSON line."""
    job = json.loads(sys.stdin.read())
    try:
        result = measure(job)
    except Exception as exc:  # a process boundary: the orchestrator reports it and goes on
        result = {"ran": False, "why_not": f"{exc.__class__.__name__}: {exc}"}
    print(json.dumps(result))
    return 0


def run(module: str, directory: Path, job: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    """The orchestrator's side: run ``python -m module`` on ``job`` in a fresh, then removed,
    ``directory`` (passed as ``job["directory"]``); its result, or why it has none."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        return call(module, {**job, "directory": str(directory.resolve())}, timeout=timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def call(module: str, job: dict[str, Any], timeout: float = 3600, prefix: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``python -m module`` on ``job`` (under ``prefix``, e.g. ``ip netns exec NS``); its result, or why
    it has none."""
    try:
        proc = subprocess.run([*prefix, sys.executable, "-m", module], input=json.dumps(job), capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ran": False, "why_not": f"worker ran past {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"ran": False, "why_not": f"worker exited {proc.returncode}: {' | '.join(tail)}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result
