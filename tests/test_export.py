"""hanzo_torch.export: the prefill and decode steps as aten-only programs, torch-mlir, IREE.

Tiny random-weight qwen3 and qwen3moe files (1 layer, hidden 256, a 263-token vocabulary) carry
Q4_K, Q6_K, Q8_0 and IQ4_XS weights. The exported program is checked against eager hanzo-torch:

* against the op references (``hanzo_torch.ops.use_reference``: the same float32 maths in another
  order), relative error <= ``REF_RTOL`` = 1e-4 of the largest logit (float32 summation order;
  a wrong block layout or a lost scale is off by O(1));
* against the default CPU kernels, which quantize activations to int8 (q8_1): median relative
  error <= 5e-2 and max <= 0.25 (measured: median 1.2e-2 on the qwen3 file; the kernels' own
  rounding, not the export's).

The torch.export part needs only torch; the MLIR part (torch-mlir -> linalg-on-tensors, IREE
``llvm-cpu`` compile and run) needs the ``[mlir]`` extra and is skipped with the reason when it
is absent.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

import hanzo_torch
from hanzo_torch import GGUFTensor
from hanzo_torch import export as hx
from tests.gguf_builders import tiny_spec, write_tiny_gguf
from tests.qwen_vocab import toy_tokenizer_metadata

REF_RTOL = 1e-4
KERNEL_MEDIAN_RTOL = 5e-2
KERNEL_MAX_RTOL = 0.25
MAX_CONTEXT = 8
PREFILL = 4
REF_OPS = ("mul_mat", "mul_mat_id", "get_rows", "swiglu_mul_mat", "moe_route", "rms_norm", "add_rms_norm",
           "qk_norm_rope", "swiglu", "kv_cache_write", "qk_norm_rope_kv_write", "attention")

SPECS = {
    "qwen3": dict(n_layer=1, ffn=256, qtypes=dict(embd="Q8_0", attn="Q4_K", ffn="Q6_K", ffn_down="IQ4_XS")),
    "qwen3moe": dict(n_layer=1, n_expert=4, n_expert_used=2, expert_ffn=256,
                     qtypes=dict(embd="Q6_K", attn="Q8_0", ffn="Q4_K", ffn_down="IQ4_XS", router="Q8_0")),
}


@functools.cache
def tiny_file(arch: str, root: str) -> str:
    return write_tiny_gguf(os.path.join(root, f"{arch}.gguf"), tiny_spec(arch, **SPECS[arch]),
                           toy_tokenizer_metadata())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("export"))


def load(arch, root):
    # the exported programs keep their caches in the compute dtype (float32); so does this eager model
    return hanzo_torch.load(tiny_file(arch, root), max_context=MAX_CONTEXT, kv_dtype="f32")


@functools.cache
def programs(arch: str, root: str):
    """(model, prefill program, decode program, the model's state before the export): exporting
    costs seconds, so once per file."""
    model = load(arch, root)
    ids, pos = prompt(arch)
    before = eager_logits(model, ids, pos)[1]
    k, state = model.blk[0].k_cache, (model.cache_batch_size, model.seq_len)
    ep, dec = hx.export_program(model, seq_len=PREFILL), hx.export_program(model, seq_len=1)
    kept = model.blk[0].k_cache is k and (model.cache_batch_size, model.seq_len) == state
    return model, ep, dec, (before, kept)


def prompt(arch):
    g = torch.Generator().manual_seed(len(arch))
    ids = torch.randint(0, 263, (1, PREFILL + 1), generator=g)
    pos = torch.arange(PREFILL + 1).unsqueeze(0)
    return ids, pos


def eager_logits(model, ids, pos, monkeypatch=None):
    """Prefill of the first PREFILL tokens, then one decode step: (logits [1, T, V], logits [1, 1, V])."""
    model.setup_cache(1)
    with torch.no_grad():
        a = model(ids[:, :PREFILL], pos[:, :PREFILL])
        b = model(ids[:, PREFILL:], pos[:, PREFILL:])
    return a, b


def reference_logits(model, ids, pos, monkeypatch):
    with hanzo_torch.ops.use_reference(*REF_OPS):
        return eager_logits(model, ids, pos)


def rel(a, b) -> torch.Tensor:
    return (a.float() - b.float()).abs() / b.float().abs().max()


def check_close(got, ref, fast):
    assert got.shape == ref.shape
    assert rel(got, ref).max().item() <= REF_RTOL
    e = rel(got, fast)
    assert e.median().item() <= KERNEL_MEDIAN_RTOL and e.max().item() <= KERNEL_MAX_RTOL


def run_program(ep, model, ids, pos, caches):
    out = ep.module()(ids, pos, *caches)
    return out[0], list(out[1:])


@pytest.mark.parametrize("arch", list(SPECS))
def test_export_program_is_aten_only_packed_and_matches_eager(arch, root, monkeypatch):
    model, ep, dec, _ = programs(arch, root)
    ids, pos = prompt(arch)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if t.startswith("hanzo.")], targets
    # the weights are the packed bytes: every GGUFTensor's uint8 data and nothing dense of its size
    packed = [p.packed for p in model.parameters() if isinstance(p, GGUFTensor)]
    state = {**ep.state_dict, **ep.constants}
    u8 = {t.data_ptr(): t for t in state.values() if t.dtype == torch.uint8}  # a tied weight is listed twice
    assert sorted(t.numel() for t in u8.values()) == sorted({t.data_ptr(): t.numel() for t in packed}.values())
    biggest_float = max((t.numel() for t in state.values() if t.is_floating_point()), default=0)
    assert biggest_float < min(p.numel() for p in model.parameters() if isinstance(p, GGUFTensor))

    a = model.args
    caches = [torch.zeros(1, MAX_CONTEXT, a.n_head_kv, a.head_dim) for _ in range(2 * a.n_layer)]
    got, caches = run_program(ep, model, ids[:, :PREFILL], pos[:, :PREFILL], caches)
    got2, _ = run_program(dec, model, ids[:, PREFILL:], pos[:, PREFILL:], caches)
    ref, ref2 = reference_logits(model, ids, pos, monkeypatch)
    fast, fast2 = eager_logits(model, ids, pos)
    check_close(got, ref, fast)
    check_close(got2, ref2, fast2)


def test_export_program_leaves_the_model_alone(root):
    model, _, _, (before, kept) = programs("qwen3", root)
    assert kept, "the export changed the model's KV cache or sequence state"
    ids, pos = prompt("qwen3")
    torch.testing.assert_close(eager_logits(model, ids, pos)[1], before, rtol=0, atol=0)


def test_export_program_bad_arguments(root):
    model = load("qwen3", root)
    with pytest.raises(ValueError, match="seq_len"):
        hx.export_program(model, seq_len=MAX_CONTEXT + 1)
    with pytest.raises(ValueError, match="batch_size"):
        hx.export_program(model, seq_len=1, batch_size=0)
    with pytest.raises(TypeError, match="hanzo_torch.load"):
        hx.export_program(torch.nn.Linear(2, 2))


def test_half_bits_decode_is_exact():
    bits = torch.arange(65536, dtype=torch.int64)
    want = bits.to(torch.int32).to(torch.int16).view(torch.float16).float()
    got = hx._half_bits_to_float(bits)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # signed zeros too


# ---------------------------------------------------------------------- torch-mlir + IREE
mlir_reason = hx.mlir_available()
needs_mlir = pytest.mark.skipif(mlir_reason is not None, reason=mlir_reason or "")


@needs_mlir
# the MoE model's IREE compile is the longest case of the default suite: slow-marked (its exported
# program is checked against eager by test_export_program_is_aten_only_packed_and_matches_eager)
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "qwen3moe" else a for a in SPECS])
def test_mlir_export_runs_in_iree(arch, root, monkeypatch, tmp_path):
    model, ep, dec, _ = programs(arch, root)
    ids, pos = prompt(arch)
    out = tmp_path / f"{arch}.mlirbc"
    hx.lower_to_mlir({"prefill": ep, "decode": dec}, out)
    result = hx.ExportResult(str(out), out.stat().st_size, PREFILL, MAX_CONTEXT, 1, model.args.n_layer, 0)
    gguf_bytes = os.path.getsize(tiny_file(arch, root))
    # the packed weights are in the module as bytes, not expanded to float32 (4-8x the GGUF)
    assert 0 < result.file_bytes < 2 * gguf_bytes, (result, gguf_bytes)
    print(f"{arch}: {out.name} {result.file_bytes} bytes, GGUF {gguf_bytes} bytes")
    vmfb = hx.compile_iree(out)
    print(f"{arch}: vmfb {len(vmfb)} bytes")
    assert len(vmfb) < 2 * gguf_bytes, (len(vmfb), gguf_bytes)
    iree = hx.IreeModel.from_model(vmfb, result, model)
    got = iree.prefill(ids[:, :PREFILL], pos[:, :PREFILL])
    got2 = iree.decode(ids[:, PREFILL:], pos[:, PREFILL:])
    ref, ref2 = reference_logits(model, ids, pos, monkeypatch)
    fast, fast2 = eager_logits(model, ids, pos)
    check_close(got, ref, fast)
    check_close(got2, ref2, fast2)


def test_mlir_missing_names_the_extra(monkeypatch, root):
    monkeypatch.setattr(hx, "mlir_available", lambda: "the MLIR export needs the [mlir] extra")
    with pytest.raises(ImportError, match=r"\[mlir\]"):
        hx.export_mlir(load("qwen3", root), "/nonexistent/x.mlir")


def test_cli_export_without_the_extra(monkeypatch, root, tmp_path, capsys):
    from hanzo_torch import cli

    monkeypatch.setattr(hx, "mlir_available", lambda: "the MLIR export needs the [mlir] extra")
    assert cli.main(["export", tiny_file("qwen3", root), "-o", str(tmp_path / "m.mlir")]) == 1
    err = capsys.readouterr().err
    assert "[mlir] extra" in err and "Traceback" not in err
    assert cli.main(["export", tiny_file("qwen3", root), "-o", str(tmp_path / "m.mlir"), "-c", "4",
                     "--prefill-len", "8"]) == 1
    assert "--prefill-len 8 exceeds -c 4" in capsys.readouterr().err


@needs_mlir
def test_cli_export_writes_the_module(root, tmp_path, capsys, monkeypatch):
    from hanzo_torch import cli

    _, ep, dec, _ = programs("qwen3", root)
    made = {PREFILL: ep, 1: dec}  # the programs of these arguments, exported once for this module
    monkeypatch.setattr(hx, "export_program", lambda model, seq_len, batch_size=1: made[seq_len])
    out = tmp_path / "m.mlir"
    assert cli.main(["export", tiny_file("qwen3", root), "-o", str(out), "-c", str(MAX_CONTEXT),
                     "--prefill-len", str(PREFILL)]) == 0
    text = out.read_text()
    assert "func.func @prefill" in text and "func.func @decode" in text and "torch.operator" not in text
    assert "x the GGUF" in capsys.readouterr().out
