"""Qwen2 / Qwen3 / Qwen3-MoE models against transformers' GGUF loader, on tiny random-weight files.

For each architecture :mod:`tests.gguf_builders` writes a *packed* file P (a mix of K-quants,
legacy quants and F32, per layer) and its *dense twin* D: the same model with every tensor stored
as F32 holding the exact ``gguf.quants.dequantize`` of P's tensor. transformers
(``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``) dequantizes P with that same
function, so its model of D is its model of P; loading D only keeps each architecture to one
transformers load (about 10-40 s each on a shared 2-core machine: gguf's reader walks the 152k
vocabulary element by element).

Error bounds (relative: max |ours - theirs| / max |theirs| over all logits):

* ``DENSE_RTOL = 1e-4`` where both sides compute in float32 with the same weights (D, and P with
  the ``HANZO_<OP>_FALLBACK`` references, which dequantize to float32 and multiply). float32
  rounding (eps 6e-8) over dot products of length <= 768 and two layers gives about 1e-6
  (measured 2e-7 to 5e-7); a wrong RoPE, norm, bias, head layout or expert choice gives O(1).
* For P on the fast kernels, which quantize activations to int8 per block (ggml q8_1/q8_K, a
  relative rounding of up to 2^-8 per value, about 0.5% per matmul): per position,
  max |diff| / max |logit|, median over positions < ``KERNEL_MEDIAN_RTOL = 1e-2`` (measured
  2e-3 to 5e-3) and max < ``KERNEL_MAX_RTOL = 0.25`` (measured up to 5e-2: in the MoE model a
  rounding-level change flips a near-tied expert choice for one token), and the teacher-forced
  greedy token agrees at >= 90% of positions (measured 100%). A wrong row, scale or expert is
  O(1) everywhere.
* ``SHAPE_RTOL = 1e-2`` when the same packed model on the fast kernels sees the same tokens in
  different shapes (batch vs single, prefill vs decode): a kernel may quantize activations
  differently on its mat-vec and GEMM paths (measured 1.4e-3). A KV-cache slot, position or
  mask error gives O(1).
"""
from __future__ import annotations

import functools
import math
import mmap

import gguf
import pytest
import torch

import hanzo_torch
from hanzo_torch import GGUFError, GGUFTensor
from hanzo_torch.models.layers import Embedding, Experts, Linear, PackedEmbedding, PackedExperts, PackedLinear
from hanzo_torch.models.qwen import Transformer
from tests.gguf_builders import tiny_spec, tokenizer_metadata, write_tiny_gguf

transformers = pytest.importorskip("transformers")

DENSE_RTOL = 1e-4
KERNEL_MEDIAN_RTOL = 1e-2
KERNEL_MAX_RTOL = 0.25
SHAPE_RTOL = 1e-2
N_GREEDY = 32
MAX_CONTEXT = 128
FALLBACK_OPS = ("mul_mat", "mul_mat_id", "get_rows", "swiglu_mul_mat")

# Packed formats per role (embd, output, attn, ffn = gate/up, ffn_down, router), per layer.
SPECS = {
    # untied head; layer 0 packed (K-quants + Q5_0), layer 1 F32
    "qwen3": dict(tied=False, qtypes=dict(embd="Q8_0", output="Q6_K"),
                  layer_qtypes={0: dict(attn="Q4_K", ffn="Q5_0", ffn_down="Q6_K")}),
    # tied F32 embedding; layer 0 experts packed, layer 1 F32 (router always F32, as llama.cpp)
    "qwen3moe": dict(layer_qtypes={0: dict(attn="Q8_0", ffn="Q4_K", ffn_down="Q6_K")}),
    # tied packed embedding like the real Qwen2.5 files; every layer packed
    "qwen2": dict(qtypes=dict(embd="Q4_K", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K"),
                  layer_qtypes={1: dict(attn="Q8_0", ffn="Q4_1", ffn_down="Q5_1")}),
}
ARCHS = tuple(SPECS)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class Zoo:
    """Files, models and reference outputs shared by the whole module (built on first use)."""

    def __init__(self, root):
        self.root = root
        self.meta = tokenizer_metadata(full=False)
        self.prompt = torch.randint(0, 151643, (1, 16), generator=torch.Generator().manual_seed(1))

    @functools.cache
    def files(self, arch: str) -> tuple[str, str]:
        spec = tiny_spec(arch, **SPECS[arch])
        d = self.root / arch
        d.mkdir()
        return (write_tiny_gguf(d / "packed.gguf", spec, self.meta),
                write_tiny_gguf(d / "dense.gguf", spec, self.meta, dense_twin=True))

    def model(self, arch: str, which: str, **kw):
        packed, dense = self.files(arch)
        kw.setdefault("kv_dtype", "f32")  # as transformers keeps K/V: DENSE_RTOL assumes float32 throughout
        return hanzo_torch.load(packed if which == "packed" else dense, max_context=MAX_CONTEXT, **kw)

    @functools.cache
    def hf(self, arch: str):
        """transformers' model of the dense twin, its greedy continuation and the logits over it."""
        _, dense = self.files(arch)
        import pathlib

        path = pathlib.Path(dense)
        with _cached_gguf_reader():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            out = model.generate(self.prompt, max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY,
                                 do_sample=False, pad_token_id=0)
            seq = out[:, : self.prompt.shape[1] + N_GREEDY]
            logits = model(seq).logits.float()
        return model, seq, logits


class _cached_gguf_reader:
    """Within the block, ``gguf.GGUFReader`` parses each file once (transformers opens it 2-3
    times; each parse of a 152k vocabulary takes seconds)."""

    def __enter__(self):
        self.orig = gguf.GGUFReader
        gguf.GGUFReader = functools.lru_cache(maxsize=2)(self.orig)

    def __exit__(self, *exc):
        gguf.GGUFReader = self.orig


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("models"))


@pytest.fixture
def references():
    with hanzo_torch.ops.use_reference(*FALLBACK_OPS):
        yield


def greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Prefill ``prompt [1, T]`` then decode ``n - 1`` tokens one at a time through the KV cache."""
    model.reset()
    with torch.no_grad():
        tokens = [int(model(prompt)[0, -1].argmax())]
        for _ in range(n - 1):
            tokens.append(int(model(torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
    return torch.cat([prompt, torch.tensor([tokens])], dim=1)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_dense_matches_transformers(zoo, arch):
    """F32 file: logits over prompt + continuation within DENSE_RTOL; 32 greedy tokens identical."""
    _, hf_seq, hf_logits = zoo.hf(arch)
    model = zoo.model(arch, "dense")
    assert model.args.arch == arch
    seq = greedy(model, zoo.prompt, N_GREEDY)
    assert seq.tolist() == hf_seq.tolist()
    model.reset()
    with torch.no_grad():
        logits = model(hf_seq)
    assert logits.dtype == torch.float32 and logits.shape == hf_logits.shape
    assert rel_err(logits, hf_logits) < DENSE_RTOL


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_references_match_transformers(zoo, arch, references):
    """Packed file on the float32 reference ops: as exact as the dense file. Greedy agreement is
    checked teacher-forced (argmax at each position of transformers' greedy sequence), which,
    with incremental == full forward (tested below), is the same statement as equal greedy
    sequences, at the cost of one forward (the references dequantize every weight per call)."""
    _, hf_seq, hf_logits = zoo.hf(arch)
    model = zoo.model(arch, "packed")
    assert any(isinstance(p, GGUFTensor) and p.qtype != "F32" for p in model.parameters())
    with torch.no_grad():
        logits = model(hf_seq)
    assert rel_err(logits, hf_logits) < DENSE_RTOL
    P = zoo.prompt.shape[1]
    assert logits[0, P - 1 : -1].argmax(-1).tolist() == hf_seq[0, P:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_kernels_match_transformers(zoo, arch):
    """Packed file on whatever kernels are registered (int8-dot on CPU): see the module docstring."""
    _, hf_seq, hf_logits = zoo.hf(arch)
    model = zoo.model(arch, "packed")
    with torch.no_grad():
        logits = model(hf_seq)
    per_pos = ((logits - hf_logits).abs().amax(-1) / hf_logits.abs().amax(-1))[0]
    assert per_pos.median().item() < KERNEL_MEDIAN_RTOL, per_pos
    assert per_pos.max().item() < KERNEL_MAX_RTOL, per_pos
    P = zoo.prompt.shape[1]
    agree = (logits[0, P - 1 : -1].argmax(-1) == hf_seq[0, P:]).float().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2"])
def test_incremental_decode_equals_full_forward(zoo, arch):
    """Prefill + single tokens + a chunk, with implicit and explicit positions, equals one forward."""
    model = zoo.model(arch, "packed")
    seq = torch.randint(0, 151643, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(seq)
        model.reset()
        parts = [model(seq[:, :7])]
        for t in range(7, 10):
            parts.append(model(seq[:, t : t + 1]))
        parts.append(model(seq[:, 10:15], positions=torch.arange(10, 15)[None]))
        for t in range(15, 20):  # explicit positions, as a captured decode graph feeds them
            parts.append(model(seq[:, t : t + 1], positions=torch.tensor([[t]])))
        last = model(seq[:, 19:20], positions=torch.tensor([[19]]), last_only=True)
    assert rel_err(torch.cat(parts, dim=1), full) < SHAPE_RTOL
    assert last.shape == (1, 1, full.shape[-1]) and rel_err(last, full[:, -1:]) < SHAPE_RTOL


def test_decode_step_compiles_as_one_graph(zoo):
    """torch.compile(fullgraph=True) of a decode step with explicit positions: any host sync
    (.item(), .tolist(), data-dependent shapes) in the forward would be a graph break and fail.
    The compiled steps equal the eager ones."""
    model = zoo.model("qwen3moe", "packed")
    prompt = torch.tensor([[11, 22, 33, 44]])
    with torch.no_grad():
        model(prompt)
        eager = [model(torch.tensor([[t]]), positions=torch.tensor([[t]])) for t in range(4, 7)]
        model.reset()
        model(prompt)
        step = torch.compile(model, fullgraph=True, dynamic=False)
        for t, ref in zip(range(4, 7), eager):
            assert rel_err(step(torch.tensor([[t]]), positions=torch.tensor([[t]])), ref) < DENSE_RTOL


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_batch_of_two_equals_single_sequences(zoo, arch):
    model = zoo.model(arch, "packed")
    seqs = torch.randint(0, 151643, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batch = model(seqs[:, :11])
        batch_next = model(seqs[:, 11:])  # one decode step for both rows
        for b in range(2):
            model.reset()
            single = model(seqs[b : b + 1])
            assert rel_err(batch[b], single[0, :11]) < SHAPE_RTOL
            assert rel_err(batch_next[b], single[0, 11:]) < SHAPE_RTOL
        with pytest.raises(ValueError, match="batch size"):
            model(seqs[:, :1])  # B=2 mid-sequence of a B=1 sequence


def test_bfloat16_compute(zoo):
    """dtype=bfloat16: activations and KV cache in bf16, logits still float32, close to float32
    (bf16 keeps 8 mantissa bits: ~0.4% per rounding; measured per-position median 5e-3)."""
    packed, _ = zoo.files("qwen3moe")
    m32 = hanzo_torch.load(packed, max_context=32)
    m16 = hanzo_torch.load(packed, max_context=32, dtype=torch.bfloat16, kv_dtype="bf16")
    ids = torch.randint(0, 151643, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = m32(ids), m16(ids)
    assert b.dtype == torch.float32 and m16.blk[0].k_cache.dtype == torch.bfloat16
    per_pos = ((a - b).abs().amax(-1) / a.abs().amax(-1))[0]
    assert per_pos.median().item() < 3e-2, per_pos
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_context_overflow_raises(zoo):
    _, dense = zoo.files("qwen3")
    model = hanzo_torch.load(dense, max_context=8)
    assert model.max_context == 8
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]))
        with pytest.raises(ValueError, match="context overflow"):
            model(torch.tensor([[7, 8, 9]]))
        with pytest.raises(ValueError, match="context overflow"):
            model(torch.tensor([[7]]), positions=torch.tensor([[8]]))
        model.reset()
        assert model(torch.arange(8)[None]).shape == (1, 8, 151936)  # exactly full is fine
    assert hanzo_torch.load(dense).max_context == 2048  # min(context_length, 4096)


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_layers_match_packed_layers(zoo, arch, references):
    """A model built by hand from the dense layers, holding the float32 expansion of the packed
    file's weights, computes what load()'s packed layers compute on the float32 references
    (within DENSE_RTOL: the same products, summed in another order). A wrong expert gather,
    gate/up swap or transposed weight in a dense twin is O(1)."""
    model = zoo.model(arch, "packed")
    dense = Transformer(model.args, MAX_CONTEXT)
    state = {n: p.dequantize(torch.float32) if isinstance(p, GGUFTensor) else p for n, p in model.state_dict().items()}
    dense.load_state_dict(state)
    dense.kv_dtype = "f32"
    assert type(dense.blk[0].attn_q) is Linear and not any(isinstance(p, GGUFTensor) for p in dense.parameters())
    ids = torch.randint(0, 151643, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = torch.cat([model(ids[:, :9]), model(ids[:, 9:])], dim=1)
        got = torch.cat([dense(ids[:, :9]), dense(ids[:, 9:])], dim=1)
    assert rel_err(got, want) < DENSE_RTOL


def test_load_swaps_in_packed_layers_and_builds_nothing(zoo, monkeypatch):
    """Every projection, embedding and expert layer of a loaded model is its packed twin; load()
    activates no backend (the first op does)."""
    activated = []
    monkeypatch.setattr(hanzo_torch.backends, "activate", lambda device_type: activated.append(device_type))
    for arch in ("qwen3moe", "qwen2"):
        model = hanzo_torch.load(zoo.files(arch)[0])
        kinds = {type(m) for m in model.modules()} & {Linear, Embedding, Experts, PackedLinear, PackedEmbedding,
                                                      PackedExperts}
        assert kinds == ({PackedLinear, PackedEmbedding, PackedExperts} if arch == "qwen3moe"
                         else {PackedLinear, PackedEmbedding}), kinds
    assert activated == []


def test_weights_stay_packed(zoo):
    packed, _ = zoo.files("qwen2")
    model = hanzo_torch.load(packed, mmap=True)
    f = model.gguf
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert type(p) is not GGUFTensor and p.dtype == torch.float32, name
        else:
            assert isinstance(p, GGUFTensor), name
            assert f.maps(p.packed), name  # a view of the memory-mapped file, not a copy
    assert model.output.weight is model.token_embd.weight  # tied: no output.weight in the file
    assert model.token_embd.weight.qtype == "Q4_K"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])
def test_copied_weights_equal_mapped_ones(zoo, arch):
    """mmap=False: every packed weight (expert stacks included) is a copy outside the file mapping
    with the same bytes, page-aligned, tied weights stay one tensor, and the logits are the same bits."""
    packed, _ = zoo.files(arch)
    mapped = hanzo_torch.load(packed, max_context=32, mmap=True)
    copied = hanzo_torch.load(packed, max_context=32, mmap=False)
    f = copied.gguf
    pm, pc = dict(mapped.named_parameters()), dict(copied.named_parameters())
    assert pm.keys() == pc.keys()
    n_packed = 0
    for name, w in pc.items():
        if isinstance(w, GGUFTensor):
            n_packed += 1
            assert not f.maps(w.packed) and w.packed.data_ptr() % mmap.PAGESIZE == 0, name
            assert w.packed.untyped_storage().nbytes() == w.packed.numel(), name  # saving one saves only it
            assert (w.qtype, w.shape, w.dtype) == (pm[name].qtype, pm[name].shape, pm[name].dtype), name
            assert torch.equal(w.packed, pm[name].packed), name
    assert n_packed >= 9
    assert copied.output.weight is copied.token_embd.weight
    with torch.inference_mode():
        assert torch.equal(copied(zoo.prompt), mapped(zoo.prompt))


def test_mmap_argument_is_checked_before_work(zoo, tmp_path):
    packed, _ = zoo.files("qwen2")
    with pytest.raises(TypeError, match="mmap must be None, True or False, got str 'no'"):
        hanzo_torch.load(packed, mmap="no")
    with pytest.raises(TypeError, match="mmap must be"):  # before the file is even opened
        hanzo_torch.load(tmp_path / "missing.gguf", mmap=1)


def test_mmap_false_refuses_a_copy_that_does_not_fit(zoo, monkeypatch):
    from hanzo_torch import host_memory

    packed, _ = zoo.files("qwen2")
    monkeypatch.setattr(host_memory, "mem_available", lambda: 1000)
    with pytest.raises(MemoryError, match=r"packed.gguf'\): mmap=False needs .* GiB .* available; use mmap=True"):
        hanzo_torch.load(packed, mmap=False)
    model = hanzo_torch.load(packed)  # the default maps the file when the copy would not fit in half
    assert all(model.gguf.maps(p.packed) for p in model.parameters() if isinstance(p, GGUFTensor))


def test_config_from_metadata(zoo):
    packed, _ = zoo.files("qwen3moe")
    a = hanzo_torch.load(packed).args
    assert (a.n_layer, a.dim, a.n_head, a.n_head_kv, a.head_dim) == (2, 256, 4, 2, 128)
    assert (a.moe, a.n_expert, a.n_expert_used, a.expert_ffn_dim, a.qk_norm, a.qkv_bias) == (
        True, 8, 2, 768, True, False)
    assert a.head_dim * a.n_head != a.dim  # head_dim comes from key_length, not dim / heads
    assert (a.rope_theta, a.vocab_size, a.tied_embeddings) == (1e6, 151936, True)
    assert math.isclose(a.norm_eps, 1e-6, rel_tol=1e-6)


def test_unknown_architecture_raises(tmp_path):
    embd = {"token_embd.weight": torch.zeros(8, 32)}
    hanzo_torch.save_gguf(tmp_path / "llama.gguf", embd, {"llama.block_count": 1}, architecture="llama")
    with pytest.raises(GGUFError, match=r"unsupported architecture 'llama'.*qwen2, qwen3, qwen3moe"):
        hanzo_torch.load(tmp_path / "llama.gguf")
    hanzo_torch.save_gguf(tmp_path / "none.gguf", embd, {"qwen2.block_count": 1})
    with pytest.raises(GGUFError, match="no general.architecture"):
        hanzo_torch.load(tmp_path / "none.gguf")


def test_missing_tensor_and_bad_shape_raise(zoo, tmp_path):
    meta = {"tokenizer.ggml.tokens": zoo.meta["tokenizer.ggml.tokens"][:512]}
    spec = tiny_spec("qwen2", n_layer=1)
    path = write_tiny_gguf(tmp_path / "ok.gguf", spec, meta)
    f = hanzo_torch.GGUFFile(path)
    tensors = {n: t.dequantize(torch.float32).numpy() for n, t in f.tensors.items()}
    md = {k: f.metadata[k] for k in f.metadata if k.startswith("qwen2.") or k == "general.architecture"}
    dropped = {n: t for n, t in tensors.items() if n != "blk.0.attn_q.bias"}
    hanzo_torch.save_gguf(tmp_path / "missing.gguf", {n: torch.from_numpy(t) for n, t in dropped.items()}, md)
    with pytest.raises(GGUFError, match="missing tensor 'blk.0.attn_q.bias'"):
        hanzo_torch.load(tmp_path / "missing.gguf")
    bad = dict(tensors, **{"blk.0.ffn_up.weight": tensors["blk.0.ffn_up.weight"][:256]})
    hanzo_torch.save_gguf(tmp_path / "bad.gguf", {n: torch.from_numpy(t) for n, t in bad.items()}, md)
    with pytest.raises(GGUFError, match="'blk.0.ffn_up.weight' has shape"):
        hanzo_torch.load(tmp_path / "bad.gguf")


def test_tokenizer_and_generate(tmp_path):
    """A file with the full Qwen3 vocabulary: model.tokenizer and model.generate (greedy) agree
    with encoding by hand and the cached greedy loop."""
    spec = tiny_spec("qwen3", n_layer=1)
    path = write_tiny_gguf(tmp_path / "full.gguf", spec, tokenizer_metadata(full=True))
    model = hanzo_torch.load(path, max_context=64)
    ids = model.tokenizer.encode("def fibonacci(n):")
    assert model.tokenizer.decode(ids) == "def fibonacci(n):"
    expected = greedy(model, torch.tensor([ids]), 8)[0, len(ids):].tolist()
    result = model.generate("def fibonacci(n):", max_new_tokens=8, temperature=0, ignore_eos=True)
    assert result.token_ids == expected
