"""``python -m flatcake`` as a user runs it: a bad argument is one line on stderr naming the option and
what was expected, exit 2, no traceback, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import flatcake

pytestmark = pytest.mark.integration

TRACE = '{"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [1]}\n'


def flatcake_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flatcake", *argv], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


def test_version() -> None:
    run = flatcake_cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"flatcake {flatcake.__version__}"


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("http://x", "--host: 'http://x' is not an address to listen on; expected an IP address or a name"),
        ("", "--host: '' is not an address to listen on"),
        ("a:b:c", "--host: 'a:b:c' is neither an IP address nor a name this machine resolves (e.g. 127.0.0.1"),
    ],
)
def test_emulate_bad_host(tmp_path: Path, host: str, said: str) -> None:
    data = tmp_path / "emu"
    run = flatcake_cli("emulate", "--host", host, "--port", "0", "--data-dir", str(data))
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"flatcake: error: {said}"), run.stderr
    assert "Traceback" not in run.stderr and not data.exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--host", "a:b:c"],
            "--host: 'a:b:c' is not a base URL; expected http://HOST:PORT, e.g. http://127.0.0.1:8000",
        ),
        (["--host", ""], "--host: '' is not a base URL; expected http://HOST:PORT"),
        (["--host", "http://[::1:8000"], "--host: 'http://[::1:8000' is not a base URL; expected http://HOST:PORT"),
        (["--host", "http://127.0.0.1:99999"], "--host: 'http://127.0.0.1:99999' is not a base URL"),
        (["--host", "http://no-such-host.invalid:8000"], "--host: cannot resolve 'no-such-host.invalid'"),
        (["--qps", "0"], "--qps: 0 must be > 0"),
        (["--trace", "missing.jsonl"], "--trace: 'missing.jsonl' is not a file"),
    ],
)
def test_loadgen_run_bad_arguments(tmp_path: Path, argv: list[str], said: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    given = {"--host": "http://127.0.0.1:1", "--trace": str(trace), "--qps": "1"}
    given.update(zip(argv[::2], argv[1::2], strict=True))
    results = tmp_path / "out" / "results.jsonl"
    run = flatcake_cli("loadgen", "run", *[x for kv in given.items() for x in kv], "--results", str(results))
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"flatcake: error: {said}"), run.stderr
    assert not results.parent.exists()


def test_loadgen_bench_checks_its_target_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = flatcake_cli("loadgen", "bench", "--role", "master", "--target", "a:b:c", "--trace", "missing.jsonl",
                       "--results", str(out), "--qps", "1", "--system", "x")  # fmt: skip
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "flatcake: error: --host: 'a:b:c' is not a base URL; expected http://HOST:PORT, e.g. http://127.0.0.1:8000"
    ]
    assert not out.exists()


def test_argparse_errors_have_no_traceback(tmp_path: Path) -> None:
    run = flatcake_cli("emulate", "--port", "99999", "--data-dir", str(tmp_path / "emu"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert (
        run.stderr.splitlines()[-1]
        == "flatcake emulate: error: argument --port: '99999' is not a TCP port (0..65535; 0 picks a free one)"
    )


def test_emulate_page_size_that_direct_io_cannot_read_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "emu"
    run = flatcake_cli("emulate", "--page-tokens", "16", "--port", "0", "--data-dir", str(data))
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("flatcake: error: page_tokens x bytes_per_token_layer (16 x 64) must be a multiple "
                               "of 4096"), run.stderr  # fmt: skip
    assert not data.exists()


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path: Path) -> None:
    """``flatcake operator render cache.yaml | head -0``: the reader closes the pipe before the command
    writes; the command stops without an error line (exit 141, as Unix tools end on SIGPIPE)."""
    cache = tmp_path / "cache.yaml"
    cache.write_text(
        "apiVersion: flatcake.io/v1alpha1\nkind: FlatCakeCache\nmetadata: {name: kv}\n"
        "spec: {ssd: {directory: /mnt/kv}, kv: {layers: 80, pageBytes: 65536, pageTokens: 64}}\n"
    )
    proc = subprocess.Popen([sys.executable, "-m", "flatcake", "operator", "render", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before a line is written (the command is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and err == "", err
