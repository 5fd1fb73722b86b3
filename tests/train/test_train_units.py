"""Training pieces without a process group: settings checks, dropout masks per rank, pretrained init,
and the command line (in process at tp = 1, and one launch of `tensorpar train --tp 2`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorpar.comm import Group
from tensorpar.layers.attention import HeadLayout
from tensorpar.parallel import ParallelContext
from tensorpar.train.config import TrainConfig
from tensorpar.layers.dropout import DropoutRNG, HeadKeyedAttention, HiddenDropout
from tests._ranks import run_tp

REPO = Path(__file__).resolve().parents[2]


def fake_rank(rank: int, size: int) -> Group:
    """A group handle that only carries rank and size (the dropout masks need nothing else)."""
    return Group(pg=None, rank=rank, size=size)


# ---------------------------------------------------------------- settings

def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible by tp=4.*use seq_len=28 or 32"):
        TrainConfig(tp=4, sequence_parallel=True, seq_len=30)
    TrainConfig(tp=4, sequence_parallel=False, seq_len=30)      # fine without sequence parallelism


@pytest.mark.parametrize("kw,msg", [(dict(tp=0), "tp=0: must be a positive integer"),
                                    (dict(dtype="fp16"), "dtype='fp16': use one of float32, bfloat16"),
                                    (dict(hidden_dropout=1.0), r"hidden_dropout=1.0: must be in \[0, 1\)"),
                                    (dict(init="hub"), "init='hub'"),
                                    (dict(val_fraction=0.0), "val_fraction=0.0")])
def test_bad_settings_name_the_setting(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**kw)


def test_model_checks_before_any_weight(tmp_path):
    from tensorpar.train.config import check_against_model
    from tensorpar.hf.presets import preset_config
    c = preset_config("tiny", 256, 128)
    with pytest.raises(ValueError, match="seq_len=512 exceeds the model's max_position_embeddings=256"):
        check_against_model(TrainConfig(seq_len=512), c, 256)
    with pytest.raises(ValueError, match="tokenizer has 300 ids but the model's vocab_size is 256"):
        check_against_model(TrainConfig(), c, 300)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset_config("huge", 256, 128)


# ---------------------------------------------------------------- dropout masks

def test_hidden_dropout_replicated_same_mask_on_every_rank():
    rng = DropoutRNG(7)
    rng.set_step(3)
    x = torch.ones(2, 8, 6)
    outs = [HiddenDropout(0.5, rng, 1, "mlp_out", fake_rank(r, 4))(x) for r in range(4)]
    full = HiddenDropout(0.5, rng, 1, "mlp_out", fake_rank(0, 1))(x)
    assert (full == 0).any() and (full == 2).any()
    for o in outs:
        assert torch.equal(o, full)
    rng.set_step(4)
    assert not torch.equal(HiddenDropout(0.5, rng, 1, "mlp_out", fake_rank(0, 1))(x), full)  # new step, new mask


def test_hidden_dropout_sequence_parallel_slices_gather_to_tp1_mask():
    rng = DropoutRNG(7)
    x = torch.ones(2, 8, 6)
    full = HiddenDropout(0.3, rng, 0, "attn_out", fake_rank(0, 1))(x)
    for tp in (2, 4):
        parts = [HiddenDropout(0.3, rng, 0, "attn_out", fake_rank(r, tp), sequence_parallel=True)(x[:, :8 // tp])
                 for r in range(tp)]
        assert torch.equal(torch.cat(parts, dim=1), full)


class _Attn:
    """The attributes HeadKeyedAttention reads from a TPAttention."""

    def __init__(self, layout, rank, tp):
        self.layout, self.tp, self.layer_idx, self.training = layout, fake_rank(rank, tp), 1, True


def test_attention_dropout_masks_keyed_by_global_head():
    """Heads 0-8 computed at tp = 1, or split 5/4 (tp = 2) or 3/2/2/2 (tp = 4): the same output per head."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 6, 4, generator=g) for _ in range(3))
    fn = HeadKeyedAttention(DropoutRNG(1))
    full, _ = fn(_Attn(HeadLayout.make(9, 3, 4, 1), 0, 1), q, k, v, None, dropout=0.4, scaling=0.5)
    nodrop, _ = fn(_Attn(HeadLayout.make(9, 3, 4, 1), 0, 1), q, k, v, None, dropout=0.0, scaling=0.5)
    assert not torch.allclose(full, nodrop)
    for tp in (2, 4):
        layout = HeadLayout.make(9, 3, 4, tp)
        parts = []
        for r in range(tp):
            a, b = layout.q_heads.range(r)
            parts.append(fn(_Attn(layout, r, tp), q[:, a:b], k[:, a:b], v[:, a:b], None, dropout=0.4,
                            scaling=0.5)[0])
        torch.testing.assert_close(torch.cat(parts, dim=2), full, rtol=1e-6, atol=1e-6)
    # grouped KV heads left unexpanded (each serves 3 consecutive query heads): the same result
    kv_heads = [0, 3, 6]
    grouped, _ = fn(_Attn(HeadLayout.make(9, 3, 4, 1), 0, 1), q, k[:, kv_heads], v[:, kv_heads], None,
                    dropout=0.4, scaling=0.5)
    expanded, _ = fn(_Attn(HeadLayout.make(9, 3, 4, 1), 0, 1), q, k[:, kv_heads].repeat_interleave(3, 1),
                     v[:, kv_heads].repeat_interleave(3, 1), None, dropout=0.4, scaling=0.5)
    assert torch.equal(grouped, expanded)


def test_no_dropout_attention_equals_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(3))
    out, _ = HeadKeyedAttention(DropoutRNG(0))(_Attn(HeadLayout.make(3, 3, 4, 1), 0, 1), q, k, v, None, dropout=0.0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- fine-tuning from pretrained weights

@pytest.fixture(scope="module")
def pretrained_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests._train_jobs import tiny_config
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config(num_attention_heads=9, num_key_value_heads=3,
                                                         hidden_size=36, tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("pretrained") / "model"
    model.save_pretrained(path)
    return str(path)


def job_finetune(ctx, folder):
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import build_model, resolve_source
    from tests._train_jobs import synthetic_data
    cfg = TrainConfig(model=folder, seq_len=16, batch_size=4, steps=3, lr=1e-3, tp=ctx.tp.size,
                      sequence_parallel=ctx.tp.size > 1)
    data = synthetic_data()
    src = resolve_source(cfg)
    model, plan = build_model(cfg, src, ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    return [tr.train_step().loss for _ in range(3)], src.weights is not None


def first_batch(data, cfg):
    return next(data.train_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed))


def test_finetune_starts_from_the_pretrained_weights(pools, pretrained_folder):
    """The first loss is the pretrained model's loss on the first batch (computed by transformers), at tp = 1 and 2."""
    from transformers import AutoModelForCausalLM

    from tests._train_jobs import synthetic_data
    data = synthetic_data()
    x, y = first_batch(data, TrainConfig(seq_len=16, batch_size=4))
    ref = AutoModelForCausalLM.from_pretrained(pretrained_folder, dtype=torch.float32)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item()
    for tp in (1, 2):
        losses, used_weights = run_tp(pools, tp, job_finetune, pretrained_folder)[0]
        assert used_weights
        assert abs(losses[0] - want) <= 1e-5 * want, (tp, losses[0], want)
        assert losses[2] < losses[0]


# ---------------------------------------------------------------- command line

@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    lines = [f"{w} {i % 7} the quick brown fox jumps over the lazy dog {i % 3}." for i, w in
             enumerate(["Alas", "Hark", "Prithee", "Forsooth"] * 300)]
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text("\n".join(lines))
    return str(p)


def test_cli_run_writes_metrics_plot_checkpoints_and_resumes(tmp_path, text_file):
    from tensorpar.train.checkpoint import list_checkpoints
    from tensorpar.train.cli import run
    from tensorpar.train.metrics import read_metrics
    ctx = ParallelContext.single()
    cfg = TrainConfig(model="tiny", data=text_file, seq_len=32, batch_size=4, steps=6, eval_every=3,
                      eval_batches=2, save_every=3, out_dir=str(tmp_path / "run"), warmup_steps=1)
    s = run(cfg, ctx, progress=False, export=str(tmp_path / "hf"))
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in recs if r["kind"] == "val"] == [3, 6]
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == 128 for r in recs if r["kind"] == "train")
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_000003", "step_000006"]
    assert (Path(s["export"]) / "config.json").is_file()
    # resume from step 3 to step 6: the same losses as the uninterrupted run, metrics cut at step 3 first
    cont = run(cfg, ctx, progress=False, resume=str(tmp_path / "run" / "checkpoints" / "step_000003"))
    assert cont["step"] == 6
    again = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert again == [r["loss"] for r in recs if r["kind"] == "train"]


def test_cli_rejects_bad_input_before_launch(capsys, text_file):
    from tensorpar.cli import main
    rc = main(["train", "--tp", "4", "--sequence-parallel", "--seq-len", "30", "--data", text_file, "--no-progress"])
    assert rc == 2 and "seq_len=30 is not divisible by tp=4" in capsys.readouterr().err
    rc = main(["train", "--tp", "5", "--model", "tiny", "--data", text_file, "--no-progress"])
    assert rc == 2 and "--tp 5: exceeds the model's 4 attention heads" in capsys.readouterr().err
    rc = main(["train", "--data", "no-such-corpus", "--no-progress"])
    assert rc == 2 and "use 'shakespeare' or the path of a UTF-8 .txt file" in capsys.readouterr().err


@pytest.mark.slow  # CI keeps sequence parallelism's in-process parity
def test_cli_launch_tp2_sequence_parallel(tmp_path, text_file):
    """The real command: two ranks started by the elastic launcher, sequence parallelism, export."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "tensorpar", "train", "--tp", "2", "--sequence-parallel", "--model", "tiny",
           "--data", text_file, "--steps", "4", "--seq-len", "32", "--batch-size", "4", "--eval-every", "2",
           "--eval-batches", "1", "--out", str(tmp_path / "run"), "--export", str(tmp_path / "hf"), "--no-progress"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "done: step 4" in p.stdout
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in recs if r["kind"] == "train"]) == 4
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["tp_size_at_save"] == 2 and state["config"]["sequence_parallel"] is True
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_the_plan_is_built_once_per_run(tmp_path, text_file, monkeypatch):
    # `tensorpar train` builds the plan once, in the launching process, and sends it to the ranks in the job (issue
    # 22; before: 1 + 2 per rank, 9 plans for --tp 2 --pp 2, then 1 + 1 per rank). One rank runs in this process, so
    # the launcher's build and any build of the rank are both counted here.
    import tensorpar.hf.plan as hf_plan
    from tensorpar.cli import main
    calls = []
    real = hf_plan.make_plan
    monkeypatch.setattr(hf_plan, "make_plan", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    rc = main(["train", "--tp", "1", "--model", "tiny", "--data", text_file, "--seq-len", "32", "--batch-size", "4",
               "--steps", "1", "--eval-batches", "1", "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 0 and calls == [1], calls


def test_trainer_refuses_a_model_on_another_device():
    """A model left on the CPU for a rank that computes on a GPU fails at once, in one line, not at the first
    embedding lookup of the first step (seen on CUDA: "Expected all tensors to be on the same device")."""
    from tensorpar.parallel import ParallelContext
    from tests._train_jobs import BASE, make_trainer

    with pytest.raises(ValueError, match=r"^the model's parameters are on cpu but this rank computes on cuda:0 "
                                         r"\(ctx.device\): build it with build_model\(\.\.\., device=ctx.device\)$"):
        make_trainer(ParallelContext.single("cuda:0"), BASE, device="cpu")


def test_check_device_names_the_same_device_alike():
    """``cpu:0`` is the CPU its parameters report as ``cpu`` (a review found a CPU rank of ctx.device "cpu:0"
    refused); meta parameters (other pipeline stages) are not counted."""
    from tensorpar.train.model import check_device

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        check_device(model, device)
    with pytest.raises(ValueError, match="parameters are on cpu but this rank computes on meta"):
        check_device(model, "meta")
