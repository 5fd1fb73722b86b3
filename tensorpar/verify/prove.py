"""The proof of a discovered plan (``--discover-plan``): :func:`prove_plan` runs it on a small random-weight instance
(:func:`~tensorpar.hf.discover.tiny_config`) at tp = 2 and 3 against the unsharded model with
:func:`~tensorpar.verify.compare.compare_to_reference` and refuses it, naming the first module over tolerance;
:func:`resolve_flags` is the launching step of ``--discover-plan`` / ``--save-plan`` (generate, verify): discover,
prove, write the plan file the ranks read as ``--plan-file``. Discovery itself is :mod:`tensorpar.hf.discover`.
"""
from __future__ import annotations

import copy
import re

import torch

from tensorpar.hf.discover import UserPlan, discover_plan, plan_dict, save_plan, tiny_config, variants
from tensorpar.hf.discover_block import DiscoveryError, _fail, _heads

def _proof_job(ctx, config, spec: dict, train: bool):
    """One rank of the proof: random weights (seed 0, every tensor perturbed so biases and norms are not their
    init), the sharded copy made with ``spec``, :func:`compare_to_reference` at this pool's tp. Returns the
    report as a dict (rank 0's is the over-ranks maximum on every rank)."""
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    from tensorpar.testing import random_model
    from tensorpar.verify.compare import compare_to_reference

    ref = random_model(copy.deepcopy(config), attn_implementation="eager").eval()
    par = parallelize(copy.deepcopy(ref), make_plan(config, ctx.tp.size, user_plan=spec), ctx.tp).eval()
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1234))
    return compare_to_reference(ref, par, ctx.tp, ids, train=train).to_dict()


def instance_spec(plan: UserPlan, n: int) -> dict:
    """The plan-file form of ``plan`` for an instance of ``n`` blocks: entries placed block by block (dense and MoE
    layers mixed, ``model.layers.5.mlp``) for blocks it does not have are left out (they would match nothing)."""
    spec = plan_dict(plan)
    blocks = re.escape(plan.blocks.removesuffix(".*"))
    spec["entries"] = {p: e for p, e in spec["entries"].items()
                       if not (m := re.match(rf"{blocks}\.(\d+)\.", p)) or int(m.group(1)) < n}
    return spec


def prove_plan(config, plan: UserPlan, *, tps=(2, 3), train: bool = True, pools=None) -> list[dict]:
    """Run ``plan`` on :func:`tiny_config` of ``config`` at each tp in ``tps`` against the unsharded model
    (logits, every watched module, with ``train`` the loss and every gradient); return the reports
    (:meth:`~tensorpar.verify.policy.LayoutReport.to_dict`), one per tp.

    ``pools``: ``n -> WorkerPool`` of ``n`` gloo ranks (the tests' fixture); None: a pool per tp, started here
    (CPU, spawn) and closed after. Raises DiscoveryError naming the first module over tolerance (or the plan's
    ValueError at the small instance) and pointing to ``--plan-file``."""
    from tensorpar.hf.plan import make_plan
    from tensorpar.testing import RankFailure, WorkerPool

    small = tiny_config(config)
    spec = instance_spec(plan, small.num_hidden_layers)
    nh = _heads(small)[0]
    reports = []
    for t in tps:
        if t > nh:
            continue
        try:
            make_plan(small, t, user_plan=spec)
        except ValueError as e:
            raise _fail(f"the discovered plan does not build at tp={t}: {e}") from None
        pool = pools(t) if pools is not None else WorkerPool(t, collective_timeout_s=120.0)
        try:
            rep = pool.run(_proof_job, small, spec, train)[0]
        except RankFailure as e:
            last = [x for x in str(e).strip().splitlines() if x.strip()][-1:]
            raise _fail(f"the discovered plan fails on a random-weight {small.model_type} at tp={t}: "
                        f"{' '.join(last)}") from None
        finally:
            if pools is None:
                pool.close()
        reports.append(rep)
        bad = next((d for d in rep["diffs"] if not d["ok"]), None)
        if bad is not None or rep["replicated_mismatch"]:
            what = (f"{bad['name']} ({bad['kind']}) differs by {bad['max_abs']:.3e} > tolerance {bad['tol']:.3e}"
                    if bad is not None else f"replicated gradients differ across ranks: "
                    f"{', '.join(rep['replicated_mismatch'][:3])}")
            raise _fail(f"the discovered plan is refused: on a random-weight {small.model_type} "
                        f"({small.num_hidden_layers} blocks) at tp={t} against the unsharded model, {what}")
    return reports


def prove_discovered(config, plan: UserPlan, *, tps=(2, 3), train: bool = True, pools=None):
    """Prove ``plan`` or, when the proof refuses it, each of its :func:`~tensorpar.hf.discover.variants` (a fused
    projection's other row layout) in turn; return ``(the plan that passed, its reports)``. Raises the first
    plan's DiscoveryError when none passes."""
    first = None
    for p in variants(plan):
        try:
            return p, prove_plan(config, p, tps=tps, train=train, pools=pools)
        except DiscoveryError as e:
            first = first or e
    raise first


def discovered_plan_file(config, *, save: str | None = None, train: bool = True, tps=(2, 3), pools=None) -> str:
    """``--discover-plan`` in the launching process: discover, prove (:func:`prove_plan`), write the plan file
    (``save``, or a file in the temporary directory) and return its path, which the ranks read as
    ``--plan-file``. Raises DiscoveryError (discovery or proof)."""
    import os
    import tempfile

    plan, _ = prove_discovered(config, discover_plan(config), tps=tps, train=train, pools=pools)
    if save is None:
        fd, save = tempfile.mkstemp(prefix=f"tensorpar-{config.model_type}-", suffix=".json")
        os.close(fd)
    save_plan(plan, save)
    return os.path.abspath(save)


# ---------------------------------------------------------------- command-line flags

def add_arguments(p, *, plan_file: bool = False) -> None:
    """``--discover-plan`` and ``--save-plan`` (generate, serve, verify); with ``plan_file`` also ``--plan-file``
    (generate, serve)."""
    if plan_file:
        p.add_argument("--plan-file", default=None,
                       help="a .json/.yaml sharding plan that overrides or extends the built-in table, or shards an "
                            "architecture without one (docs/plans.md)")
    p.add_argument("--discover-plan", action="store_true",
                   help="find the sharding plan from the model's modules and shapes, prove it at tp 2 and 3 on a "
                        "small random-weight instance, then use it (docs/discover.md); not --plan auto")
    p.add_argument("--save-plan", default=None, metavar="PLAN.json",
                   help="with --discover-plan: write the proven plan here (reuse it with --plan-file, no proof)")


def resolve_flags(args, config, *, train: bool = False) -> None:
    """In the launching process: with ``--discover-plan``, discover and prove the plan and set ``args.plan_file``
    to the written file, so the ranks take the one ``--plan-file`` path. Raises ValueError (both plan flags, a
    ``--save-plan`` without ``--discover-plan``, a save path whose folder does not exist, DiscoveryError)."""
    import os

    discover, save = getattr(args, "discover_plan", False), getattr(args, "save_plan", None)
    if save is not None and not discover:
        raise ValueError(f"--save-plan {save}: needs --discover-plan (it saves the discovered plan)")
    if not discover:
        return
    if getattr(args, "plan_file", None) is not None:
        raise ValueError(f"--discover-plan and --plan-file {args.plan_file}: give one of the two")
    if save is not None and os.path.isdir(save):
        raise ValueError(f"--save-plan {save}: is a folder; give a file path, e.g. {os.path.join(save, 'plan.json')}")
    if save is not None and not os.path.isdir(os.path.dirname(os.path.abspath(save))):
        raise ValueError(f"--save-plan {save}: the folder {os.path.dirname(os.path.abspath(save))} does not exist")
    args.plan_file = discovered_plan_file(config, save=save, train=train)
