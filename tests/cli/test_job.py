"""One job path (issue 22, item 1): the launching process reads the config, the tokenizer and builds the plan once
and hands every rank one frozen :class:`tensorpar.job.Job`; rank code reads neither argparse nor WORLD_SIZE / RANK.

The counts are taken where the work happens: a :class:`~tensorpar.hf.plan.ShardingPlan` constructed (every plan a
family table or a plan file makes is one; unpickling a shipped plan constructs none), a model config read through
transformers (``PretrainedConfig.get_config_dict``: ``AutoConfig`` and every config class go through it), a
tokenizer loaded (``AutoTokenizer.from_pretrained``). In the ranks the same counters are installed by
:func:`_counting_rank`, which the launcher starts in place of the command's rank function.
"""
from __future__ import annotations

import inspect
import json
import os
import re

import pytest

from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: F401  (fixture)


def _install_counters(counts: dict) -> None:
    """Count plan builds, config reads and tokenizer loads in this process (patches classes; see module doc)."""
    import transformers
    from transformers.configuration_utils import PretrainedConfig

    from tensorpar.hf.plan import ShardingPlan

    init = ShardingPlan.__init__

    def counted_init(self, *a, **k):
        counts["plans"] = counts.get("plans", 0) + 1
        init(self, *a, **k)
    ShardingPlan.__init__ = counted_init
    get_config_dict = PretrainedConfig.get_config_dict.__func__

    def counted_get_config_dict(cls, *a, **k):
        counts["configs"] = counts.get("configs", 0) + 1
        return get_config_dict(cls, *a, **k)
    PretrainedConfig.get_config_dict = classmethod(counted_get_config_dict)
    tok_from_pretrained = transformers.AutoTokenizer.from_pretrained.__func__

    def counted_tokenizer(cls, *a, **k):
        counts["tokenizers"] = counts.get("tokenizers", 0) + 1
        return tok_from_pretrained(cls, *a, **k)
    transformers.AutoTokenizer.from_pretrained = classmethod(counted_tokenizer)


def _counting_rank(*args) -> int:
    """Started by the launcher on every rank in place of ``tensorpar.generate._rank_main`` (top level: pickled):
    counts what the real rank function builds and reads, and writes the counts to ``$TENSORPAR_TEST_COUNTS``."""
    from tensorpar import generate

    counts: dict = {}
    _install_counters(counts)
    rc = generate._rank_main(*args)
    with open(os.path.join(os.environ["TENSORPAR_TEST_COUNTS"], f"rank-{os.getpid()}.json"), "w") as f:
        json.dump(counts, f)
    return rc


def _run_counted(folder, tmp_path, monkeypatch, capfd, *flags) -> tuple[dict, list[dict]]:
    from tensorpar import generate
    from tensorpar.cli import main

    out = tmp_path / "counts"
    out.mkdir()
    monkeypatch.setenv("TENSORPAR_TEST_COUNTS", str(out))
    monkeypatch.setenv("TENSORPAR_THREADS", "1")
    monkeypatch.setattr(generate, "_rank_main", _counting_rank)  # the launcher pickles it by name: the ranks run it
    parent: dict = {}
    import transformers
    from transformers.configuration_utils import PretrainedConfig

    from tensorpar.hf.plan import ShardingPlan
    monkeypatch.setattr(ShardingPlan, "__init__", ShardingPlan.__init__)  # restored after the test
    monkeypatch.setattr(PretrainedConfig, "get_config_dict", PretrainedConfig.get_config_dict)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", transformers.AutoTokenizer.from_pretrained)
    _install_counters(parent)
    rc = main(["generate", "--model", folder, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "3",
               "--fast-collectives", "off", *flags])
    assert rc == 0, capfd.readouterr().err[-2000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert len(ranks) == 2
    return parent, ranks


def test_generate_tp2_builds_the_plan_and_reads_config_and_tokenizer_once(tiny_with_tokenizer, tmp_path,  # noqa: F811
                                                                         monkeypatch, capfd):
    """`generate --tp 2`: one plan, one config read, one tokenizer load per run, all in the launching process; the
    ranks build and read none of them (before: the parent read the config twice, and each rank read it three times,
    loaded the tokenizer and built the plan again)."""
    parent, ranks = _run_counted(tiny_with_tokenizer, tmp_path, monkeypatch, capfd)
    assert {"parent": parent, "ranks": ranks} == {"parent": {"plans": 1, "configs": 1, "tokenizers": 1},
                                                  "ranks": [{}, {}]}
    assert "the cat" in capfd.readouterr().out   # rank 0 printed the prompt and its continuation


@pytest.mark.slow
def test_generate_tp_weights_auto_builds_the_plan_once_per_rank(tiny_with_tokenizer, tmp_path,  # noqa: F811
                                                                monkeypatch, capfd):
    """With --tp-weights auto the split is measured by the ranks: the launching process checks an even plan, each
    rank builds its plan once after measuring; the config and tokenizer are still read once, by the parent."""
    parent, ranks = _run_counted(tiny_with_tokenizer, tmp_path, monkeypatch, capfd, "--tp-weights", "auto")
    assert {"parent": parent, "ranks": ranks} == {"parent": {"plans": 1, "configs": 1, "tokenizers": 1},
                                                  "ranks": [{"plans": 1}, {"plans": 1}]}


def _rank_functions(command: str):
    if command == "job":
        from tensorpar import job
        return [job.start, job.load_model, job.rank_weights, job.print0]
    from tensorpar import generate
    from tensorpar.serve import cli as serve_cli
    from tensorpar.train import ranks as train_ranks
    from tensorpar.verify import cli as verify_cli

    return {"generate": [generate._rank_main], "serve": [serve_cli._rank_main, serve_cli._serve],
            "train": [train_ranks._rank_main, train_ranks.run], "verify": [verify_cli._rank_main]}[command]


@pytest.mark.parametrize("command", ["generate", "serve", "train", "verify", "job"])
def test_rank_code_reads_no_argparse_and_no_rank_environment(command):
    """The ranks' entry functions take the job alone: no argparse Namespace, no WORLD_SIZE / RANK from the
    environment (the rank is torch.distributed's, through the ParallelContext)."""
    for fn in _rank_functions(command):
        src = inspect.getsource(fn)
        params = [n for n, p in inspect.signature(fn).parameters.items() if p.kind != p.VAR_POSITIONAL]
        assert "args" not in params, f"{fn.__qualname__} takes args (a Namespace)"
        found = re.findall(r"argparse|\bargs\.\w+|WORLD_SIZE|[\"']RANK[\"']|rank0_print", src)
        assert not found, f"{fn.__module__}.{fn.__qualname__} reads {found}"


def test_generate_rank_runs_without_the_launch_environment(tiny_with_tokenizer, monkeypatch, capsys):  # noqa: F811
    """A one-rank generate job runs in this process with WORLD_SIZE garbage and RANK unset: the rank takes its world
    size from the job (before, it parsed WORLD_SIZE and failed)."""
    import argparse

    from tensorpar import generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    job = generate.validate(p.parse_args(["--model", tiny_with_tokenizer, "--tp", "1", "--prompt", "the cat",
                                          "--max-new-tokens", "2", "--fast-collectives", "off"]))
    monkeypatch.setenv("WORLD_SIZE", "not-a-number")
    monkeypatch.delenv("RANK", raising=False)
    from tensorpar.launch import free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")   # a one-rank group needs no rendezvous (an in-process store)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert generate._rank_main(job) == 0
    assert capsys.readouterr().out.startswith("the cat")


@pytest.mark.slow
def test_generate_under_torchrun_builds_its_job_in_process(tiny_with_tokenizer):  # noqa: F811
    """Under torchrun every process is a rank: it validates, builds its job in-process (tp from torchrun's world
    size) and prints the same text as `generate --tp 2` through tensorpar's own launcher."""
    import subprocess
    import sys
    from pathlib import Path

    from tensorpar.launch import free_port

    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    flags = ["generate", "--model", tiny_with_tokenizer, "--prompt", "the cat", "--max-new-tokens", "4",
             "--fast-collectives", "off"]
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "tensorpar"]
    a = subprocess.run(torchrun + flags, env=env, capture_output=True, text=True, timeout=300)
    b = subprocess.run([sys.executable, "-m", "tensorpar", *flags, "--tp", "2"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    text = [next(line for line in r.stdout.splitlines() if line.startswith("the cat")) for r in (a, b)]
    assert text[0] == text[1], text
