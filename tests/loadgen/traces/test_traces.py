from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.errors import ConfigError
from flatcake.loadgen.traces import stats as ts
from flatcake.loadgen.traces.formats import (
    MOONCAKE_TRACE,
    TraceError,
    TraceRequest,
    read_lines,
    read_trace,
    write_trace,
)
from flatcake.loadgen.traces.synth import SynthConfig, synthesize

pytestmark = pytest.mark.unit

MOONCAKE = MOONCAKE_TRACE  # the released trace, shipped xz-compressed
GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}'


def lines(*text: str) -> list[TraceRequest]:
    return list(read_lines(io.StringIO("\n".join(text) + "\n"), "t.jsonl"))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", r"t.jsonl:2: not valid JSON"),
        ("[1, 2]", r"t.jsonl:2: expected a JSON object"),
        ('{"timestamp": 0, "output_length": 5, "hash_ids": []}', r"t.jsonl:2: missing field 'input_length'"),
        ('{"timestamp": 0, "input_length": "9", "output_length": 5, "hash_ids": [1]}', r"'input_length' is str"),
        (
            '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1]}',
            r"1 hash_ids for input_length 1000",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": ["a"]}',
            r"'hash_ids' must hold integers",
        ),
        ('{"timestamp": -1, "input_length": 10, "output_length": 5, "hash_ids": [1]}', r">= 0"),
        (
            '{"format": "flatcake-trace/1", "timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
            r"missing field 'session'",
        ),
    ],
)
def test_parse_errors_name_the_line_and_field(bad: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        lines(GOOD, bad)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ('{"timestamp": NaN, "input_length": 10, "output_length": 5, "hash_ids": [1]}', "'timestamp' is nan"),
        ('{"timestamp": 1e999, "input_length": 10, "output_length": 5, "hash_ids": [1]}', "'timestamp' is inf"),
        ('{"timestamp": 0, "input_length": 1' + "0" * 400 + ', "output_length": 5, "hash_ids": [1]}',
         "'input_length' is 1000"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 9' + "9" * 30 + ', "hash_ids": [1]}',
         "'output_length' is 9999"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1' + "0" * 30 + "]}",
         "'hash_ids' must hold integers that fit in 64 bits"),
        ('{"session": "s", "turn": 1, "block_tokens": "abc", "timestamp": 0, "input_length": 10, '
         '"output_length": 5, "hash_ids": [1]}', "'block_tokens' is str"),
        ('{"session": "s", "turn": 1, "block_tokens": 0, "timestamp": 0, "input_length": 10, '
         '"output_length": 5, "hash_ids": [1]}', "'block_tokens' is 0"),
        ('{"session": "s", "turn": 1, "block_tokens": [512], "timestamp": 0, "input_length": 10, '
         '"output_length": 5, "hash_ids": [1]}', "'block_tokens' is list"),
    ],
)  # fmt: skip
def test_trace_stats_names_the_field_of_a_bad_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, field: str
) -> None:
    """`flatcake trace stats` on huge numbers, a bad block_tokens and NaN timestamps: exit code 2
    (ConfigError), the line and field named, no traceback."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + bad + "\n")
    assert main(["trace", "stats", str(path), "--quiet"]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert f"{path}:2: field {field}" in err and "Traceback" not in err, err


def test_trace_stats_of_an_empty_trace_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Statistics of nothing are not a success: exit 2, saying why (was: a table of zeros and exit 0)."""
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert main(["trace", "stats", str(path), "--quiet"]) == ConfigError.exit_code
    assert "no requests in it" in capsys.readouterr().err


def test_generic_format_round_trips(tmp_path: Path) -> None:
    reqs = [TraceRequest(5.0, 300, 7, (1, 2, 3), "s1", 2, 128), TraceRequest(9.5, 1000, 1, (4, 5))]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 2
    assert list(read_trace(path)) == reqs
    assert reqs[0].block_token_counts() == [128, 128, 44]
    assert list(read_trace(path, limit=1)) == reqs[:1]


def test_mooncake_conversation_trace_statistics(tmp_path: Path) -> None:
    """Figures computed independently from the released trace (intervening-requests convention)."""
    stats, per_block, dist = ts.compute_with_data(read_trace(MOONCAKE), progress=False)
    assert stats["requests"] == 12_031 and stats["accesses"] == 288_500 and stats["distinct_blocks"] == 182_790
    assert round(stats["ideal_hit_rate_blocks"], 4) == 0.3664
    assert round(stats["ideal_hit_rate_tokens"], 4) == 0.3736
    assert round(stats["one_shot_fraction"], 4) == 0.7585
    assert round(stats["top10_access_share"], 4) == 0.3387
    assert round(stats["reuse_distance_mean"], 1) == 726.6
    assert stats["reuse_distance_p99"] == 5526 and stats["reuse_distance_p50"] == 383
    paths = ts.plot(per_block, dist, tmp_path / "plots", "mooncake")
    assert [p.name for p in paths] == ["access_share.png", "reuse_distance.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in paths)


def test_tiny_trace_statistics_by_hand() -> None:
    reqs = lines(
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}',
        '{"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [3]}',
        '{"timestamp": 2, "input_length": 600, "output_length": 1, "hash_ids": [1, 4]}',
    )
    s = ts.compute(reqs, progress=False)
    assert (s["requests"], s["distinct_blocks"], s["accesses"]) == (3, 4, 5)
    assert s["ideal_hit_rate_blocks"] == pytest.approx(1 / 5)
    assert s["ideal_hit_rate_tokens"] == pytest.approx(512 / (1024 + 100 + 600))
    assert s["one_shot_fraction"] == pytest.approx(3 / 4)
    assert s["reuse_distance_mean"] == 1.0  # block 1: request 0 -> 2, one request between


@pytest.mark.parametrize("profile", ["agentic", "chat", "api"])
def test_synthesized_traces_have_their_profile_shape(profile: str) -> None:
    reqs = list(synthesize(SynthConfig(profile, requests=500, seed=3)))
    assert len(reqs) == 500 and reqs == list(synthesize(SynthConfig(profile, requests=500, seed=3)))  # seeded
    s = ts.compute(reqs, progress=False)
    blocks_per_request = s["accesses"] / s["requests"]
    if profile == "agentic":
        assert blocks_per_request > 250 and s["reuse_distance_mean"] < 1.5 and s["ideal_hit_rate_tokens"] > 0.9
        assert len({r.session for r in reqs if r.session and r.session.endswith("-sub")}) >= 1  # forks
    elif profile == "api":
        assert 0.90 <= s["one_shot_fraction"] <= 0.97 and s["reuse_distance_p99"] > 10 * s["reuse_distance_p50"]
    else:
        assert blocks_per_request < 10 and s["ideal_hit_rate_tokens"] > 0.5
    assert all(r.timestamp_ms <= q.timestamp_ms for r, q in itertools.pairwise(reqs))


def test_cli_stats_and_synth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat.jsonl"
    assert main(["trace", "synth", "--profile", "chat", "--requests", "50", "--out", str(out)]) == 0
    assert main(["trace", "stats", str(out), "--quiet", "--json", str(tmp_path / "s.json")]) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data) == set(ts.KEYS) and data["requests"] == 50
    assert "ideal_hit_rate_tokens" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "\n{oops\n")
    assert main(["trace", "stats", str(bad), "--quiet"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.xz"])
def test_compressed_traces_read_as_they_are(tmp_path: Path, suffix: str) -> None:
    import gzip
    import lzma

    text = "\n".join([GOOD, GOOD.replace('"timestamp": 0', '"timestamp": 5')]) + "\n"
    path = tmp_path / f"t{suffix}"
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    with opener(path, "wt") as f:
        f.write(text)
    assert [r.timestamp_ms for r in read_trace(path)] == [0, 5]


def test_users_are_independent_seeded_streams_merged_by_time() -> None:
    one = list(synthesize(SynthConfig("agentic", requests=40, seed=7)))
    both = list(synthesize(SynthConfig("agentic", requests=40, seed=7, users=2)))
    assert len(both) == 80 and [r.timestamp_ms for r in both] == sorted(r.timestamp_ms for r in both)
    first = [r for r in both if r.session and r.session.startswith("u0-")]
    assert [(r.timestamp_ms, r.hash_ids, r.session) for r in first] == [
        (r.timestamp_ms, r.hash_ids, f"u0-{r.session}") for r in one
    ]
    ids = [{h for r in both if r.session and r.session.startswith(f"u{k}-") for h in r.hash_ids} for k in (0, 1)]
    assert ids[0] and ids[1] and not ids[0] & ids[1]  # no shared blocks between users


def test_the_bundled_trace_is_what_its_documented_recipe_makes(tmp_path: Path) -> None:
    """docs/benchmarks.md and the data README give the command that made agentic_small.jsonl: it does."""
    import re
    import subprocess
    import sys

    data = Path(__file__).resolve().parents[3] / "loadgen" / "traces" / "data"
    recipe = re.search(r"`flatcake (trace synth [^`]+)`", (data / "README.md").read_text().replace("\n  ", " "))
    assert recipe is not None
    out = tmp_path / "synth.jsonl"
    subprocess.run([sys.executable, "-m", "flatcake.cli", *recipe.group(1).split(), "--out", str(out)], check=True,
                   capture_output=True)  # fmt: skip
    assert out.read_bytes() == (data / "agentic_small.jsonl").read_bytes()
    assert recipe.group(1) in (data.parents[2] / "docs" / "benchmarks.md").read_text()
