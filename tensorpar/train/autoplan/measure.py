"""Measuring a run that ``--plan`` chose, and printing the planner's prediction next to it.

:class:`PeakMemory` and :func:`step_with_tensor_peak` measure a rank's peak memory (the CUDA allocator's, the
resident set's, or the live tensors of one step), :func:`gather_measurements` collects every rank's median step
time and peak, and :func:`comparison_line` prints them against the prediction with the relative errors.
"""
from __future__ import annotations

import statistics

from tensorpar.train.autoplan.choose import _mib


WARMUP_STEPS = 2  # steps left out of the measured median (first-call allocation, pipeline set-up)


class PeakMemory:
    """Peak memory of this rank while training, above what it held before the model was built.

    * CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching allocator's
      tensors; what the planner models), minus the bytes allocated at the start;
    * CPU: the resident-set high-water mark ``VmHWM`` of ``/proc/self/status``, reset to the current resident
      set at the start by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), minus the resident set at
      the start. It counts the allocator's retained pages and library buffers too. Where the reset is not
      possible, ``getrusage``'s ``ru_maxrss`` (the process's lifetime peak) is used and ``method`` says so.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return
        self.base = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "RSS high-water (VmHWM, reset at start)"
        except OSError:
            self.method = "RSS high-water (ru_maxrss, process lifetime)"
        self.base = (self.base or 0) * 1024

    def peak_bytes(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        hwm = _status_kib("VmHWM")
        if hwm is None or "ru_maxrss" in self.method:
            import resource
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, int(hwm * 1024 - self.base))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def measured_step_time(step_times: list[float], warmup: int = WARMUP_STEPS) -> tuple[float, int]:
    """``(median seconds, steps counted)`` of the steps after ``warmup`` (all of them if too few)."""
    kept = step_times[warmup:] if len(step_times) > warmup else step_times
    return (statistics.median(kept) if kept else float("nan")), len(kept)


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``: negative when the planner is optimistic."""
    return (predicted - measured) / measured if measured else float("nan")


def comparison_line(prediction: dict, medians: list[float], counted: int, peaks: list[tuple]) -> str:
    """Predicted vs measured step time (each rank's median after warm-up; the slowest rank's) and peak memory per
    rank (the largest): the tensors' peak where measured (CUDA allocator, or the second step's live tensors on a
    CPU), else the resident-set growth. ``peaks``: per rank ``(bytes, method)``."""
    t, n = max(medians), counted
    mem, method = max(peaks, key=lambda p: p[0]) if peaks else (0, "not measured")
    pt, pm = prediction["step_time_s"], prediction["memory_bytes"]
    per_rank = ", ".join(_mib(p[0]) for p in peaks)
    return (f"plan vs measured: step time predicted {pt * 1e3:.1f} ms, measured {t * 1e3:.1f} ms (median of {n} "
            f"steps after {WARMUP_STEPS} warm-up, slowest rank; error {100 * relative_error(pt, t):+.0f}%); peak "
            f"memory per rank predicted {_mib(pm)}, measured {_mib(mem)} ({method}; ranks [{per_rank}]; "
            f"error {100 * relative_error(pm, mem):+.0f}%)")


def gather_measurements(ctx, step_times: list[float], rss_peak: int, tensor_peak: int | None = None):
    """``(every rank's median step time, steps counted, every rank's (peak bytes, how measured))`` on every rank
    (one all-gather of JSON over all ranks). The peak is ``tensor_peak`` when given, else ``rss_peak``."""
    import torch.distributed as dist

    med, n = measured_step_time(step_times)
    how = ("live tensors of the second step, parameters and optimizer state" if tensor_peak is not None else
           "resident-set growth since the model was built" if ctx.device.type == "cpu" else
           "torch.cuda.max_memory_allocated")
    mine = (med, (tensor_peak if tensor_peak is not None else rss_peak, how))
    if ctx.world_size == 1 or not dist.is_initialized():
        return [med], n, [mine[1]]
    from tensorpar.comm import all_gather_json
    box = all_gather_json(mine, dist.group.WORLD)  # JSON, not all_gather_object: nothing from a peer is unpickled
    return [b[0] for b in box], n, [tuple(b[1]) for b in box]


def step_with_tensor_peak(trainer):
    """``(trainer.train_step(), peak bytes)``: the step runs under
    :func:`tensorpar.planner.calibrate.peak_memory_bytes` (every operator's outputs tracked until freed), and the
    peak of live tensors above the parameters and the optimizer state is added to their bytes: weights,
    gradients, optimizer state and activations, what the planner's memory model counts. Run it on a step after
    the first (AdamW makes its state in the first step, so only later steps hold it during backward). Slower
    than a plain step."""
    import torch

    from tensorpar.planner.calibrate import peak_memory_bytes

    held = list(trainer.params) + [t for st in trainer.optimizer.state.values() for t in st.values()
                                   if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    r, above = peak_memory_bytes(trainer.train_step, baseline=held)
    return r, sum(storages.values()) + above
