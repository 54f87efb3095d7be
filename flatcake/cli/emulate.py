"""``flatcake emulate``: the inference-server emulator."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from flatcake.cli.common import _port, _size_arg
from flatcake.loadgen import names

# Its defaults, shown in --help: importing the configuration loads no numpy (tests/loadgen/test_names.py).
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.node_agent.constants import PLACEMENT_MODES, SCHEDULER_POLICIES

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _emulate(args: argparse.Namespace) -> int:
    from flatcake.loadgen.emulator.server import serve

    fields = {k: v for k, v in vars(args).items() if k in EmulatorConfig.__dataclass_fields__ and v is not None}
    serve(EmulatorConfig(**fields), args.host, args.port)
    return 0


def add(sub: Subparsers) -> None:
    """``flatcake emulate``: the emulated inference server."""
    emulate = sub.add_parser("emulate", help="an inference server that stores real KV through the storage under test")
    emulate.add_argument(
        "--mode",
        choices=["flatcake", "flatcake-native", "tiered", "dram", "none"],
        default="flatcake",
        help="flatcake: SGLang HiCache's rules over FlatCake's backend, as it ships; flatcake-native: the paper's "
        "engine-integrated FlatCake (FC-MAS, restores at dispatch: a what-if); tiered: SGLang's rules over --l3; "
        "dram: its host tier alone; none: nothing stored (default: flatcake)",
    )
    emulate.add_argument(
        "--host", default="127.0.0.1", help="IP address or name to listen on; 0.0.0.0: every interface"
    )
    emulate.add_argument("--port", type=_port, default=8000, help="TCP port, 0..65535 (0: a free one)")
    emulate.add_argument("--data-dir", dest="data_dir", default=".flatcake-emulator", help="where the pools go")
    emulate.add_argument("--agent-socket", dest="agent_socket", help="flatcake modes: use this node agent")
    emulate.add_argument(
        "--preset",
        "--model",  # the old name: a served model's name is what --model means to an inference server
        dest="model",
        metavar="PRESET",
        help="geometry preset: KV geometry and GPU costs (dsv4-flash, llama3-70b-tp4), not a served model's name",
    )
    emulate.add_argument("--gpu", help="the modelled GPU with --model: h200 (default) or a100")
    emulate.add_argument(
        "--prefetch-policy",
        dest="prefetch_policy",
        help="tiered: SGLang's prefetch stop policy: timeout, best_effort, wait_complete",
    )
    sizes = ("hbm-bytes", "dram-bytes", "ssd-bytes", "scope-file-bytes")  # with units, as simulate's --dram
    numbers: list[tuple[str, Callable[[str], object]]] = [(n, _size_arg) for n in sizes]
    numbers += [("prefill-tokens-per-s", float), ("decode-tokens-per-s", float), ("layers", int),
                ("page-tokens", int), ("bytes-per-token-layer", int)]  # fmt: skip
    for name, kind in numbers:
        field = name.replace("-", "_")  # unset: EmulatorConfig's default, shown here
        unit = "a size, e.g. 64GiB or a byte count " if name in sizes else ""
        default = EmulatorConfig.__dataclass_fields__[field].default
        emulate.add_argument(f"--{name}", type=kind, dest=field, help=f"{unit}(default: {default})")
    emulate.add_argument(
        "--l3",
        choices=names.L3_BACKENDS,
        help="tiered mode: the storage below SGLang's host tier, written through: an idealized SSD log (default), "
        "SGLang's HiCacheFile, one file per page (needs the sglang extra), or Mooncake Store (needs the peers extra)",
    )
    emulate.add_argument(
        "--storage-dram-share",
        type=float,
        dest="storage_dram_share",
        help="flatcake mode: FlatCake's pool's share of --dram-bytes, the rest SGLang's host pool (default: 0.5)",
    )
    emulate.add_argument(
        "--keep-page-cache",
        dest="drop_page_cache",
        action="store_false",
        default=None,
        help="--l3 hicache-file: leave its page files in the OS page cache (default: dropped once written, so "
        "its reads hit the device as the others' O_DIRECT reads do)",
    )
    emulate.add_argument(
        "--scheduler",
        choices=SCHEDULER_POLICIES,
        help="flatcake-native mode: how requests are ordered: mas (FC-MAS, default) or fcfs (the ablation)",
    )
    emulate.add_argument("--placement", choices=PLACEMENT_MODES,
                         help="flatcake modes, in-process engine: Table 2 (table2, default) or adaptive")  # fmt: skip
    emulate.set_defaults(func=_emulate, service=True)
