"""The planner against published Megatron-LM runs (issue 15.1): Korthikanti et al. 2022 Tables 4 and 5
(+ section 6.3) and Narayanan et al. 2021 Table 2. One device preset (a100-80gb) and one set of
assumptions for every row; the table of predicted vs published is printed (pytest -s shows it).

Two splits (issue 27 item 15). The fit split is the rows above (Table 4's ten times set the two fitted constants,
``accuracy.fit_table4``); the held-out split is Narayanan et al. 2021 Table 1 (the weak-scaling runs of 1.7B to 1T
parameters), which no constant was set on. Targets: fit split mean |error| <= 10 % and no row > 20 %; held-out
split mean <= 5 % and no row > 8 % (the code before the GEMM-shape and NIC terms of cost.py / cluster.py missed
that: mean 6.6 %, worst -11.7 %, flat per GPU where the runs rise with size); activation memory within 5 % of
the paper's formulas. The ZeRO-3 rows of Narayanan Table 2 (DeepSpeed, not a layout the planner plans) are
printed and checked separately: the simple ZeRO-3 model misses them (expected failure, see docs/planner.md).
No process group, no torch.
"""
import pytest

from tensorpar.planner import accuracy
from tensorpar.planner.published import HELD_OUT, RUNS

PTD = [r for r in RUNS if r.scheme == "ptd-p"]
ZERO3 = [r for r in RUNS if r.scheme == "zero-3"]


def test_every_published_row_has_a_source():
    assert len(PTD) == 20 and len(ZERO3) == 6
    for run in RUNS:
        assert run.source and run.table and run.row and run.value > 0


def test_accuracy_against_published_runs():
    table = accuracy.rows(PTD)
    print("\n" + accuracy.format_table(table))
    summary = accuracy.summary(table)
    worst = max(table, key=lambda r: abs(r.error))
    assert summary["mean_abs_error"] <= 0.10, accuracy.format_table(table)
    assert abs(worst.error) <= 0.20, f"{worst.run.table} {worst.run.row}: {100 * worst.error:+.1f}%"


def test_accuracy_on_the_held_out_table():
    """Narayanan et al. 2021 Table 1, predicted with the constants fitted on the other split. Bound: mean |error|
    <= 5 %, no row > 8 %. Published per-GPU throughput rises from 135-142 (h/t = 768-2304) to 163 TFLOP/s (h/t =
    2560-3200); the old single-efficiency model gave 122-147, 6.6 % mean and 11.7 % worst, too low at both ends:
    the 1.7B-7.5B runs (tp 1-4) lost their data-parallel all-reduce to one NIC per GPU where NCCL uses all of a
    node's, and the 530B and 1T runs their wider matmuls' higher rate."""
    assert len(HELD_OUT) == 10 and all(r.source and r.table == "Table 1" for r in HELD_OUT)
    assert not {id(r) for r in HELD_OUT} & {id(r) for r in RUNS}
    table = accuracy.rows(HELD_OUT)
    print("\n" + accuracy.format_table(table))
    summary = accuracy.summary(table)
    worst = max(table, key=lambda r: abs(r.error))
    assert summary["mean_abs_error"] <= 0.05, accuracy.format_table(table)
    assert abs(worst.error) <= 0.08, f"{worst.run.row}: {100 * worst.error:+.1f}%"
    # the trend: the three largest models are predicted faster per GPU than the three smallest, as published
    small, large = [r.predicted for r in table[:3]], [r.predicted for r in table[-3:]]
    assert min(large) > max(small)


def test_shipped_constants_are_the_table4_fit():
    """The A100 matmul efficiency and ELEMENTWISE_TRAFFIC are the least-error fit to Table 4 (and nothing else)."""
    from tensorpar.planner import cost
    from tensorpar.planner.cluster import A100_MATMUL_EFFICIENCY

    eff, traffic, mean = accuracy.fit_table4()
    assert (eff, traffic) == (A100_MATMUL_EFFICIENCY, cost.ELEMENTWISE_TRAFFIC)
    assert mean < 0.02


def test_table4_forward_and_backward_separately():
    """The per-layer model reproduces forward and backward times of Table 4 one by one (the data the two
    fitted constants come from, so this checks the fit, not a prediction)."""
    from tensorpar.planner.cost import layer_times
    from tensorpar.planner.layout import Layout, Workload
    from tensorpar.planner.published import MODELS

    for run in (r for r in PTD if r.table == "Table 4"):
        lt = layer_times(MODELS["22B"], Layout(**run.layout), accuracy.cluster_for(8), Workload(4, 2048),
                         accuracy.ASSUMPTIONS)
        assert 1e3 * lt.forward == pytest.approx(run.detail["forward"], rel=0.06), run.row
        assert 1e3 * lt.backward == pytest.approx(run.detail["backward"], rel=0.06), run.row


def test_activation_memory_matches_the_papers_formulas():
    rows = accuracy.memory_rows()
    print("\n" + accuracy.format_memory(rows))
    assert len(rows) == 8
    for run, planner, formula in rows:
        assert planner == pytest.approx(formula, rel=0.05), run.row


@pytest.mark.xfail(strict=True, reason="ZeRO-3 (DeepSpeed) is not modelled to the target: predicted "
                   "throughput is 25-60 % above Narayanan Table 2; see docs/planner.md, Accuracy")
def test_zero3_rows():
    table = accuracy.rows(ZERO3)
    print("\n" + accuracy.format_table(table))
    assert max(abs(r.error) for r in table) <= 0.20


@pytest.mark.parametrize("row", ["1T, present work", "175B, full recompute", "530B, present work, dp 8"])
def test_evaluate_on_the_command_line_reproduces_a_row(row, capsys):
    """The table's numbers are what `tensorpar plan --evaluate` prints for the published layout."""
    import json

    from tensorpar import cli
    from tensorpar.planner.published import MODELS

    run = next(r for r in PTD if r.row == row)
    spec = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in run.layout.items())
    code = cli.main(["plan", "--model", MODELS[run.model].name, "--gpus", str(run.gpus), "--device", "a100-80gb",
                     "--global-batch", str(run.global_batch), "--seq", "2048", "--grad-dtype", "float32",
                     "--reserve-gb", "0", "--evaluate", spec, "--json"])
    plan = json.loads(capsys.readouterr().out)[0]
    assert code == 0
    assert plan["step_time_s"] == pytest.approx(accuracy.predict(run), rel=1e-5)
