"""Byte-level BPE tokenizer and chat template built from a GGUF file's ``tokenizer.*`` metadata.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, what llama.cpp's converter writes
for Qwen2/Qwen2.5/Qwen3/Qwen3-MoE) with the ``qwen2`` pre-tokenizer (and the plain GPT-2 one,
``default``/``gpt2``). The BPE itself runs in the `tokenizers` library; the chat template is
rendered with jinja2 in a sandbox, with the helpers Hugging Face chat templates expect.

GGUF keys read (llama.cpp ``gguf-py`` names):
``tokenizer.ggml.{model,pre,tokens,token_type,merges,bos_token_id,eos_token_id,padding_token_id,
eot_token_id,eom_token_id,add_bos_token,add_eos_token}`` and ``tokenizer.chat_template``.

Token types (``gguf.TokenType``): NORMAL tokens form the BPE vocabulary; CONTROL tokens
(``<|im_start|>``, ``<|endoftext|>``...) become special added tokens (matched verbatim in text,
dropped by ``skip_special_tokens``); USER_DEFINED tokens (``<think>``, ``<tool_call>``) become
non-special added tokens (matched verbatim, always decoded); UNUSED padding slots (``[PAD151665]``)
keep their id but are never produced by encoding.

No normalizer is applied (llama.cpp and transformers' GGUF loader apply none either).
"""
from __future__ import annotations

import codecs
import datetime
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .gguf_file import GGUFError

__all__ = ["Tokenizer", "IncrementalDecoder", "TokenizerError"]

# gguf.TokenType values (llama.cpp llama_token_type); kept as ints so the module imports cheaply.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes by tokenizer.ggml.pre. qwen2: the pattern in Qwen2/Qwen3's
# tokenizer.json (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2 uses the same one).
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_REGEXES: dict[str, str | None] = {
    "qwen2": _QWEN2_REGEX,
    "default": None,  # None: GPT-2's own byte-level split (ByteLevel use_regex=True)
    "gpt2": None,
}

# Token texts llama.cpp treats as end-of-generation when they are control tokens (llama-vocab.cpp
# special_eog_ids heuristics). Generation stops on any of these in addition to eos/eot/eom ids.
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
              "<|return|>", "<|call|>", "<EOT>", "<｜end▁of▁sentence｜>")


class TokenizerError(GGUFError):
    """The GGUF tokenizer metadata is missing, inconsistent, or of an unsupported kind, or its
    chat template fails (a :class:`~hanzo_torch.GGUFError`: the file is at fault)."""


def _short(value: Any, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _check_str_list(key: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TokenizerError(f"{key} must be an array of strings, got {type(value).__name__}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise TokenizerError(f"{key}[{i}] is {type(v).__name__} {_short(v)}, expected a string")


class _native_errors:
    """Turns an error of the `tokenizers` library (a plain Exception, or a Rust panic, which
    reaches Python as ``pyo3_runtime.PanicException``, a BaseException) into a TokenizerError."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, TokenizerError)):
            return False
        if isinstance(exc, Exception) or type(exc).__name__ == "PanicException":
            kind = "out of memory" if isinstance(exc, MemoryError) else type(exc).__name__
            raise TokenizerError(f"the tokenizer failed {self.what}: {kind}: {' '.join(str(exc).split())[:200]}") from None
        return False


def _byte_alphabet() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes
    to U+0100.. in increasing byte order. Returns char -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_CHAR_TO_BYTE = _byte_alphabet()


def _plain(value: Any) -> Any:
    """Unwrap a metadata value to plain Python (typed wrappers with ``.value``, numpy arrays)."""
    if hasattr(value, "value") and not isinstance(value, (str, bytes, int, float, bool)):
        value = value.value
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8")
    return value


def _read_metadata(path: str | os.PathLike) -> Mapping[str, Any]:
    from .gguf_file import GGUFFile

    with GGUFFile(path) as f:
        return f.metadata  # decoded lazily; stays readable after close


class Tokenizer:
    """Byte-level BPE tokenizer plus chat template of a GGUF model.

    Build with :meth:`from_gguf`. Token ids are Python ints in ``[0, vocab_size)``.

    Attributes:
        vocab_size: number of token slots (``len(tokenizer.ggml.tokens)``).
        bos_token_id / eos_token_id / pad_token_id: ints or None.
        eos_token_ids: frozenset of ids that end generation (eos, eot, eom and llama.cpp's
            end-of-generation control tokens such as ``<|im_end|>``, ``<|endoftext|>``).
        max_token_bytes: an upper bound of the UTF-8 bytes of one token (4 x the longest token
            text), used to refuse texts that cannot fit a context before encoding them.
        add_bos_token / add_eos_token: whether ``encode(add_special_tokens=True)`` adds them.
        chat_template: the jinja2 source or None.
        backend: the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], *,
                 pre: str = "qwen2", bos_token_id: int | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, eot_token_id: int | None = None,
                 eom_token_id: int | None = None, add_bos_token: bool = False, add_eos_token: bool = False,
                 chat_template: str | None = None):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _HFTokenizer

        _check_str_list("tokenizer.ggml.tokens", tokens)
        _check_str_list("tokenizer.ggml.merges", merges)
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        if not isinstance(token_types, Sequence) or isinstance(token_types, str):
            raise TokenizerError(f"tokenizer.ggml.token_type must be an array of integers, got "
                                 f"{type(token_types).__name__}")
        if len(token_types) != n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries, tokens has {n}")
        for i, t in enumerate(token_types):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= BYTE:
                raise TokenizerError(f"tokenizer.ggml.token_type[{i}] = {_short(t)} is not a token type "
                                     f"(an integer in [0, {BYTE}])")
        if not isinstance(pre, str) or pre not in _PRE_REGEXES:
            raise TokenizerError(f"unsupported tokenizer.ggml.pre {_short(pre)} (supported: {sorted(_PRE_REGEXES)})")
        for name, tid in (("bos", bos_token_id), ("eos", eos_token_id), ("padding", pad_token_id),
                          ("eot", eot_token_id), ("eom", eom_token_id)):
            if tid is None:
                continue
            if isinstance(tid, bool) or not isinstance(tid, int):
                raise TokenizerError(f"tokenizer.ggml.{name}_token_id must be an integer, got "
                                     f"{type(tid).__name__} {_short(tid)}")
            if not 0 <= tid < n:
                raise TokenizerError(f"tokenizer.ggml.{name}_token_id {tid} is outside the vocabulary [0, {n})")
        for name, flag in (("add_bos_token", add_bos_token), ("add_eos_token", add_eos_token)):
            if not isinstance(flag, bool):
                raise TokenizerError(f"tokenizer.ggml.{name} must be a bool, got {type(flag).__name__} {_short(flag)}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerError(f"tokenizer.chat_template must be a string, got {type(chat_template).__name__}")

        self.tokens = list(tokens)
        self.token_types = list(token_types)
        self.vocab_size = n
        # an upper bound of the UTF-8 bytes one token stands for (a character is at most 4
        # bytes): a text of more characters than n_tokens * this cannot encode to n_tokens
        self.max_token_bytes = 4 * max(1, max(len(t) for t in self.tokens))
        self.pre = pre
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self.chat_template = chat_template

        vocab = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)  # first id wins for duplicated texts
        pairs = []
        for m in merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed tokenizer.ggml.merges entry {m!r} (expected 'left right')")
            pairs.append((left, right))
        try:
            with _native_errors("building the BPE vocabulary/merges"):
                model = models.BPE(vocab, pairs, ignore_merges=False)
        except TokenizerError as exc:  # tokenizers raises a bare Exception for a merge naming no token
            raise TokenizerError(f"invalid BPE vocabulary/merges: {exc}") from None
        backend = _HFTokenizer(model)
        regex = _PRE_REGEXES[pre]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=regex is None)
        if regex is None:
            backend.pre_tokenizer = byte_level
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level])
        backend.decoder = decoders.ByteLevel()
        added_ids = [i for i, t in enumerate(self.token_types) if t in (CONTROL, USER_DEFINED)]
        with _native_errors("adding the control/user-defined tokens"):
            backend.add_tokens([AddedToken(self.tokens[i], special=self.token_types[i] == CONTROL, normalized=False)
                                for i in added_ids])
        for i in added_ids:
            if backend.token_to_id(self.tokens[i]) != vocab.get(self.tokens[i]):
                raise TokenizerError(f"added token {self.tokens[i]!r} did not keep its id {i}")
        self.backend = backend
        self.special_ids = frozenset(i for i in added_ids if self.token_types[i] == CONTROL)

        eog = {tid for tid in (eos_token_id, eot_token_id, eom_token_id) if tid is not None}
        for text in _EOG_TEXTS:
            tid = vocab.get(text)
            if tid is not None and self.token_types[tid] == CONTROL:
                eog.add(tid)
        self.eos_token_ids = frozenset(eog)
        self._bytes_cache: dict[int, bytes] = {}
        # compiled now: a template that does not parse is a problem of the file, found at load
        self._template = _compile_template(chat_template) if chat_template is not None else None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, source: Any) -> "Tokenizer":
        """Build from a GGUF file path, a ``GGUFFile`` (``.metadata``) or a metadata mapping.

        Raises:
            TokenizerError: no tokenizer metadata, an unsupported ``tokenizer.ggml.model``/``pre``,
                inconsistent arrays, values of the wrong type (nested arrays, a non-integer
                special token id, a non-string chat template) or a chat template that does not
                compile; the message starts with the file path when ``source`` has one.
            GGUFError: the file itself is malformed (from :class:`~hanzo_torch.GGUFFile`).
        """
        where = None
        if isinstance(source, (str, os.PathLike)):
            where = os.fspath(source)
            meta = _read_metadata(source)
        elif isinstance(source, Mapping):
            meta = source
        elif hasattr(source, "metadata"):
            where = getattr(source, "path", None)
            meta = source.metadata
        else:
            raise TypeError(f"Tokenizer.from_gguf expects a path, a GGUFFile or a metadata mapping, got {type(source)!r}")
        try:
            tok = cls._from_metadata(meta)
        except TokenizerError as exc:
            if where is None:
                raise
            raise TokenizerError(f"{where}: {exc}") from None
        tok.source = where
        return tok

    @classmethod
    def _from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":

        def get(key: str, default: Any = None) -> Any:
            return _plain(meta[key]) if key in meta else default

        kind = get("tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError("the GGUF has no tokenizer (tokenizer.ggml.model is missing)")
        if kind != "gpt2":
            raise TokenizerError(f"unsupported tokenizer.ggml.model {kind!r}: only byte-level BPE ('gpt2') is supported")
        tokens = get("tokenizer.ggml.tokens")
        merges = get("tokenizer.ggml.merges")
        for key, value in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges)):
            if value is None:
                raise TokenizerError(f"{key} is missing")
        _check_str_list("tokenizer.ggml.tokens", tokens)
        types = get("tokenizer.ggml.token_type")
        if types is None:
            types = [NORMAL] * len(tokens)

        # values are passed on as stored: the constructor rejects a float or bool where an
        # integer id belongs, instead of converting it
        return cls(tokens, types, merges, pre=get("tokenizer.ggml.pre", "default"),
                   bos_token_id=get("tokenizer.ggml.bos_token_id"), eos_token_id=get("tokenizer.ggml.eos_token_id"),
                   pad_token_id=get("tokenizer.ggml.padding_token_id"),
                   eot_token_id=get("tokenizer.ggml.eot_token_id"), eom_token_id=get("tokenizer.ggml.eom_token_id"),
                   add_bos_token=get("tokenizer.ggml.add_bos_token", False),
                   add_eos_token=get("tokenizer.ggml.add_eos_token", False),
                   chat_template=get("tokenizer.chat_template"))

    # ------------------------------------------------------------------ encode / decode
    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Control/user-defined token texts inside ``text`` map to their ids.

        ``add_special_tokens`` prepends BOS / appends EOS only when the GGUF asks for it
        (``tokenizer.ggml.add_bos_token``/``add_eos_token``; both False for Qwen).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text)!r}")
        with _native_errors(f"encoding a text of {len(text)} characters"):
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (ints or a 1-D tensor). Invalid UTF-8 byte sequences become U+FFFD.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token stands for (byte-level alphabet undone; added tokens as UTF-8)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            text = self.tokens[token_id]
            if self.token_types[token_id] in (CONTROL, USER_DEFINED, UNUSED):
                b = text.encode("utf-8")
            else:
                try:
                    b = bytes(_CHAR_TO_BYTE[c] for c in text)
                except KeyError:  # not a byte-level token (should not happen in a gpt2 vocab)
                    b = text.encode("utf-8")
            self._bytes_cache[token_id] = b
        return b

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """Raw bytes of ``ids`` concatenated (no UTF-8 validation)."""
        ids = self._check_ids(ids)
        return b"".join(self.token_bytes(i) for i in ids if not (skip_special_tokens and i in self.special_ids))

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        """A streaming decoder: ``push(id) -> str`` returns only complete UTF-8 characters."""
        return IncrementalDecoder(self, skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[token_id]

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[Any] | None = None,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the GGUF's chat template.

        The template runs in a jinja2 sandbox with the variables and helpers Hugging Face templates
        use: ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
        ``raise_exception``, ``strftime_now``, a ``tojson`` filter that does not HTML-escape,
        plus any ``kwargs`` (e.g. ``enable_thinking=False`` for Qwen3).

        Returns the prompt text, or its token ids (no BOS added) if ``tokenize``.

        Raises:
            TokenizerError: the GGUF has no ``tokenizer.chat_template``, or the template fails
                while rendering (naming the file and the key).
        """
        source = chat_template or self.chat_template
        if source is None:
            raise TokenizerError("this GGUF has no tokenizer.chat_template; pass chat_template= or use a plain prompt")
        if chat_template is not None:
            template = _compile_template(chat_template)
        else:
            if self._template is None:
                self._template = _compile_template(source)
            template = self._template
        msgs = [dict(m) for m in messages]
        for m in msgs:
            if "role" not in m:
                raise TokenizerError(f"chat message without a 'role': {m!r}")
        ctx = dict(messages=msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                   bos_token=self.tokens[self.bos_token_id] if self.bos_token_id is not None else "",
                   eos_token=self.tokens[self.eos_token_id] if self.eos_token_id is not None else "")
        ctx.update(kwargs)
        try:
            text = template.render(**ctx)
        except _TemplateRaised as exc:
            raise TokenizerError(f"{self._template_where(chat_template)}: chat template error: {exc}") from None
        except Exception as exc:  # jinja2 errors (undefined, sandbox violations, type errors), ZeroDivisionError, ...
            raise TokenizerError(f"{self._template_where(chat_template)}: chat template failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        return self.encode(text, add_special_tokens=False) if tokenize else text

    source: str | None = None
    """The GGUF file the tokenizer was read from (None: built from a metadata mapping)."""

    def _template_where(self, override: str | None) -> str:
        if override is not None:
            return "chat_template="
        return f"{self.source}: tokenizer.chat_template" if self.source else "tokenizer.chat_template"

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_id}, eog={sorted(self.eos_token_ids)})")


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's templates expect plain json.dumps (no HTML escaping, non-ASCII kept).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"tokenizer.chat_template does not parse: {exc}") from None
    except (RecursionError, MemoryError, ValueError, TypeError) as exc:  # absurd nesting or sizes
        raise TokenizerError(f"tokenizer.chat_template does not compile: {type(exc).__name__}") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces without splitting a UTF-8 character.

    ``push(id)`` returns the newly completed text (possibly ""); ``flush()`` returns what is left
    (an incomplete trailing sequence becomes U+FFFD). The concatenation of all pieces equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        tok = self.tokenizer
        if not 0 <= token_id < tok.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {tok.vocab_size})")
        if self.skip_special_tokens and token_id in tok.special_ids:
            return ""
        return self._utf8.decode(tok.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
