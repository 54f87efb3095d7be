"""The error family: one wire code and one exit code per meaning, mapped back by the client and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatcake import errors as E
from flatcake.cli import main
from flatcake.node_agent.service.client import _error

pytestmark = pytest.mark.unit

FAMILY = [E.ConfigError, E.CapacityError, E.PoolFullError, E.NotFoundError, E.UnknownKeyError,
          E.UnknownHandleError, E.StorageIOError, E.StorageWriteError, E.FencedError, E.PrepareError]  # fmt: skip


def test_each_meaning_has_its_own_exit_code_and_every_code_maps_back() -> None:
    meanings = [E.ConfigError, E.ProtocolError, E.CapacityError, E.NotFoundError, E.StorageIOError,
                E.FencedError, E.PrepareError]  # fmt: skip
    exits = [cls.exit_code for cls in meanings]
    assert len(set(exits)) == len(exits) and 1 not in exits  # 1 stays "a bug"
    codes = {cls.code for cls in FAMILY}
    for code in codes:
        cls = E.by_code(code)
        assert cls is not None and cls.code == code
    assert E.by_code("unknown_handle") is E.UnknownHandleError
    assert E.by_code("unknown_key") is E.UnknownKeyError and E.by_code("pool_full") is E.PoolFullError
    assert E.by_code("malformed") is None  # protocol-level codes stay ProtocolErrors


def test_a_subclass_elsewhere_does_not_change_what_the_wire_maps_to() -> None:
    from flatcake.operator.spec import SpecError  # a ConfigError with the same code

    assert issubclass(SpecError, E.ConfigError) and E.by_code("bad_config") is E.ConfigError


@pytest.mark.parametrize("cls", FAMILY)
def test_the_client_raises_what_the_agent_answered(cls: type[E.FlatCakeError]) -> None:
    exc = _error(cls.code, "keys[3]: 'x' is not stored")
    assert isinstance(exc, E.FlatCakeError) and exc.code == cls.code
    assert "keys[3]" in str(exc)


def test_protocol_codes_and_bad_args_come_back_as_themselves() -> None:
    exc = _error("not_registered", "lookup: register first")
    assert isinstance(exc, E.ProtocolError) and exc.code == "not_registered"
    assert type(_error("bad_args", "hints: must be a map")) is ValueError


def test_the_cli_exits_with_the_errors_code_and_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"ssd": {"low_watermark": 0.95, "high_watermark": 0.9}}))
    assert main(["agent", "prepare", "--config", str(config), "--dry-run"]) == E.ConfigError.exit_code
    err = capsys.readouterr().err
    assert "ssd.low_watermark/high_watermark" in err and "0 < low <= high <= 1" in err
