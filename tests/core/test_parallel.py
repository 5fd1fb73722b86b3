"""Parallel context: a (dp, pp, tp) grid of 4 gloo ranks, its groups and its DeviceMesh."""
import torch

from tensorpar import comm
from tensorpar.parallel import ParallelConfig, set_rank_threads
from tensorpar.testing import WorkerPool


def job_grid(ctx):
    tp_sum = comm.all_reduce(torch.tensor([float(ctx.rank)]), ctx.tp)
    dp_sum = comm.all_reduce(torch.tensor([float(ctx.rank)]), ctx.dp)
    mesh = ctx.mesh
    return {"rank": ctx.rank, "tp": (ctx.tp.rank, ctx.tp.size), "dp": (ctx.dp.rank, ctx.dp.size),
            "pp": ctx.pp.size, "tp_sum": tp_sum.item(), "dp_sum": dp_sum.item(),
            "mesh_names": mesh.mesh_dim_names, "mesh_tp_size": mesh["tp"].size(), "mesh_dp_size": mesh["dp"].size()}


def test_dp2_tp2_groups_and_mesh():
    with WorkerPool(4, ParallelConfig(tp=2, dp=2), collective_timeout_s=30) as pool:
        out = pool.run(job_grid)
    # grid arange(4).view(dp=2, pp=1, cp=1, tp=2): tp groups {0,1} {2,3}; dp groups {0,2} {1,3}
    assert [o["tp_sum"] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o["dp_sum"] for o in out] == [2.0, 4.0, 2.0, 4.0]
    assert [o["tp"] for o in out] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert out[0]["mesh_names"] == ("dp", "pp", "cp", "tp")
    assert out[0]["mesh_tp_size"] == 2 and out[0]["mesh_dp_size"] == 2


def test_rank_threads_share_cores(monkeypatch):
    monkeypatch.delenv("TENSORPAR_THREADS", raising=False)
    prev = torch.get_num_threads()
    try:
        assert set_rank_threads(4, cores=2) == 1
        assert set_rank_threads(2, cores=8) == 4
        monkeypatch.setenv("TENSORPAR_THREADS", "3")
        assert set_rank_threads(2, cores=8) == 3
    finally:
        torch.set_num_threads(prev)
