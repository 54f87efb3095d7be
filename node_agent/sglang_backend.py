"""Kept for configurations written before the layout moved: ``"module_path":
"flatcake.node_agent.sglang_backend"`` still loads the backend. New configurations name
``flatcake.node_agent.sglang``."""

from flatcake.node_agent.sglang.backend import FlatCakeStorage

__all__ = ["FlatCakeStorage"]
