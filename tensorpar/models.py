"""``tensorpar models``: the families with a built-in sharding plan, what each supports, and the tp proven in CI.

The table is computed from the code, not written by hand: the families are :data:`tensorpar.hf.families.FAMILIES`,
a feature is listed when the family's plan supports it (sequence parallelism is refused by plans that cannot
split the sequence), and "tp proven" is the tp values of the family parity test (``tests/test_families*.py``),
where each family is compared with the unsharded transformers model (logits, loss, every gradient, grad norm,
greedy tokens).
"""
from __future__ import annotations

import argparse

PROVEN_TP = (1, 2, 3, 4)  # tests/test_families.py parametrizes every family over these


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the table as JSON")


#: families whose sequence-parallel parity is proven (tests/test_families.py::test_family_parity_sequence_parallel,
#: tests/test_families_fam.py); the others' plans refuse sequence_parallel=True
SEQUENCE_PARALLEL = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "starcoder2",
                     "gpt_neox", "olmo2")


def rows() -> list[dict]:
    """One dict per family: ``model_type``, ``generate``, ``train``, ``sequence_parallel``, ``pipeline_stages``,
    ``expert_parallel``, ``tp_proven``."""
    from tensorpar.hf.families import FAMILIES, is_causal_lm
    from tensorpar.hf.families import moe
    from tensorpar.pipeline.stages import PIPELINE_FAMILIES

    out = []
    for mt, builder in sorted(FAMILIES.items()):
        text = is_causal_lm(mt)   # vision families (vit, dinov2, siglip) classify images: examples/classify_vit.py
        out.append({"model_type": mt, "generate": text, "train": text, "sequence_parallel": mt in SEQUENCE_PARALLEL,
                    "pipeline_stages": mt in PIPELINE_FAMILIES, "expert_parallel": builder is moe.plan,
                    "tp_proven": list(PROVEN_TP)})
    return out


def main(args: argparse.Namespace) -> int:
    import json

    table = rows()
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{'family':<12} {'generate':<9} {'train':<6} {'seq-par':<8} {'pipeline':<9} {'experts':<8} tp proven in CI")
    for r in table:
        yn = lambda b: "yes" if b else "-"  # noqa: E731
        print(f"{r['model_type']:<12} {yn(r['generate']):<9} {yn(r['train']):<6} {yn(r['sequence_parallel']):<8} "
              f"{yn(r['pipeline_stages']):<9} {yn(r['expert_parallel']):<8} {', '.join(map(str, r['tp_proven']))}")
    print("every family: logits, loss, every gradient, grad norm and 16 greedy tokens equal to the unsharded "
          "transformers model (tests/test_families.py); vit, dinov2: classification logits, loss, every gradient "
          "and grad norm (tests/test_vit.py)")
    return 0
