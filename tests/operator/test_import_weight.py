"""The operator loads the operator↔agent contract (config, constants), not the engine: the node
agent's public face is lazy (issue 30: importing the handlers used to load 35 node-agent modules,
numpy and msgpack)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import json, sys
import {module}
heavy = ["numpy", "msgpack", "flatcake.node_agent.datapath.engine", "flatcake.node_agent.catalog.local"]
print(json.dumps([m for m in heavy if m in sys.modules]))
"""


@pytest.mark.parametrize("module", ["flatcake.operator.handlers", "flatcake.node_agent.constants",
                                    "flatcake.node_agent.config"])  # fmt: skip
def test_importing_the_operator_or_the_contract_loads_no_engine(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert json.loads(done.stdout) == []


def test_the_face_still_gives_every_name_it_lists() -> None:
    import flatcake.node_agent as face

    for name in face.__all__:
        assert getattr(face, name) is not None, name
    assert sorted(dir(face)) == sorted(face.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        face.nope  # noqa: B018


def test_the_face_is_what_a_user_programs_against() -> None:
    """Issue 30: configuration, the engine and its restores, the client, hints and errors; the agent's
    internal decisions (placement, FC-MAS, read plans, the scope table) are reached by module path."""
    import flatcake.node_agent as face
    from flatcake import errors

    user = {"AgentConfig", "DramConfig", "EngineConfig", "IOConfig", "PlacementConfig", "SsdConfig", "Engine",
            "PutResult", "Restore", "HostRestore", "connect", "AgentConnection", "spawn", "Hints", "Key",
            "ChainSignals", "Cluster", "aligned_empty", "ThreadBuffers"}  # fmt: skip
    error_names = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.FlatCakeError)}
    assert set(face.__all__) - error_names == user
    for internal in ("ScopeTable", "Scheduler", "plan_restore", "decide", "LocalCatalog", "protocol"):
        assert not hasattr(face, internal), internal


def test_the_faces_type_checking_imports_are_its_exports() -> None:
    """The face keeps one list (``_EXPORTS``, name -> module); ``__all__`` is made from it, and the imports
    type checkers read (under TYPE_CHECKING) must name the same names from the same modules."""
    import ast
    from pathlib import Path

    import flatcake.node_agent as face

    tree = ast.parse(Path(face.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.name: imp.module for imp in guarded.body if isinstance(imp, ast.ImportFrom) for a in imp.names}
    assert typed == face._EXPORTS
    assert face.__all__ == sorted(face._EXPORTS)


def test_every_public_method_on_the_face_says_what_it_does() -> None:
    """What a user programs against is documented where they read it: each public method and property of
    the face's classes has a docstring."""
    import inspect

    import flatcake.node_agent as face

    bare = []
    for name in face.__all__:
        cls = getattr(face, name)
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for attr, value in vars(cls).items():
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if not attr.startswith("_") and callable(func) and not (func.__doc__ or "").strip():
                bare.append(f"{name}.{attr}")
    assert not bare, bare
