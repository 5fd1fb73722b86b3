"""Single-process measurements of this machine's compute: square-matmul throughput (:func:`measure_matmul`),
device-memory copy bandwidth (:func:`measure_memory_bandwidth`) and the time of torch's AdamW step per parameter
(:func:`measure_optimizer`), on the GPU when there is one, else on this process's CPU threads.
"""
from __future__ import annotations

import time


def measure_matmul(sizes: tuple[int, ...] | None = None, min_seconds: float = 0.2,
                   clock=time.perf_counter) -> tuple[str, list[dict]]:
    """(device description, [{"n", "dtype", "tflops"}]) for square n x n matmuls. ``clock``: wall time by default;
    ``time.thread_time`` (CPU, one torch thread) gives the rate of the thread alone on a core, whatever else runs."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = sizes or ((2048, 4096, 8192) if cuda else (256, 512, 1024))
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):  # warm-up: kernel selection, caches
            a @ b
        iters = 1
        while True:  # double the repetitions until one timing lasts min_seconds
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            for _ in range(iters):
                a @ b
            if cuda:
                torch.cuda.synchronize()
            elapsed = clock() - start
            if elapsed >= min_seconds:
                break
            iters *= 2
        out.append({"n": n, "dtype": str(dtype).removeprefix("torch."), "tflops": 2 * n ** 3 * iters / elapsed / 1e12})
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    return name, out


def measure_memory_bandwidth(nbytes: int = 1 << 28, min_seconds: float = 0.2, clock=time.perf_counter) -> float:
    """Device-memory bandwidth, GB/s: bytes read plus bytes written per second by ``dst.copy_(src)`` of
    ``nbytes`` fp32 tensors (on the GPU when there is one, else in host memory with torch's threads). ``clock``:
    as :func:`measure_matmul`."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults, allocation
    iters = 1
    while True:
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        for _ in range(iters):
            dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        elapsed = clock() - start
        if elapsed >= min_seconds:
            return 2 * nbytes * iters / elapsed / 1e9
        iters *= 2


def measure_optimizer(params: int = 1 << 20, min_seconds: float = 0.1, clock=time.perf_counter) -> float:
    """Nanoseconds per parameter of one ``torch.optim.AdamW`` step (the trainer's optimizer, torch's default
    implementation, fp32, weight decay on) over ``params`` parameters in 8 tensors, on this process's threads
    (on the GPU when there is one): the median of repeated steps after two warm-up steps (which make the state).
    ``clock``: as :func:`measure_matmul`.
    """
    import statistics

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps = [torch.nn.Parameter(torch.randn(params // 8, device=device)) for _ in range(8)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)
    samples: list[float] = []
    total = 0.0
    for i in range(200):
        if device == "cuda":
            torch.cuda.synchronize()
        start = clock()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = clock() - start
        if i >= 2:
            samples.append(elapsed)
            total += elapsed
            if total >= min_seconds and len(samples) >= 5:
                break
    return statistics.median(samples) / (len(ps) * (params // 8)) * 1e9
