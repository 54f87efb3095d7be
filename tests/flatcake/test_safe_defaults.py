"""Safe defaults: an empty agent config starts nothing, the agent's HTTP stays on loopback unless
configured (the operator passes the pod's IP), and ``flatcake emulate`` checks its arguments and binds
before it makes a pool, leaving nothing behind when a start fails."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.errors import ConfigError
from flatcake.node_agent.config import REQUIRED, AgentConfig, EngineConfig, missing_required
from flatcake.operator import render
from flatcake.operator.spec import parse_spec
from tests.support.kube_api import admit


@pytest.mark.unit
def test_an_empty_agent_config_names_every_required_field(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    path.write_text("{}")
    with pytest.raises(ConfigError) as caught:
        EngineConfig.load(path)
    for name in REQUIRED:
        assert name in str(caught.value)
    assert {"layers", "page_bytes", "page_tokens", "dram.bytes", "ssd.dir", "ssd.file_bytes", "ssd.file_count"} == set(
        REQUIRED
    )
    path.write_text(json.dumps(EngineConfig().to_dict()))
    assert EngineConfig.load(path) == EngineConfig()  # everything given: loads


@pytest.mark.unit
def test_agent_serve_with_an_empty_config_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "engine.json"
    path.write_text("{}")
    assert main(["agent", "serve", "--config", str(path)]) == ConfigError.exit_code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "required field(s) missing: layers" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.json"]


@pytest.mark.unit
def test_agent_http_is_on_loopback_unless_configured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert AgentConfig().metrics_host == "127.0.0.1"
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(EngineConfig().to_dict()))
    # In a pod, "$(POD_IP)" reaches the agent unexpanded when the env lacks POD_IP: said plainly.
    assert main(["agent", "serve", "--config", str(path), "--metrics-host", "$(POD_IP)"]) == ConfigError.exit_code
    assert "--metrics-host: '$(POD_IP)' is not an IP address" in capsys.readouterr().err
    # Nothing listens for other nodes unless configured; --listen-host without cluster.listen is refused.
    assert AgentConfig().socket and not EngineConfig().cluster.listen
    assert main(["agent", "serve", "--config", str(path), "--listen-host", "10.0.0.1"]) == ConfigError.exit_code
    assert "--listen-host: the configuration has no cluster.listen" in capsys.readouterr().err


@pytest.mark.unit
def test_the_operator_binds_each_agent_to_its_pod_ip() -> None:
    parsed = parse_spec(
        admit(
            "flatcake.io",
            "flatcakecaches",
            {"spec": {"ssd": {"directory": "/data/kv"}, "kv": {"layers": 43, "pageBytes": 12288}}},
        )["spec"]
    )
    cache = render.Cache("main", "kv", "uid-1")
    config = render.engine_config(parsed, cache)
    assert missing_required(config) == []  # what the operator renders, the agent's load() accepts
    agent = render.daemon_set(parsed, cache, config)["spec"]["template"]["spec"]["containers"][0]
    command = agent["command"]
    assert command[command.index("--metrics-host") + 1] == "$(POD_IP)"
    pod_ip = next(e for e in agent["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.integration
def test_emulate_checks_arguments_before_making_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "emu"
    with pytest.raises(SystemExit) as exited:
        main(["emulate", "--port", "99999", "--data-dir", str(data)])
    assert exited.value.code == 2 and "--port: '99999' is not a TCP port" in capsys.readouterr().err
    assert main(["emulate", "--port", "0", "--data-dir", str(data), "--ssd-bytes", "0"]) == ConfigError.exit_code
    assert "ssd_bytes: 0 must be a positive integer" in capsys.readouterr().err
    assert main(["emulate", "--host", "no-such-host.invalid", "--port", "0", "--data-dir", str(data)]) == 2
    assert "--host: 'no-such-host.invalid' is neither an IP address" in capsys.readouterr().err
    assert not data.exists()


@pytest.mark.integration
def test_emulate_binds_before_making_pools_and_cleans_up_a_failed_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "emu"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["emulate", "--port", str(port), "--data-dir", str(data)]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and "Traceback" not in err
    assert not data.exists()  # the port was taken: no pool was made
    # Bound, then the pools fail (no agent at the socket): what the start made is removed.
    code = main(["emulate", "--port", "0", "--data-dir", str(data), "--agent-socket", str(tmp_path / "none.sock")])
    assert code != 0 and "cannot reach the flatcake agent" in capsys.readouterr().err
    assert not data.exists()
