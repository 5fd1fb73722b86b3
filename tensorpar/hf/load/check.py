"""The checks of a checkpoint against the model its config describes, made before any weight is read.

:func:`check_checkpoint` builds the model on the meta device (:func:`_meta_model`), lists what it reads
(:class:`_Expected`: every parameter under all its tied names, with the names transformers renames,
:func:`_checkpoint_names`) and compares that with the checkpoint's headers in both directions: missing tensors,
unused tensors, wrong shapes or dtypes, each named.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar.hf.load.reader import read_header, weight_map


def _checkpoint_names(model: nn.Module, keys) -> dict[str, str]:
    """Parameter name -> checkpoint key for the checkpoint keys that transformers renames when it loads
    (its ``WeightRenaming`` table for the model, e.g. GPT-NeoX's ``embed_out.*`` -> ``lm_head.*``, as the
    Pythia checkpoints and transformers' own ``save_pretrained`` write it). Keys that need a conversion
    beyond a rename are not mapped (the parameter is then reported missing). ``{}`` if this transformers
    has no such table."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        out: dict[str, str] = {}
        for key in keys:
            new, _ = rename_source_key(key, renamings, [])
            if new != key:
                out.setdefault(new, key)
        return out
    except (ImportError, AttributeError, TypeError):  # a transformers without (this form of) the table
        return {}


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _few(names, k: int = 3) -> str:
    names = sorted(names, key=_natural)
    more = f", ... {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def _meta_model(config, dtype=torch.float32):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


class _Expected:
    """What a model (unsharded, on meta) reads from a checkpoint: each parameter under all its
    (tied) names with its full shape, the buffer names, and the patterns transformers ignores."""

    def __init__(self, model: nn.Module):
        self.groups: dict[int, list[str]] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.floating: dict[str, bool] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.groups.setdefault(id(p), []).append(name)
            full = list(p.shape)
            if getattr(p, "tp_dim", None) is not None:
                full[p.tp_dim] = p.tp_partition.n
            self.shape[name] = tuple(full)
            self.floating[name] = p.is_floating_point()
        tied = getattr(model, "get_expanded_tied_weights_keys", None)  # transformers >= 5: {alias: source}
        for alias, source in (tied(all_submodels=True) if tied is not None else {}).items():
            # the meta model is not tied yet (init_empty_weights); merge the alias into its source's group
            ga = next((k for k, v in self.groups.items() if alias in v), None)
            gs = next((k for k, v in self.groups.items() if source in v), None)
            if ga is not None and gs is not None and ga != gs:
                self.groups[gs] += self.groups.pop(ga)
        self.buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        self.ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self._model, self._renamed = model, None

    def key(self, name: str, stored) -> str | None:
        """The checkpoint key holding model tensor ``name``: itself, without the base-model prefix, or the key
        transformers renames to it when loading (GPT-NeoX's ``embed_out.weight`` for ``lm_head.weight``)."""
        if name in stored:
            return name
        if self.prefix and name.startswith(self.prefix + "."):
            short = name[len(self.prefix) + 1:]
            if short in stored:
                return short
        if self._renamed is None:
            self._renamed = _checkpoint_names(self._model, stored)
        key = self._renamed.get(name)
        return key if key in stored else None

    def model_name(self, key: str) -> str:
        if key in self.shape or key in self.buffers or not self.prefix:
            return key
        return f"{self.prefix}.{key}"


def _check(folder: Path, expected: _Expected, config, wmap: dict[str, Path]) -> None:
    headers: dict[Path, dict] = {f: read_header(f)[0] for f in sorted(set(wmap.values()))}
    stored = set(wmap)
    missing, wrong, used = [], [], set()
    for names in expected.groups.values():
        keys = [k for k in (expected.key(n, stored) for n in names) if k is not None]
        if not keys:  # a tied parameter needs only one of its names in the checkpoint
            missing.append(names[0])
            continue
        for n in names:
            k = expected.key(n, stored)
            if k is None:
                continue
            used.add(k)
            info = headers[wmap[k]][k]
            got = tuple(info["shape"])
            if got != expected.shape[n]:
                wrong.append(f"{k} {list(got)} (model expects {list(expected.shape[n])})")
            elif expected.floating[n] and not str(info["dtype"]).startswith(("F", "BF")):
                wrong.append(f"{k} stored as {info['dtype']} (a quantized or integer tensor; the model needs "
                             "floating point: dequantize it first)")
    unused = []
    for k in stored - used:
        n = expected.model_name(k)
        if n in expected.buffers or any(p.search(k) for p in expected.ignore):
            continue  # buffers (rotary inv_freq, attention masks) are rebuilt from the config
        unused.append(k)
    from tensorpar.hf.moe_checkpoint import layout as moe_layout
    if moe_layout(getattr(config, "model_type", None)) is not None and any(".experts." in k for k in stored):
        # stacked experts in the model, one tensor per expert in the file: read_moe_shard maps them when loading
        missing = [n for n in missing if ".experts." not in n]
        unused = [k for k in unused if ".experts." not in k]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors the model needs are missing ({_few(missing)})")
    if unused:
        problems.append(f"{len(unused)} checkpoint tensors are not used by the model ({_few(unused)})")
    if wrong:
        problems.append(f"{len(wrong)} tensors have the wrong shape or dtype ({_few(wrong, 2)})")
    if problems:
        layers = getattr(config, "num_hidden_layers", None)
        what = f"{getattr(config, 'model_type', '?')}" + (f", num_hidden_layers={layers}" if layers is not None else "")
        raise ValueError(f"checkpoint in {folder} does not match its config ({what}): " + "; ".join(problems)
                         + "; use the config.json the weights were saved with")


def check_checkpoint(folder: str | Path, config=None) -> None:
    """Compare the safetensors headers of ``folder`` with the model ``config`` describes, both ways.

    Reads only headers (no tensor data) and builds the unsharded model on the meta device (no
    memory). Checks that every parameter is stored (a tied parameter under any one of its names,
    e.g. ``lm_head.weight`` may be absent when ``tie_word_embeddings``), that every stored tensor is
    used by the model (buffers such as rotary ``inv_freq`` and the keys transformers itself ignores
    on load are allowed), and that shapes are the full, unsharded ones and floating point. Names may
    omit the base-model prefix (``h.0...`` for ``transformer.h.0...``), as transformers accepts.

    Args:
        folder: a Hugging Face-format folder (``*.safetensors``, optional index).
        config: its ``PretrainedConfig``; default ``AutoConfig.from_pretrained(folder)``.

    Raises:
        ValueError: one line listing each kind of mismatch with its count and a few names (e.g. a
            config of 20 layers over a checkpoint of 30: "60 checkpoint tensors are not used by the
            model (model.layers.20.input_layernorm.weight, ...)"); unreadable headers, naming the file.
        FileNotFoundError: no ``*.safetensors`` file in ``folder``.
    """
    from transformers import AutoConfig

    folder = Path(folder)
    config = config if config is not None else AutoConfig.from_pretrained(folder)
    _check(folder, _Expected(_meta_model(config)), config, weight_map(folder))
