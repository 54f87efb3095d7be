"""A real SGLang server on the CPU: a tiny generated model, the CPU compatibility layer, a launcher."""
