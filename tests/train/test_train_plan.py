"""`tensorpar train --plan auto | plan.json`: the planner's layout is the one run, bad plans are refused in the
launching process with one line naming the setting, and the run ends with predicted vs measured step time and
memory. The calibration is the cached one of this machine (measured once, ~30 s on 2 busy cores)."""
import json
import os
import subprocess
import sys

import pytest

from tensorpar.planner.cluster import DeviceSpec
from tensorpar.train import autoplan
from tensorpar.train.config import TrainConfig
from tensorpar.hf.presets import preset_config
from tests.train.test_train_3d_cli import run_main

TEXT = "".join(f"Line {i}: to be, or not to be, that is the question {i * 7 % 13}.\n" for i in range(600))


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return str(path)


def common(tmp_path, text):
    return ["--model", "tiny", "--data", text, "--seq-len", "32", "--batch-size", "8", "--out", str(tmp_path / "run"),
            "--no-progress", "--eval-every", "0"]


@pytest.mark.parametrize("extra,msg", [
    (["--plan", "auto", "--nproc", "2", "--tp", "2"], "--plan auto and --tp 2 both set the layout; drop --tp"),
    (["--plan", "auto", "--nproc", "4", "--pp", "2", "--dp", "2"], "--plan auto and --pp 2 --dp 2 both set the layout"),
    (["--plan", "auto", "--nproc", "2", "--micro-batches", "2"], "--plan auto and --micro-batches 2 both set"),
    (["--plan", "auto"], "--plan auto needs the number of ranks to plan for: add --nproc N"),
    (["--nproc", "2"], "--nproc 2 goes with --plan"),
    (["--inter-node-bw", "0.125"], "--inter-node-bw goes with --plan"),
    (["--plan", "auto", "--nproc", "2", "--inter-node-bw", "0"], "--inter-node-bw 0: must be a finite number of GB/s > 0"),
    (["--plan", "auto", "--nproc", "2", "--inter-node-latency-us", "50"], "--inter-node-latency-us 50 needs "
                                                                         "--inter-node-bw"),
])
def test_plan_flags_conflicts(tmp_path, text, capsys, extra, msg):
    rc = run_main(extra + common(tmp_path, text))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("plan,nproc,msg", [
    ({"tp": 2, "pp": 2, "dp": 1, "micro_batch": 1}, "2", "tp x pp x dp = 2 x 2 x 1 = 4, but 2 ranks were given "
                                                        "(--nproc)"),
    ([], None, "the list of plans is empty"),
    ({"tp": 2, "pp": 1}, None, "the plan lacks dp, micro_batch"),
    ([{"tp": 2, "pp": 1, "dp": 1, "micro_batch": 1}, {"tp": 2}], None, "plan #2 lacks pp, dp, micro_batch"),
    ({"tp": 1, "pp": 1, "dp": 2, "micro_batch": 1, "distributed_optimizer": True}, None,
     "cannot run distributed_optimizer=true"),
    ([{"tp": 1, "pp": 1, "dp": 2, "micro_batch": 1, "recompute": "selective"},
      {"tp": 1, "pp": 1, "dp": 2, "micro_batch": 1, "ep": 2}], None,
     "cannot run recompute=selective (the trainer recomputes whole blocks: use recompute=full or none) (nor can it the "
     "other 1 plans of the file)"),
    ({"tp": 1, "pp": 4, "dp": 1, "micro_batch": 1}, None, "does not fit --model tiny with --batch-size 8 --seq-len 32: "
                                                          "pp x virtual_stages (4 x 1) exceeds the 2 layers"),
    ({"tp": 1, "pp": 1, "dp": 2, "micro_batch": 3}, None, "dp x micro_batch (2 x 3) must divide --global-batch (8)"),
    ({"tp": 1, "pp": 1, "dp": 1, "micro_batch": 1, "cp": 2, "cp_mode": "ring"}, None,   # tensorpar plan --cp 2
     "cannot run cp=2 (--plan does not set context parallelism yet: give --tp 1 --pp 1 --dp 1 --cp 2 --cp-mode ring"),
    ({"tp": "2", "pp": 1, "dp": 1, "micro_batch": 1}, None, "the plan: tp='2' must be a positive integer"),
    ("not json", None, "not JSON"),
])
def test_bad_plan_files_fail_before_launch(tmp_path, text, capsys, plan, nproc, msg):
    path = tmp_path / "plan.json"
    path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    rc = run_main(["--plan", str(path)] + (["--nproc", nproc] if nproc else []) + common(tmp_path, text))
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "measuring this machine" not in line]
    assert rc == 2 and len(err) == 1 and f"--plan {path}" in err[0] and msg in err[0], err


def test_torchrun_world_size_is_the_rank_count(tmp_path, text, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"tp": 2, "pp": 1, "dp": 1, "micro_batch": 1}))
    rc = run_main(["--plan", str(path)] + common(tmp_path, text))
    err = capsys.readouterr().err
    assert rc == 2 and "= 2, but 4 ranks were given (torchrun's WORLD_SIZE=4)" in err, err
    rc = run_main(["--plan", "auto", "--nproc", "2"] + common(tmp_path, text))
    assert rc == 2 and "--nproc 2 differs from torchrun's WORLD_SIZE=4" in capsys.readouterr().err


FAKE = dict(cores=2, cuda=False, backend="cpu (1 threads)", matmul_tflops=0.02, hbm_gbps=4.0, memory_gib=16.0,
            train_layer_overhead_us=2000.0, train_micro_batch_overhead_us=3000.0,
            collective={"backend": "gloo", "bandwidth_gbps": 0.5, "latency_us": 100.0})


def test_auto_takes_the_planners_fastest_runnable_layout():
    """choose_auto returns the first plan of the planner's ranking that the trainer runs, mapped to the flags
    that run it (micro-batches = batch / (dp x micro_batch), v = 2 -> interleaved 1F1B)."""
    from tensorpar.planner.enumerate import search

    cfg = TrainConfig(model="small", seq_len=64, batch_size=8)
    config = preset_config("small", 256, 64)
    device = autoplan.rank_device(FAKE, 4)
    choice = autoplan.choose_auto(cfg, config, device, 4)
    found = search(*autoplan.planner_inputs(cfg, config, device, 4))
    def runnable(p):
        if autoplan.unsupported(p.layout) is not None:
            return False
        try:   # the trainer's own config checks (1F1B needs micro-batches >= pp: such plans are skipped)
            run = autoplan.layout_config(cfg, p.layout, 8)
        except ValueError:
            return False
        return autoplan.runtime_problem(run, config) is None

    first = next(p for p in found.ranked if runnable(p))
    assert choice.plan.layout == first.layout
    c, lay = choice.cfg, first.layout
    assert (c.tp, c.pp, c.dp, c.sequence_parallel) == (lay.tp, lay.pp, lay.dp, lay.sequence_parallel)
    assert c.micro_batches == 8 // (lay.dp * lay.micro_batch) and c.recompute == (lay.recompute == "full")
    assert c.tp * c.pp * c.dp == 4
    line = choice.summary()
    assert line.startswith(f"plan (auto): tp={c.tp} pp={c.pp} dp={c.dp} micro-batches={c.micro_batches}")
    assert f"predicted step {first.cost.step.total * 1e3:.1f} ms" in line
    # one rank alone on the 2-core host (1 thread: 2 cores // 4 ranks), the 4 ranks sharing the 2 cores in the
    # cost model (tensorpar.planner.sharing); the RAM divided among the ranks
    assert device.train_layer_overhead_us == 2000.0 and device.peak_tflops == pytest.approx(0.02)
    assert (device.host_cores, device.threads_per_rank, device.external_threads) == (2.0, 1, 0.0)
    assert device.memory_gib == 4.0
    one = autoplan.rank_device(FAKE, 1)   # one rank: 2 threads
    assert one.train_layer_overhead_us == 2000.0 and one.peak_tflops == pytest.approx(0.04)


def test_other_users_load_shares_the_cores():
    """Processor sharing: calibrated (by wall clock) at load 3 on 2 cores (2 other runnable threads: the measuring
    thread got 2/3 of a core), so alone a thread is 3/2 as fast: fixed times x 2/3, rate / (2/3); the collectives as
    measured; 4 ranks started at load 5: 4 other runnable threads, which the cost model shares the cores with."""
    cal = {**FAKE, "loadavg_1min": 3.0}
    dev = autoplan.rank_device(cal, 4, load_now=5.0)
    assert dev.train_layer_overhead_us == pytest.approx(2000.0 * (2 / 3))
    assert dev.peak_tflops == pytest.approx(0.02 / (2 / 3))
    assert (dev.local_link_latency_us, dev.local_link_gbps) == (100.0, 0.5)
    assert dev.external_threads == 4.0 and "at load 5.0" in dev.name
    # an idle machine: no other users' threads
    idle = autoplan.rank_device(cal | {"loadavg_1min": 1.0}, 4, load_now=1.0)
    assert idle.train_layer_overhead_us == 2000.0 and idle.external_threads == 0.0
    # timed by the thread's CPU time: no load correction of the rates; the measured layer efficiency is the device's
    cpu = cal | {"clock": "thread_cpu", "layer_matmul_efficiency": 0.7}
    dev = autoplan.rank_device(cpu, 4)
    assert dev.train_layer_overhead_us == 2000.0 and dev.peak_tflops == pytest.approx(0.02)
    assert dev.matmul_efficiency == 0.7


def test_calibrated_overhead_enters_the_step_time():
    """The fixed per-layer and per-micro-batch times add m x (layers x per-layer + per-micro-batch) on one rank."""
    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import Layout

    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=8)
    config = preset_config("tiny", 256, 32)
    base = {**FAKE, "train_layer_overhead_us": 0.0, "train_micro_batch_overhead_us": 0.0}
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=2)   # 4 micro-batches of 2 layers
    t0 = score(lay, *autoplan.planner_inputs(cfg, config, autoplan.rank_device(base, 1), 1)).cost.step.total
    t1 = score(lay, *autoplan.planner_inputs(cfg, config, autoplan.rank_device(FAKE, 1), 1)).cost.step.total
    assert t1 - t0 == pytest.approx(4 * (2 * 2000e-6 + 3000e-6))


def test_measured_step_time_and_error():
    assert autoplan.measured_step_time([9.0, 5.0, 1.0, 3.0, 2.0]) == (2.0, 3)   # warm-up steps left out
    assert autoplan.measured_step_time([4.0]) == (4.0, 1)
    assert autoplan.relative_error(0.9, 1.0) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="device train_layer_overhead_us"):
        DeviceSpec("x", 1, 1, 1, 1, train_layer_overhead_us=-1)


def test_first_runnable_plan_of_a_tensorpar_plan_file(tmp_path):
    """`tensorpar plan --json` ranks layouts the trainer cannot run (distributed optimizer) first; --plan takes the
    first one it can, and says which."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "tensorpar", "plan", "--layers", "2", "--hidden", "64", "--heads", "4",
                        "--kv-heads", "2", "--ffn", "176", "--vocab", "256", "--gpus", "4", "--gpus-per-node", "4",
                        "--global-batch", "8", "--seq", "32", "--top", "0", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "plan.json"
    path.write_text(r.stdout)
    plans = json.loads(r.stdout)
    first = next(i for i, p in enumerate(plans) if not p["distributed_optimizer"] and p["recompute"] != "selective"
                 and p["ep"] == 1)
    lay, position = autoplan.check_plan_file(str(path), 4)
    assert position == first + 1
    assert (lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.sequence_parallel) == tuple(
        plans[first][k] for k in ("tp", "pp", "dp", "micro_batch", "sequence_parallel"))


def test_plan_auto_on_one_process(tmp_path, text):
    """--nproc 1: the layout is tp = pp = dp = 1 (micro-batches chosen by the planner); predicted vs measured."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--plan", "auto", "--nproc", "1", "--steps", "5"]
                       + common(tmp_path, text), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    chosen = next(line for line in lines if line.startswith("plan (auto):"))
    assert "tp=1 pp=1 dp=1 micro-batches=" in chosen and "predicted step" in chosen and "MiB per rank" in chosen
    assert "done: step 5" in r.stdout
    cmp = next(line for line in lines if line.startswith("plan vs measured:"))
    assert "median of 3 steps after 2 warm-up" in cmp and "live tensors of the second step, parameters and optimizer state" in cmp


@pytest.mark.slow   # ~70 s on 2 busy cores (a 2-rank launch); the one-process run above stays in CI
def test_plan_file_runs_its_pipeline_layout(tmp_path, text):
    """A plan saved by `tensorpar plan --json` (the first of its list) is run as saved: pp = 2 on 2 ranks, with
    micro-batches = batch / (dp x micro_batch)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"tp": 1, "pp": 2, "dp": 1, "micro_batch": 2, "sequence_parallel": False,
                                 "recompute": "none", "distributed_optimizer": False, "virtual_stages": 1, "ep": 1,
                                 "rank": 1}, {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 1}]))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--plan", str(plan), "--steps", "4"]
                       + common(tmp_path, text), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"plan ({plan}): tp=1 pp=2 dp=1 micro-batches=4 schedule=1f1b sp=off recompute=off" in r.stdout
    assert "done: step 4" in r.stdout and "plan vs measured: step time predicted" in r.stdout


def test_tp_weights_are_checked_against_the_plans_tp(tmp_path, text, capsys):
    """--tp-weights with --plan FILE: the weights go with the plan's tp (2 here), not the default --tp 1."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"tp": 2, "pp": 1, "dp": 1, "micro_batch": 1}))
    rc = run_main(["--plan", str(path), "--tp-weights", "3,1,1"] + common(tmp_path, text))
    err = capsys.readouterr().err
    assert rc == 2 and "has 3 entries but tp is 2" in err, err
