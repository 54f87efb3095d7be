"""One registry of benchmark system names (loadgen/names.py): each bench runs what it says it runs, a
name means one thing, and earlier spellings still work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from flatcake.errors import ConfigError
from flatcake.loadgen import names
from flatcake.loadgen.bench import context, e2e, peers
from flatcake.loadgen.simulate import systems as simulated

pytestmark = pytest.mark.unit


def test_each_bench_runs_the_registrys_names() -> None:
    assert names.names("peers") == peers.PEERS
    assert names.names("e2e") == e2e.SYSTEMS
    assert names.names("context") == context.SYSTEMS
    assert names.names("simulate") == simulated.SYSTEMS
    # e2e's systems each map to an emulator mode; the stored systems of context are peers' systems.
    assert all(
        e2e.EMULATE.get(s, (s, "log"))[0] in ("flatcake", "flatcake-native", "tiered", "dram", "none")
        for s in e2e.SYSTEMS
    )
    assert set(context.STORED) <= set(peers.PEERS)


def test_earlier_spellings_map_and_a_wrong_name_says_where_it_runs() -> None:
    old = ["tiered_naive", "flatcake_engine", "hicache_file"]
    assert names.resolve("peers", old) == ("tiered-naive", "flatcake-engine", "hicache-file")
    assert names.resolve("simulate", ["tiered-l3", "tiered-l2"]) == ("tiered", "dram")
    assert names.resolve("e2e", ["none"]) == ("recompute",)
    with pytest.raises(ConfigError, match=r"--systems: 'per-block' is not a system of e2e; choose from flatcake,.*"
                       r"\(per-block runs in: restore\)"):  # fmt: skip
        names.resolve("e2e", ["per-block"], "--systems")
    with pytest.raises(
        ConfigError,
        match="'nope' is not a system of simulate; choose from flatcake,flatcake-native,tiered,hicache-file,hicache-mooncake,dram$",
    ):
        names.resolve("simulate", ["nope"])


def test_names_are_unique_and_spelled_one_way() -> None:
    all_names = [s.name for s in names.REGISTRY]
    assert len(all_names) == len(set(all_names))
    assert all(n == n.lower() and "_" not in n for n in all_names)
    assert not set(names.ALIASES) & set(all_names) and set(names.ALIASES.values()) <= set(all_names)


def test_bench_serve_takes_the_systems_of_its_engine() -> None:
    from flatcake.loadgen.bench import serve

    assert names.names("serve-vllm") == ("flatcake", "vllm", "vllm-offload", "vllm-offload-disk")
    assert serve.ServeConfig(engine="vllm", systems=names.names("serve-vllm")).engine == "vllm"
    with pytest.raises(ConfigError, match="'hicache-file' is not a system of serve-vllm"):
        serve.ServeConfig(engine="vllm", systems=("hicache-file",))
    with pytest.raises(ValueError, match="engine: 'tgi' must be one of sglang, vllm"):
        serve.ServeConfig(engine="tgi")


def test_every_system_a_bench_builds_has_one_implementation_imported_only_when_used() -> None:
    built = {*names.names("restore"), *names.names("peers"), *names.names("context")} - {"recompute"}
    assert built == set(names.IMPLEMENTATIONS["system"])
    assert set(names.IMPLEMENTATIONS["l3"]) == {"hicache-file", "hicache-mooncake"}  # e2e's real L3s
    assert tuple(names.IMPLEMENTATIONS["simulate"]) == names.names("simulate")
    for role in names.IMPLEMENTATIONS.values():
        for where in role.values():
            module, _, attribute = where.partition(":")
            assert importlib.util.find_spec(module) is not None and attribute, where
    tiered = names.implementation("system", "tiered")
    assert tiered.__name__ == "TieredSystem" and names.implementation("system", "tiered_naive").__name__ == (
        "TieredNaiveSystem"
    )  # earlier spellings too
    with pytest.raises(ConfigError, match="'dram' has no l3 implementation; these do: hicache-file, hicache-mooncake"):
        names.implementation("l3", "dram")
    # The emulator's configuration (and the CLI's help) loads no system: the registry names them as strings.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, flatcake.loadgen.emulator.config, flatcake.loadgen.systems; "
         "print(sorted(m for m in sys.modules if m.startswith('flatcake.loadgen.systems.')))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert loaded == "['flatcake.loadgen.systems.hicache_rules']"


def test_the_emulators_configuration_imports_no_numpy() -> None:
    """The CLI and the operator-side tools read the emulator's configuration without the engine: no numpy
    (it loaded numpy and 44 modules through the systems and the model presets)."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, flatcake.loadgen.emulator.config; print('numpy' in sys.modules)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert loaded == "False"
