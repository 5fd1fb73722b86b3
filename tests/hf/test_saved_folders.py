"""Every family from a plain ``save_pretrained`` folder (no attention implementation in its config.json), through
the command line: the sharded model runs the attention transformers itself picks for the config (gemma2: eager,
its soft-capping has no sdpa path), and ``tensorpar verify`` finds it equal to transformers' unsharded model.

CI runs gemma2 (the family transformers refuses sdpa for) at tp = 2 through the CLI, and the attention rule for
every family in process; the CLI runs of the other families are marked slow."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests import families, families_fam, families_moe

FAMILIES = sorted({*families.FAMILIES, *(f.partition(":")[0] for f in families_fam.FAMILIES), *families_moe.FAMILIES})


def _config(model_type: str):
    for mod in (families, families_fam, families_moe):
        try:
            c = mod.config(model_type)
        except KeyError:
            continue
        c._attn_implementation = None   # as a config.json saved by transformers: no attention implementation
        return c
    raise KeyError(model_type)


def saved_folder(tmp_path_factory, model_type: str):
    """A tiny random model of ``model_type`` written by ``save_pretrained`` (transformers 5.24)."""
    from transformers import AutoModelForCausalLM
    path = tmp_path_factory.mktemp(model_type)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(model_type)).save_pretrained(path)
    return path


def test_attention_is_the_one_transformers_picks(tmp_path_factory):
    """The rule, for every family: what ``from_pretrained`` on the folder selects (no ranks started)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.hf.load import resolve_attn_implementation as attn_implementation
    for mt in FAMILIES:
        folder = saved_folder(tmp_path_factory, mt)
        want = AutoModelForCausalLM.from_pretrained(folder).config._attn_implementation
        assert attn_implementation(AutoConfig.from_pretrained(folder)) == want, mt
    assert attn_implementation(_config("gemma2")) == "eager" and attn_implementation(_config("llama")) == "sdpa"


@pytest.mark.parametrize("model_type", [pytest.param(mt, marks=() if mt == "gemma2" else pytest.mark.slow)
                                        for mt in FAMILIES])
def test_verify_a_saved_folder_at_tp2(tmp_path_factory, model_type):
    """``tensorpar verify --model FOLDER --tp 2``: every block's output, the logits, loss and gradients within
    verify's fp32 tolerance of transformers' ``from_pretrained`` model (tolerance from the reduction length)."""
    folder = saved_folder(tmp_path_factory, model_type)
    p = subprocess.run([sys.executable, "-m", "tensorpar", "verify", "--model", str(folder), "--tp", "2", "--train"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tensorpar verify: OK" in p.stdout
