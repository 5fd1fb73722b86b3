"""`tensorpar generate` end to end through the elastic launcher, and its bad-input errors."""
import os
import subprocess
import sys

import pytest

from tests.decode.test_generate import make_model_folder


def _cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tensorpar", "generate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _main(capsys, *args):
    """``tensorpar generate ARGS`` in this process (``tensorpar.cli.main``, what ``python -m tensorpar`` runs), for the
    checks made before any rank starts: ``(exit code, stdout, stderr)``, without a new interpreter's import of torch
    per case (about 5 s each as a subprocess)."""
    from tensorpar.cli import main
    capsys.readouterr()
    rc = main(["generate", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A random llama with the SmolLM2-style byte-level BPE tokenizer of a tiny vocabulary."""
    folder = make_model_folder(tmp_path_factory.mktemp("cli") / "tiny", "llama")
    _add_tokenizer(folder)
    return str(folder)


def _add_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(folder)


@pytest.mark.slow  # a launch (21 s); CI launches generate --tp 2 over gloo in test_comm_int8 (the same checks),
#                   test_job and test_ctrl_c_stops_every_rank
def test_generate_tp2_runs_and_exits_clean(tiny_with_tokenizer):
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "5",
             "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time to first token" in r.stdout and "tokens/s" in r.stdout


def test_print_plan(tiny_with_tokenizer, capsys):
    r = _main(capsys, "--model", tiny_with_tokenizer, "--tp", "3", "--print-plan")
    assert r.returncode == 0, r.stderr
    assert "ShardingPlan(llama, tp_size=3" in r.stdout and "9 q heads -> [3, 3, 3]" in r.stdout


def test_missing_path(capsys):
    r = _main(capsys, "--model", "/nonexistent/model", "--tp", "2")
    assert r.returncode != 0 and "no such file or folder" in r.stderr


def test_unsupported_architecture(tmp_path, capsys):
    from transformers import BloomConfig
    BloomConfig(hidden_size=32, n_head=4, n_layer=1, vocab_size=50).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    r = _main(capsys, "--model", str(tmp_path), "--tp", "2")
    assert r.returncode != 0 and "unsupported architecture" in r.stderr and "llama" in r.stderr
    assert "--plan-file" in r.stderr          # the way to shard an architecture without a built-in table


def test_truncated_safetensors(tiny_with_tokenizer, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_with_tokenizer, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = _cli("--model", str(bad), "--tp", "2")
    assert r.returncode != 0 and "model.safetensors" in r.stderr


def test_tp_larger_than_heads(tiny_with_tokenizer, capsys):
    r = _main(capsys, "--model", tiny_with_tokenizer, "--tp", "10", "--print-plan")
    assert r.returncode != 0 and "--tp 10: exceeds the model's 9 attention heads" in r.stderr


def test_prompt_longer_than_positions(tiny_with_tokenizer, capsys):
    r = _main(capsys, "--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "a" * 200)
    assert r.returncode != 0 and "max_position_embeddings=128" in r.stderr


@pytest.mark.slow      # 25 s; CI keeps Ctrl-C in test_serve.py (test_zz_sigint...) and test_nshosts_script.py
def test_ctrl_c_stops_every_rank(tiny_with_tokenizer):
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "tensorpar", "generate", "--model", tiny_with_tokenizer, "--tp", "2",
                          "--prompt", "the cat", "--max-new-tokens", "100", "--fast-collectives", "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    deadline = time.monotonic() + 120
    out = ""
    while "the cat" not in out and time.monotonic() < deadline:   # wait until rank 0 is generating
        out += p.stdout.read(1) or ""
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=60)
    err = p.stderr.read()
    assert rc != 0 and "interrupted" in err, err[-2000:]
    # nothing of this session is left running (allow a few seconds for processes to finish exiting)
    for _ in range(40):
        left = subprocess.run(["pgrep", "-a", "-s", str(p.pid)], capture_output=True, text=True).stdout.strip()
        if not left:
            break
        time.sleep(0.25)
    assert left == "", left


@pytest.mark.parametrize("args,msg", [(["--tp", "0"], "--tp must be a positive integer"),
                                      (["--timeout", "0"], "--timeout must be a positive"),
                                      (["--prompt", ""], "--prompt must not be empty")])
def test_bad_options_fail_before_launch(tiny_with_tokenizer, capsys, args, msg):
    r = _main(capsys, "--model", tiny_with_tokenizer, *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("args", [["--top-p", "0.5", "--top-k", "5", "--seed", "7"], ["--top-k", "5"],
                                  ["--top-p", "0.9", "--temperature", "0"], ["--seed", "7"]])
def test_sampling_options_without_temperature_refused(tiny_with_tokenizer, args):
    """Sampling options at the default temperature 0 (greedy) would do nothing: one line, before any rank starts."""
    import argparse

    from tensorpar import generate
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    with pytest.raises(ValueError, match=r"^--(top-p|top-k|seed) .*need --temperature > 0"):
        generate.validate(p.parse_args(["--model", tiny_with_tokenizer, *args]))
    # with a temperature they are used, and the defaults alone stay greedy
    generate.validate(p.parse_args(["--model", tiny_with_tokenizer, *args, "--temperature", "0.8"]))
    generate.validate(p.parse_args(["--model", tiny_with_tokenizer, "--top-k", "0", "--top-p", "1"]))
    assert "default 0 = greedy" in " ".join(p.format_help().split())


@pytest.mark.slow  # CI keeps test_generate_tp2_runs_and_exits_clean
def test_long_prefill_says_what_it_does(tiny_with_tokenizer):
    prompts = []
    for i in range(10):                       # >= 512 prompt tokens in all (10 prompts of >= 60 tokens)
        prompts += ["--prompt", f"p{i} " + "x y " * 30]
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--max-new-tokens", "2", *prompts)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensorpar: prefilling 10 x" in r.stderr and "prompt tokens on tp=2 ranks" in r.stderr


@pytest.mark.slow  # CI keeps the in-process collective checks (test_fingerprint)
def test_check_collectives_flag_runs_clean(tiny_with_tokenizer):
    # the fingerprint check runs at the first decode step (ranks agree: no error); mismatches are in test_fingerprint
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "4",
             "--check-collectives")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow  # CI time (2026-12-02: suite 20.5 min); a representative case stays in CI
def test_quantize_int8_tp2_text_equals_tp1(tiny_with_tokenizer, tmp_path):
    """int8 blocks of 32 inputs: a model whose inputs are whole blocks at tp 1 and 2 (tests/decode/test_quant.py's
    llama) prints the same text at both; the tiny llama (hidden 36) is refused before any rank starts."""
    import tests.decode.test_generate as tg
    from tests.decode.test_quant import QARCHS
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tg.ARCHS, "llama", QARCHS["llama"])
        folder = str(make_model_folder(tmp_path / "q", "llama"))
    _add_tokenizer(folder)
    outs = []
    for tp in ("1", "2"):
        r = _cli("--model", folder, "--tp", tp, "--prompt", "the cat", "--max-new-tokens", "8", "--quantize", "int8")
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.splitlines()[0])
    assert outs[0] == outs[1] and outs[0].startswith("the cat")
    r = _cli("--model", tiny_with_tokenizer, "--tp", "1", "--prompt", "the cat", "--quantize", "int8")
    assert r.returncode == 2 and "the hidden size is split as [36]" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # a launch (8 s); CI keeps the in-process int8 refusals (test_quant)
def test_quantize_int8_refused_for_a_family_without_the_lean_path(tmp_path):
    folder = make_model_folder(tmp_path / "gpt2", "gpt2")
    r = _cli("--model", str(folder), "--tp", "2", "--quantize", "int8")
    assert r.returncode == 2
    ours = [line for line in r.stderr.splitlines() if line.startswith("tensorpar generate:")]   # (+ transformers'
    #                                                                                              warnings)
    assert len(ours) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--quantize int8" in ours[0] and "'gpt2'" in ours[0] and "--quantize none" in ours[0]


@pytest.mark.slow  # a launch (8 s)
def test_chat_without_a_chat_template_is_one_line(tiny_with_tokenizer):
    """Old code: transformers' paragraph-long error (with a docs URL) from every rank, not naming --chat."""
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--chat", "--max-new-tokens", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--chat:" in r.stderr and "has no chat template" in r.stderr and "drop --chat" in r.stderr


# ---------------------------------------------------------------- --plan auto (issue 23.5: the planner chooses for the link)

# One rank's device for the planner, written as a --device-file (no calibration of this machine in these tests): a
# made-up host whose own link is 50 us per collective; the link between hosts comes from the flags.
PLAN_DEVICE = {"name": "test host", "memory_gib": 4.0, "peak_tflops": 0.1, "intra_node_gbps": 0.0,
               "inter_node_gbps": 0.0, "hbm_gbps": 10.0, "local_link_gbps": 2.0, "local_link_latency_us": 50.0}
SLOW_LINK = ["--inter-node-bw", "0.125", "--inter-node-latency-us", "500"]   # 1 Gbit/s


@pytest.fixture
def device_file(tmp_path):
    import json
    path = tmp_path / "device.json"
    path.write_text(json.dumps(PLAN_DEVICE))
    return str(path)


def _parse(*argv):
    import argparse

    from tensorpar import generate
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    return p.parse_args(list(argv))


def _torchrun_env(monkeypatch, world: int, local: int) -> None:
    """This process as rank 0 of a torchrun of ``world`` ranks, ``local`` per host (what the planner reads)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))


def test_plan_auto_chooses_tp_on_one_host_and_pp_across_a_slow_link(tiny_with_tokenizer, device_file, monkeypatch,
                                                                     capsys):
    """The launching process's choice (no rank started): 2 ranks on one host -> tp=2 (stages on one host buy memory,
    not speed); 2 hosts of 1 rank at 1 Gbit/s -> tp=1 pp=2 (tp across would pay 2 x 2 + 3 collectives per token at
    500 us, pp one send and one broadcast); 2 hosts of 2 ranks -> tp=2 inside each host, pp=2 across. Each prints one
    line naming the layout; the Job's degrees are the plan's."""
    from tensorpar import generate
    job = generate.validate(_parse("--model", tiny_with_tokenizer, "--plan", "auto", "--nproc", "2", "--device-file",
                                   device_file, "--prompt", "the cat", "--max-new-tokens", "4"))
    assert (job.parallel.tp, job.parallel.pp) == (2, 1)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "plan (auto) for 2 ranks on 1 host: tp=2 pp=1" in out, out
    assert job.task.plan_prediction["layout"] == "tp=2" and job.task.plan_prediction["decode_ms"] > 0
    for world, local, want in ((2, 1, (1, 2)), (4, 2, (2, 2))):
        _torchrun_env(monkeypatch, world, local)
        job = generate.validate(_parse("--model", tiny_with_tokenizer, "--plan", "auto", "--device-file", device_file,
                                       *SLOW_LINK, "--prompt", "the cat", "--max-new-tokens", "4"))
        assert (job.parallel.tp, job.parallel.pp) == want
        out = " ".join(capsys.readouterr().out.split())
        assert (f"plan (auto) for {world} ranks on 2 hosts, link between hosts 0.125 GB/s 500 us: "
                f"tp={want[0]} pp={want[1]}") in out and "pp across nodes" in out, out


def test_plan_auto_refuses_a_device_with_no_memory_past_the_reserve(tiny_with_tokenizer, tmp_path):
    """A device file of 1.5 GiB against the planner's 2 GiB reserve said "needs 0.26 GiB > -0.50 GiB usable per
    rank; use more ranks" (review): now one line naming the file's field and the reserve, as ``plan`` says it."""
    import json

    from tensorpar import generate
    path = tmp_path / "small.json"
    path.write_text(json.dumps({**PLAN_DEVICE, "memory_gib": 1.5}))
    with pytest.raises(ValueError, match=rf"--device-file {path}: memory_gib 1.5 GiB leaves no memory for the model "
                                         r"after the 2 GiB per rank kept off the model; give more than 2 GiB"):
        generate.validate(_parse("--model", tiny_with_tokenizer, "--plan", "auto", "--nproc", "2", "--device-file",
                                 str(path), "--prompt", "the cat", "--max-new-tokens", "4"))


def test_plan_auto_choice_by_hand():
    """The same rule on the planner's numbers: at 1 Gbit/s (500 us) tp=2 across 2 hosts costs 7 collectives per
    token, pp=2 across costs 2 messages; the chosen plan is the faster and the runner-up is the other."""
    from dataclasses import replace

    from tensorpar.inference_plan import choose
    from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
    from tensorpar.planner.inference import InferenceWorkload
    from tensorpar.planner.model_spec import ModelSpec

    model = ModelSpec("tiny", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=128,
                      vocab_size=1000, max_positions=256)
    dev = replace(DeviceSpec(**PLAN_DEVICE), inter_node_gbps=0.125, inter_node_latency_us=500.0)
    work = InferenceWorkload(1, 8, 8, weight_bytes=4, kv_bytes=4, reserve_gib=0)
    best, plans = choose(model, ClusterSpec(dev, 2, 1), work)
    assert (best.tp, best.pp) == (1, 2) and [(q.tp, q.pp) for q in plans] == [(1, 2), (2, 1)]
    # one send of the hidden state (500 us) and the token broadcast (half an all-reduce's latency: 250 us)
    assert best.decode_pp_comm == pytest.approx(500e-6 + 256 / 1.25e8 + 250e-6 + 16 / 1.25e8, rel=1e-9)
    assert plans[1].decode_comm > 6 * 500e-6     # 5 all-reduces at 500 us, the pick's 2 collectives at 250 us each
    best, plans = choose(model, ClusterSpec(dev, 2, 2), work)     # one host: tp only
    assert (best.tp, best.pp) == (2, 1) and len(plans) == 1
    with pytest.raises(ValueError, match=r"no tp x pp layout of 9 ranks splits --model \(8 heads, 2 layers\); "
                                         r"rank counts with one: 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16"):
        choose(model, ClusterSpec(dev, 9, 9), work)


@pytest.mark.parametrize("args,msg", [
    (["--plan", "auto", "--nproc", "2", "--tp", "1"],
     "--plan auto chose tp=2 pp=1 for 2 ranks, but --tp 1 was given; drop --tp (the plan sets them) or drop --plan auto"),
    (["--plan", "auto", "--nproc", "2", "--pp", "2"], "but --pp 2 was given"),
    (["--plan", "auto", "--nproc", "40"], "--plan auto: no tp x pp layout of 40 ranks splits --model"),
    (["--plan", "auto"], "--plan auto needs the number of ranks to plan for: add --nproc N"),
    (["--plan", "auto", "--nproc", "0"], "--nproc 0: must be a positive number of ranks"),
    (["--nproc", "2"], "--nproc goes with --plan auto"),
    (["--inter-node-bw", "1"], "--inter-node-bw goes with --plan auto"),
    (["--plan", "auto", "--nproc", "2", "--ep", "2"], "the planner does not plan expert parallelism"),
    (["--plan", "auto", "--nproc", "2", "--inter-node-latency-us", "500"],
     "--inter-node-latency-us 500 needs --inter-node-bw"),
    (["--plan", "auto", "--nproc", "2", "--inter-node-bw", "-1"], "--inter-node-bw -1: must be a finite number"),
])
def test_plan_auto_bad_input_is_one_line_before_any_rank(tiny_with_tokenizer, device_file, capsys, args, msg):
    from tensorpar import generate
    device = ["--device-file", device_file] if "--plan" in args else []
    assert generate.main(_parse("--model", tiny_with_tokenizer, *device, "--prompt", "the cat", *args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err


@pytest.mark.slow   # two launches of 2 ranks (~50 s on the loaded 2-core machine); the choice is tested fast above
def test_plan_auto_runs_the_chosen_layout_and_prints_predicted_vs_measured(tiny_with_tokenizer, device_file):
    """Launched: --plan auto on 2 local ranks runs tp=2 through the one generate path; its text equals the
    explicit --tp 2 run's (greedy: the same tokens), and the end line puts the predicted decode ms/token and time to
    first token next to the measured ones."""
    r = _cli("--model", tiny_with_tokenizer, "--plan", "auto", "--nproc", "2", "--device-file", device_file,
             "--prompt", "the cat", "--max-new-tokens", "6", "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("tensorpar: plan (auto) for 2 ranks on 1 host: tp=2 pp=1"), r.stdout
    text = next(x for x in lines if x.startswith("the cat"))
    end = next(x for x in lines if x.startswith("tensorpar: plan vs measured (tp=2): decode per token "))
    assert "ms predicted," in end and "measured (" in end and "first token" in end, end
    explicit = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "6",
                    "--fast-collectives", "off")
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    assert text == next(x for x in explicit.stdout.splitlines() if x.startswith("the cat"))


def test_prompt_file_adds_one_prompt_per_line_after_the_prompts(tmp_path):
    """``--prompt-file``: each non-blank line a prompt (CRLF endings too), after the ``--prompt`` flags; read once, in
    the launching process (a second check adds nothing)."""
    import argparse

    from tensorpar.generate.flags import add_arguments, check_flags
    f, g = tmp_path / "prompts.txt", tmp_path / "bom.txt"
    f.write_bytes("the cat\r\n\n  \nla mère\n".encode())
    g.write_bytes("\ufeffThe capital\n".encode())          # a byte-order mark (Windows editors): not in the prompt
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--prompt", "first", "--prompt-file", str(f), "--prompt-file", str(g)])
    check_flags(args)
    check_flags(args)
    assert args.prompt == ["first", "the cat", "la mère", "The capital"]


def test_prompt_file_dash_reads_standard_input(monkeypatch):
    import io

    from tensorpar.generate.flags import read_prompt_file
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\ufeffone\n\ntwo\n".encode())))
    assert read_prompt_file("-") == ["one", "two"]


@pytest.mark.parametrize("content,msg", [(None, "cannot read it"), (b"\n \n", "no prompt in it"),
                                         (b"ok\n\xff\n", "not UTF-8 text")])
def test_bad_prompt_file_is_one_line(tmp_path, capsys, content, msg):
    f = tmp_path / "p.txt"
    if content is not None:
        f.write_bytes(content)
    r = _main(capsys, "--model", "/nonexistent/model", "--prompt-file", str(f))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"--prompt-file {f}: {msg}" in r.stderr, r.stderr
