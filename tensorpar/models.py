"""``tensorpar models``: the families with a built-in sharding plan, what each supports, and the tp proven in CI.

The table is computed from the code, not written by hand: one row per family record
(:data:`tensorpar.hf.families.RECORDS`), a feature listed when the record says so, and "tp proven" the tp values
of the family parity test (``tests/hf/test_families*.py``), where each family is compared with the unsharded transformers model (logits, loss, every gradient, grad norm,
greedy tokens). Below them, the families without a table whose plan ``--discover-plan`` finds and CI proves
(:data:`tensorpar.hf.discover.PROVEN`, tests/hf/test_discover.py: logits, every module, loss and every gradient at
tp 2 and 3), marked ``discovered``.
"""
from __future__ import annotations

import argparse

PROVEN_TP = (1, 2, 3, 4)
PROVEN_TP_DISCOVERED = (2, 3)  # tests/hf/test_discover.py proves each discovered family at these  # tests/hf/test_families.py parametrizes every family over these


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def rows() -> list[dict]:
    """One dict per family (its :class:`~tensorpar.hf.families.record.Family` record): ``model_type``,
    ``generate``, ``train``, ``sequence_parallel``, ``pipeline_stages``, ``expert_parallel``, ``fast_decode``,
    ``tp_proven``, ``plan`` (``table``, or ``discovered``: no table, ``--discover-plan``)."""
    from tensorpar.hf.discover import PROVEN
    from tensorpar.hf.families import RECORDS

    out = []
    for mt, r in sorted(RECORDS.items()):
        text = r.causal_lm   # vision families (vit, dinov2, siglip) classify images: examples/classify_vit.py
        out.append({"model_type": mt, "generate": text, "train": text, "sequence_parallel": r.sequence_parallel,
                    "pipeline_stages": r.pipeline_stages, "expert_parallel": r.expert_parallel,
                    "fast_decode": r.fast_decode, "tp_proven": list(PROVEN_TP), "plan": "table"})
    for mt in sorted(PROVEN):
        out.append({"model_type": mt, "generate": True, "train": False, "sequence_parallel": False,
                    "pipeline_stages": False, "expert_parallel": False, "fast_decode": False,
                    "tp_proven": list(PROVEN_TP_DISCOVERED), "plan": "discovered"})
    return out


def main(args: argparse.Namespace) -> int:
    import json

    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{'family':<12} {'generate':<9} {'train':<6} {'seq-par':<8} {'pipeline':<9} {'experts':<8} "
          f"{'fast-dec':<9} tp proven in CI")
    for r in table:
        yn = lambda b: "yes" if b else "-"  # noqa: E731
        print(f"{r['model_type']:<12} {yn(r['generate']):<9} {yn(r['train']):<6} {yn(r['sequence_parallel']):<8} "
              f"{yn(r['pipeline_stages']):<9} {yn(r['expert_parallel']):<8} "
              f"{yn(r['fast_decode']):<9} {', '.join(map(str, r['tp_proven']))}"
              + ("  (discovered plan: --discover-plan, no table)" if r["plan"] == "discovered" else ""))
    print("every family: logits, loss, every gradient, grad norm and 16 greedy tokens equal to the unsharded "
          "transformers model (tests/hf/test_families.py); vit, dinov2: classification logits, loss, every gradient "
          "and grad norm (tests/hf/test_vit.py)")
    return 0
