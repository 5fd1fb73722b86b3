"""The training planner's rank device on a CPU host: the threads a rank really runs (``TENSORPAR_THREADS``, the ranks'
own rule) and hosts that are namespaces of one machine sharing its cores (tensorpar.launch.machine_ranks,
DeviceSpec.machine_ranks). Expected values are worked by hand from the processor-sharing rule of
tensorpar.planner.sharing.thread_share: ``min(1, cores / runnable threads)``. No process is started."""
import dataclasses

import pytest

from tests.planner.test_planner_sharing import CAL, _small


def test_rank_thread_count_is_the_ranks_rule(monkeypatch):
    from tensorpar.launch import rank_thread_count

    monkeypatch.delenv("TENSORPAR_THREADS", raising=False)
    assert rank_thread_count(1, 2) == 2 and rank_thread_count(4, 2) == 1 and rank_thread_count(2, 8) == 4
    monkeypatch.setenv("TENSORPAR_THREADS", "3")
    assert rank_thread_count(2, 8) == 3


def test_rank_device_runs_the_threads_of_tensorpar_threads(monkeypatch):
    """1 rank per host on 2 cores, TENSORPAR_THREADS=1 (the link bench's ranks): the rank runs 1 thread, so its
    device is one thread's: 0.02 TFLOP/s, 4 GB/s, 8 ns per parameter of AdamW (CAL's one-thread values; a
    calibration without a load record needs no correction). The old device assumed 2 threads: 0.04, 8, 4 ns."""
    from tensorpar.train.autoplan import rank_device

    monkeypatch.setenv("TENSORPAR_THREADS", "1")
    d = rank_device(CAL, 2, 1)
    assert d.threads_per_rank == 1
    assert d.peak_tflops == pytest.approx(0.02) and d.hbm_gbps == pytest.approx(4.0)
    assert d.optimizer_ns_per_param == pytest.approx(8.0)
    monkeypatch.delenv("TENSORPAR_THREADS")
    d = rank_device(CAL, 2, 1)
    assert d.threads_per_rank == 2 and d.peak_tflops == pytest.approx(0.04)
    assert d.optimizer_ns_per_param == pytest.approx(4.0)


def _two_hosts(machine_ranks):
    """``(device, planner inputs)``: 2 hosts of 1 rank each, 2 cores and 2 threads per rank, a 1 Gbit/s link."""
    from tensorpar.train.autoplan import rank_device

    autoplan, cfg, config = _small()
    device = dataclasses.replace(rank_device(CAL, 2, 1, machine_ranks=machine_ranks), inter_node_gbps=0.125,
                                 inter_node_latency_us=3000.0)
    return device, autoplan.planner_inputs(cfg, config, device, 2, 1)


def test_hosts_of_one_machine_share_its_cores(monkeypatch):
    """tp = 2 across 2 namespace hosts of one 2-core machine, 2 threads per rank: 4 threads run on 2 cores, so the
    compute and the optimizer take 1 / 0.5 = 2x the time of 2 hosts of their own (2 threads on 2 cores each: share
    1); the tp all-reduces are the wire's and do not change; the memory is the machine's halved."""
    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import Layout

    monkeypatch.delenv("TENSORPAR_THREADS", raising=False)
    lay = Layout(tp=2, pp=1, dp=1, micro_batch=4)
    one_machine, shared = _two_hosts(2)
    own_machines, alone = _two_hosts(None)
    assert one_machine.machine_ranks == 2 and own_machines.machine_ranks == 0
    assert one_machine.memory_gib == pytest.approx(8.0) and own_machines.memory_gib == pytest.approx(16.0)
    a, b = score(lay, *shared).cost.step, score(lay, *alone).cost.step
    assert a.compute == pytest.approx(2 * b.compute) and a.optimizer == pytest.approx(2 * b.optimizer)
    assert a.tp_comm == pytest.approx(b.tp_comm) and b.tp_comm > 0
    # pp = 2 across them: each host's stage alone had its 2 cores; now both stages' 4 threads share them while
    # both run, so the step can only be slower
    lay = Layout(tp=1, pp=2, dp=1, micro_batch=4)
    a, b = score(lay, *shared).cost.step, score(lay, *alone).cost.step
    assert a.total > b.total


def test_machine_ranks_counts_this_jobs_ranks_in_proc(tmp_path, monkeypatch):
    """The processes of this torchrun job (same run id, master address and port) on this kernel, by RANK: ours (0),
    the other namespace host's rank 1 (twice: counted once); not another job's rank (another port), a process
    without RANK (the torchrun agent) or one whose environment cannot be read."""
    from tensorpar.launch import machine_ranks

    job = {"TORCHELASTIC_RUN_ID": "j1", "MASTER_ADDR": "h0", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1"}
    procs = {"11": dict(job, RANK="1"), "12": dict(job, RANK="1"), "13": dict(job, RANK="0"),
             "14": dict(job, MASTER_PORT="29501", RANK="3"), "15": job}
    for pid, env in procs.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (tmp_path / "16").mkdir()   # no environ file: unreadable
    for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert machine_ranks(str(tmp_path)) is None   # not under torchrun
    for k, v in dict(job, RANK="0").items():
        monkeypatch.setenv(k, v)
    assert machine_ranks(str(tmp_path)) == 2
    assert machine_ranks(str(tmp_path / "16")) == 1   # nothing readable: the local ranks
