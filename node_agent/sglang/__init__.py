"""FlatCake as an SGLang HiCache storage backend (see README.md here). Importing this package imports
SGLang and torch; SGLang loads it by ``module_path`` through its ``dynamic`` backend factory."""

from flatcake.node_agent.sglang.backend import FlatCakeStorage

__all__ = ["FlatCakeStorage"]
