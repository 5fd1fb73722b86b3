"""The CUDA / NCCL path: layer parity, collectives, sampling and SmolLM2 generation on GPUs.

Every test here is marked ``cuda`` and skipped (with the reason) on a machine without a CUDA device;
``scripts/gpu_check.sh`` runs them with a timeout and writes a results file. Three set-ups:

* ``tp = 1`` in this process on ``cuda:0``;
* ``tp = 2`` over NCCL, one GPU per rank (needs 2 GPUs; NCCL refuses two ranks on one GPU);
* ``tp = 2`` on one GPU split into ranks: gloo process groups carrying CUDA tensors, both ranks on
  ``cuda:0`` (gloo copies through host memory; it checks the device handling, not the speed).

References are the unsharded modules / transformers on the same device, as in the CPU tests.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.generate import SamplingConfig, generate_tokens
from tensorpar.serve.tokens import sample
from tensorpar.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tensorpar.testing import local_slice

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")]

# set-up name -> (backend, device of each rank); the NCCL set-up needs one GPU per rank. "gloo-cpu" runs
# the same jobs and harness on CPU (tests/core/test_cuda_harness.py), so their expected values are checked
# on every machine.
SETUPS = {
    "nccl-2gpu": ("nccl", ["cuda:0", "cuda:1"]),
    "gloo-1gpu-split": ("gloo", ["cuda:0", "cuda:0"]),
}
CPU_SETUP = ("gloo", ["cpu", "cpu"])


def _needs(setup: str):
    if setup == "nccl-2gpu" and N_GPUS < 2:
        pytest.skip(f"NCCL at tp=2 needs 2 GPUs, this machine has {N_GPUS}")


# ---------------------------------------------------------------- a spawn harness for CUDA ranks

def _rank_entry(rank, world, port, backend, devices, fn, args, results):
    from tensorpar.parallel import ParallelConfig, init_parallel

    device = torch.device(devices[rank])
    os.environ["LOCAL_RANK"] = str(device.index if device.index is not None else rank)  # NCCL: cuda:<LOCAL_RANK>
    try:
        torch.set_num_threads(1)
        ctx = init_parallel(ParallelConfig(tp=world), rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}", backend=backend, timeout_s=120,
                            set_threads=False)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            ctx.device = device      # gloo ranks on a GPU: init_parallel picks the CPU for gloo, the jobs compute here
        try:
            out = fn(ctx, device, *args)
        finally:
            ctx.destroy()
        # Plain pickle bytes: a tensor put on the queue as is would be shared through this process's
        # resource socket, which is gone once this process exits, before the parent reads it.
        results.put((rank, "ok", pickle.dumps(_to_cpu(out))))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cuda_ranks(setup: str, fn, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(ctx, device, *args)`` on the ranks of ``setup`` (a ``SETUPS`` name, or ``"gloo-cpu"``);
    returns the per-rank results in rank order. Raises ``AssertionError`` with a rank's traceback."""
    import torch.multiprocessing as mp

    backend, devices = CPU_SETUP if setup == "gloo-cpu" else SETUPS[setup]
    mpc = mp.get_context("spawn")  # CUDA cannot be used in forked children
    results = mpc.Queue()
    port = _free_port()
    procs = [mpc.Process(target=_rank_entry, args=(r, len(devices), port, backend, devices, fn, args, results))
             for r in range(len(devices))]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(procs):
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)}
                if dead:  # killed (e.g. out of memory) or crashed before it could report
                    raise AssertionError(f"{setup}: rank(s) exited without a result, exit codes {dead}") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"{setup}: ranks {sorted(set(range(len(procs))) - set(out))} gave no "
                                         f"result within {timeout_s} s") from None
                continue
            except (OSError, EOFError) as e:
                codes = {r: p.exitcode for r, p in enumerate(procs)}
                raise AssertionError(f"{setup}: lost the result channel ({e!r}); rank exit codes {codes}") from e
            if status != "ok":
                raise AssertionError(f"{setup}: rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(len(devices))]


# ---------------------------------------------------------------- jobs (module level: spawn pickles them)

def job_layers(ctx, device):
    """Max abs differences of output / input grad / weight grad slices vs the unsharded modules."""
    tp = ctx.tp
    torch.manual_seed(0)
    diffs = {}
    ref = nn.Linear(12, 10, device=device)
    for gather in (False, True):
        layer = ColumnParallelLinear.from_linear(ref, tp, gather_output=gather)
        x = torch.randn(2, 3, 12, device=device, requires_grad=True)
        y_ref = ref(x)
        gy = torch.randn_like(y_ref)
        gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, ref.weight), gy)
        y = layer(x)
        want = y_ref if gather else comm.split(y_ref, tp, -1, layer.partition)
        gx, gw = torch.autograd.grad(y, (x, layer.weight), gy if gather else comm.split(gy, tp, -1, layer.partition))
        assert y.device == x.device and layer.weight.device == x.device
        diffs[f"column gather={gather}"] = max((y - want).abs().max().item(), (gx - gx_ref).abs().max().item(),
                                               (gw - local_slice(gw_ref, layer.weight, tp.rank)).abs().max().item())
    row_ref = nn.Linear(12, 10, device=device)
    row = RowParallelLinear.from_linear(row_ref, tp, input_is_parallel=False)
    x = torch.randn(2, 3, 12, device=device, requires_grad=True)
    y_ref = row_ref(x)
    gy = torch.randn_like(y_ref)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, row_ref.weight), gy)
    y = row(x)
    gx, gw = torch.autograd.grad(y, (x, row.weight), gy)
    diffs["row"] = max((y - y_ref).abs().max().item(), (gx - gx_ref).abs().max().item(),
                       (gw - local_slice(gw_ref, row.weight, tp.rank)).abs().max().item())
    emb_ref = nn.Embedding(11, 6, device=device)
    emb = VocabParallelEmbedding.from_embedding(emb_ref, tp)
    ids = torch.randint(0, 11, (2, 5), device=device)
    diffs["embedding"] = (emb(ids) - emb_ref(ids)).abs().max().item()
    return diffs


def job_collectives(ctx, device):
    """Each collective on CUDA tensors (uneven shard sizes included) against its definition."""
    tp, r, t = ctx.tp, ctx.tp.rank, ctx.tp.size
    checks = {}
    x = torch.arange(6, dtype=torch.float32, device=device).view(2, 3) + 10 * r
    want_sum = sum(torch.arange(6, dtype=torch.float32, device=device).view(2, 3) + 10 * k for k in range(t))
    y = comm.all_reduce(x, tp)
    checks["all_reduce sum"] = y.device == x.device and torch.equal(y, want_sum)
    checks["all_reduce max"] = torch.equal(comm.all_reduce(x, tp, op="max"), x - 10 * r + 10 * (t - 1))
    sizes = [3 + k for k in range(t)]  # uneven: 3, 4, ...
    local = torch.full((2, sizes[r]), float(r), device=device)
    g = comm.all_gather(local, tp, -1, sizes)
    want = torch.cat([torch.full((2, s), float(k), device=device) for k, s in enumerate(sizes)], -1)
    checks["all_gather uneven"] = g.device == x.device and torch.equal(g, want)
    full = torch.arange(2 * sum(sizes), dtype=torch.float32, device=device).view(2, -1) * (r + 1)
    rs = comm.reduce_scatter(full, tp, -1, sizes)
    total = torch.arange(2 * sum(sizes), dtype=torch.float32, device=device).view(2, -1) * sum(range(1, t + 1))
    checks["reduce_scatter uneven"] = torch.equal(rs, total[:, sum(sizes[:r]): sum(sizes[:r + 1])])
    b = comm.broadcast(torch.full((4,), float(r + 7), device=device), tp, src=t - 1)
    checks["broadcast"] = torch.equal(b, torch.full((4,), float(t - 1 + 7), device=device))
    a = torch.randn(2, 4, device=device, requires_grad=True)
    gathered = comm.gather_from_tp_region(a, tp)
    (gathered * (r + 1)).sum().backward()
    checks["gather backward is split"] = a.grad.device == a.device and torch.equal(
        a.grad, torch.full_like(a, float(r + 1)))
    return checks


def job_smollm2(ctx, device, folder, ids, mask, n):
    """Greedy and seeded-sampling tokens of the sharded SmolLM2 on ``device``."""
    from tensorpar.hf.load import build_parallel_model

    model, _ = build_parallel_model(folder, ctx.tp, device=device)
    ids, mask = ids.to(device), mask.to(device)
    greedy = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n)).tokens
    sampled = [generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(
        max_new_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=3)).tokens for _ in range(2)]
    return greedy, sampled


# ---------------------------------------------------------------- tp = 1 on cuda:0

def test_layers_at_tp1_on_cuda():
    from tensorpar.parallel import ParallelContext

    diffs = job_layers(ParallelContext.single("cuda:0"), torch.device("cuda:0"))
    assert max(diffs.values()) <= 1e-5, diffs


def test_sample_uses_a_generator_on_the_logits_device():
    logits = torch.randn(3, 50, device="cuda:0")
    cfg = SamplingConfig(temperature=0.7, top_k=10, top_p=0.9, seed=1)
    a = sample(logits, cfg, torch.Generator(device="cuda:0").manual_seed(1))
    b = sample(logits, cfg, torch.Generator(device="cuda:0").manual_seed(1))
    assert a.device == logits.device and torch.equal(a, b)
    with pytest.raises(ValueError, match="sampling generator is on cpu but the logits are on cuda:0"):
        sample(logits, cfg, torch.Generator().manual_seed(1))


def test_generate_tokens_samples_on_cuda(tmp_path):
    """generate_tokens makes its generator on the model's device: sampling on CUDA runs and is seeded."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    from tests.decode.test_generate import make_model_folder, prompts

    folder = make_model_folder(tmp_path / "llama", "llama")
    ctx = ParallelContext.single("cuda:0")
    model, _ = build_parallel_model(str(folder), ctx.tp, device=torch.device("cuda:0"))
    ids, mask = prompts(53)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.9, top_k=20, seed=5)
    a = generate_tokens(model, ctx.tp, ids.cuda(), mask.cuda(), sampling=cfg).tokens
    b = generate_tokens(model, ctx.tp, ids.cuda(), mask.cuda(), sampling=cfg).tokens
    assert torch.equal(a, b) and a.shape == (3, 6) and int(a.max()) < 53


# ---------------------------------------------------------------- tp = 2: NCCL on 2 GPUs, gloo on 1 GPU split

@pytest.mark.parametrize("setup", list(SETUPS))
def test_collectives_on_cuda(setup):
    _needs(setup)
    for rank, checks in enumerate(run_cuda_ranks(setup, job_collectives)):
        assert all(checks.values()), f"{setup} rank {rank}: {checks}"


@pytest.mark.parametrize("setup", list(SETUPS))
def test_layer_parity_on_cuda(setup):
    _needs(setup)
    for rank, diffs in enumerate(run_cuda_ranks(setup, job_layers)):
        assert max(diffs.values()) <= 1e-5, f"{setup} rank {rank}: {diffs}"


@pytest.fixture(scope="module")
def smollm2_reference():
    """SmolLM2 greedy tokens from transformers on cuda:0 (single process, fp32). Skips when SmolLM2 is
    neither in the cache nor downloadable (a GPU machine without network: point TENSORPAR_CACHE at a
    cache that holds it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tensorpar.hub import resolve_model

    try:
        folder = str(resolve_model("smollm2", progress=False))
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 is not in the cache and cannot be downloaded here: {str(e)[:200]}")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok(["The capital of France is", "Once upon a time, in a small village,"], return_tensors="pt",
              padding=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = model.generate(**{k: v.cuda() for k, v in enc.items()}, max_new_tokens=32, min_new_tokens=32,
                             do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    del model
    torch.cuda.empty_cache()
    return folder, enc["input_ids"], enc["attention_mask"], out[:, enc["input_ids"].shape[1]:].cpu()


@pytest.mark.network
@pytest.mark.parametrize("setup", ["tp1"] + list(SETUPS))
def test_smollm2_on_cuda_equals_transformers(setup, smollm2_reference):
    from tensorpar.parallel import ParallelContext

    folder, ids, mask, want = smollm2_reference
    if setup == "tp1":
        outs = [_to_cpu(job_smollm2(ParallelContext.single("cuda:0"), torch.device("cuda:0"), folder, ids, mask,
                                    want.shape[1]))]
    else:
        _needs(setup)
        outs = run_cuda_ranks(setup, job_smollm2, folder, ids, mask, want.shape[1])
    for rank, (greedy, sampled) in enumerate(outs):
        same = (greedy == want).all(dim=0)
        first = int((~same).nonzero()[0]) if not bool(same.all()) else None
        assert first is None, f"{setup} rank {rank}: greedy tokens differ from transformers from step {first}"
        assert torch.equal(sampled[0], sampled[1]), f"{setup} rank {rank}: seeded sampling is not reproducible"
        assert torch.equal(sampled[0], outs[0][1][0]), f"{setup}: ranks sampled different tokens"
