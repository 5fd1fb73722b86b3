"""Capacity-weighted tensor parallelism (issue 12 part 3): ``tp_weights`` splits every sharded dimension by the
same rule (:func:`tensorpar.shard.split_sizes`), and the results equal the unsharded model exactly as for an
even split: logits, loss, every gradient and the grad norm (Llama with GQA, with and without sequence
parallelism; a Qwen2-MoE with routed and shared experts), greedy tokens against transformers' generate, and
20 training steps against tp = 1. One launch per tp degree.

Tolerance (tensorpar.testing "close", fp32): row-parallel sums add in another order; tokens must be identical."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tensorpar import capacity
from tensorpar.hf.plan import make_plan
from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.shard import split_sizes
from tensorpar.testing import assert_parity, random_model
from tests._ranks import run_tp
from tests._train_jobs import BASE, job_runs, train_run
from tests.decode.test_generate import hf_reference, make_model_folder, prompts
from tests.hf.test_hf_parity import tiny_llama_config


# ---------------------------------------------------------------- the rule and its checks (no ranks)

def test_every_dimension_splits_by_the_same_rule():
    cfg = tiny_llama_config()      # 6 heads / 2 KV heads, intermediate 40, vocab 37
    for w in [(3, 1), (2, 1, 1), (1, 2, 5)]:
        plan = make_plan(cfg, len(w), tp_weights=w)
        assert list(plan.heads.q_heads.sizes) == split_sizes(6, len(w), weights=w)
        assert list(plan.intermediate.sizes) == split_sizes(40, len(w), weights=w)
        assert list(plan.vocab.sizes) == split_sizes(37, len(w), weights=w)
    plan = make_plan(cfg, 2, tp_weights=(3, 1))
    assert plan.heads.q_heads.sizes == (5, 1) and plan.intermediate.sizes == (30, 10) and plan.vocab.sizes == (28, 9)
    # rank 0's heads 0-4 read KV heads 0 and 1, rank 1's head 5 reads KV head 1: held by both
    assert plan.heads.kv_heads.units == ((0, 1), (1,))
    assert make_plan(cfg, 2, tp_weights="1,1").vocab.sizes == make_plan(cfg, 2).vocab.sizes == (19, 18)


def test_weighted_heads_keep_gqa_groups_whole():
    from tensorpar.layers.attention import HeadLayout

    # SmolLM2's 9 query / 3 KV heads: 3,1 gives rank 0 two whole groups and rank 1 one (6 + 3 heads, no KV head
    # on two ranks), where a per-head split (7 + 2) would put KV head 2 on both ranks
    lay = HeadLayout.make(9, 3, 64, 2, split_weights=(3, 1))
    assert lay.q_heads.sizes == (6, 3) and lay.kv_heads.units == ((0, 1), (2,))
    assert HeadLayout.make(32, 8, 64, 2, split_weights=(3, 1)).q_heads.sizes == (24, 8)
    # as many groups as ranks: every rank one group, whatever the weights
    assert HeadLayout.make(9, 3, 64, 3, split_weights=(2, 1, 1)).q_heads.sizes == (3, 3, 3)
    # weights too skewed for whole groups (9,1 would leave rank 1 none): per head, group 2 on both ranks
    lay = HeadLayout.make(9, 3, 64, 2, split_weights=(9, 1))
    assert lay.q_heads.sizes == (8, 1) and lay.kv_heads.units == ((0, 1, 2), (2,))
    # fewer groups than ranks (MQA-like): per head; the even split is unchanged (per head, balanced)
    assert HeadLayout.make(6, 2, 8, 3, split_weights=(2, 1, 1)).q_heads.sizes == (3, 2, 1)
    assert HeadLayout.make(9, 3, 64, 2).q_heads.sizes == (5, 4)


def test_moe_expert_columns_split_by_the_weights():
    from tests.families_moe import config
    cfg = config("qwen2_moe")
    plan = make_plan(cfg, 2, tp_weights=(3, 1))
    parts = {type(e.style).__name__: e.style for e in plan.entries}
    expert = parts["SharedExpertMoE"]
    sizes = {tuple(getattr(expert, a).sizes) for a in vars(expert) if hasattr(getattr(expert, a), "sizes")}
    assert tuple(split_sizes(20, 2, weights=(3, 1))) in sizes        # moe_intermediate_size
    assert tuple(split_sizes(14, 2, weights=(3, 1))) in sizes        # shared_expert_intermediate_size


@pytest.mark.parametrize("weights,tp,msg", [
    ("3,1,1", 2, "has 3 entries but tp is 2"),
    ((0, 1), 2, "must be a positive finite number (got 0)"),
    ((-1, 2), 2, "got -1"),
    ("x,1", 2, "one positive number per tp rank"),
    ((float("nan"), 1), 2, "positive finite"),
])
def test_bad_weights_are_named(weights, tp, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(tp=tp, tp_weights=weights)


def test_too_skewed_weights_name_what_works():
    cfg = tiny_llama_config()      # 6 heads: 20,1 gives rank 1 no head
    with pytest.raises(ValueError, match=r"--tp-weights 20,1 leaves a tp rank with no part .*num_attention_heads.* "
                                         r"no more skewed than 20,4"):
        capacity.check_for_model("20,1", 2, cfg)
    fix = capacity.feasible_weights((20, 1), 6)
    assert min(split_sizes(6, 2, weights=fix)) >= 1
    with pytest.raises(ValueError, match="no more skewed than"):
        split_sizes(6, 2, weights=(20, 1), name="heads")
    assert capacity.check_for_model("auto", 2, cfg) == "auto"
    with pytest.raises(ValueError, match="must be measured first"):
        make_plan(cfg, 2, tp_weights="auto")


def test_weights_from_speeds():
    assert capacity.weights_from_speeds([30.0, 10.0]) == (1.0, 0.33)
    assert capacity.weights_from_speeds([5.0, 5.0, 10.0]) == (0.5, 0.5, 1.0)
    assert capacity.weights_from_speeds([1000.0, 1.0]) == (1.0, 0.01)
    with pytest.raises(ValueError, match="must be positive"):
        capacity.weights_from_speeds([1.0, 0.0])
    assert capacity.measure_matmul_gflops("cpu", n=64, seconds=0.01) > 0


def test_train_config_and_cli_flag():
    import argparse

    from tensorpar.train.cli import add_arguments, config_from_args
    from tensorpar.train.config import TrainConfig
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--tp", "2", "--tp-weights", "3,1"]))
    assert cfg.tp_weights == (3.0, 1.0)
    assert TrainConfig.from_dict(cfg.to_dict()).tp_weights == (3.0, 1.0)     # a checkpoint's JSON round trip
    assert config_from_args(p.parse_args(["--tp", "2", "--tp-weights", "auto"])).tp_weights == "auto"
    with pytest.raises(ValueError, match="has 1 entries but tp is 2"):
        config_from_args(p.parse_args(["--tp", "2", "--tp-weights", "3"]))


@pytest.mark.parametrize("command", ["generate", "serve", "verify"])
def test_cli_refuses_bad_weights_before_ranks_start(command, tmp_path, capsys):
    """Every command checks the weights against the model in the launching process (exit 2, one line)."""
    from tensorpar.cli import main
    folder = make_model_folder(tmp_path / "m", "llama")          # 9 heads
    args = {"generate": ["generate", "--model", str(folder), "--tp", "2"],
            "serve": ["serve", "--model", str(folder), "--tp", "2"],
            "verify": ["verify", "--model", "tiny", "--tp", "2"]}[command]
    rc = main(args + ["--tp-weights", "50,1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tp-weights 50,1" in err and "no more skewed than" in err, err


# ---------------------------------------------------------------- equality with the unsharded model (ranks)

def _parity_step(cfg, ref, par, tp, ids):
    from tensorpar import comm
    from tensorpar.grads import grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
    from tensorpar.layers import vocab_parallel_cross_entropy
    from tensorpar.testing import compare_grads
    plan = par.tensorpar_plan
    for m in (ref, par):
        m.zero_grad(set_to_none=True)
    logits_ref = ref(ids).logits
    loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss_ref.backward()
    logits = par(ids).logits
    loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], tp, partition=plan.vocab)
    loss.backward()
    sync_sequence_parallel_grads(par.parameters(), tp)
    sync_duplicated_grads(par.parameters(), tp)
    d = [assert_parity("logits", comm.all_gather(logits.detach(), tp, -1, plan.vocab), logits_ref),
         assert_parity("loss", loss, loss_ref)]
    d += compare_grads(par, ref, tp.rank)
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()))
    return d


def job_weighted(ctx, weights, folder, n_tokens):
    """Llama (plain and sequence parallel) and Qwen2-MoE parity, greedy tokens, and the auto measurement."""
    from transformers import AutoModelForCausalLM

    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.load import build_parallel_model
    from tests.families_moe import config as moe_config
    tp = ctx.tp
    out = {"n": 0}
    for sp in (False, True):
        cfg = tiny_llama_config()
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg).float()
        par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size, sequence_parallel=sp, tp_weights=weights), tp)
        out["n"] += len(_parity_step(cfg, ref, par, tp, torch.randint(0, cfg.vocab_size, (2, 12))))
    cfg = moe_config("qwen2_moe")
    ref = random_model(cfg)
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size, tp_weights=weights), tp)
    out["n"] += len(_parity_step(cfg, ref, par, tp, torch.randint(0, cfg.vocab_size, (2, 9))))
    out["moe_sizes"] = [p.shape[-1] for n, p in par.named_parameters() if n.endswith("layers.0.mlp.experts.down_proj")]
    # generation from a saved folder, through the loader (the path of tensorpar generate / serve)
    model, plan = build_parallel_model(folder, tp, tp_weights=weights)
    ids, mask = prompts(53)
    out["tokens"] = generate_tokens(model, tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n_tokens)).tokens
    out["local_heads"] = plan.heads.local_heads(tp.rank)
    out["auto"] = capacity.measure_tp_weights(ctx, seconds=0.05)
    return out


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return str(make_model_folder(tmp_path_factory.mktemp("weighted") / "llama", "llama"))   # 9 heads / 3 KV


@pytest.mark.parametrize("weights", [(3, 1), (2, 1, 1)])
def test_weighted_equals_unsharded_and_transformers(pools, llama_folder, weights):
    ids, mask = prompts(53)
    want, _ = hf_reference(llama_folder, ids, mask, 24)
    res = run_tp(pools, len(weights), job_weighted, weights, llama_folder, 24)
    # 9 heads in 3 GQA groups, kept whole: 3,1 -> 2 + 1 groups; 2,1,1 -> one group each
    assert [r["local_heads"] for r in res] == {(3, 1): [6, 3], (2, 1, 1): [3, 3, 3]}[weights]
    for r, got in enumerate(res):
        assert got["n"] > 40
        assert torch.equal(got["tokens"], want), f"weights {weights} rank {r}: greedy tokens differ from transformers"
        assert got["auto"] == res[0]["auto"] and len(got["auto"]) == len(weights)   # every rank derives the same
    # the experts' intermediate columns follow the weights (20 of them)
    assert [x["moe_sizes"][0] for x in res] == split_sizes(20, len(weights), weights=weights)


@pytest.fixture(scope="module")
def train_runs(pools):
    single = ParallelContext.single()
    return {1: train_run(single, BASE, grad_steps=(1, 20)),
            2: run_tp(pools, 2, job_runs, [("w31", BASE.replace(tp=2, tp_weights=(3, 1)), dict(grad_steps=(1, 20)))]),
            3: run_tp(pools, 3, job_runs, [("w211", BASE.replace(tp=3, tp_weights=(2, 1, 1)),
                                            dict(grad_steps=(1, 20)))])}


@pytest.mark.parametrize("tp,name", [(2, "w31"), (3, "w211")])
def test_weighted_training_equals_tp1(train_runs, tp, name):
    want = train_runs[1]
    for rank, got in enumerate(train_runs[tp]):
        got = got[name]
        assert max(abs(a - b) / abs(b) for a, b in zip(got["loss"], want["loss"])) <= 1e-5, (rank, got["loss"])
        assert max(abs(a - b) / abs(b) for a, b in zip(got["norm"], want["norm"])) <= 1e-5, rank
    got = train_runs[tp][0][name]
    for step in (1, 20):
        for pname, g in want["grads"][step].items():
            assert_parity(f"{name} step {step} grad {pname}", got["grads"][step][pname], g)


# ---------------------------------------------------------------- the planner's --devices (same rule)

def test_planner_devices_split_by_the_same_rule(capsys):
    from tensorpar.cli import main
    from tensorpar.planner import model_spec as ms
    from tensorpar.planner.weighted import parse_devices, plan_weighted
    devs = parse_devices("a100-80gb:2,v100-32gb")
    assert [d.name for d in devs] == ["a100-80gb", "a100-80gb", "v100-32gb"]
    assert [d.name for d in parse_devices('["h100-80gb", {"name": "slow", "memory_gib": 16, "peak_tflops": 50}]')] \
        == ["h100-80gb", "slow"]
    model = ms.preset("llama3-8b")
    even, weighted = plan_weighted(model, devs)
    w = [r.weight for r in weighted.ranks]
    from tensorpar.layers.attention import HeadLayout
    lay = HeadLayout.make(model.num_heads, model.num_kv_heads, model.head_dim, 3, split_weights=w)
    assert [r.heads for r in weighted.ranks] == list(lay.q_heads.sizes) == [12, 12, 8]   # whole GQA groups of 4
    assert [r.ffn for r in weighted.ranks] == split_sizes(model.ffn_hidden_size, 3, weights=w)
    assert [r.vocab for r in weighted.ranks] == split_sizes(model.vocab_size, 3, weights=w)
    assert [r.heads for r in even.ranks] == split_sizes(model.num_heads, 3)
    # the slowest rank sets the pace: the even split is held back by the V100, the weighted one is near the bound
    assert even.time_s == even.ranks[2].seconds_per_token and weighted.efficiency > 0.9 > even.efficiency
    assert main(["plan", "--model", "llama3-8b", "--devices", "a100-80gb:4,v100-32gb:4", "--inference"]) == 0
    assert "weighted 1,1,1,1,0.401" in capsys.readouterr().out
    assert main(["plan", "--model", "llama3-8b", "--devices", "a100:2"]) == 2
    assert "'a100' is not a device preset" in capsys.readouterr().err
    # a device object gets --device-file's checks (review: peak_tflops 1e300 gave "split weights [1.0, 0.0] must all
    # be positive", naming neither the device nor the field)
    for obj, says in ((', "peak_tflops": 1e300}', "--devices item 1 (slow): peak_tflops 1e+300: outside the plausible"),
                      (', "peak_tflops": true}', "--devices item 1 (slow): peak_tflops true is not a number")):
        arg = '["h100-80gb", {"name": "slow", "memory_gib": 16' + obj + "]"
        assert main(["plan", "--model", "llama3-8b", "--devices", arg]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- auto: measured in init_parallel, made usable

def job_auto(ctx):
    from tensorpar.hf.load import build_parallel_model  # noqa: F401  (the import a rank of generate does)
    return ctx.tp_weights, capacity.resolve_for_model(ctx, tiny_llama_config())


def test_auto_weights_measured_by_init_parallel():
    from tensorpar.testing import WorkerPool
    with WorkerPool(2, ParallelConfig(tp=2, tp_weights="auto")) as pool:
        res = pool.run(job_auto)
    (w0, r0), (w1, r1) = res
    assert w0 == w1 and r0 == r1 and len(w0) == 2 and max(w0) == 1.0 and min(w0) > 0
    assert min(split_sizes(6, 2, weights=r0)) >= 1


def test_auto_weights_too_skewed_for_the_model_are_raised():
    """A rank measured 100x slower still gets one head: auto weights are raised to the most skewed that work."""
    from types import SimpleNamespace
    ctx = SimpleNamespace(config=ParallelConfig(tp=2, tp_weights="auto"), tp_weights=(1.0, 0.01))
    w = capacity.resolve_for_model(ctx, tiny_llama_config())          # 6 heads, vocab 37, intermediate 40
    assert split_sizes(6, 2, weights=w) == [5, 1]
    plan = make_plan(tiny_llama_config(), 2, tp_weights=w)
    assert min(plan.heads.q_heads.sizes) == 1 and min(plan.vocab.sizes) >= 1
    fixed = SimpleNamespace(config=ParallelConfig(tp=2, tp_weights=(3, 1)), tp_weights=(3.0, 1.0))
    assert capacity.resolve_for_model(fixed, tiny_llama_config()) == (3.0, 1.0)      # user weights: as given


# ---------------------------------------------------------------- the command line, end to end

from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: E402,F401  (the fixture: a model with a tokenizer)


@pytest.mark.slow   # ~30-60 s: three launches; the weighted split's tokens are proven in process above
def test_generate_cli_weighted_and_auto_print_the_even_text(tiny_with_tokenizer):  # noqa: F811
    import os
    import subprocess
    import sys
    folder = tiny_with_tokenizer

    def cli(*extra):
        env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--model", folder, "--tp", "2", "--prompt",
                            "the cat", "--max-new-tokens", "6", *extra], capture_output=True, text=True, timeout=400,
                           env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    plan = cli("--tp-weights", "3,1", "--print-plan")
    assert "9 q heads -> [6, 3], 3 kv heads -> r0:[0, 1] r1:[2]" in plan, plan
    text = [cli(*extra).splitlines()[0] for extra in ((), ("--tp-weights", "3,1"), ("--tp-weights", "auto"))]
    assert text[0] == text[1] == text[2], text


@pytest.mark.slow  # CI keeps the in-process weighted parity tests
def test_train_cli_auto_then_resume_at_other_weights(tmp_path):
    """`tensorpar train --tp-weights auto` runs (weights measured in the ranks, saved in the checkpoint's config);
    its checkpoint resumes under 1,3 (checkpoints are layout-independent)."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    common = ["--tp", "2", "--data", "shakespeare", "--seq-len", "32", "--batch-size", "4", "--out", str(out),
              "--no-progress", "--eval-batches", "1"]
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--steps", "2", "--tp-weights", "auto"] + common,
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    w = state["config"]["tp_weights"]
    assert len(w) == 2 and max(w) == 1.0 and min(w) > 0, w          # measured numbers, not "auto"
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--steps", "3", "--resume", "--tp-weights", "1,3"]
                       + common, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: step 3" in r.stdout
