"""The ``flatcake`` command: a parser per command group (``flatcake/cli/<group>.py``, each with ``add``)
and a short handler per command that imports its subsystem only when run (``flatcake --help`` loads
none of them); the work lives in the subsystems."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import flatcake
from flatcake.cli import agent, bench, emulate, geometry, loadgen, operator, report, simulate, trace
from flatcake.errors import FlatCakeError


def build_parser() -> argparse.ArgumentParser:
    """The ``flatcake`` command line: one function per command group below."""
    parser = argparse.ArgumentParser(prog="flatcake", description="Flat DRAM+SSD KV-cache storage for LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO (agent serve, emulate: always); tracebacks of internal errors")  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {flatcake.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add(sub)
    trace.add(sub)
    simulate.add(sub)
    loadgen.add(sub)
    report.add(sub)
    emulate.add(sub)
    agent.add(sub)
    operator.add(sub)
    geometry.add(sub)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.default not in (None, False, [], (), argparse.SUPPRESS)
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:  # argparse has no public walk over subcommands
        if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"  # argparse prints no line for an option without help
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _with_defaults(sub)


def _end_progress() -> None:
    """Clear a progress bar still drawn on stderr, so an error starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return
    for bar in list(getattr(tqdm.tqdm, "_instances", ())):
        bar.leave = False
        bar.close()


def _fail(message: str, code: int) -> int:
    _end_progress()
    print(f"flatcake: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _with_defaults(parser)
    args = parser.parse_args(argv)
    # A long-running service (the agent, the emulator) says what it serves at INFO; a one-shot command
    # stays quiet unless asked (-v).
    verbose = args.verbose or getattr(args, "service", False)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except FlatCakeError as exc:  # each kind has its exit code (flatcake/errors.py)
        return _fail(str(exc), exc.exit_code)
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except (ValueError, RuntimeError, OSError) as exc:  # bad arguments or an environment problem, said plainly
        return _fail(str(exc), 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:  # a bug: one line, the traceback with -v
        if args.verbose:
            raise
        return _fail(f"{type(exc).__name__}: {exc} (internal error; run with -v for the traceback)", 1)
