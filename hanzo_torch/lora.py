"""LoRA fine-tuning of a GGUF model: PEFT adapters on the packed layers, llama.cpp's adapter files.

``import hanzo_torch.lora`` registers, through PEFT's custom-module dispatch
(``LoraConfig._register_custom_module``, PEFT docs "Custom models"), a LoRA layer for each layer
kind of :mod:`hanzo_torch.models.layers`, on every :class:`peft.LoraConfig` made from then on
(the configs ``PeftModel.from_pretrained`` reads back included):

================================  ==============================  =====================================
base layer                        LoRA layer                      adapter (PEFT names, torch order)
================================  ==============================  =====================================
``Linear`` / ``PackedLinear``     :class:`LoraLinear`             ``lora_A [r, in]``, ``lora_B [out, r]``
``Experts`` / ``PackedExperts``   :class:`LoraExperts`            one per expert: ``lora_A [E, r, in]``,
                                                                  ``lora_B [E, out, r]``
================================  ==============================  =====================================

so PEFT's own calls work on a model from :func:`hanzo_torch.load`::

    import hanzo_torch, hanzo_torch.lora
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(hanzo_torch.load(path), LoraConfig(r=8, lora_alpha=16,
                           target_modules=["attn_q", "attn_v", "ffn_up"]))
    logits = model(input_ids, use_cache=False)        # the training forward, [B, T, V]

The packed weights stay frozen and byte-identical (they are constants of every op); only the
adapter matrices train. PEFT's ``save_pretrained`` / ``PeftModel.from_pretrained`` write and read
``adapter_model.safetensors`` + ``adapter_config.json``. :func:`save_gguf` / :func:`load_gguf`
write and read llama.cpp's LoRA adapter GGUF (``llama-completion --lora``), :func:`merge`
writes a GGUF with the adapter folded into re-quantized weights.

The fused gate+up op (``hanzo::swiglu_mul_mat``) never sees an adapter: a SwiGLU whose gate or
up projection carries one runs the two projections unfused (:meth:`LoraLinear.swiglu`).
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

try:
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("hanzo_torch.lora needs peft: pip install 'hanzo-torch[train]'") from e

from .models.layers import Experts, Linear, PackedLinear

__all__ = ["LoraLinear", "LoraExperts", "CUSTOM_MODULES", "register", "lora_layers", "base_model",
           "save_gguf", "load_gguf", "merge"]

hanzo = torch.ops.hanzo


def _unsupported(config, layer: str) -> None:
    if config.lora_bias:
        raise ValueError(f"{layer}: LoraConfig(lora_bias=True) is not supported on hanzo-torch layers")
    if config.use_dora:
        raise ValueError(f"{layer}: LoraConfig(use_dora=True) is not supported on hanzo-torch layers")


class _AdapterLayer(nn.Module, LoraLayer):
    """The constructor PEFT's dispatcher calls and the list of adapters a forward applies, shared by
    :class:`LoraLinear` and :class:`LoraExperts`."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs) -> None:
        _unsupported(config, type(self).__name__)
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _adapters(self) -> list[str]:
        return [] if self.disable_adapters else [a for a in self.active_adapters if a in self.lora_A]


class LoraLinear(_AdapterLayer):
    """PEFT's LoRA on a :class:`~hanzo_torch.models.layers.Linear` or ``PackedLinear``:
    ``y = base(x) + sum_adapters scaling * lora_B(lora_A(dropout(x)))``.

    ``x``: ``[..., in_features]`` float; returns ``[..., out_features]`` in the base layer's output
    dtype. Without an autograd graph to build (inference, ``torch.no_grad``) one active adapter
    with no dropout on a packed base runs as one ``hanzo::lora_mul_mat``. PEFT's in-place
    ``merge``/``merge_and_unload`` is refused: the packed base stays frozen; use :func:`merge`,
    which writes a new GGUF.
    """

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError(f"{type(self).__name__}: mixed-batch adapter_names is not supported")
        base = self.base_layer
        names = self._adapters()
        if not names:
            return base(x)
        if len(names) == 1 and type(base) is PackedLinear:
            a, b = self.lora_A[names[0]].weight, self.lora_B[names[0]].weight
            graph = torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or b.requires_grad)
            if not graph and isinstance(self.lora_dropout[names[0]], nn.Identity):
                w, bias = base._parameters["weight"], base._parameters["bias"]
                y = hanzo.lora_mul_mat(x, w.packed, w.qtype, a.to(x.dtype), b.to(x.dtype),
                                       float(self.scaling[names[0]]))
                return y if bias is None else y + bias
        result = base(x)
        for name in names:
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            h = self.lora_dropout[name](x.to(lora_a.weight.dtype))
            result = result + (lora_b(lora_a(h)) * self.scaling[name]).to(result.dtype)
        return result

    def swiglu(self, up: nn.Module, x: Tensor) -> Tensor:
        """``silu(self(x)) * up(x)`` unfused, so that this layer's adapter (and ``up``'s) apply."""
        return hanzo.swiglu(self(x), up(x))

    def get_delta_weight(self, adapter: str) -> Tensor:
        """``scaling * lora_B @ lora_A``: ``[out_features, in_features]`` float, the adapter's weight delta."""
        return self.lora_B[adapter].weight @ self.lora_A[adapter].weight * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        raise NotImplementedError("the packed base weight of a hanzo-torch layer is frozen; "
                                  "hanzo_torch.lora.merge(model, out_path, qtype) writes a merged GGUF")

    def unmerge(self) -> None:
        raise NotImplementedError("hanzo-torch LoRA layers never merge in place (see hanzo_torch.lora.merge)")

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


class _ExpertLora(nn.Module):
    """A stack of per-expert adapter matrices, ``weight [n_expert, rows, cols]`` (a ``.weight`` so that
    PEFT's state-dict names are those of its ``nn.Linear`` adapters)."""

    def __init__(self, n_expert: int, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_expert, rows, cols))

    def extra_repr(self) -> str:
        return "n_expert={}, rows={}, cols={}".format(*self.weight.shape)


class LoraExperts(_AdapterLayer):
    """PEFT's LoRA on an expert bank (:class:`~hanzo_torch.models.layers.Experts` or
    ``PackedExperts``): one adapter per expert, as llama.cpp's ``*_exps`` adapters
    (``build_lora_mm_id``). ``experts(x, ids) = base(x, ids) + scaling * x @ lora_A[e]^T @ lora_B[e]^T``
    for each chosen expert ``e = ids[t, j]``; shapes as the base layer's (``x [T, in]`` or
    ``[T, k, in]``, ``ids int64 [T, k]`` -> ``[T, k, out]``).

    The adapter term groups the rows by expert on the host (one small GEMM pair per expert used),
    so a compiled forward breaks its graph there.
    """

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        E, N, K = module.weight.shape
        self.n_expert = E
        return K, N

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        if r <= 0:
            raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        p = config.lora_dropout
        self.lora_dropout.update(nn.ModuleDict({adapter_name: nn.Dropout(p) if p > 0 else nn.Identity()}))
        self.lora_A[adapter_name] = _ExpertLora(self.n_expert, r, self.in_features)
        self.lora_B[adapter_name] = _ExpertLora(self.n_expert, self.out_features, r)
        self.lora_bias[adapter_name] = False
        self.use_rslora[adapter_name] = config.use_rslora
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        init = config.init_lora_weights
        if init is not False:
            if init is not True and init != "gaussian":
                raise ValueError(f"LoraExperts: init_lora_weights={init!r} is not supported (True, False, 'gaussian')")
            with torch.no_grad():  # per expert, as PEFT's default for nn.Linear: A uniform (kaiming, a=sqrt 5), B zero
                a = self.lora_A[adapter_name].weight
                if init == "gaussian":
                    a.normal_(0.0, 1.0 / r)
                else:
                    bound = 1.0 / math.sqrt(self.in_features)
                    a.uniform_(-bound, bound)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def forward(self, x: Tensor, ids: Tensor, *args, **kwargs) -> Tensor:
        result = self.base_layer(x, ids)  # [T, k, N]
        names = self._adapters()
        if not names:
            return result
        T, k = ids.shape
        rows = (x.unsqueeze(1) if x.dim() == 2 else x).expand(T, k, x.shape[-1]).reshape(T * k, -1)
        flat = ids.reshape(-1)
        for name in names:
            a, b = self.lora_A[name].weight, self.lora_B[name].weight  # [E, r, K], [E, N, r]
            h = self.lora_dropout[name](rows.to(a.dtype))
            delta = h.new_zeros(T * k, self.out_features)
            for e in torch.unique(flat).tolist():
                sel = (flat == e).nonzero().squeeze(1)
                delta = delta.index_add(0, sel, h[sel] @ a[e].t() @ b[e].t())
            result = result + (delta * self.scaling[name]).view(T, k, -1).to(result.dtype)
        return result

    def get_delta_weight(self, adapter: str) -> Tensor:
        """``scaling * lora_B[e] @ lora_A[e]`` for every expert: ``[E, out, in]`` float."""
        return torch.bmm(self.lora_B[adapter].weight, self.lora_A[adapter].weight) * self.scaling[adapter]

    merge = LoraLinear.merge
    unmerge = LoraLinear.unmerge

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


CUSTOM_MODULES: dict[type, type] = {Linear: LoraLinear, Experts: LoraExperts}
"""The mapping given to ``LoraConfig._register_custom_module`` (the packed twins subclass the dense
layers, so both match)."""


def register(config: "peft.LoraConfig") -> "peft.LoraConfig":
    """Register :data:`CUSTOM_MODULES` on ``config`` (done for every LoraConfig made after this
    module is imported; call it for one made before). Returns ``config``."""
    config._register_custom_module(CUSTOM_MODULES)
    return config


def _install() -> None:
    cls = peft.LoraConfig
    if getattr(cls.__post_init__, "_hanzo_torch", False):
        return
    original = cls.__post_init__

    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        register(self)

    __post_init__._hanzo_torch = True
    cls.__post_init__ = __post_init__


_install()


# ---------------------------------------------------------------------- helpers over a model
def base_model(model: nn.Module) -> nn.Module:
    """The hanzo-torch model under a :class:`peft.PeftModel` (or ``model`` itself)."""
    if isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def lora_layers(model: nn.Module) -> dict[str, BaseTunerLayer]:
    """``GGUF base tensor name -> LoRA layer`` of every hanzo-torch LoRA layer in ``model``
    (``"blk.0.attn_q.weight"``: the module path in the base model plus ``.weight``)."""
    root = base_model(model)
    return {f"{name}.weight": m for name, m in root.named_modules() if isinstance(m, (LoraLinear, LoraExperts))}


def _adapter_name(model: nn.Module, adapter_name: Optional[str]) -> str:
    if adapter_name is not None:
        return adapter_name
    active = getattr(model, "active_adapter", None)
    return active if isinstance(active, str) else "default"


# ---------------------------------------------------------------------- llama.cpp adapter GGUF
def save_gguf(model: nn.Module, path: str | os.PathLike, adapter_name: Optional[str] = None,
              dtype: torch.dtype = torch.float32) -> dict[str, tuple]:
    """Write one adapter of ``model`` as llama.cpp's LoRA adapter GGUF (``llama-completion --lora``).

    Facts from llama.cpp's ``convert_lora_to_gguf.py`` and ``src/llama-adapter.cpp``: metadata
    ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha`` (float32) and
    the base model's ``general.architecture``; tensors ``<base tensor name>.lora_a`` /
    ``.lora_b``, in torch order PEFT's ``lora_A [r, in]`` and ``lora_B [out, r]`` (ggml ``ne``
    ``[in, r]`` and ``[r, out]``; for an expert bank ``[E, r, in]`` and ``[E, out, r]``).
    llama.cpp scales each pair by ``alpha / r`` with ``r`` read from ``lora_b``; where PEFT's
    scaling differs from ``lora_alpha / r`` (rsLoRA, per-layer alphas) the difference is folded
    into the written ``lora_b``.

    Args:
        model: a :class:`peft.PeftModel` (or a model with hanzo-torch LoRA layers injected).
        path: output file (written to ``path + ".tmp"`` and renamed).
        adapter_name: the adapter to write; default the active one.
        dtype: tensor type, float32 (F32), float16 (F16) or bfloat16 (BF16).

    Returns:
        ``tensor name -> torch-order shape`` written.

    Raises:
        ValueError: no LoRA layer with that adapter, a dtype other than the three, or a base model
            without ``.gguf`` (its architecture is unknown).
    """
    from .gguf_file import save_gguf as _save

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"save_gguf: dtype must be float32, float16 or bfloat16, got {dtype}")
    name = _adapter_name(model, adapter_name)
    layers = {k: m for k, m in lora_layers(model).items() if name in m.lora_A}
    if not layers:
        raise ValueError(f"save_gguf: the model has no hanzo-torch LoRA layer with adapter {name!r}")
    root = base_model(model)
    arch = getattr(getattr(root, "args", None), "arch", None)
    if arch is None:
        raise ValueError("save_gguf: the base model has no architecture (args.arch); load it with hanzo_torch.load")
    alpha = float(next(iter(layers.values())).lora_alpha[name])
    tensors, shapes = {}, {}
    for tname, m in layers.items():
        a = m.lora_A[name].weight.detach().float()
        b = m.lora_B[name].weight.detach().float()
        r = m.r[name]
        fold = float(m.scaling[name]) * r / alpha  # 1.0 for PEFT's plain alpha / r with this alpha
        if fold != 1.0:
            b = b * fold
        tensors[f"{tname}.lora_a"] = a.to(dtype).contiguous()
        tensors[f"{tname}.lora_b"] = b.to(dtype).contiguous()
        shapes[f"{tname}.lora_a"], shapes[f"{tname}.lora_b"] = tuple(a.shape), tuple(b.shape)
    meta = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": alpha,
            "general.name": f"hanzo-torch LoRA ({name})"}
    _save(os.fspath(path), tensors, meta, architecture=arch)
    return shapes


_PAIR = re.compile(r"^(?P<base>.+\.weight)\.lora_(?P<ab>[ab])$")


def read_gguf(path: str | os.PathLike) -> tuple[str, float, dict[str, tuple[Tensor, Tensor]]]:
    """Read a llama.cpp LoRA adapter GGUF: ``(architecture, alpha, {base tensor name: (A, B)})``,
    ``A [r, in]`` / ``B [out, r]`` (or ``[E, r, in]`` / ``[E, out, r]``) float32 in torch order.

    Raises:
        ValueError: ``general.type`` is not ``adapter`` or ``adapter.type`` not ``lora``, a tensor
            name without a ``.lora_a``/``.lora_b`` suffix on a ``.weight`` name (norm adapters,
            which llama.cpp skips, are skipped), a pair with one half missing, or shapes whose
            ranks disagree, each naming the file and tensor.
    """
    from .gguf_file import GGUFFile

    f = GGUFFile(path)
    meta = f.metadata
    if meta.get("general.type") != "adapter":
        raise ValueError(f"{path}: general.type is {meta.get('general.type')!r}, not 'adapter': not a LoRA adapter file")
    if meta.get("adapter.type") != "lora":
        raise ValueError(f"{path}: adapter.type is {meta.get('adapter.type')!r}, not 'lora'")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    pairs: dict[str, dict[str, Tensor]] = {}
    for tname, t in f.tensors.items():
        m = _PAIR.match(tname)
        if m is None:
            if tname.endswith("_norm.weight"):
                continue
            raise ValueError(f"{path}: tensor {tname!r} is not a '<base>.weight.lora_a' / '.lora_b' adapter tensor")
        pairs.setdefault(m["base"], {})[m["ab"]] = t.dequantize(torch.float32).clone()
    out = {}
    for base, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            raise ValueError(f"{path}: LoRA pair for {base!r} is missing lora_{'b' if 'a' in ab else 'a'}")
        a, b = ab["a"], ab["b"]
        if a.dim() != b.dim() or a.shape[-2] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]:
            raise ValueError(f"{path}: {base!r}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not "
                             f"[.., r, in] and [.., out, r] of one rank")
        out[base] = (a, b)
    return f.architecture, alpha, out


def load_gguf(model: nn.Module, path: str | os.PathLike, scale: float = 1.0,
              adapter_name: str = "default") -> "peft.PeftModel":
    """Apply a llama.cpp LoRA adapter GGUF to a model from :func:`hanzo_torch.load`.

    The adapter becomes a PEFT adapter (``adapter_name``) on the layers it names, with
    ``scaling = scale * alpha / r`` (llama.cpp's ``--lora-scaled FILE SCALE``; ``alpha = 0``
    means ``scaling = scale``, as llama.cpp). ``model`` may already be a PeftModel (the adapter is
    added to it).

    Returns:
        The :class:`peft.PeftModel` (in inference mode: the adapter is frozen).

    Raises:
        ValueError: what :func:`read_gguf` raises; an architecture other than the model's; a tensor
            the model lacks or whose shape does not match the adapter (named), before anything is
            changed.
    """
    arch, alpha, pairs = read_gguf(path)
    root = base_model(model)
    if arch != root.args.arch:
        raise ValueError(f"{path}: adapter architecture {arch!r} does not match the model's {root.args.arch!r}")
    modules = dict(root.named_modules())
    ranks = {}
    for base, (a, b) in pairs.items():
        mname = base[: -len(".weight")]
        m = modules.get(mname)
        if isinstance(m, BaseTunerLayer):
            m = m.get_base_layer()
        if not isinstance(m, (Linear, Experts)):
            raise ValueError(f"{path}: LoRA tensor {base!r} has no linear layer {mname!r} in the model")
        shape = tuple(m.weight.shape)  # [out, in] or [E, out, in]
        want_a, want_b = (*shape[:-2], a.shape[-2], shape[-1]), (*shape[:-2], shape[-2], a.shape[-2])
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"{path}: {base!r}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not fit the "
                             f"weight {shape} (want {want_a} / {want_b})")
        ranks[mname] = a.shape[-2]
    r0 = max(set(ranks.values()), key=list(ranks.values()).count)
    eff_alpha = alpha if alpha else None
    config = peft.LoraConfig(
        r=r0, lora_alpha=eff_alpha if eff_alpha is not None else r0, target_modules=sorted(ranks),
        rank_pattern={f"^{re.escape(k)}$": v for k, v in ranks.items() if v != r0},
        alpha_pattern={} if eff_alpha is not None else {f"^{re.escape(k)}$": v for k, v in ranks.items()},
        init_lora_weights=False, inference_mode=True)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(adapter_name, config)
        peft_model = model
    else:
        peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name)
    for base, (a, b) in pairs.items():
        layer = lora_layers(peft_model)[base]
        with torch.no_grad():
            la, lb = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
            la.copy_(a.to(la.dtype))
            lb.copy_((b * scale).to(lb.dtype))
    peft_model.set_adapter(adapter_name)
    for p in peft_model.parameters():
        p.requires_grad_(False)
    return peft_model


# ---------------------------------------------------------------------- merge into a GGUF
def merge(model: nn.Module, out_path: str | os.PathLike, qtype: str = "Q8_0", adapter_name: Optional[str] = None,
          *, progress: bool = True) -> dict[str, str]:
    """Write a GGUF of the base model with one adapter folded in: ``W' = deq(W) + scaling * B A``
    for each adapted tensor, then every tensor typed by llama-quantize's recipe for ``qtype``
    (:func:`hanzo_torch.requantize.requantize`: ``"Q4_K_M"``, ``"Q8_0"``, ``"F16"``, ... ; the
    adapted tensors are always re-quantized from the merged floats, the others copied byte for
    byte where their type does not change). The base model's file (``model.gguf``) is the source.

    Returns:
        ``tensor name -> ggml type`` written.

    Raises:
        ValueError: no adapter ``adapter_name``, a base model not loaded from a GGUF, an unknown
            ``qtype``, ``out_path`` equal to the base file; what ``requantize`` raises.
    """
    from .requantize import requantize

    name = _adapter_name(model, adapter_name)
    layers = {k: m for k, m in lora_layers(model).items() if name in m.lora_A}
    if not layers:
        raise ValueError(f"merge: the model has no hanzo-torch LoRA layer with adapter {name!r}")
    root = base_model(model)
    src = getattr(root, "gguf", None)
    if src is None:
        raise ValueError("merge: the base model was not loaded from a GGUF file (model.gguf is None)")
    replace = {}
    for tname, m in layers.items():
        w = src.tensors[tname]
        with torch.no_grad():
            replace[tname] = w.dequantize(torch.float32) + m.get_delta_weight(name).detach().float()
    return requantize(src.path, os.fspath(out_path), qtype, progress=progress, replace=replace)
