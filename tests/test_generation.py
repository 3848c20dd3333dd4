"""hanzo_torch.generation with tiny fake models (no real weights)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hanzo_torch.generation import (
    GenerationResult,
    SamplingParams,
    TextStream,
    apply_repetition_penalty,
    generate,
    sample_next,
    stream_generate,
    truncate_candidates,
)
from hanzo_torch.tokenizer import Tokenizer
from qwen_vocab import toy_tokenizer_metadata

# the scripted stand-in models run Python between ops, so a CPU graph capture of their decode
# step is rejected (with a warning, once per model): tests/test_cpu_graphs.py covers that
pytestmark = pytest.mark.filterwarnings("ignore:decode graph capture failed:RuntimeWarning")

TOK = Tokenizer.from_gguf(toy_tokenizer_metadata())
V = TOK.vocab_size
EOS, EOT = 257, 258


class ScriptedLM(nn.Module):
    """Predicts ``script[t + 1]`` after the token at position t (EOS past the end), by a margin
    of 10 logits, and checks that it is fed the script and consecutive positions."""

    def __init__(self, script: list[int], max_context: int | None = None, end: int = EOS):
        super().__init__()
        self.script = script
        self.end = end
        self.calls: list[tuple[list[int], list[int]]] = []
        self.resets = 0
        self.fed = 0
        if max_context is not None:
            self.max_context = max_context
        self.tokenizer = TOK
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the module a device

    def reset(self):
        self.resets += 1
        self.fed = 0

    def forward(self, input_ids, positions=None, *, last_only=False):
        assert input_ids.dtype == torch.long and input_ids.dim() == 2 and input_ids.shape[0] == 1
        assert positions is not None and positions.shape == input_ids.shape
        pos = positions[0].tolist()
        assert pos == list(range(self.fed, self.fed + len(pos))), (pos, self.fed)
        if hasattr(self, "max_context"):
            assert pos[-1] < self.max_context
        self.fed += len(pos)
        self.calls.append((input_ids[0].tolist(), pos))
        logits = torch.zeros(1, len(pos), V)
        for j, p in enumerate(pos):
            nxt = self.script[p + 1] if p + 1 < len(self.script) else self.end
            logits[0, j] = torch.linspace(0, 1, V)  # a deterministic background
            logits[0, j, nxt] = 10.0
        return logits[:, -1:] if last_only else logits


class FixedLM(nn.Module):
    """Returns the same logits at every position."""

    def __init__(self, logits: torch.Tensor, tokenizer=TOK):
        super().__init__()
        self.logits = logits
        self.tokenizer = tokenizer

    def reset(self):
        pass

    def forward(self, input_ids, positions=None, *, last_only=False):
        T = 1 if last_only else input_ids.shape[1]
        return self.logits.expand(1, T, -1).clone()


def _script(text: str) -> list[int]:
    return TOK.encode(text)


# ---------------------------------------------------------------------- samplers
def test_truncate_candidates_top_k_top_p_min_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    vals, ids = truncate_candidates(logits, top_k=2)
    assert ids.tolist() == [1, 3] and torch.equal(vals, logits[[1, 3]])
    assert truncate_candidates(logits, top_p=0.75)[1].tolist() == [1, 3]  # 0.5 < 0.75 <= 0.8
    assert truncate_candidates(logits, top_p=0.85)[1].tolist() == [1, 3, 2]
    assert truncate_candidates(logits, top_p=0.4)[1].tolist() == [1]  # always keeps the first
    assert truncate_candidates(logits, top_p=1.0)[1].tolist() == [1, 3, 2, 0]
    assert truncate_candidates(logits, min_p=0.5)[1].tolist() == [1, 3]  # p >= 0.25
    assert truncate_candidates(logits, min_p=0.2)[1].tolist() == [1, 3, 2]  # p >= 0.1
    assert truncate_candidates(logits, min_p=0.99)[1].tolist() == [1]
    # top-p after top-k renormalizes over the k survivors: 0.5/0.8 = 0.625 < 0.7
    assert truncate_candidates(logits, top_k=2, top_p=0.7)[1].tolist() == [1, 3]
    assert truncate_candidates(logits, top_k=2, top_p=0.6)[1].tolist() == [1]
    # min-p with top-p over the full vocabulary (the pre-cut path)
    assert truncate_candidates(logits, top_p=0.75, min_p=0.2)[1].tolist() == [1, 3]
    assert truncate_candidates(logits, top_p=0.95, min_p=0.2)[1].tolist() == [1, 3, 2]
    assert truncate_candidates(logits, top_k=10)[1].tolist() == [1, 3, 2, 0]  # k > V: no cut


def test_repetition_penalty_ctrl_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # not modified in place
    # greedy: the penalty moves the choice from the repeated token to the runner-up
    p = SamplingParams(temperature=0, repetition_penalty=3.0)
    assert sample_next(logits, p, None, recent_ids=[0]) == 2
    assert sample_next(logits, SamplingParams(temperature=0), None, recent_ids=[0]) == 0
    # repeat_last_n bounds the window
    p = SamplingParams(temperature=0, repetition_penalty=3.0, repeat_last_n=1)
    assert sample_next(logits, p, None, recent_ids=[0, 3]) == 0


def test_greedy_picks_argmax():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(V, generator=g)
        assert sample_next(logits, SamplingParams(temperature=0)) == int(logits.argmax())
        assert sample_next(logits, SamplingParams(temperature=1.5, top_k=1), torch.Generator()) == int(logits.argmax())
    model = FixedLM(torch.randn(V, generator=g))
    res = generate(model, [1, 2, 3], 5, temperature=0, ignore_eos=True)
    assert res.token_ids == [int(model.logits.argmax())] * 5


def test_sampling_distribution_respects_filters():
    probs = torch.full((V,), 1e-9)
    probs[[10, 20, 30, 40]] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    g = torch.Generator().manual_seed(1)

    def draws(n=2000, **kw):
        p = SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw})
        return [sample_next(logits, p, g) for _ in range(n)]

    d = draws()
    assert set(d) <= {10, 20, 30, 40}
    for tid, p in zip((10, 20, 30, 40), (0.5, 0.3, 0.15, 0.05)):
        sigma = math.sqrt(p * (1 - p) / len(d))
        assert abs(d.count(tid) / len(d) - p) < 5 * sigma
    assert set(draws(500, top_p=0.75)) == {10, 20}
    assert set(draws(500, top_k=3)) == {10, 20, 30}
    assert set(draws(500, min_p=0.25)) == {10, 20, 30}
    # temperature sharpens among survivors: at T=0.25, 0.5^4 : 0.3^4 -> ~88% of token 10
    d = draws(1000, temperature=0.25, top_k=2)
    assert set(d) == {10, 20} and d.count(10) / len(d) > 0.8


def test_sampling_params_validation():
    for kw in ({"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0},
               {"top_p": 1.5}, {"min_p": 1.0}, {"min_p": -0.1}, {"repetition_penalty": 0.0}, {"repeat_last_n": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="no finite value"):
        sample_next(torch.full((V,), float("nan")), SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="no finite value"):
        sample_next(torch.full((V,), float("-inf")), SamplingParams(), torch.Generator())


# ---------------------------------------------------------------------- generation loop
def test_greedy_generation_follows_script_and_stops_at_eos():
    script = _script("hello world, this is a test")
    model = ScriptedLM(script)
    res = generate(model, script[:4], 100, temperature=0)
    assert isinstance(res, GenerationResult)
    assert res.token_ids == script[4:] and res.text == TOK.decode(script[4:]) and str(res) == res.text
    st = res.stats
    assert st.stop_reason == "eos" and st.prompt_tokens == 4 and st.generated_tokens == len(script) - 4
    assert st.decode_steps == st.generated_tokens  # the EOS was produced by the last decode step
    assert st.prefill_s > 0 and st.decode_s > 0 and st.decode_tokens_per_s > 0
    assert "prefill: 4 tokens" in st.summary()
    # prefill in one forward, then one token at a time with consecutive positions
    assert model.calls[0] == (script[:4], [0, 1, 2, 3])
    assert [c[1] for c in model.calls[1:]] == [[p] for p in range(4, len(script))]
    assert [c[0][0] for c in model.calls[1:]] == script[4:]
    # a second call resets the sequence
    assert generate(model, script[:4], 100, temperature=0).token_ids == script[4:] and model.resets == 2


def test_text_prompt_and_other_eos_tokens():
    script = _script("hello there")
    res = generate(ScriptedLM(script, end=EOT), "hello", 50, temperature=0)  # <|endoftext|> also ends
    assert res.text == " there" and res.stats.stop_reason == "eos"
    res = generate(ScriptedLM(script), torch.tensor([script[:2]]), 50, temperature=0)  # [1, T] tensor
    assert res.text == TOK.decode(script[2:])


def test_max_new_tokens_and_ignore_eos():
    script = _script("abcdefgh")
    res = generate(ScriptedLM(script), script[:2], 3, temperature=0)
    assert res.token_ids == script[2:5] and res.stats.stop_reason == "length"
    assert res.stats.decode_steps == 2  # the last token is never fed back
    res = generate(ScriptedLM(script), script[:2], 10, temperature=0, ignore_eos=True)
    assert res.token_ids[:6] == script[2:] and res.token_ids[6] == EOS and len(res.token_ids) == 10
    res = generate(ScriptedLM(script), script[:2], 0)
    assert res.token_ids == [] and res.text == "" and res.stats.stop_reason == "length"


def test_context_limit():
    script = _script("0123456789abcdefghij")
    model = ScriptedLM(script, max_context=8)
    res = generate(model, script[:3], 100, temperature=0)
    # 3 prompt slots + 5 generated tokens fed back = 8; the 6th is sampled but never fed
    assert res.token_ids == script[3:9] and res.stats.stop_reason == "context"
    assert max(p for _, pos in model.calls for p in pos) == 7
    res = generate(ScriptedLM(script, max_context=8), script[:8], 5, temperature=0)
    assert len(res.token_ids) == 1  # a full context still yields the token after it
    with pytest.raises(ValueError, match="max_context is 8"):
        generate(ScriptedLM(script, max_context=8), script[:9], 5)


def test_stop_strings_batch_and_stream():
    script = _script("one two STOP three END")
    res = generate(ScriptedLM(script), script[:1], 100, temperature=0, stop="STOP")
    assert res.text == "ne two " and res.stats.stop_reason == "stop"
    assert TOK.decode(res.token_ids) == "ne two STOP"  # ids up to the token completing the stop
    res = generate(ScriptedLM(script), script[:1], 100, temperature=0, stop=["END", "three", "TO"])
    assert res.text == "ne two S"  # earliest occurrence wins
    res = generate(ScriptedLM(script), script[:1], 100, temperature=0, stop=["STOPX"])
    assert res.text == "ne two STOP three END" and res.stats.stop_reason == "eos"  # held-back text is released
    stream = generate(ScriptedLM(script), script[:1], 100, temperature=0, stop="STOP", stream=True)
    assert isinstance(stream, TextStream)
    pieces = list(stream)
    assert "".join(pieces) == "ne two " and not any("S" in p for p in pieces)
    assert stream.result is not None and stream.result.text == "ne two " and stream.stats.stop_reason == "stop"


def test_stream_equals_full_text_and_keeps_utf8_whole():
    text = "héllo 🎉 世界 <|im_start|>ok"
    script = _script("x" + text)
    full = generate(ScriptedLM(script), script[:1], 100, temperature=0)
    pieces = list(stream_generate(ScriptedLM(script), script[:1], 100, temperature=0))
    assert "".join(pieces) == full.text == "héllo 🎉 世界 ok"  # control token skipped
    assert not any("\ufffd" in p for p in pieces) and len(pieces) > 5
    kept = generate(ScriptedLM(script), script[:1], 100, temperature=0, skip_special_tokens=False)
    assert kept.text == text


def test_seed_determinism():
    g = torch.Generator().manual_seed(3)
    model = FixedLM(torch.randn(V, generator=g))
    kw = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    a = generate(model, [1, 2], 40, seed=123, **kw).token_ids
    b = generate(model, [1, 2], 40, seed=123, **kw).token_ids
    c = generate(model, [1, 2], 40, seed=124, **kw).token_ids
    assert a == b and a != c and len(set(a)) > 5
    torch.manual_seed(0)
    r = generate(model, [1, 2], 40, **kw)
    assert r.stats.seed is not None and generate(model, [1, 2], 40, seed=r.stats.seed, **kw).token_ids == r.token_ids
    state = torch.get_rng_state()
    generate(model, [1, 2], 5, seed=1, **kw)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is untouched


def test_chat_messages_prompt():
    msgs = [{"role": "user", "content": "hi"}]
    prompt = TOK.encode(TOK.apply_chat_template(msgs), add_special_tokens=False)
    model = ScriptedLM(prompt + _script("ok"))
    res = generate(model, msgs, 10, temperature=0)
    assert model.calls[0][0] == prompt and res.text == "ok"


def test_bad_inputs():
    model = ScriptedLM(_script("abc"))
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [], 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [V + 5], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1], -1)
    with pytest.raises(ValueError, match="stop strings"):
        generate(model, [1], 5, stop=[""])
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1], 5, temperature=-1)
    with pytest.raises(TypeError, match="prompt must be"):
        generate(model, 3.5, 5)
    with pytest.raises(TypeError, match="integer"):
        generate(model, torch.tensor([1.0, 2.0]), 5)
    bare = FixedLM(torch.zeros(V), tokenizer=None)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        generate(bare, "text", 5)
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate(bare, [1], 5, stop="x")
    res = generate(bare, [1], 3, temperature=0)  # ids in, ids out without a tokenizer
    assert res.token_ids == [0, 0, 0] and res.text == ""
