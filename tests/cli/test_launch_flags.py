"""One set of launch flags with one set of defaults for generate, train, serve and verify (issue 22, item 1)."""
import argparse
import importlib

import pytest

from tensorpar.cli import check_launch_arguments
from tensorpar.launch import DEFAULT_TIMEOUT_S, DEFAULT_TP

COMMANDS = {"generate": "tensorpar.generate", "train": "tensorpar.train.cli", "serve": "tensorpar.serve.cli",
            "verify": "tensorpar.verify"}
SHARED = ("--tp", "--tp-weights", "--dtype", "--timeout", "--fast-collectives", "--check-collectives", "--verbose")


def parser(command):
    p = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[command]).add_arguments(p)
    return p


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_the_shared_flags_with_the_same_defaults(command):
    """Old code: serve's --timeout defaulted to 120 (the others 300), verify had no --fast-collectives or
    --check-collectives, train took --bf16 but no --dtype."""
    p = parser(command)
    flags = {s for a in p._actions for s in a.option_strings}
    assert set(SHARED) <= flags
    a = p.parse_args([])
    assert a.timeout == DEFAULT_TIMEOUT_S and a.dtype == "float32" and a.fast_collectives == "auto"
    assert a.check_collectives is False and a.verbose is False and a.tp_weights is None
    assert int(str(a.tp).split(",")[0]) == DEFAULT_TP


def test_train_bf16_is_dtype_bfloat16():
    p = parser("train")
    assert p.parse_args(["--bf16"]).dtype == p.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "0.001", "1e9"])
def test_one_timeout_rule(value):
    for command in COMMANDS:
        a = parser(command).parse_args(["--timeout", value])
        with pytest.raises(ValueError, match=r"^--timeout must be a positive, finite number of seconds from 1 to 1e8"):
            check_launch_arguments(a)


@pytest.mark.slow  # a launched verify (9 s)
def test_verify_runs_with_check_collectives_and_fast_collectives_off(tmp_path):
    """verify's new shared flags reach its ranks: fingerprints on (compared before every collective) and gloo
    instead of shared memory; the report is still OK."""
    import json

    from tensorpar.cli import main
    out = tmp_path / "r.json"
    rc = main(["verify", "--model", "tiny", "--tp", "2", "--check-collectives", "--fast-collectives", "off",
               "--json", str(out)])
    layouts = json.loads(out.read_text())["layouts"]
    assert rc == 0 and [(r["tp_size"], r["ok"]) for r in layouts] == [(2, True)]


@pytest.mark.parametrize("command", COMMANDS)
def test_dtype_short_spellings_are_the_same_setting(command):
    # `tensorpar plan` took bf16/fp32 and the others float32/bfloat16 (review): every command takes both now
    p = parser(command)
    assert p.parse_args(["--dtype", "bf16"]).dtype == "bfloat16"
    assert p.parse_args(["--dtype", "fp32"]).dtype == "float32"


def test_torchrun_refuses_a_tp_it_would_not_run(monkeypatch):
    # under torchrun generate/serve took tp from WORLD_SIZE / ep and silently ignored a --tp the user gave (review:
    # --tp 2 on a 1-rank torchrun ran tp 1); a default --tp still follows the world size
    from tensorpar.cli import torchrun_tp
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "1")
    a = parser("generate").parse_args([])
    torchrun_tp(a)
    assert a.tp == 1
    with pytest.raises(ValueError, match=r"^--tp 2 x --ep 1 = 2 ranks, but torchrun started WORLD_SIZE=1"):
        torchrun_tp(parser("generate").parse_args(["--tp", "2"]))
    monkeypatch.setenv("WORLD_SIZE", "4")
    a = parser("serve").parse_args(["--tp", "2", "--ep", "2"])
    torchrun_tp(a)
    assert a.tp == 2
