"""hanzo_torch.tokenizer against transformers' GGUF tokenizer on the real Qwen3 vocabulary."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from hanzo_torch.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer, TokenizerError
from qwen_vocab import add_tokenizer_metadata, qwen3_tokenizer_metadata

REAL_MODEL = Path(os.environ.get("HANZO_CACHE") or Path.home() / ".cache" / "hanzo-torch") / "models" / \
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"

CORPUS = [
    "Hello, world!",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\r\n",
    "    \t\t  \n\n\n   trailing spaces   ",
    "1234567890 3.14159 1e-10 0x7fff 000123 99999999999",
    "你好，世界！今天天气很好。日本語のテキスト、カタカナ。한국어 문장입니다.",
    "Emoji 🎉🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵 and ❤️",
    "I'M HERE, you're there, they'll go, she'd've, DON'T",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nsimple\n</think>\n\n4<|im_end|>",
    "text<|endoftext|>more text<|im_start|>x<|im_sta partial <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "Ünïcödé çåfé naïve résumé Ελληνικά русский עברית العربية हिन्दी ไทย",
    "e\u0301 combining accent, zero\u200bwidth, nbsp\u00a0here, \u2028line sep",
    "\n",
    " ",
    "",
    "a" * 300 + " " + "ab" * 100,
    "   leading\n\n\n\n\nmany newlines\r\n\r\nwindows",
    "mixed123abc456DEF!!!???...---___===",
    "\x00\x01\x7f control bytes \x1b[31mred\x1b[0m",
]

MESSAGE_SETS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Write a haiku."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _write_tiny_gguf(path: Path, metadata: dict, arch: str = "qwen3") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    add_tokenizer_metadata(writer, metadata)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def meta() -> dict:
    return qwen3_tokenizer_metadata()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, meta) -> Path:
    return _write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny-qwen3.gguf", meta)


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_gguf(meta)


@pytest.fixture(scope="module")
def hf_tok(tiny_gguf):
    # AutoTokenizer.from_pretrained(folder, gguf_file=...) resolves Qwen2Tokenizer for qwen2/qwen3
    # GGUFs (checked by the slow test on the real model) but first parses the whole file for the
    # model config (~30 s on this machine); the tokenizer class goes straight to the tokenizer.
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)


def test_metadata_types_follow_llama_cpp(meta):
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 151936
    by_text = dict(zip(tokens, types))
    assert by_text["<|im_start|>"] == CONTROL and by_text["<|fim_prefix|>"] == CONTROL
    assert by_text["<think>"] == USER_DEFINED and by_text["<tool_call>"] == USER_DEFINED
    assert by_text["Hello"] == NORMAL
    assert tokens[151700] == "[PAD151700]"


def test_from_gguf_file_equals_from_metadata(tiny_gguf, tok):
    from_file = Tokenizer.from_gguf(tiny_gguf)
    assert from_file.vocab_size == tok.vocab_size == 151936
    assert (from_file.bos_token_id, from_file.eos_token_id, from_file.pad_token_id) == (151643, 151645, 151643)
    assert from_file.chat_template == tok.chat_template
    for text in CORPUS[:6]:
        assert from_file.encode(text) == tok.encode(text)


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_encode_matches_transformers(tok, hf_tok, index):
    text = CORPUS[index]
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_inside_text(tok):
    ids = tok.encode("a<|im_start|>b<think>c")
    assert 151644 in ids and 151667 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "ab<think>c"  # <think> is not special
    assert tok.eos_token_ids == {151645, 151643}
    assert tok.add_bos_token is False and tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_decoder_never_splits_characters(tok, skip):
    for text in CORPUS:
        ids = tok.encode(text)
        dec = tok.incremental_decoder(skip_special_tokens=skip)
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)
    # A 4-byte emoji spelled as single-byte tokens: nothing comes out until the last byte.
    single = [tok.backend.token_to_id(c) for c in "ðŁİī"]  # byte-level spelling of F0 9F 8E 89
    assert None not in single and tok.decode(single) == "🎉"
    dec = tok.incremental_decoder()
    assert [dec.push(i) for i in single] == ["", "", "", "🎉"]
    dec = tok.incremental_decoder()
    assert dec.push(single[0]) == "" and dec.flush() == "\ufffd"


@pytest.mark.parametrize("index", range(len(MESSAGE_SETS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, index, gen):
    msgs = MESSAGE_SETS[index]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=gen)
    theirs = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    assert ours.startswith("<|im_start|>")
    ours = tok.apply_chat_template(msgs, add_generation_prompt=gen, tools=TOOLS, enable_thinking=False)
    theirs = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, tools=TOOLS,
                                        enable_thinking=False)
    assert ours == theirs
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(tok.apply_chat_template(msgs))


def test_chat_template_errors(tok):
    with pytest.raises(TokenizerError, match="bad role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ raise_exception('bad role') }}")
    with pytest.raises(TokenizerError, match="SecurityError|unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{{ messages.append(1) }}")
    with pytest.raises(TokenizerError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    assert tok.apply_chat_template([{"role": "user", "content": "é"}],
                                   chat_template="{{ messages[0] | tojson }}") == '{"role": "user", "content": "é"}'


def _toy_metadata(**overrides) -> dict:
    # 256 byte-level tokens, two merges, one control and one user-defined token.
    from hanzo_torch.tokenizer import _CHAR_TO_BYTE

    alphabet = sorted(_CHAR_TO_BYTE, key=_CHAR_TO_BYTE.get)
    tokens = alphabet + ["he", "hel", "<|end|>", "<x>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [NORMAL] * 258 + [CONTROL, USER_DEFINED],
        "tokenizer.ggml.merges": ["h e", "he l"],
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                                   "{% if add_generation_prompt %}[assistant]{% endif %}",
    }
    meta.update(overrides)
    return meta


def test_toy_vocabulary_bpe():
    tok = Tokenizer.from_gguf(_toy_metadata())
    ids = tok.encode("hello<|end|> <x>")
    assert tok.tokens[ids[0]] == "hel" and [tok.tokens[i] for i in ids[1:3]] == ["l", "o"]
    assert ids[3] == 258 and tok.tokens[ids[4]] == "Ġ" and ids[5] == 259
    assert tok.decode(ids) == "hello<|end|> <x>"
    assert tok.decode(ids, skip_special_tokens=True) == "hello <x>"
    assert tok.eos_token_ids == {258}  # eos; "<|end|>" is also an end-of-generation text
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "[user]q[assistant]"


@pytest.mark.parametrize("overrides, match", [
    ({"tokenizer.ggml.model": "llama"}, "unsupported tokenizer.ggml.model 'llama'"),
    ({"tokenizer.ggml.pre": "falcon"}, "unsupported tokenizer.ggml.pre 'falcon'"),
    ({"tokenizer.ggml.token_type": [NORMAL] * 3}, "token_type has 3 entries"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id 1000000 is outside"),
    ({"tokenizer.ggml.merges": ["hel"]}, "malformed tokenizer.ggml.merges"),
    # a broken template is a problem of the file: found when the tokenizer is built, not used
    ({"tokenizer.chat_template": "{% if %}"}, "chat_template does not parse"),
    ({"tokenizer.chat_template": 5}, "chat_template must be a string, got int"),
    ({"tokenizer.ggml.merges": [["h", "e"]]}, r"merges\[0\] is list"),
    ({"tokenizer.ggml.merges": "h e"}, "merges must be an array of strings"),
    ({"tokenizer.ggml.tokens": [["a"], "b"]}, r"tokens\[0\] is list"),
    ({"tokenizer.ggml.token_type": [[1]] * 260}, r"token_type\[0\] = \[1\] is not a token type"),
    ({"tokenizer.ggml.token_type": [1.0] * 260}, r"token_type\[0\] = 1.0 is not a token type"),
    ({"tokenizer.ggml.token_type": [99] * 260}, r"token_type\[0\] = 99 is not a token type"),
    ({"tokenizer.ggml.bos_token_id": 1.0}, "bos_token_id must be an integer, got float"),
    ({"tokenizer.ggml.eos_token_id": True}, "eos_token_id must be an integer, got bool"),
    ({"tokenizer.ggml.add_bos_token": 1}, "add_bos_token must be a bool, got int"),
])
def test_bad_metadata_raises(overrides, match):
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_gguf(_toy_metadata(**overrides))


def test_missing_tokenizer_and_bad_ids():
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "qwen3"})
    tok = Tokenizer.from_gguf(_toy_metadata())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5, 260])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.incremental_decoder().push(-1)
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="no tokenizer.chat_template"):
        Tokenizer.from_gguf(_toy_metadata(**{"tokenizer.chat_template": None})).apply_chat_template([])


@pytest.mark.slow
def test_real_model_matches_transformers_auto_tokenizer():
    from transformers import AutoTokenizer

    if not REAL_MODEL.is_file():
        pytest.fail(f"real model missing: {REAL_MODEL} (run `hanzo-torch pull`)")
    tok = Tokenizer.from_gguf(REAL_MODEL)
    hf = AutoTokenizer.from_pretrained(str(REAL_MODEL.parent), gguf_file=REAL_MODEL.name)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert tok.decode(ids) == text == hf.decode(ids)
    for msgs in MESSAGE_SETS:
        assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_invalid_utf8_is_replaced_like_tokenizers():
    tok = Tokenizer.from_gguf(_toy_metadata())
    ids_of = {tok.tokens[i]: i for i in range(256)}
    from hanzo_torch.tokenizer import _CHAR_TO_BYTE

    byte_id = {b: ids_of[c] for c, b in _CHAR_TO_BYTE.items()}
    for seq in ([0xF0, 0x9F, 0x8E, 0x61], [0xF0, 0x9F], [0xC3, 0x28], [0xFF, 0xFE, 0x78], [0xED, 0xA0, 0x80]):
        ids = [byte_id[b] for b in seq]
        text = tok.decode(ids)
        assert text == tok.backend.decode(ids) and "\ufffd" in text  # tokenizers' lossy UTF-8
        dec = tok.incremental_decoder()
        assert "".join(dec.push(i) for i in ids) + dec.flush() == text
