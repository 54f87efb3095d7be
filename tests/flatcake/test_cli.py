"""The command line as a new user meets it: defaults in --help, --version, errors as one line (no
traceback, no half-drawn progress bar), and a bad --host that says what was expected."""

from __future__ import annotations

import pytest

import flatcake
from flatcake import cli
from flatcake.cli import common
from flatcake.cli import trace as trace_cli
from flatcake.errors import ConfigError

pytestmark = pytest.mark.unit


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(["emulate"], capsys)
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: flatcake)", "(default: .flatcake-emulator)",
                  "(default: 16777216)"):  # fmt: skip
        assert shown in text, shown
    assert "(default: 64)" in help_of(["loadgen", "run"], capsys)
    assert "(default: results/e2e)" in help_of(["bench", "e2e"], capsys)


def test_emulator_sizes_take_units_as_simulate_does(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["emulate", "--hbm-bytes", "1GiB", "--dram-bytes", "0", "--ssd-bytes", "4TB"])
    assert (args.hbm_bytes, args.dram_bytes, args.ssd_bytes) == (1 << 30, 0, 4 * 10**12)
    assert cli.build_parser().parse_args(["emulate", "--scope-file-bytes", "65536"]).scope_file_bytes == 65536
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["emulate", "--hbm-bytes", "lots"])
    assert "--hbm-bytes: 'lots' is not a size; write e.g. 1TiB" in capsys.readouterr().err


def test_the_emulators_help_shows_its_configs_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI reads EmulatorConfig's defaults (no copy to keep in step)."""
    from flatcake.loadgen.emulator.config import EmulatorConfig

    with pytest.raises(SystemExit):
        cli.main(["emulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"--hbm-bytes HBM_BYTES a size, e.g. 64GiB or a byte count (default: {EmulatorConfig().hbm_bytes})" in out
    assert f"(default: {EmulatorConfig().prefill_tokens_per_s})" in out


def test_the_api_choices_are_the_load_generators() -> None:
    from flatcake.loadgen.replay.requests import APIS

    assert list(APIS) == common.API_CHOICES


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"flatcake {flatcake.__version__}"


def test_a_bad_host_says_what_was_expected(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["loadgen", "run", "--host", "127.0.0.1:8000", "--trace", "t.jsonl", "--qps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "flatcake: error: --host: '127.0.0.1:8000' is not a base URL; expected http://HOST:PORT, e.g. http://127.0.0.1:8000"
    )


def test_errors_are_one_line_after_a_progress_bar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from tqdm import tqdm

    def failing(args: object) -> int:
        bar = tqdm(total=10, file=sys.stderr)
        bar.update(3)
        raise ConfigError("trace: not a trace (give a JSONL file)")

    monkeypatch.setattr(trace_cli, "_trace_stats", failing)
    assert cli.main(["trace", "stats", "x.jsonl"]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "flatcake: error: trace: not a trace (give a JSONL file)"  # a line of its own
    assert "Traceback" not in err


def test_an_internal_error_is_one_line_unless_verbose(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: object) -> int:
        raise KeyError("slot")

    monkeypatch.setattr(trace_cli, "_trace_stats", broken)
    assert cli.main(["trace", "stats", "x.jsonl"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "flatcake: error: KeyError: 'slot' (internal error; run with -v for the traceback)"
    with pytest.raises(KeyError):
        cli.main(["-v", "trace", "stats", "x.jsonl"])


def test_services_say_what_they_serve_at_info_and_one_shot_commands_stay_quiet() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["agent", "serve", "--config", "engine.json"]).service is True
    assert parse(["emulate"]).service is True
    assert not getattr(parse(["trace", "stats", "t.jsonl"]), "service", False)
    assert not getattr(parse(["bench", "e2e"]), "service", False)


def test_one_spelling_per_flag_the_old_ones_still_read() -> None:
    """loadgen bench names its endpoint --host as loadgen run does (--target still read), and takes
    --qps comma-separated as every other command does (one rate per word still read)."""
    parse = cli.build_parser().parse_args
    base = ["loadgen", "bench", "--role", "master", "--trace", "t", "--results", "r", "--system", "s"]
    new = parse([*base, "--host", "http://127.0.0.1:8000", "--qps", "1,2", "4"])
    old = parse([*base, "--target", "http://127.0.0.1:8000", "--qps", "1", "2", "4"])
    assert new.target == old.target == "http://127.0.0.1:8000"
    assert [q for rates in new.qps for q in rates] == [q for rates in old.qps for q in rates] == [1.0, 2.0, 4.0]
    # loadgen staging is the command's name (one meaning of "bench": flatcake bench X); bench still runs it.
    staging = parse(["loadgen", "staging", *base[2:], "--host", "http://127.0.0.1:8000", "--qps", "1,2,4"])
    assert staging.func is new.func and staging.target == new.target
