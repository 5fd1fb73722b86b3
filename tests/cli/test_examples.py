"""The README's Python example is examples/generate_tp.py, and it runs under torchrun (issue 14, item 10)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tensorpar.testing import free_port
from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: F401  (fixture: random llama + tokenizer)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "generate_tp.py"


def _between_markers(text: str) -> str:
    m = re.search(r"# --- README example begins\n(.*?)# --- README example ends", text, re.S)
    assert m, "markers missing from examples/generate_tp.py"
    return m.group(1).strip()


def test_readme_python_block_is_the_example():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Using it from Python"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1).strip()
    assert block == _between_markers(EXAMPLE.read_text())


def test_example_runs_under_torchrun_and_matches_transformers(tiny_with_tokenizer):  # noqa: F811
    """Two ranks under torchrun; the printed continuation is transformers' own greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = dict(os.environ, PYTHONPATH=str(REPO), TENSORPAR_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(EXAMPLE), tiny_with_tokenizer]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "ShardingPlan(llama, tp_size=2" in p.stdout
    tok = AutoTokenizer.from_pretrained(tiny_with_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer, dtype=torch.float32).eval()
    ids = tok(["The capital of France is"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip(), "the tiny model stopped at once: the comparison would prove nothing"
    assert p.stdout.endswith(expected + "\n"), (p.stdout[-500:], expected)
