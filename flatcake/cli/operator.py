"""``flatcake operator``: the kopf operator, and its offline render and check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flatcake.errors import ConfigError

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _operator(args: argparse.Namespace) -> int:
    if args.action == "render":
        return _operator_render(args)
    if args.action == "check":
        return _operator_check(args)
    from flatcake.operator import handlers

    try:
        handlers.run(args.namespace, liveness=args.liveness)
    except RuntimeError as exc:
        print(f"flatcake operator: {exc}", file=sys.stderr)
        return 2
    return 0


def _operator_render(args: argparse.Namespace) -> int:
    import yaml

    from flatcake.operator import preview

    if len(args.file) != 1:
        raise ConfigError("operator render: give one FlatCakeCache's YAML file (flatcake operator render CACHE.yaml)")
    try:
        body = yaml.safe_load(Path(args.file[0]).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{args.file[0]}: cannot read a FlatCakeCache from it ({exc})") from None
    namespace = args.namespace[0] if args.namespace else "default"  # as kubectl apply -n gives it
    objects = preview.objects(body, preview.load_crd_schema(args.crd), args.agent_cluster_role, namespace)
    print(preview.dump(objects), end="")
    return 0


def _operator_check(args: argparse.Namespace) -> int:
    from flatcake.operator import check

    if not args.file:
        raise ConfigError("operator check: give the manifests to check (files, or - for standard input)")
    report = check.check(check.read(args.file, sys.stdin))
    for line in report.notes:
        print(f"note: {line}", file=sys.stderr)
    for line in report.problems:
        print(line)
    print(f"{report.checked} objects checked, {len(report.problems)} problems", file=sys.stderr)
    return 1 if report.problems else 0


def add(sub: Subparsers) -> None:
    """``flatcake operator``: the kopf operator."""
    op = sub.add_parser("operator", help="the kopf operator: reconciles FlatCakeCache resources into node agents")
    op.add_argument("action", nargs="?", choices=("run", "render", "check"), default="run",
                    help="run (default); render what the operator would apply for FILE, offline; or check "
                    "manifests (FILE..., - for standard input) offline as the API server would")  # fmt: skip
    op.add_argument("file", nargs="*", help="render: the FlatCakeCache's YAML; check: the manifests")
    op.add_argument("--crd", help="render: the CRD's YAML (default: this checkout's crds/flatcakecaches.yaml)")
    op.add_argument("--agent-cluster-role", default="flatcake-agent", dest="agent_cluster_role",
                    help="render: the agents' ClusterRole, as the chart names it")  # fmt: skip
    op.add_argument("--namespace", action="append", default=[],
                    help="run: watch this namespace (repeat; default all); render: the cache's namespace where its "
                    "metadata names none (default: default)")  # fmt: skip
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    op.set_defaults(func=_operator)
