"""``tensorpar serve --check-collectives``: the engine's steps are fingerprinted on every tp rank; ranks that ran
different step plans end with a named error instead of silently different text (issue 12 part 2, on serve)."""
import pytest

from tests._ranks import run_tp
from tests.decode.test_generate import make_model_folder


def job_engine(ctx, folder, diverge: bool):
    from tensorpar import fingerprint
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.cli import check_collectives
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.plan import Row, StepPlan
    model, _ = build_parallel_model(folder, ctx.tp, tp_weights=(2, 1))   # a weighted layout on the way
    engine = Engine(model, ctx.tp, max_batch=2, max_len=32)
    check_collectives(engine, ctx.tp, timeout_s=20.0)
    try:
        tokens = [5, 6, 7] if not (diverge and ctx.tp.rank == 1) else [5, 6, 8]   # rank 1 got another prompt
        res = engine.step(StepPlan("step", [Row(slot=0, tokens=tokens, start=0)]), None)
        return ("ok", res.tokens)
    except fingerprint.CollectiveMismatch as e:
        return ("mismatch", str(e))
    finally:
        fingerprint.disable(ctx.tp)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_model_folder(tmp_path_factory.mktemp("serve_fp") / "llama", "llama"))


def test_serve_check_collectives_passes_and_names_divergent_plans(pools, folder):
    ok = run_tp(pools, 2, job_engine, folder, False)
    assert [r[0] for r in ok] == ["ok", "ok"] and ok[0][1] == ok[1][1]
    bad = run_tp(pools, 2, job_engine, folder, True)
    assert all(r[0] == "mismatch" and "step plan" in r[1] for r in bad), bad


def test_serve_flag_exists():
    import argparse

    from tensorpar.serve.cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--check-collectives", "--tp-weights", "3,1"])
    assert a.check_collectives and a.tp_weights == "3,1"
