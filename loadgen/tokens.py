"""The emulator's tokenization rule, shared by the emulator and the load generator: one token per 4
characters.

No model's tokenizer ships with FlatCake (the emulator has no model), so text is cut into 4-character
chunks, about what English text averages with BPE tokenizers. The rule keeps what a prefix cache needs:
texts that share a prefix of ``4k`` characters share their first ``k`` token ids, so page keys (and
cache hits) follow shared text exactly as they follow shared token ids.

``decode`` is the inverse for the ids the load generator makes (``0 <= id < VOCAB``): each id spells
4 lowercase letters, so ``encode(decode(ids)) == ids``, and a trace replayed as text hits the same pages
as the same trace replayed as token ids. Any other 4-character chunk maps to a stable hash below VOCAB.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

CHARS_PER_TOKEN = 4
VOCAB = 50_000  # token ids the load generator uses; 26**4 > VOCAB, so each spells 4 letters
_A = ord("a")


def _spell(token: int) -> str:
    if not 0 <= token < VOCAB:
        raise ValueError(f"token id {token} is outside 0..{VOCAB - 1}")
    out = []
    for _ in range(CHARS_PER_TOKEN):
        token, digit = divmod(token, 26)
        out.append(chr(_A + digit))
    return "".join(out)


def _id(chunk: str) -> int:
    if len(chunk) == CHARS_PER_TOKEN and all("a" <= c <= "z" for c in chunk):
        value = 0
        for c in reversed(chunk):
            value = value * 26 + ord(c) - _A
        if value < VOCAB:
            return value
    digest = hashlib.blake2b(chunk.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per 4 characters (a shorter last chunk is one token too)."""
    return [_id(text[i : i + CHARS_PER_TOKEN]) for i in range(0, len(text), CHARS_PER_TOKEN)]


def count(text: str) -> int:
    """How many tokens ``text`` is under the rule: ceil(characters / 4)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def decode(tokens: Sequence[int]) -> str:
    """Text whose ``encode`` is ``tokens`` (ids in ``0..VOCAB-1``): 4 letters per token."""
    return "".join(_spell(int(t)) for t in tokens)
