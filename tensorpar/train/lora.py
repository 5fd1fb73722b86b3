"""LoRA fine-tuning in the one trainer (``tensorpar train --lora R``): the settings' checks, PEFT's config of a run,
the check against the model before any rank starts, and the PEFT files of a checkpoint.

The model side is :mod:`tensorpar.hf.lora` (adapters added to the unsharded model, PEFT's files) and
:mod:`tensorpar.layers.lora` (each adapter sharded with its base projection); the trainer itself is unchanged but
for one rule: the optimizer, the gradient sums and the checkpoints cover the parameters that require a gradient,
which under LoRA are the adapters only.
"""
from __future__ import annotations

from pathlib import Path

def check_lora_settings(cfg: "TrainConfig") -> None:
    """The LoRA settings on their own (before the model is known): rank > 0, alpha > 0, dropout in [0, 1), target
    modules a list of names (a comma-separated string becomes a tuple); the layouts LoRA runs at (tp with or
    without sequence parallelism, dp with ddp; not pp, ep, cp or fsdp yet). ValueError naming the flag."""
    if cfg.lora_r is None:
        for name in ("lora_alpha", "lora_target_modules"):
            if getattr(cfg, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --lora R (the adapters' rank)")
        if cfg.lora_dropout:
            raise ValueError("--lora-dropout needs --lora R (the adapters' rank)")
        return
    if not isinstance(cfg.lora_r, int) or isinstance(cfg.lora_r, bool) or cfg.lora_r <= 0:
        raise ValueError(f"--lora {cfg.lora_r!r}: the adapters' rank must be a positive integer (e.g. --lora 8)")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise ValueError(f"--lora-alpha {cfg.lora_alpha!r}: must be > 0 (the scaling is lora_alpha / r)")
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"--lora-dropout {cfg.lora_dropout!r}: must be in [0, 1)")
    t = cfg.lora_target_modules
    if isinstance(t, str):
        t = tuple(x.strip() for x in t.split(",") if x.strip())
    if t is not None:
        t = tuple(t)
        if not t or not all(isinstance(x, str) and x for x in t):
            raise ValueError(f"--lora-target-modules {cfg.lora_target_modules!r}: give module names, e.g. "
                             f"q_proj,k_proj,v_proj,o_proj")
        object.__setattr__(cfg, "lora_target_modules", t)
    for name, v, ok in (("--pp", cfg.pp, 1), ("--ep", cfg.ep, 1), ("--cp", cfg.cp, 1)):
        if v != ok:
            raise ValueError(f"--lora {cfg.lora_r} with {name} {v}: not supported yet; LoRA runs with --tp (and "
                             f"--sequence-parallel) and --dp; use {name} 1")
    if cfg.dp_mode == "fsdp" and cfg.dp > 1:
        raise ValueError(f"--lora {cfg.lora_r} with --dp-mode fsdp: not supported yet (the adapters are small: "
                         f"ddp replicates them); use --dp-mode ddp")


def peft_config(cfg, base: str | None = None):
    """PEFT's ``LoraConfig`` of the run (``base``: the model folder, recorded as ``base_model_name_or_path``)."""
    from tensorpar.hf.lora import lora_config
    return lora_config(cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                       target_modules=cfg.lora_target_modules, base_model_name_or_path=base)


def add_run_lora(model, cfg, base: str | None = None):
    """The run's adapters added to the unsharded ``model`` (:func:`tensorpar.hf.lora.add_lora`), each LoRA layer
    drawn from :func:`tensorpar.train.model.module_seed` ``(cfg.seed, "<module>.lora")``. Returns ``model``."""
    from tensorpar.hf.lora import add_lora
    from tensorpar.train.model import module_seed
    return add_lora(model, peft_config(cfg, base), lambda name: module_seed(cfg.seed, f"{name}.lora"))


def check_lora_model(cfg, model_config, plan) -> None:
    """Before any rank starts: the adapters of ``cfg`` on the model of ``model_config`` (meta device) match some
    module, and ``plan`` shards every one of them (:meth:`~tensorpar.hf.plan.ShardingPlan.check`, the rule
    ``parallelize`` applies on the ranks). Raises ValueError (one line)."""
    import copy
    import warnings

    from tensorpar.hf.plan import meta_model

    with warnings.catch_warnings():     # PEFT's warnings on this throw-away meta model (e.g. a tied lm_head target)
        warnings.simplefilter("ignore")  # would come before the one-line refusal below; the ranks still show them
        model = add_run_lora(meta_model(copy.deepcopy(model_config)), cfg)
    if plan is not None:
        plan.check(model)


def trainable_meta_shapes(cfg, model_config) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of the tensors a checkpoint of this run holds: every parameter of the model, or under
    LoRA the adapters only (built on the meta device; the adapters are small CPU tensors)."""
    import copy

    from tensorpar.hf.plan import meta_model

    model = meta_model(copy.deepcopy(model_config))
    if cfg is not None and cfg.lora_r is not None:
        add_run_lora(model, cfg)
        return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def write_peft_files(folder: Path, cfg, base: str | None) -> None:
    """Add ``adapter_model.safetensors`` and ``adapter_config.json`` to a checkpoint folder being written (rank 0,
    before it is published): the full adapters, assembled from the pieces every rank wrote into ``folder/model``
    (no collective), under PEFT's names, so ``peft.PeftModel.from_pretrained(base_model, folder)`` loads them."""
    from tensorpar.hf.lora import save_adapter
    from tensorpar.train.checkpoint import read_full
    from tensorpar.train.checkpoint.format import MODEL_DIR

    tensors = read_full(folder / MODEL_DIR)
    save_adapter(folder, tensors, peft_config(cfg, base))


def export_adapter(ckpt, out, *, overwrite: bool = False) -> Path:
    """``--export`` of a LoRA run: the checkpoint's PEFT files (``adapter_model.safetensors``,
    ``adapter_config.json``) copied into ``out`` with the export marker (:func:`tensorpar.train.export.
    check_export_dir` decides, as for a full export, whether ``out`` may be written). Returns ``out``."""
    import os
    import shutil

    from tensorpar.hf.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from tensorpar.train.checkpoint import latest_checkpoint
    from tensorpar.train.export import _write_marker, check_export_dir

    ckpt = latest_checkpoint(ckpt)
    out = Path(out)
    check_export_dir(out, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    files = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
    for name in files:
        tmp = out / f".{name}.tmp-{os.getpid()}"
        shutil.copyfile(ckpt / name, tmp)
        os.replace(tmp, out / name)
    _write_marker(out, files, ckpt)
    return out
