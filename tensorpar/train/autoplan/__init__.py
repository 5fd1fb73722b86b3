"""``tensorpar train --plan auto | plan.json``: run the layout the planner chooses, then compare its prediction.

* ``--plan auto`` scores every (tp, pp, dp, micro-batch, sequence parallelism, recomputation, interleaving)
  layout of the ranks it was given with :mod:`tensorpar.planner` on *this machine*, measured by
  :func:`tensorpar.planner.calibrate.calibrate` (matmul rate, memory bandwidth, loopback all-reduce), keeps the
  layouts that ``tensorpar train`` runs (no distributed optimizer, no selective recomputation, no expert
  parallelism; the trainer's own checks pass) and takes the fastest that fits in memory.
* ``--plan FILE`` runs the first plan of a ``tensorpar plan --json`` file (a list) that the trainer runs, or the
  one plan object of a file, after checking that its degrees multiply to the ranks given and that it is valid
  and fits for the model trained.

The calibration is cached in ``<cache>/calibration/<machine key>.json`` (written atomically, under a file lock
so that torchrun's ranks measure once and then read the same file, and so choose the same layout). Delete the
file to measure again. The key names the host, its usable cores, torch's version and the GPU.

From the calibration the planner gets one rank's share of the machine (:func:`rank_device`):

* CUDA: one GPU per rank: the measured matmul rate, copy bandwidth, AdamW step and memory as they are;
* CPU: the ranks share the host, and on a shared machine with other users' processes. Matmuls, copy bandwidth,
  the AdamW step (:func:`tensorpar.planner.calibrate.measure_optimizer`) and the fixed overheads
  (:func:`measure_train_overhead`) are measured on one thread; a rank runs ``max(1, cores // nproc)`` threads
  (:func:`tensorpar.parallel.set_rank_threads`). The device holds one rank's rates *alone* on the host, and the
  planner's cost model shares the cores among the runnable threads (processor sharing,
  :mod:`tensorpar.planner.sharing`): ``min(1, cores / runnable threads)`` each, where the runnable threads are
  the busy ranks' (a pipeline stage that waits frees its core) and the other users', estimated by the 1-minute
  load average minus one (the measuring process), at calibration and again before the ranks start
  (:func:`rank_device`). The RAM is divided by ``nproc``.
* Collectives: the calibration measures 2-rank all-reduces over gloo and over tensorpar's shared-memory
  collectives; the device gets the backend that the trainer's groups use (``rank_device(backend=,
  tp_backend=)``; tensorpar train: gloo for every group unless shared memory is installed on the tp group).

Training is fp32 AdamW here (``dtype=float32``; bf16 autocast keeps fp32 weights): 4-byte weights and
gradients, 8 bytes of optimizer state per parameter (momentum and variance, no master copy), 4-byte
activations (2 under bf16 autocast), attention by ``sdpa`` (the trainer's).

After the run, :func:`comparison_line` prints the predicted step time next to the median of the measured steps
after warm-up, and the predicted memory per rank next to the measured peak (:class:`PeakMemory`).

One module per concern: :mod:`.calibration` (measured once, cached), :mod:`.sampler` (other users' competition
for the cores), :mod:`.device` (one rank's device from the calibration), :mod:`.choose` (``--plan auto`` and
``--plan FILE``), :mod:`.measure` (the run's measurements against the prediction).
"""
from tensorpar.train.autoplan.calibration import (CALIBRATION_VERSION, EFFICIENCY_LAYER, cached_calibration,
                                                  calibration_path, describe_device_source, machine_key,
                                                  measure_layer_efficiency, measure_train_overhead, quick_calibration)
from tensorpar.train.autoplan.sampler import CompetitionSampler, _loadavg, autogroup_enabled
from tensorpar.train.autoplan.device import collective_fit, rank_device
from tensorpar.train.autoplan.choose import (CPU_RESERVE_GIB, PLAN_KEYS, Choice, check_plan_file, choose_auto,
                                             choose_from_file, env_nproc, layout_config, planner_inputs,
                                             read_plan_file, runtime_problem, unsupported)
from tensorpar.train.autoplan.measure import (WARMUP_STEPS, PeakMemory, comparison_line, gather_measurements,
                                              measured_step_time, relative_error, step_with_tensor_peak)

__all__ = ["CALIBRATION_VERSION", "EFFICIENCY_LAYER", "cached_calibration", "calibration_path",
           "describe_device_source", "machine_key", "measure_layer_efficiency", "measure_train_overhead",
           "quick_calibration", "CompetitionSampler", "autogroup_enabled", "collective_fit", "rank_device",
           "CPU_RESERVE_GIB", "PLAN_KEYS", "Choice", "check_plan_file", "choose_auto", "choose_from_file",
           "env_nproc", "layout_config", "planner_inputs", "read_plan_file", "runtime_problem", "unsupported",
           "WARMUP_STEPS", "PeakMemory", "comparison_line", "gather_measurements", "measured_step_time",
           "relative_error", "step_with_tensor_peak"]
