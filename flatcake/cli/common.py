"""What several command groups share: argument types, JSON output, and constants kept here so
that ``--help`` imports no subsystem (tests/flatcake/test_cli.py checks they agree with their sources)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from flatcake.errors import ConfigError


def _ints(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a comma-separated list of integers (e.g. 8192,16384)") from None


def _write_json(path: str | None, report: dict[str, object]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


T = TypeVar("T")


if TYPE_CHECKING:  # what add_subparsers returns (argparse names no public type; generic only in typeshed)
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _port(text: str) -> int:
    """An argparse type: a TCP port, checked before anything starts."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535; 0 picks a free one)")
    return port


def _csv(kind: Callable[[str], T], flag: str) -> Callable[[str], tuple[T, ...]]:
    """An argparse type for comma-separated values, naming the flag when one is bad."""

    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(kind(v) for v in text.split(",") if v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a comma-separated list") from None

    return parse


def _parts(text: str) -> tuple[str, ...]:
    """``bench agent --parts``: names from ``PARTS``, checked before anything runs."""
    from flatcake.loadgen.bench.agent import PARTS

    parts = tuple(p for p in text.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--parts: {bad or text!r} not among {','.join(PARTS)}")
    return parts


def _size_arg(text: str) -> int:
    """A size flag's bytes: ``64GiB``, ``512Mi``, ``4TB`` or a byte count (0 allowed: a tier turned off)."""
    if text.strip() == "0":
        return 0
    from flatcake.loadgen.simulate.run import parse_size

    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None


def _address(flag: str, value: str) -> str:
    """An IP address flag. In a pod it is ``$(POD_IP)``, which Kubernetes expands only when the
    container's env sets POD_IP (from status.podIP); unexpanded, say so."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ConfigError(
            f"{flag}: {value!r} is not an IP address (e.g. 127.0.0.1, or the pod's IP: "
            "set POD_IP from status.podIP in the container's env and pass $(POD_IP))"
        ) from None


# flatcake.loadgen.replay.requests.APIS, without importing the load generator (numpy) on every command;
# tests/flatcake/test_cli.py checks they agree.
API_CHOICES = ["openai", "chat", "sglang"]


API_HELP = "openai: /v1/completions, chat: /v1/chat/completions, sglang: /generate"


def _ladder(args: argparse.Namespace, given: dict[str, object], rate_flags: tuple[str, ...]) -> None:
    """``--sweep START,STOP`` and ``--slo-ttft`` into a bench's config fields: the sweep chooses its own
    rates, so it refuses the ``rate_flags`` given beside it; an objective without a sweep is refused."""
    if args.sweep is not None:
        if any(getattr(args, f.removeprefix("--").replace("-", "_"), None) is not None for f in rate_flags):
            raise ConfigError(f"--sweep chooses its own rates; leave out {' and '.join(rate_flags)}")
        given["ladder"] = tuple(args.sweep)
    elif args.slo_ttft_s is not None:
        raise ConfigError("--slo-ttft applies to --sweep only")
