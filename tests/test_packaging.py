"""The image's runtime pins (requirements/runtime.txt) agree with the development lock."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "-")):
            name, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def test_runtime_pins_are_the_locks_and_cover_the_dependencies() -> None:
    lock, runtime = pins(ROOT / "requirements/lock.txt"), pins(ROOT / "requirements/runtime.txt")
    assert {n: v for n, v in runtime.items() if lock.get(n) != v} == {}, "runtime.txt differs from lock.txt"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0]).lower() for d in deps}
    assert names <= runtime.keys(), names - runtime.keys()
    assert not {"mypy", "ruff", "hypothesis", "kmock"} & runtime.keys()  # test tools stay out of the image
    assert "requirements/runtime.txt" in (ROOT / "Dockerfile").read_text()
