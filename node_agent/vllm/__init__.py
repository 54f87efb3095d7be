"""FlatCake as a vLLM v1 KV connector. Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "FlatCakeConnector",
        "kv_connector_module_path": "flatcake.node_agent.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/flatcake/agent.sock"}}'

The connector (``connector.py``) imports vLLM, so it is loaded on first use of its name: the pure
planning (``plan.py``) imports without vLLM.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "FlatCakeConnector":
        from flatcake.node_agent.vllm.connector import FlatCakeConnector

        return FlatCakeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
