"""Models over packed GGUF weights: :func:`load` and the Qwen2/Qwen3/Qwen3-MoE module."""
from __future__ import annotations

import os
from typing import Optional, Union

import torch
import torch.nn as nn

from .config import ARCHITECTURES, ModelArgs, check_max_context, load_tokenizer
from .layers import packed_twin
from .qwen import Block, Transformer

__all__ = ["load", "ModelArgs", "Transformer", "Block", "ARCHITECTURES"]


def load(
    path: Union[str, "os.PathLike[str]"],
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
    max_context: Optional[int] = None,
    kv_dtype: Union[str, torch.dtype, None] = None,
    extend_context: bool = False,
    tensor_parallel: bool = False,
    tp_group=None,
    mmap: Optional[bool] = None,
) -> Transformer:
    """Load a GGUF model as an ``nn.Module`` with its weights kept packed.

    The class is chosen from ``general.architecture`` (``qwen2``, ``qwen3``, ``qwen3moe``) and
    configured from the file's metadata only, after every hyper-parameter, tensor shape and the
    tokenizer metadata have been validated against each other (:mod:`hanzo_torch.models.config`):
    a malformed or hostile file raises :class:`GGUFError` before anything is allocated. The
    module is built on the meta device, its projection, embedding and expert layers are swapped
    for their packed twins (:mod:`hanzo_torch.models.layers`), and the file's tensors are
    assigned to it as :class:`~hanzo_torch.GGUFTensor`: on the CPU either views of the
    memory-mapped file (``mmap=True``; the OS is asked to read the file into the page cache in the
    background, :meth:`~hanzo_torch.gguf_file.GGUFFile.prefetch`) or packed copies in memory
    advised for transparent huge pages (``mmap=False``, :mod:`hanzo_torch.host_memory`); 1-D norm
    weights and biases are dequantized to ``dtype``. No full-precision copy of a matrix is ever
    made.

    The first op call on a device type activates the kernels serving it, so on a fresh install
    the first forward on the CPU includes the one-time build of the C++ kernels
    (``python3 -m hanzo_torch.backends.cpu`` builds them ahead; the CLI activates them right after
    loading), except where a CPU load may copy the weights (``mmap=False`` or None): the panels
    of the decode mat-vec are sized and laid out by those kernels, so that load builds them.

    Args:
        path: the ``.gguf`` file.
        device: where the weights, activations and KV cache live (packed weights are copied
            there when it is not the CPU).
        dtype: compute dtype of the activations: float32, bfloat16 or float16; default: the
            backend's (``hanzo_torch.backends.for_device(device).defaults``: float32 on CPU and
            vulkan, bfloat16 on CUDA/ROCm and other devices). Logits are float32 regardless.
        max_context: KV cache length in tokens (default ``min(context_length, 4096)``); at most
            the file's ``context_length`` unless ``extend_context``.
        kv_dtype: KV cache element type, llama.cpp's names: ``"f32"``, ``"f16"``, ``"bf16"`` or
            ``"q8_0"`` (34-byte blocks of 32 values, an f16 scale and int8 codes), or a torch
            float dtype. Default: the backend's: ``"f16"`` on CPU (half the bytes of float32 that
            decode attention reads per token), the compute ``dtype`` elsewhere. Attention converts
            cache rows to float32; scores, softmax and P*V are float32 whatever this is.
        extend_context: allow ``max_context`` above ``context_length`` (the model was not trained
            for such positions; the cache costs memory proportional to it).
        tensor_parallel: shard the model over the ranks of the default ``torch.distributed``
            process group (gloo on CPU, NCCL on CUDA/ROCm; every rank calls ``load`` with the
            same arguments): each rank keeps its slices of the packed weights, and the forward
            runs the collectives (:mod:`hanzo_torch.distributed`); ``model.tp`` holds them.
        tp_group: shard over this process group instead (implies ``tensor_parallel``).
        mmap: CPU only (other devices copy the weights to the device anyway). True: the packed
            weights stay zero-copy views of the file mapping (page-cache pages; memory shared with
            other processes mapping the file, llama.cpp's default). False: they are copied at load
            into one private anonymous mapping advised for 2 MiB transparent huge pages, which a
            decode step streams faster (Zen 4, 2 threads: tg128 1.02-1.11x over five runs,
            ``benchmarks/RESULTS.md``); costs a read of the whole file at load. With the copy, the
            Q4_K weights also get row-interleaved panels for the CPU's decode mat-vec
            (:func:`hanzo_torch.backends.cpu.attach_panels`: about 1.03x their bytes more memory,
            built in parallel at load; ``HANZO_CPU_PANELS=0`` builds none), and where ``avx2`` is
            the kernels' level, the Q6_K weights planes (1x their bytes; ``HANZO_CPU_Q6K_PLANES=0``
            builds none). None
            (default): False where the kernel offers transparent huge pages (``always`` or
            ``madvise``) and the weights (with the panels) take at most half of ``MemAvailable``, else True
            (:func:`hanzo_torch.host_memory.resolve_mmap`).

    Returns:
        :class:`~hanzo_torch.models.qwen.Transformer` in eval mode; ``model(input_ids[B, T])``
        gives float32 logits ``[B, T, V]``; ``model.tokenizer`` (built and checked here),
        ``model.generate(...)``, ``model.reset()``.

    Raises:
        GGUFError: anything wrong with the file, naming it and the key or tensor: not a GGUF file
            or not a regular file, unsupported or missing architecture, a missing metadata key or
            one of the wrong type, an out-of-range or inconsistent hyper-parameter, a missing,
            unexpected or wrongly shaped tensor, non-finite norm weights or biases, a broken
            tokenizer (vocabulary size different from the embedding rows, special token ids
            out of range or not integers, malformed merges or token types, a chat template that
            is not a string or does not compile). The first forward also raises it for
            non-finite or constant logits.
        ValueError: bad ``max_context`` (<= 0, or above ``context_length`` without
            ``extend_context``), ``dtype`` or ``kv_dtype`` (q8_0 needs a head dim that is a
            multiple of 32), or a malformed ``HANZO_CPU_ISA``; with tensor parallel, no initialized
            process group, or heads / block sizes that cannot be split over its ranks.
        TypeError: ``max_context``/``extend_context`` of the wrong type, ``dtype`` not a torch dtype,
            ``mmap`` not None or a bool.
        MemoryError: ``mmap=False`` while the copy would not fit in the available memory.
        OSError: the file cannot be opened.
        RuntimeError: the device's backend cannot claim it (``"vulkan"`` while another extension
            owns PrivateUse1).
    """
    from ..gguf_file import GGUFError, GGUFFile

    from .. import backends, host_memory

    device = backends.prepare_device(device)  # the vulkan backend claims its device type here
    backend = backends.for_device(device)
    if dtype is None:
        dtype = backend.defaults.activations
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    kv_name = _kv_dtype_name(kv_dtype, backend, dtype)
    check_max_context(max_context, 2**63, extend_context)  # types and sign, before any work
    host_memory.check_mmap_arg(mmap)
    group = None
    if tensor_parallel is not False or tp_group is not None:
        from .. import distributed

        group = distributed.resolve_group(tensor_parallel, tp_group, device)
    backends.check_environment()  # a malformed HANZO_CPU_ISA fails here, not as a warning at the first op
    f = GGUFFile(path, dtype=dtype)
    args = ModelArgs.from_gguf(f)  # validates the whole header before anything is built
    max_context = check_max_context(max_context, args.context_length, extend_context)
    tokenizer = load_tokenizer(f, args.vocab_size)
    if group is not None:
        plan = distributed.plan_shards(args, f, distributed.dist.get_world_size(group), distributed.dist.get_rank(group))

    if kv_name == "q8_0" and args.head_dim % 32:
        raise ValueError(f"{f.path}: kv_dtype q8_0 needs a head dim that is a multiple of 32, got {args.head_dim}")
    with torch.device("meta"):
        model = Transformer(args, max_context)
        for name, module in list(model.named_modules()):
            twin = packed_twin(module)
            if twin is not None:
                parent, _, leaf = name.rpartition(".")
                model.get_submodule(parent).register_module(leaf, twin)
    model.kv_dtype = kv_name
    tensors = f.tensors
    used = set()
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name == "output.weight" and args.tied_embeddings:
            continue
        if name not in tensors:
            raise GGUFError(f"{f.path}: missing tensor {name!r} for architecture {args.arch!r}")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise GGUFError(
                f"{f.path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(param.shape)} "
                f"from the metadata"
            )
        if t.dim() == 1:  # norm weights and biases: small, dense
            t = t.dequantize(dtype)
            if not bool(torch.isfinite(t).all()):
                raise GGUFError(f"{f.path}: tensor {name!r} holds NaN or inf (in {dtype})")
        # tensor parallel: slices are moved to the device after sharding, not the whole tensors
        _assign(model, name, t if t.device == device or group is not None else t.to(device))
        used.add(name)
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise GGUFError(f"{f.path}: tensors not used by the {args.arch} model: {', '.join(unexpected[:8])}")
    if args.tied_embeddings:
        model.output.weight = model.token_embd.weight
    if group is not None:
        distributed.shard_model(model, f, group, plan, device)
    mapped = True
    if backend.host_memory:
        mapped = _host_weights(model, mmap, f, ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
                               if group is not None else 1)
    model.gguf = f
    model._tokenizer = tokenizer
    _check_first_logits(model, f.path)
    if backend.host_memory and group is None and mapped:
        f.prefetch()  # embedding rows would otherwise be read from disk inside decode steps
    return model.eval()


def _host_weights(model: nn.Module, mmap: Optional[bool], f, ranks_here: int = 1) -> bool:
    """Apply ``load``'s ``mmap`` choice to the host model's packed weights that are views of the file
    ``f`` (the open GGUFFile; tied weights once, slices already copied out by tensor parallel left
    alone): leave them mapped, or swap each for a :func:`~hanzo_torch.host_memory.copy_packed` copy,
    dropping each source's pages from the process's view of the file as soon as it is copied, so
    the resident set holds about the weights once throughout. ``ranks_here``: processes on this
    host making the same choice (tensor parallel), which share its memory. Returns whether the
    weights stay mapped."""
    from .. import host_memory
    from ..backends import cpu
    from ..tensor import GGUFTensor

    owners = {}  # id(weight) -> (weight, [(module, name), ...])
    for module in model.modules():
        for name, p in module._parameters.items():
            if isinstance(p, GGUFTensor) and f.maps(p.packed):
                owners.setdefault(id(p), (p, []))[1].append((module, name))
    weights = [w for w, _ in owners.values()]
    on_cpu = all(w.packed.device.type == "cpu" for w in weights)
    # the CPU mat-vec's panels (Q4_K; Q6_K planes on avx2), built beside the copies (backends.cpu.attach_panels)
    # for the weights a mat-vec reads: not a table that only embeddings look up (an untied
    # token_embd: 129 MiB of panels for the default model that nothing would read). mmap=True
    # copies nothing, so it needs neither them nor the kernels that lay them out.
    from .layers import Embedding

    def _matvec_reads(places) -> bool:
        return not all(isinstance(module, Embedding) for module, _ in places)

    panels = sum(cpu.panel_bytes(w.qtype, tuple(w.packed.shape)) for w, places in owners.values()
                 if _matvec_reads(places)) if on_cpu and mmap is not True else 0
    nbytes = sum(w.packed.numel() for w in weights) + panels
    if not weights or host_memory.resolve_mmap(mmap, nbytes * max(1, ranks_here), where=f"load({f.path!r})"):
        return True
    f.advise(weights, willneed=True)  # read-ahead of a cold file instead of one fault per page
    copies = host_memory.copy_packed([w.packed for w in weights], done=lambda src: f.advise([src], release=True))
    copied = []
    for (w, places), packed in zip(owners.values(), copies):
        new = nn.Parameter(w._with(packed=packed), requires_grad=False)
        if _matvec_reads(places):
            copied.append(new)
        for module, name in places:
            module._parameters[name] = new
    if panels:
        cpu.attach_panels(copied)
    return False


def _check_first_logits(model: nn.Module, path: str) -> None:
    """Check the logits of the model's first forward, once: weights holding NaN/inf, or values
    large enough to overflow a norm, give non-finite or constant logits (every activation
    normalized to 0), which would otherwise decode as token 0 repeated. One host sync; a
    forward hook removed after the first check, so later forwards run without it."""
    from ..gguf_file import GGUFError

    def hook(module, args, logits):
        if not isinstance(logits, torch.Tensor):  # CausalLMOutput of a labels= forward: its loss
            logits = logits.loss.detach().reshape(1, 1)
        if torch.compiler.is_compiling() or (logits.is_cuda and torch.cuda.is_current_stream_capturing()):
            return  # checked by the first eager forward
        if logits.numel():
            logits = logits.cpu()  # the one sync; devices need no kernels for the checks below
            if not bool(torch.isfinite(logits).all()):
                raise GGUFError(f"{path}: the model's first logits contain NaN or inf: its weights hold "
                                "non-finite values or overflow the compute dtype")
            if logits.shape[-1] > 1 and bool((logits.amax(-1) == logits.amin(-1)).all()):
                raise GGUFError(f"{path}: the model's first logits are the same for every token: its "
                                "weights or norms overflow (activations normalized to zero)")
            handle.remove()

    handle = model.register_forward_hook(hook)


_KV_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _kv_dtype_name(kv_dtype, backend, dtype: torch.dtype) -> str:
    """``load``'s ``kv_dtype`` argument as a key of ``KV_CACHE_DTYPES`` (None: the default of
    ``backend``, a :class:`~hanzo_torch.backends.base.Backend`, else the activations' dtype)."""
    from ..ops.fused import KV_CACHE_DTYPES

    if kv_dtype is None:
        return backend.defaults.kv or _KV_NAMES[dtype]
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in _KV_NAMES:
        return _KV_NAMES[kv_dtype]
    if isinstance(kv_dtype, str) and kv_dtype in KV_CACHE_DTYPES:
        return kv_dtype
    raise ValueError(f"kv_dtype must be one of {', '.join(KV_CACHE_DTYPES)} or torch.float32/float16/bfloat16, "
                     f"got {kv_dtype!r}")


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))
