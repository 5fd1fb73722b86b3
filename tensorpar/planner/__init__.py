"""Automatic choice of a parallel layout (tp, pp, dp, sequence parallelism, micro-batch, recomputation,
distributed optimizer) for a model on a cluster, from a memory and step-time model. Pure Python: no GPU
and no process group, except :mod:`tensorpar.planner.calibrate`.

    from tensorpar.planner import preset, ClusterSpec, device_preset, Workload, Assumptions, search
    found = search(preset("llama3-8b"), ClusterSpec(device_preset("h100-80gb"), 64, 8),
                   Workload(global_batch=512, seq_len=8192), Assumptions(attention="sdpa"))
    best = found.ranked[0]
    tps = plan_inference(preset("llama3-70b"), ClusterSpec(device_preset("h100-80gb"), 8, 8),
                         InferenceWorkload(batch=8, prompt_len=2048, max_new_tokens=512))
"""
from tensorpar.planner.cluster import ClusterSpec, DeviceSpec, device_preset
from tensorpar.planner.enumerate import Plan, PlanSearch, score, search
from tensorpar.planner.inference import InferencePlan, InferenceWorkload, plan_inference
from tensorpar.planner.layout import Assumptions, Layout, Workload, problems
from tensorpar.planner.model_spec import ModelSpec, from_dims, from_hf_config, preset

__all__ = [
    "Assumptions", "ClusterSpec", "DeviceSpec", "InferencePlan", "InferenceWorkload", "Layout", "ModelSpec", "Plan",
    "PlanSearch", "Workload", "device_preset", "from_dims", "from_hf_config", "plan_inference", "preset", "problems",
    "score", "search",
]
