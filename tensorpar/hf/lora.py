"""PEFT LoRA adapters of a Hugging Face model: add them for training, save them in PEFT's format, merge them.

* :func:`lora_config` is PEFT's ``LoraConfig`` of ``tensorpar train --lora R`` (``lora_alpha``, ``lora_dropout``,
  ``target_modules``: PEFT's names and defaults).
* :func:`add_lora` injects the adapters into the unsharded model (meta or real) with PEFT itself
  (``peft.inject_adapter_in_model``: base weights frozen) and draws them from a seed per module
  (PEFT's initialisation: ``A`` Kaiming-uniform, ``B`` zero), so they are the same at every tp;
  :func:`tensorpar.hf.apply.parallelize` then shards each with its base projection (:mod:`tensorpar.layers.lora`).
* :func:`save_adapter` writes ``adapter_model.safetensors`` and ``adapter_config.json`` from full (gathered)
  adapter tensors, as ``PeftModel.save_pretrained`` does, so ``peft.PeftModel.from_pretrained`` loads them on the
  unsharded base.
* :func:`check_adapter` (launching process) and :func:`merge_adapter` (each rank, after its sharded load) serve
  ``generate`` / ``serve --lora DIR``: the adapter is merged into each rank's base shard at load
  (``W_r += s * B_r A`` for a column-parallel base, ``W_r += s * B A_r`` for a row-parallel one), so decoding runs
  the plain sharded model at full speed.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_config(r: int, *, alpha: float | None = None, dropout: float = 0.0, target_modules=None,
                base_model_name_or_path: str | None = None):
    """PEFT's ``LoraConfig`` (task ``CAUSAL_LM``): ``alpha`` None is PEFT's default (8); ``target_modules`` None is
    PEFT's default for the model type (``q_proj``, ``v_proj`` for llama). Raises ValueError for ``r <= 0``."""
    import peft

    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"--lora {r!r}: the adapters' rank must be a positive integer (e.g. --lora 8)")
    kw = {} if alpha is None else {"lora_alpha": alpha}
    targets = list(target_modules) if isinstance(target_modules, (list, tuple)) else target_modules
    return peft.LoraConfig(r=r, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM",
                           base_model_name_or_path=base_model_name_or_path, **kw)


def add_lora(model: nn.Module, config, seed_of) -> nn.Module:
    """Inject LoRA adapters into ``model`` (the unsharded transformers model, meta or real) in place and draw them
    on the CPU, fp32, each LoRA layer from the CPU generator seeded with ``seed_of(its module name)`` (the trainer:
    :func:`tensorpar.train.model.module_seed` of the run's seed), so they do not depend on tp or on the order.

    Base weights are frozen (``requires_grad=False``), adapters trainable. Returns ``model``.

    Raises:
        ValueError: (one line) ``config.target_modules`` match no module of the model, naming its linear layers.
    """
    import peft

    from tensorpar.layers.lora import is_lora_layer

    try:
        peft.inject_adapter_in_model(config, model, low_cpu_mem_usage=True)   # adapters on meta: drawn below
    except ValueError as e:
        if "not found in the base model" not in str(e) and "NoMatching" not in type(e).__name__:
            raise
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        targets = config.target_modules
        shown = ",".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else targets
        raise ValueError(f"--lora-target-modules {shown}: matches no module of the "
                         f"{getattr(model.config, 'model_type', 'model')} model; its linear layers are "
                         f"{','.join(linears)}") from None
    targets = config.target_modules
    if isinstance(targets, (set, list, tuple)):     # every name must match (PEFT only needs one to): none dropped
        wrapped = [n for n, m in model.named_modules() if is_lora_layer(m)]
        missing = sorted(t for t in targets if not any(n == t or n.endswith("." + t) for n in wrapped))
        if missing:
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                              if is_lora_layer(m) or (isinstance(m, nn.Linear) and ".lora_" not in n
                                                      and not n.endswith(".base_layer"))})
            raise ValueError(f"--lora-target-modules: {','.join(missing)} match{'es' if len(missing) == 1 else ''} "
                             f"no module of the {getattr(model.config, 'model_type', 'model')} model (the other "
                             f"names do); its linear layers are {','.join(linears)}")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for name, m in model.named_modules():
            if not is_lora_layer(m):
                continue
            for adapter in m.lora_A:
                for mats in (m.lora_A, m.lora_B):
                    mats[adapter].to_empty(device="cpu")
                    mats[adapter].float()
                torch.manual_seed(seed_of(name))
                m.reset_lora_parameters(adapter, config.init_lora_weights)
    return model


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the trainable adapter tensors of ``model`` (``...q_proj.lora_A.default.weight``)."""
    return [n for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def save_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config) -> Path:
    """Write ``tensors`` (full adapter tensors under the sharded model's names) into ``folder`` as PEFT saves them:
    ``adapter_model.safetensors`` (names of :func:`tensorpar.layers.lora.peft_state_dict`) and
    ``adapter_config.json`` (``config``, PEFT's ``LoraConfig``). Returns ``folder``."""
    from safetensors.torch import save_file

    from tensorpar.layers.lora import peft_state_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in peft_state_dict(tensors).items()}
    save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    return folder


def read_adapter(folder: str | Path):
    """``(LoraConfig, {PEFT name: tensor})`` of a PEFT adapter folder. Raises ValueError naming the folder."""
    import peft
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"--lora {str(folder)!r}: not a PEFT adapter folder (needs {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}, as PeftModel.save_pretrained or tensorpar train --lora write)")
    try:
        config = peft.LoraConfig.from_pretrained(str(folder))
    except (ValueError, TypeError) as e:   # json.JSONDecodeError is a ValueError; unknown fields a TypeError
        raise ValueError(f"--lora {str(folder)!r}: {ADAPTER_CONFIG} cannot be read as a LoRA config: "
                         f"{' '.join(str(e).split())}") from None
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except Exception as e:                  # safetensors raises its own error types for a damaged file
        raise ValueError(f"--lora {str(folder)!r}: {ADAPTER_WEIGHTS} cannot be read: {' '.join(str(e).split())}") \
            from None
    return config, tensors


def check_adapter(folder: str | Path, model_config) -> str:
    """Check ``--lora DIR`` against the model before any rank starts: a PEFT LoRA folder whose every tensor names
    a projection of the model with the shape the model gives it (``A [r, in]``, ``B [out, r]``). Returns the
    folder as an absolute path. Raises ValueError (one line) naming the first mismatch: adapters trained on
    another base."""
    from tensorpar.hf.plan import meta_model

    folder = Path(folder).expanduser().resolve()
    config, tensors = read_adapter(folder)
    if getattr(config, "peft_type", None) is not None and str(config.peft_type).split(".")[-1] != "LORA":
        raise ValueError(f"--lora {str(folder)!r}: a {config.peft_type} adapter; tensorpar merges LoRA adapters")
    if getattr(config, "use_dora", False):
        raise ValueError(f"--lora {str(folder)!r}: DoRA adapters (use_dora) are not supported; use plain LoRA")
    modules = dict(meta_model(model_config).named_modules())
    for key, t in tensors.items():
        name, kind = _split_key(key)
        m = modules.get(name)
        if not isinstance(m, nn.Linear) or kind is None or t.dim() != 2:
            raise ValueError(f"--lora {str(folder)!r}: tensor {key} names no linear layer of this "
                             f"{model_config.model_type} model; the adapter was trained on another base")
        want = (config.r if kind == "lora_A" else m.out_features, m.in_features if kind == "lora_A" else config.r)
        if tuple(t.shape) != want and not (config.rank_pattern or {}):
            raise ValueError(f"--lora {str(folder)!r}: {key} has shape {list(t.shape)} but this model needs "
                             f"{list(want)}; the adapter was trained on another base")
    kinds: dict[str, set] = {}
    for key in tensors:
        name, kind = _split_key(key)
        kinds.setdefault(name, set()).add(kind)
    half = next((n for n, k in kinds.items() if k != {"lora_A", "lora_B"}), None)
    if half is not None:        # a matrix missing: the ranks' merge would fail on it
        have = ", ".join(sorted(kinds[half]))
        raise ValueError(f"--lora {str(folder)!r}: {half} has {have} but not both lora_A and lora_B; the adapter "
                         f"file is incomplete")
    return str(folder)


def _split_key(key: str) -> tuple[str, str | None]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``(model.layers.0.self_attn.q_proj,
    "lora_A")``; the kind is None for a tensor that is not an adapter matrix."""
    name = key[len("base_model.model."):] if key.startswith("base_model.model.") else key
    for kind in ("lora_A", "lora_B"):
        if f".{kind}." in name:
            return name.split(f".{kind}.")[0], kind
    return name, None


@torch.no_grad()
def merge_adapter(model: nn.Module, folder: str | Path, tp_rank: int) -> int:
    """Add a PEFT LoRA adapter to the sharded base weights of ``model`` (each rank, after its sharded load):
    ``W += s * B A`` restricted to this rank's part, from the parameter's own layout (``tp_dim`` 0: ``B``'s rows of
    ``tp_partition``; ``tp_dim`` 1: ``A``'s columns; none: whole). ``s = lora_alpha / r`` (``/ sqrt(r)`` with
    ``use_rslora``). Returns the number of projections merged. The adapter is checked by :func:`check_adapter`
    before ranks start."""
    import math

    from tensorpar.layers.linear import _slice

    config, tensors = read_adapter(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, kind = _split_key(key)
        pairs.setdefault(name, {})[kind] = t
    params = dict(model.named_parameters())
    stage = getattr(model, "tensorpar_stage", None)     # a pipeline stage (generate/serve --pp) holds its layers only
    for name, ab in pairs.items():
        w = params.get(f"{name}.weight")
        if w is None and stage is not None:            # another stage's layer (check_adapter saw the whole model)
            continue
        w = params[f"{name}.weight"]
        a, b = ab["lora_A"].to(torch.float32), ab["lora_B"].to(torch.float32)        # [r, in], [out, r]
        r = a.shape[0]
        alpha = (config.alpha_pattern or {}).get(name.rsplit(".", 1)[-1], config.lora_alpha)
        scale = alpha / (math.sqrt(r) if config.use_rslora else r)
        dim = getattr(w, "tp_dim", None)
        if dim == 0:
            b = _slice(b, 0, w.tp_partition, tp_rank)
        elif dim == 1:
            a = _slice(a, 1, w.tp_partition, tp_rank)
        w.add_((b @ a * scale).to(device=w.device, dtype=w.dtype))
    return len(pairs)
