"""Coverage of plan discovery (docs/discover.md), measured: every ``model_type`` of the installed transformers that
has a ``*ForCausalLM`` class (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), on a small config with the head structure of
the CI test (hidden 48, 6 query heads, 2 KV heads of 8, vocabulary 61; the family's default layer count, cut by
the proof to :func:`~tensorpar.hf.discover.proof_layers`), is classified as

* ``not attempted``: the config or the model does not build; remote code; an encoder-decoder; a bidirectional
  encoder with a decoder mode (it is also a masked LM); state-space / recurrent layers; linear attention;
* ``refused by discovery``: :func:`tensorpar.hf.discover.discover_plan`'s one-line reason;
* ``refused by the proof``: :func:`tensorpar.verify.prove.prove_discovered`'s reason (the first module over
  tolerance; a fused projection's other row layout is tried too: :func:`tensorpar.hf.discover.variants`);
* ``proven``: the discovered plan passes at tp 2 and tp 3 (logits, every module, the loss, every gradient), with
  the largest forward and gradient difference at each tp.

A family with a built-in table is also checked against it: the discovered plan must split heads, MLP and
vocabulary as the table does (``same shards``).

Discovery runs in this process (meta device, each family in a try/except); the proofs run in two shared pools
of 2 and 3 gloo ranks, each job with a timeout (a failed or timed-out pool is restarted for the next family).

    PYTHONPATH=. python bench/discover_coverage.py [--only gpt2,phi] [--timeout 300] [--out bench/results]
        [--docs docs/discover.md | --no-docs] [--discover-only]

Writes ``discover_coverage.json`` and ``discover_coverage.md`` under ``--out`` (``--only``: printed, not written)
and the coverage table of docs/discover.md (between its ``coverage-table`` markers).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the head structure of tests/hf/test_discover.py::cfg (at tp 3 a KV head is shared by two ranks); the layer
#: count stays the family's default, so its per-layer lists (layer_types, no_rope_layers, ...) are its own and the
#: proof's instance keeps as many blocks as it takes for each of their values to occur (proof_layers, at most 8)
BASE = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
            intermediate_size=40, vocab_size=61, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: small values for the config keys a family has (only keys its default config holds are set)
SHRINK = dict(num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_topk=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, ffn_hidden_size=40, n_inner=40,
              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
              first_k_dense_replace=0, n_group=1, topk_group=1, num_kv_heads=2, multi_query_group_num=2,
              sliding_window=4096, max_position_embeddings=256, n_positions=256)
#: scalar multipliers set away from 1 where the config has them at 1 (else the proof would not see them)
MULTIPLIERS = dict(embedding_multiplier=4.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
                   logit_scale=0.5, scale_emb=4.0, embedding_multiplier_scale=4.0, output_multiplier_scale=0.5)
#: module class names that mark a state-space / recurrent layer, or linear attention (case-sensitive: class names)
STATE_SPACE = re.compile(r"Mamba|SSM|Ssm[A-Z]|Rwkv|xLSTM|Mlstm|Slstm|Recurrent|Rglru|Hgrn|Retention")
LINEAR_ATTN = re.compile(r"DeltaNet|LinearAttention|Lightning|ShortConv|Kda[A-Z]|GatedDelta")


def small_config(mt: str):
    """The sweep's config of ``mt``: BASE and SHRINK for the keys its config has (through its attribute_map)."""
    import transformers as T

    default = T.AutoConfig.for_model(mt)
    have = set(vars(default)) | set(getattr(default, "attribute_map", {}))
    kw = {k: v for k, v in BASE.items() if k in have or k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    if getattr(default, "multi_query", False):   # the config derives its KV heads (1) from multi_query
        kw.pop("num_key_value_heads", None)
    for k, v in SHRINK.items():
        cur = getattr(default, k, None)
        if k in have and isinstance(cur, int) and not isinstance(cur, bool) and cur > v:
            kw[k] = v
    for k, v in MULTIPLIERS.items():
        if k in have and getattr(default, k, None) in (1, 1.0):
            kw[k] = v
    try:
        return T.AutoConfig.for_model(mt, **kw)
    except Exception:  # noqa: BLE001 - a head count the config checks against its own (e.g. per-layer) lists
        kw.pop("num_key_value_heads", None)
        return T.AutoConfig.for_model(mt, **kw)


def kinds(config, plan) -> list[str]:
    """What the family's block has that the coverage target asks for (read from its config and plan)."""
    out = []
    ents = {e.pattern: e for e in plan.entries} if plan is not None else {}
    att = next((e for e in ents.values() if e.style == "attention"), None)
    if att is not None and att.args.get("fused"):
        out.append("fused QKV")
    if att is not None and att.args.get("qk_norm") == "full":
        out.append("full-width q/k norms")
    rope = getattr(config, "rope_parameters", None) or {}
    prf = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or \
        getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None)
    if (prf is not None and prf < 1) or getattr(config, "rotary_dim", None):
        out.append("partial rotary")
    norms = [e for e in ents.values() if e.style == "replicated" and "*" in e.pattern]
    if any(getattr(config, k, False) for k in ("use_parallel_residual", "parallel_attn", "parallel_block")) or \
            (plan is not None and len(norms) == 1):    # one norm in the block feeds attention and MLP alike
        out.append("parallel residual")
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in (
            "embedding_multiplier", "logits_scaling", "logit_scale", "scale_emb", "dim_model_base",
            "embedding_multiplier_scale", "output_multiplier_scale", "residual_multiplier", "attention_multiplier")):
        out.append("multipliers")
    elif getattr(config, "scale_embedding", False):
        out.append("multipliers (embedding scale)")
    if any(getattr(config, k, 0) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        out.append("MoE")
    return out


def not_attempted(config, model) -> str | None:
    """Why the family is outside the sweep's scope (a clause), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MLM

    if getattr(config, "auto_map", None):
        return "remote code (config.auto_map)"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if not hasattr(config, "hidden_size") and any(k.endswith("_config") for k in vars(config)):
        subs = ", ".join(k for k in vars(config) if k.endswith("_config") and getattr(config, k) is not None)
        return f"composite (multimodal) config ({subs}); its text model has its own model_type"
    if config.model_type in MLM:
        return "bidirectional encoder with a decoder mode (also a masked LM)"
    names = {type(m).__name__ for m in model.modules()}
    ss = sorted(n for n in names if STATE_SPACE.search(n))
    if ss:
        return f"state-space / recurrent layers ({', '.join(ss[:2])})"
    la = sorted(n for n in names if LINEAR_ATTN.search(n))
    if la:
        return f"linear attention ({', '.join(la[:2])})"
    return None


def same_shards(config, plan) -> str:
    """For a family with a table: 'same shards' when the discovered plan splits as the table, else the difference."""
    from tensorpar.hf.plan import make_plan

    a, b = make_plan(config, 3, user_plan=plan), make_plan(config, 3)
    diffs = []
    if a.heads != b.heads:
        diffs.append("heads")
    if (a.intermediate and a.intermediate.sizes) != (b.intermediate and b.intermediate.sizes):
        diffs.append("intermediate")
    if a.vocab.sizes != b.vocab.sizes:
        diffs.append("vocabulary")
    if a.blocks != b.blocks:
        diffs.append(f"blocks {a.blocks} vs {b.blocks}")
    return "same shards" if not diffs else "differs: " + ", ".join(diffs)


def short(e: BaseException) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    s = s.replace("--discover-plan: ", "").replace("; give the plan yourself with --plan-file (docs/plans.md)", "")
    return s[:400]


def sweep_one(mt: str, pools, discover_only: bool) -> dict:
    from tensorpar.hf.discover import discover_plan, plan_dict
    from tensorpar.hf.families import FAMILIES
    from tensorpar.hf.plan import meta_model
    from tensorpar.verify.prove import prove_discovered

    row: dict = {"model_type": mt, "table": mt in FAMILIES}
    t0 = time.monotonic()
    try:
        config = small_config(mt)
    except Exception as e:  # noqa: BLE001 - one family's failure is its row, not the sweep's end
        return {**row, "status": "not attempted", "reason": f"config does not build: {short(e)}"}
    try:
        model = meta_model(config)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "not attempted", "reason": f"model does not build: {short(e)}"}
    why = not_attempted(config, model)
    if why:
        return {**row, "status": "not attempted", "reason": why}
    try:
        plan = discover_plan(config, model)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "refused by discovery", "reason": short(e), "kinds": kinds(config, None)}
    row.update(kinds=kinds(config, plan), plan=plan_dict(plan))
    if row["table"]:
        try:
            row["table_check"] = same_shards(config, plan)
        except Exception as e:  # noqa: BLE001
            row["table_check"] = f"error: {short(e)}"
    if discover_only:
        return {**row, "status": "discovered (not proven: --discover-only)"}
    try:
        proven, reports = prove_discovered(config, plan, pools=pools)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "refused by the proof", "reason": short(e), "seconds": round(time.monotonic() - t0, 1)}
    if proven is not plan:      # another row layout of a fused projection passed (GPT-NeoX's per-head rows)
        row.update(kinds=kinds(config, proven), plan=plan_dict(proven))
    res = {}
    for r in reports:
        fwd = [d["max_abs"] for d in r["diffs"] if d["kind"] != "grad"]
        grad = [d["max_abs"] for d in r["diffs"] if d["kind"] == "grad"]
        res[str(r["tp_size"])] = {"ok": r["ok"], "max_forward": max(fwd, default=0.0),
                                  "max_grad": max(grad, default=0.0), "compared": len(r["diffs"])}
    status = "proven" if sorted(res) == ["2", "3"] and all(v["ok"] for v in res.values()) else "refused by the proof"
    return {**row, "status": status, "tp": res, "seconds": round(time.monotonic() - t0, 1)}


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def markdown(rows: list[dict], head: dict) -> str:
    proven = [r for r in rows if r["status"] == "proven"]
    beyond = [r for r in proven if not r["table"]]
    count = {}
    for r in rows:
        count[r["status"]] = count.get(r["status"], 0) + 1
    lines = [f"Discovery coverage: transformers {head['transformers']}, {head['date']}, {head['cpu']} "
             f"({head['cores']} cores, load {head['loadavg_start'][0]:.1f} at start), "
             f"{len(rows)} model types with a `*ForCausalLM` class; config: hidden 48, 6 query heads, 2 KV heads "
             f"of 8, each family's default layer count (the proof keeps 2 to 8 blocks: `proof_layers`) "
             f"(`bench/discover_coverage.py`).", "",
             f"**Proven at tp 2 and 3: {len(proven)}** ({len(beyond)} without a built-in table); " +
             ", ".join(f"{k}: {v}" for k, v in sorted(count.items()) if k != "proven") + ".", "",
             "Kinds among those proven without a table: " + "; ".join(
                 f"{k}: {', '.join(r['model_type'] for r in beyond if k in ' '.join(r.get('kinds', []))) or 'none'}"
                 for k in ("fused QKV", "partial rotary", "parallel residual", "multipliers", "full-width q/k norms",
                           "MoE")) + ".", "",
             "| model_type | table | result | kinds | max fwd diff tp 2 / tp 3 | reason |", "|---|---|---|---|---|---|"]
    order = {"proven": 0, "refused by the proof": 1, "refused by discovery": 2, "not attempted": 3}
    for r in sorted(rows, key=lambda r: (order.get(r["status"], 4), r["model_type"])):
        diff = ""
        if r.get("tp"):
            diff = " / ".join(f"{r['tp'][t]['max_forward']:.1e}" for t in ("2", "3") if t in r["tp"])
        table = "yes" + (f" ({r['table_check']})" if r.get("table_check") else "") if r["table"] else "no"
        reason = r.get("reason", "").replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {table} | {r['status']} | {', '.join(r.get('kinds', []))} | {diff} | "
                     f"{reason} |")
    return "\n".join(lines) + "\n"


def write_docs(path: Path, md: str) -> None:
    text = path.read_text()
    a, b = "<!-- coverage-table (bench/discover_coverage.py writes it) -->", "<!-- /coverage-table -->"
    block = f"{a}\n{md}{b}"
    if a in text:
        text = re.sub(re.escape(a) + r".*?" + re.escape(b), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    import os

    import transformers

    from machine import machine
    from tensorpar.testing import WorkerPool

    ap = argparse.ArgumentParser(description="Plan discovery and its proof at tp 2 and 3 on every model type of the "
                                 "installed transformers with a *ForCausalLM class: each is proven, refused by the "
                                 "proof, refused by discovery or not attempted (with the reason); writes "
                                 "discover_coverage.{json,md} and the table of docs/discover.md.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated model types (printed, nothing written)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per proof job (one tp) of a family")
    ap.add_argument("--out", default="bench/results", help="folder of discover_coverage.json and .md")
    ap.add_argument("--docs", default="docs/discover.md", help="the page whose coverage-table markers get the table")
    ap.add_argument("--no-docs", action="store_true", help="leave --docs as it is")
    ap.add_argument("--discover-only", action="store_true", help="discovery only, no proofs (nothing written)")
    ap.add_argument("--from-json", action="store_true", help="rewrite the .md and the docs table from --out's .json")
    a = ap.parse_args()
    if a.from_json:
        data = json.loads((Path(a.out) / "discover_coverage.json").read_text())
        md = markdown(data.pop("rows"), data)
        (Path(a.out) / "discover_coverage.md").write_text(md)
        if not a.no_docs:
            write_docs(Path(a.docs), md)
        print(md)
        return
    os.environ.setdefault("TENSORPAR_THREADS", "1")
    mts = a.only.split(",") if a.only else families()
    made: dict = {}

    def pools(n):
        if n not in made:
            made[n] = WorkerPool(n, collective_timeout_s=60.0, job_timeout_s=a.timeout)
        return made[n]

    head = {"transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            **{k: v for k, v in machine().items() if k != "loadavg"}, "loadavg_start": list(os.getloadavg())}
    rows = []
    try:
        for mt in mts:
            row = sweep_one(mt, pools, a.discover_only)
            rows.append(row)
            extra = row.get("reason") or " ".join(f"tp{t}:{v['max_forward']:.1e}" for t, v in row.get("tp", {}).items())
            print(f"{mt:28s} {row['status']:22s} {row.get('table_check', '')} {extra}"[:300], flush=True)
    finally:
        for p in made.values():
            p.close()
    head["loadavg_end"] = list(os.getloadavg())
    md = markdown(rows, head)
    if a.only or a.discover_only:
        print(md)
        return
    out = Path(a.out)
    (out / "discover_coverage.json").write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")
    (out / "discover_coverage.md").write_text(md)
    if not a.no_docs:
        write_docs(Path(a.docs), md)
    print(md)


if __name__ == "__main__":
    main()
