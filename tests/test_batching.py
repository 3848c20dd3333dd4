"""Batched generation (hanzo_torch.batching): every row equals its prompt run alone, within the
int8 kernels' tolerance (a decode step of n rows runs the quantized mat-vecs at M = n, whose
float roundings differ from M = 1, so greedy tokens may part at a near-tie)."""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch import GGUFError
from hanzo_torch.batching import BatchEngine, BatchSequence
from hanzo_torch.generation import SamplingParams
from qwen_vocab import toy_tokenizer_metadata
from tests.gguf_builders import tiny_spec, write_tiny_gguf

QTYPES = {"attn": "Q8_0", "ffn": "Q4_K", "ffn_down": "Q6_K", "embd": "Q8_0", "output": "Q8_0"}
PROMPTS = ["hello world", "a", "the quick brown fox jumps", "hell"]
TOL = 2e-2  # of the largest |logit|: the int8 CPU kernels' tolerance (row results differ by M)


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def model(request, tmp_path_factory):
    spec = tiny_spec(request.param, n_layer=2, tied=False, qtypes=QTYPES)
    path = write_tiny_gguf(tmp_path_factory.mktemp("batch") / f"{request.param}.gguf", spec, toy_tokenizer_metadata())
    return hanzo_torch.load(path, max_context=64)


def alone_logits(model, prompt_ids, tokens):
    """Logits of ``prompt_ids`` then ``tokens`` fed one at a time with batch size 1."""
    model.reset()
    P = len(prompt_ids)
    with torch.inference_mode():
        out = [model(torch.tensor([prompt_ids]), positions=torch.arange(P)[None], last_only=True)[0, -1]]
        for j, t in enumerate(tokens[:-1]):
            out.append(model(torch.tensor([[t]]), positions=torch.tensor([[P + j]]), last_only=True)[0, -1])
    return torch.stack(out)


def test_rows_equal_prompt_alone(model):
    """Different prompt lengths in one batch (3 slots for 4 prompts: one waits for a freed slot):
    each row's logits at every step equal the prompt run alone, and greedy tokens agree wherever
    the top-2 gap exceeds the tolerance."""
    tok = model.tokenizer
    engine = BatchEngine(model, 3)
    budgets = [12, 3, 9, 6]
    seqs = [BatchSequence(tok.encode(p), n, SamplingParams(temperature=0), 0, [], tok, True, True, 64,
                          keep_logits=True) for p, n in zip(PROMPTS, budgets)]
    for s in seqs:
        engine.add(s)
    steps = 0
    while not engine.idle():
        engine.step()
        steps += 1
        assert engine.busy <= 3
    assert steps < sum(budgets)  # rows were decoded together
    for s, n in zip(seqs, budgets):
        assert len(s.token_ids) == n and s.stats.stop_reason == "length"
        ref = alone_logits(model, s.prompt_ids, s.token_ids)
        got = torch.stack(s.logits)
        scale = ref.abs().max(dim=-1).values
        assert ((got - ref).abs().max(dim=-1).values <= TOL * scale).all()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * TOL * scale
        assert (got.argmax(-1) == ref.argmax(-1))[clear].all()
        assert clear.any()


def same_greedy(model, prompt_ids, got, want):
    """``got`` (a batched row's greedy tokens) equals ``want`` (the prompt run alone), except that
    from a step where the alone run's top-2 logits are within the kernels' tolerance of each other
    (a near-tie: batched rows use the int8 kernels at another row count M, whose roundings differ)
    the two may part. A difference at a step with a clear winner fails."""
    assert len(got) == len(want)
    split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if split is None:
        return
    ref = alone_logits(model, prompt_ids, want)[split]
    top2 = ref.topk(2).values
    assert top2[0] - top2[1] <= 2 * TOL * ref.abs().max(), (split, got, want)


def test_generate_list_equals_single_calls(model):
    tok = model.tokenizer
    single = [model.generate(p, max_new_tokens=8, temperature=0, ignore_eos=True) for p in PROMPTS]
    for n_parallel in (None, 2):
        batch = model.generate(PROMPTS, max_new_tokens=8, temperature=0, ignore_eos=True, n_parallel=n_parallel)
        assert len(batch) == len(PROMPTS)
        for p, r, s in zip(PROMPTS, batch, single):
            same_greedy(model, tok.encode(p), r.token_ids, s.token_ids)
            if r.token_ids == s.token_ids:
                assert r.text == s.text
    # token ids and chat message lists are prompts too: the same rows as text prompts
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    texts = model.generate(PROMPTS[:2], max_new_tokens=8, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in model.generate(ids, max_new_tokens=8, temperature=0, ignore_eos=True)] == \
        [r.token_ids for r in texts]
    from hanzo_torch.prompting import _prompt_ids

    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    alone = [model.generate(c, max_new_tokens=5, temperature=0, ignore_eos=True) for c in chats]
    for c, r, a in zip(chats, model.generate(chats, max_new_tokens=5, temperature=0, ignore_eos=True), alone):
        same_greedy(model, _prompt_ids(c, tok, True, {}), r.token_ids, a.token_ids)


def test_per_row_sampling_stop_and_stream(model):
    ref = model.generate(PROMPTS[0], max_new_tokens=10, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=7,
                         ignore_eos=True)
    rows = model.generate([PROMPTS[0], PROMPTS[0], PROMPTS[2]], max_new_tokens=10, temperature=0.9, top_k=0,
                          top_p=1.0, min_p=0.0, seed=[7, 7, 3], ignore_eos=True)
    # each row has its own generator: the two rows with one prompt and one seed draw alike, and the
    # first token (sampled from the prefill, computed alone in its slot) is the single run's; later
    # draws see logits within the int8 kernels' tolerance of the single run's (test above), which
    # can move a draw that falls next to a boundary of the distribution
    assert rows[0].token_ids == rows[1].token_ids != rows[2].token_ids
    assert rows[0].token_ids[0] == ref.token_ids[0]
    # a stop string ends its row only
    greedy = model.generate(PROMPTS[:2], max_new_tokens=10, temperature=0, ignore_eos=True)
    text0 = greedy[0].text
    stop = next(text0[i:i + 2] for i in range(3, len(text0) - 1) if text0[i:i + 2] not in greedy[1].text)
    cut = model.generate(PROMPTS[:2], max_new_tokens=10, temperature=0, ignore_eos=True, stop=stop)
    assert cut[0].stats.stop_reason == "stop" and cut[0].text == text0[:text0.find(stop)]
    assert cut[1].stats.stop_reason == "length" and cut[1].text == greedy[1].text
    stream = model.generate(PROMPTS[:2], max_new_tokens=10, temperature=0, ignore_eos=True, stream=True)
    pieces = list(stream)
    assert {r for r, _ in pieces} == {0, 1}
    assert ["".join(p for r, p in pieces if r == i) for i in (0, 1)] == [r.text for r in greedy]
    assert [r.text for r in stream.results] == [r.text for r in greedy]


def test_bad_batches_raise(model):
    with pytest.raises(ValueError, match="prompt 1: empty prompt"):
        model.generate(["a", []], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0: prompt token id 9999"):
        model.generate([[9999], [1]], max_new_tokens=2)
    with pytest.raises(ValueError, match="one int per prompt"):
        model.generate(["a", "b"], max_new_tokens=2, seed=[1])
    with pytest.raises(ValueError, match="n_parallel"):
        model.generate(["a", "b"], max_new_tokens=2, n_parallel=0)
    model.tp = object()  # what tensor_parallel=True attaches
    try:
        with pytest.raises(NotImplementedError, match="tensor-parallel"):
            BatchEngine(model, 2)
    finally:
        del model.tp


def test_non_finite_logits_are_gguf_errors(model):
    """Logits that turn NaN after the first token: GGUFError naming the file, single and batched."""
    def poison(module, args, out):
        return out if args[0].shape[1] > 1 else torch.full_like(out, float("nan"))

    handle = model.output_norm.register_forward_hook(lambda m, a, o: (poison(m, a, o[0]), o[1]))
    try:
        for prompt in ("hello world", ["hello world", "a"]):
            with pytest.raises(GGUFError, match=model.gguf.path.replace(".", r"\.") + ".*no finite value"):
                model.generate(prompt, max_new_tokens=4, temperature=0, ignore_eos=True)
    finally:
        handle.remove()
    assert len(model.generate("a", max_new_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2


def test_file_errors_at_generate_are_gguf_errors(tmp_path):
    """A chat template that compiles but fails when rendered, and a file without merges: GGUFError
    naming the file and the key, raised by generate() (as the server does per request)."""
    spec = tiny_spec("qwen3", n_layer=1)
    for template, what in (("{{ 1 // 0 }}", "ZeroDivisionError"), ("{{ messages[5].content }}", "chat template")):
        path = write_tiny_gguf(tmp_path / "t.gguf", spec, toy_tokenizer_metadata(chat_template=template))
        m = hanzo_torch.load(path, max_context=32)
        with pytest.raises(GGUFError, match=f"{path}: tokenizer.chat_template: .*{what}"):
            m.generate([{"role": "user", "content": "hi"}], max_new_tokens=2)
        with pytest.raises(GGUFError, match="tokenizer.chat_template"):
            m.generate([[{"role": "user", "content": "hi"}]] * 2, max_new_tokens=2)
    meta = toy_tokenizer_metadata()
    del meta["tokenizer.ggml.merges"]
    path = write_tiny_gguf(tmp_path / "nomerges.gguf", spec, meta)
    m = hanzo_torch.load(path, max_context=32)
    with pytest.raises(GGUFError, match=f"{path}: tokenizer.ggml.merges is missing"):
        m.generate("hi", max_new_tokens=2)
