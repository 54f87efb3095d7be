"""FlatCake: flat DRAM+SSD KV-cache storage for LLM serving."""
