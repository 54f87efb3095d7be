"""CONTRIBUTING.md's layer line, generated from the import-linter contract that checks it (pyproject.toml),
so the line a contributor reads is the rule ``bin/test`` enforces."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN = "<!-- begin generated: devtools.layers.markdown -->"
END = "<!-- end generated -->"


def node_agent_layers(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The node agent's layers, top first, as the contract lists them."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers" and c["containers"] == ["flatcake.node_agent"]]
    return list(layers)


def markdown() -> str:
    return "```\n" + " > ".join(node_agent_layers()) + "\n```"
