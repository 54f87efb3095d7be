"""``python -m sglang.bench_serving``, runnable in the test environment, and a tiny offline tokenizer.

Run as a script, this is SGLang's own benchmark client (``sglang.benchmark.serving.cli_main``: its
request building, streaming parsers and metrics, unchanged). Two imports at its top are not part of
the client and need what the test environment does not install (SGLang is installed CPU-only, without
its serving dependencies), so each is stood in for only when it cannot be imported:

- ``sglang.srt.disaggregation.utils``, for one constant (``FAKE_BOOTSTRAP_HOST``), imports SGLang's
  whole server configuration (torchvision and more);
- ``datasets`` (Hugging Face), whose ``load_dataset`` only the MMMU dataset uses.

``make_tokenizer`` writes a Hugging Face tokenizer that follows the emulator's rule (4 characters a
token, flatcake.loadgen.tokens), so bench_serving needs no download and its prompt lengths agree with
the emulator's counts.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from itertools import product
from pathlib import Path

ALPHABET = "abcdef"  # 6**4 = 1296 four-letter tokens


def make_tokenizer(directory: Path) -> Path:
    """A WordLevel tokenizer over every 4-letter word of ``ALPHABET``; text is cut every 4 characters,
    as the emulator cuts it, and ids decode back to the words joined without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"".join(w): i for i, w in enumerate(product(ALPHABET, repeat=4))}
    vocab["[UNK]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".{1,4}"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _stand_ins() -> None:
    try:
        importlib.import_module("sglang.srt.disaggregation.utils")
    except ImportError:
        stub = types.ModuleType("sglang.srt.disaggregation.utils")
        stub.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]  # SGLang's value
        sys.modules[stub.__name__] = stub
    try:
        importlib.import_module("datasets")
    except ImportError:
        stub = types.ModuleType("datasets")

        def load_dataset(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the datasets package is not installed (the MMMU dataset needs it)")

        stub.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = stub


if __name__ == "__main__":
    _stand_ins()
    from sglang.benchmark.serving import cli_main

    cli_main()
