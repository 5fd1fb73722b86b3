"""Errors in one line, free ports, honest packaging (issue 14, items 3 (generate), 4, 6, 7, 9).

Rank failures go through the real launcher (tensorpar.launch.run_ranks) with the jobs of
tests/_launch_jobs.py; flag checks run `tensorpar.cli.main` in this process (they happen before any
rank starts, so nothing is launched).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tensorpar.cli import main
from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: F401  (fixture: random llama + tokenizer)

REPO = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), TENSORPAR_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


def _job(*args, timeout=180, **popen):
    return subprocess.run([sys.executable, "-m", "tests._launch_jobs", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout, **popen)


# ---------------------------------------------------------------- item 4: one line from a rank

def test_error_inside_a_rank_is_one_line():
    p = _job("raise_on_rank1", "2")
    assert p.returncode == 1
    assert p.stderr.splitlines() == ["tensorpar: error: --lr nan: must be a finite number (rank 1)"], p.stderr


@pytest.mark.slow  # a launch (10 s)
def test_verbose_shows_the_traceback():
    p = _job("raise_on_rank1", "2", "--verbose")
    assert p.returncode == 1
    assert "Traceback (most recent call last)" in p.stderr and 'raise ValueError("--lr nan' in p.stderr
    assert p.stderr.rstrip().splitlines()[-1] == "tensorpar: error: --lr nan: must be a finite number (rank 1)"


def test_stopped_rank_names_the_collective_and_ends_the_run():
    """Rank 1 stops itself (SIGSTOP) before an all-reduce; rank 0 times out after 3 s and the run ends.

    stderr must be the one line and nothing else: a rank that exited with its gloo process group alive used to
    abort now and then in C++ ("terminate called without an active exception"; the woken rank, and the failing
    rank itself), see tensorpar.rank_errors._end_stopped and _release_process_group.

    The subprocess timeout only guards against a hang; the time it takes is measured in
    bench/bench_rank_failure.py (bench/results/rank_failure.md).
    """
    p = _job("stop_rank1_before_all_reduce", "2", timeout=120)
    assert p.returncode == 1
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("tensorpar: error: all_reduce on tp group (rank 0 of 2") and "(rank 0)" in lines[0]
    assert "Timed out" in lines[0] and "another rank stopped, hung or died" in lines[0]
    assert "; rank 1 had been stopped (SIGSTOP / Ctrl-Z) (rank 0)" in lines[0]


def test_unexpected_error_in_the_launching_process_is_one_line(monkeypatch, capsys):
    import tensorpar.generate as gen

    def boom(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(gen, "validate", boom)
    assert main(["generate", "--prompt", "hi"]) == 1
    assert capsys.readouterr().err == ("tensorpar: error: RuntimeError: boom second line "
                                       "(--verbose shows the traceback)\n")
    with pytest.raises(RuntimeError, match="boom"):
        main(["generate", "--prompt", "hi", "--verbose"])


# ---------------------------------------------------------------- item 3: generate's flags, before launch

@pytest.mark.parametrize("args,msg", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1]"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--timeout", "nan"], "--timeout must be a positive, finite number"),
    (["--timeout", "inf"], "--timeout must be a positive, finite number"),
    (["--timeout", "-1"], "--timeout must be a positive, finite number"),
    (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["--tp", "-2"], "--tp must be a positive integer"),
    (["--prompt", "caf\udce9"], "is not valid UTF-8"),
    (["--prompt", "  "], "--prompt must not be empty"),
])
def test_generate_rejects_bad_values_before_anything_loads(capsys, args, msg):
    assert main(["generate", "--model", "/nonexistent/never-read", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorpar generate: error: ") and msg in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_missing_lora_folder_is_refused_before_the_tokenizer(tiny_with_tokenizer, capsys, monkeypatch,  # noqa: F811
                                                             command):
    """``--lora`` naming no adapter folder: one line as soon as the model's config is read
    (:func:`tensorpar.job.lora_from_args`), not after the tokenizer, the plan and the checkpoint's headers (it was
    the last check of the launching process: about twice the time of the others)."""
    import transformers

    def no_tokenizer(*a, **k):
        raise AssertionError("the tokenizer was read before --lora was checked")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    extra = ["--port", "0"] if command == "serve" else []
    assert main([command, "--model", tiny_with_tokenizer, "--lora", "/nonexistent/adapter", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorpar {command}: error: --lora '/nonexistent/adapter': not a PEFT adapter folder") \
        and \
        err.count("\n") == 1, err


def test_non_utf8_prompt_bytes_from_the_shell(tiny_with_tokenizer):  # noqa: F811
    p = subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--model", tiny_with_tokenizer.encode(),
                        "--prompt", b"caf\xe9"], cwd=REPO, env=_env(), capture_output=True, timeout=120)
    assert p.returncode == 2 and b"is not valid UTF-8" in p.stderr, p.stderr[-2000:]


def test_generate_config_that_transformers_rejects(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 30, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 300}))
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["generate", "--model", str(tmp_path), "--tp", "2", "--print-plan"]) == 2
    err = capsys.readouterr().err
    assert "config.json is invalid: The hidden size (30) is not a multiple of the number of attention heads (4)" in err


# ---------------------------------------------------------------- item 6: ports

def _hold_29500():
    """Listen on 29500 (torch's default port) for the test, as another torchrun job would; None if taken."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 29500))
        s.listen()
        return s
    except OSError:  # someone already holds it: the condition the test wants anyway
        s.close()
        return None


@pytest.mark.slow  # three launches (12 s)
def test_two_concurrent_runs_next_to_another_job_on_29500():
    held = _hold_29500()
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "tests._launch_jobs", "port_of_run", "2"], cwd=REPO,
                                  env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        if held:
            held.close()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "sum [2.0, 2.0, 2.0]" in out, out
    ports = [int(out.split("port ")[1].split()[0]) for out, _ in outs]
    assert ports[0] != ports[1] and 29500 not in ports


def test_destroy_stops_the_gloo_threads_before_exit():
    """CI saw rank 1 of examples/generate_tp.py abort at exit (SIGABRT, "terminate called without an active
    exception") after its last broadcast: a gloo worker still held that broadcast's tensors and took the GIL
    while Python finalized. ``ParallelContext.destroy`` must leave no gloo thread of its groups behind."""
    p = _job("threads_after_destroy", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("pg None") == 2, p.stdout


@pytest.mark.slow  # a launch (7 s)
def test_one_rank_generate_does_not_use_29500(tiny_with_tokenizer):  # noqa: F811
    held = _hold_29500()
    try:
        p = subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--model", tiny_with_tokenizer, "--tp",
                            "1", "--prompt", "the cat", "--max-new-tokens", "3"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=180)
    finally:
        if held:
            held.close()
    assert p.returncode == 0, p.stderr[-2000:]
    assert "time to first token" in p.stdout


# ---------------------------------------------------------------- item 9: more ranks than cores

@pytest.mark.slow  # a launch of more ranks than cores (12 s)
def test_more_ranks_than_cores_warns_in_one_line():
    env = _env()
    env.pop("TENSORPAR_THREADS")
    p = subprocess.run([sys.executable, "-m", "tests._launch_jobs", "port_of_run", "2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=180, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.splitlines() == ["tensorpar: warning: 2 ranks on 1 usable cores; ranks share cores (one thread "
                                     "each) and run slower than with tp <= 1"], p.stderr


# ---------------------------------------------------------------- argparse's usage errors: one line, not the usage

@pytest.mark.parametrize("argv,line", [
    (["generate", "--dtype", "float64"], "tensorpar generate: error: --dtype: invalid choice 'float64' (choose from "
                                         "float32, bfloat16); see tensorpar generate -h"),
    (["serve", "--prefix-caching", "maybe"], "tensorpar serve: error: --prefix-caching: invalid choice 'maybe' "
                                             "(choose from on, off); see tensorpar serve -h"),
    (["generate", "--tp", "x"], "tensorpar generate: error: --tp: invalid value 'x' (give an integer); see "
                                "tensorpar generate -h"),
    (["train", "--timeout", "soon"], "tensorpar train: error: --timeout: invalid value 'soon' (give a number); see "
                                     "tensorpar train -h"),
    (["generate", "--max-new-tokns", "4"], "tensorpar generate: error: unknown option --max-new-tokns (did you mean "
                                           "--max-new-tokens?); see tensorpar generate -h"),
    (["verify", "--frobnicate"], "tensorpar verify: error: unknown option --frobnicate; see tensorpar verify -h"),
    (["serve", "--port"], "tensorpar serve: error: --port: expected one value (give an integer); see tensorpar "
                          "serve -h"),
    (["generate", "hello"], "tensorpar generate: error: unexpected argument 'hello' (the settings are options: "
                            "--name value); see tensorpar generate -h"),
    (["gen"], "tensorpar: error: command: invalid choice 'gen' (choose from generate, plan, models, verify, train, "
              "serve); see tensorpar -h"),
])
def test_usage_errors_are_one_line_naming_the_setting(capsys, argv, line):
    """argparse's errors (a bad choice, a value of the wrong type, an unknown or misspelt option, a missing value)
    are one line naming the setting, the value and what would work, exit 2 as argparse's; no usage block."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_help_is_argparses_usage_and_options(capsys):
    """``-h`` is untouched by the one-line errors: the usage block and every option, exit 0."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "-h"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: tensorpar generate [-h]") and "--max-new-tokens" in out


# ---------------------------------------------------------------- item 7: version, help, defaults, packaging

def test_version_everywhere():
    import tomllib

    import tensorpar
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert tensorpar.__version__ == version
    p = subprocess.run([sys.executable, "-m", "tensorpar", "--version"], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == f"tensorpar {version}\n"


def _parser(command: str) -> argparse.ArgumentParser:
    import importlib

    from tensorpar.cli import COMMANDS, HelpFormatter
    p = argparse.ArgumentParser(prog=f"tensorpar {command}", formatter_class=HelpFormatter)
    importlib.import_module(COMMANDS[command][0]).add_arguments(p)
    return p


def test_every_command_has_the_same_tp_and_timeout_defaults():
    from tensorpar.launch import DEFAULT_TIMEOUT_S, DEFAULT_TP
    for command in ("generate", "train"):
        d = _parser(command).parse_args([])
        assert (d.tp, d.timeout) == (DEFAULT_TP, DEFAULT_TIMEOUT_S), command


@pytest.mark.parametrize("command", ["generate", "train"])
def test_help_shows_the_defaults(command):
    parser = _parser(command)
    text = " ".join(parser.format_help().split())
    shown = [a for a in parser._actions if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)]
    assert len(shown) > 5
    for action in shown:
        assert f"(default: {action.default})" in text, action.option_strings


def test_python_dash_m_and_the_hf_extra_pin_transformers_5():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    spec = next(Requirement(r).specifier for r in extras if Requirement(r).name == "transformers")
    import transformers
    assert Version(transformers.__version__) in spec
    assert Version("4.57.0") not in spec and Version("6.0.0") not in spec
    assert (REPO / "tensorpar" / "__main__.py").is_file()


@pytest.mark.slow  # a launch with the extra's imports only (9 s)
def test_the_hf_extra_covers_everything_generate_imports(tiny_with_tokenizer):  # noqa: F811
    """`generate` runs with every installed distribution that tensorpar[hf] does not require (directly or through
    its requirements' own requirements) made unimportable: `pip install .[hf]` alone is enough."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["hf"]]
    closure: set[str] = set()
    while todo:
        r = todo.pop()
        name = r.name.lower().replace("_", "-")
        if name in closure or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        closure.add(name)
        try:
            todo += [Requirement(x) for x in (md.requires(r.name) or [])]
        except md.PackageNotFoundError:
            pass
    blocked = sorted(m for m, ds in md.packages_distributions().items()
                     if m != "tensorpar" and not any(d.lower().replace("_", "-") in closure for d in ds))
    assert "matplotlib" in blocked and "pytest" in blocked and "transformers" not in blocked
    probe = ("import importlib.abc, json, os, sys\n"
             "BLOCKED = set(json.loads(os.environ['BLOCKED']))\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in BLOCKED:\n"
             "            raise ModuleNotFoundError(f'blocked (not required by tensorpar[hf]): {name}', name=name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "from tensorpar.cli import main\n"
             f"sys.exit(main(['generate', '--model', {tiny_with_tokenizer!r}, '--tp', '1', "
             "'--prompt', 'the cat', '--max-new-tokens', '2', '--verbose']))\n")
    p = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=_env(BLOCKED=json.dumps(blocked)),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "time to first token" in p.stdout


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_thread_count_fails_before_launch(monkeypatch, value):
    from tensorpar.launch import run_ranks
    monkeypatch.setenv("TENSORPAR_THREADS", value)
    with pytest.raises(ValueError, match=f"TENSORPAR_THREADS={value!r}: must be a positive integer"):
        run_ranks(print, 2)


def test_rank_killed_by_a_signal_is_one_line():
    p = _job("kill_rank1", "2")
    assert p.returncode == 1
    assert p.stderr.splitlines() == ["tensorpar: error: killed by signal SIGKILL (out of memory? killed by hand?) "
                                     "(rank 1)"], p.stderr


def test_one_line_drops_gloo_advice_and_says_a_peer_left():
    from tensorpar.comm import CollectiveError
    from tensorpar.launch import one_line
    e = CollectiveError("all_reduce on tp group (rank 0 of 2) failed: [/__w/pytorch/third_party/gloo/gloo/transport/"
                        "tcp/pair.cc:537] Read error [127.0.0.1]:1428: Connection reset by peer. This is typically "
                        "caused by a remote worker hanging or bugs in the application. Check the logs of the remote "
                        "worker before reporting an error. GLHF! \U0001F3D6\ufe0f")
    assert one_line(e) == ("all_reduce on tp group (rank 0 of 2) failed: Read error [127.0.0.1]:1428: Connection reset "
                           "by peer. - another rank exited or closed its connection during this collective")


def test_first_error_prefers_a_ranks_own_error_over_what_its_peers_saw(tmp_path):
    """Rank 0 fails for its own reason, but rank 1 records first what it saw (rank 0 closing the shared-memory
    communicator): the launcher's line is rank 0's error."""
    import json

    from tensorpar.launch import _first_error
    peer = {"time": 1.0, "rank": "1", "message": "shared-memory all_reduce (call #5) on tp group, rank 1 of 2: rank 0 "
                                                 "(pid 7) closed its communicator before arriving"}
    (tmp_path / "rank1.json").write_text(json.dumps(peer))
    assert _first_error(str(tmp_path), secondary_too=False) is None
    assert _first_error(str(tmp_path)).endswith("(rank 1)")
    own = {"time": 1.2, "rank": "0", "message": "OverflowError: Overflow when unpacking long long"}
    (tmp_path / "rank0.json").write_text(json.dumps(own))
    assert _first_error(str(tmp_path)) == "OverflowError: Overflow when unpacking long long (rank 0)"
    gloo = {"time": 0.5, "rank": "1", "message": "all_reduce failed: Read error: Connection reset by peer. - another "
                                                 "rank exited or closed its connection during this collective"}
    (tmp_path / "rank1.json").write_text(json.dumps(gloo))
    assert _first_error(str(tmp_path)).endswith("(rank 0)")
