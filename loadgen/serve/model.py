"""A tiny model of a real architecture for a real SGLang server on the CPU, generated in about 2 s.

``make_model(directory)`` writes what ``--model-path`` needs: ``config.json`` and
``generation_config.json`` of a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``, a byte-level BPE
tokenizer trained here on a fixed generated corpus (``tokenizer.json``, ``tokenizer_config.json``) and
seeded random weights in ``model.safetensors`` (names and shapes of transformers' state dict). Same
arguments, same bytes: two servers on two generated copies give bit-identical greedy logprobs.

``--load-format dummy`` is no substitute: its outputs do not depend on the KV cache restored from a
storage tier, and these must. Weights are scaled by ``1/sqrt(fan_in)`` so attention is sharp and a
wrong restored page changes the next token's logprobs.

Needs numpy and ``tokenizers`` (both in the SGLang server venv and, with the ``sglang`` extra, in
``.venv``); the safetensors file is written here (8-byte header length, JSON header, raw tensors), so
bfloat16 needs no torch. Also a script: ``python -m flatcake.loadgen.serve.model DIR [--arch qwen2]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
DTYPES = ("bfloat16", "float32")
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")  # ids 0, 1, 2
CONTEXT = 32_768
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TEXT = (
    "The cache keeps the keys and values of every token a model has already seen, so a request that "
    "shares a prefix with an earlier one skips its prefill. Pages move between the GPU, host memory and "
    "a storage tier: flash drives, a pool of DRAM, a file system. 0123456789 +-*/=()[]{}<>.,;:!?'\"#$%&@_"
)


def corpus(words: int = 60_000, seed: int = 0) -> list[str]:
    """The tokenizer's training text: a fixed paragraph and seeded pseudo-words built from syllables."""
    rng = np.random.default_rng(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "st", "tr", "pl", "sh", "th", "gr"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    lines = [_TEXT] * 4
    counts = rng.integers(1, 4, size=words)
    picks = rng.integers(0, len(syllables), size=int(counts.sum()))
    out: list[str] = []
    at = 0
    for n in counts:
        out.append("".join(syllables[i] for i in picks[at : at + n]))
        at += n
    lines += [" ".join(out[i : i + 16]) for i in range(0, len(out), 16)]
    return lines


def make_tokenizer(vocab: int, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer with exactly ``vocab`` ids (filler tokens if training stops short)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    short = vocab - tok.get_vocab_size(with_added_tokens=True)
    if short > 0:  # every id below vocab_size must decode, since SGLang accepts any of them
        tok.add_special_tokens([f"<|filler_{i}|>" for i in range(short)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab}")
    return tok


def _bf16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bits, rounded to nearest even (values here are finite)."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, npt.NDArray[Any]], dtype: str) -> None:
    """The safetensors format by hand: u64 header length, JSON header (sorted names), data."""
    code = {"bfloat16": "BF16", "float32": "F32"}[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        array = tensors[name]
        blob = (_bf16(array) if dtype == "bfloat16" else array.astype("<f4")).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def state_dict_shapes(
    arch: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` state dict
    (untied embeddings; Qwen2 adds q/k/v biases)."""
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if arch == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (heads * head_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_heads * head_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_heads * head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[p + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _init(name: str, shape: tuple[int, ...], seed: int) -> npt.NDArray[np.float32]:
    """Each tensor from its own stream (seed and name), so adding a tensor changes no other."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    rng = np.random.default_rng([seed, int.from_bytes(digest, "little")])
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    std = 1.0 if name == "model.embed_tokens.weight" else shape[-1] ** -0.5
    return (std * rng.standard_normal(shape, np.float32)).astype(np.float32)


def make_model(
    directory: Path,
    *,
    arch: str = "llama",
    hidden: int = 640,
    layers: int = 6,
    heads: int = 10,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 8192,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Write a complete model directory for ``--model-path`` and return it.

    KV bytes per token per layer: ``2 * kv_heads * (hidden // heads) * (2 if bfloat16 else 4)``
    (512 with the defaults; a 64-token page is 32 KiB per layer).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: one of {sorted(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {DTYPES}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden}, heads {heads}, kv_heads {kv_heads}: heads must divide both")
    intermediate = intermediate or 8 * hidden // 3 // 64 * 64
    directory.mkdir(parents=True, exist_ok=True)
    architecture, model_type = ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,  # transformers 4 reads this, 5 the rope_parameters
        "rope_parameters": {"rope_theta": 10_000.0, "rope_type": "default"},
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    make_tokenizer(vocab, seed).save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[2],
        "add_bos_token": False,
        "model_max_length": CONTEXT,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2]}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    shapes = state_dict_shapes(arch, hidden, layers, heads, kv_heads, intermediate, vocab)
    write_safetensors(directory / "model.safetensors", {n: _init(n, s, seed) for n, s in shapes.items()}, dtype)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    out = make_model(a.directory, arch=a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads,
                     kv_heads=a.kv_heads, vocab=a.vocab, dtype=a.dtype, seed=a.seed)  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
