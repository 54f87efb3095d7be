"""FlatCake: flat DRAM+SSD KV-cache storage for LLM serving.

Packages: ``flatcake.node_agent`` (the storage engine, node agent, client library and SGLang backend),
``flatcake.operator`` (the kopf operator), ``flatcake.loadgen`` (traces, emulator, Locust replay,
reports, benchmarks); here: the ``flatcake`` command, the error family, the metrics catalogue and a
small Kubernetes client.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flatcake")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
