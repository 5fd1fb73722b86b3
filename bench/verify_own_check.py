"""verify's own-computation check (docs/verify.md): worst clean ratio max|diff| / tolerance of the "(own)" rows over the
test families, fp32 and bf16, and what a missing all-reduce in the last block's attention or MLP gives in bf16.

Run: PYTHONPATH=. python bench/verify_own_check.py 2  (and 3); prints one line per case (results/verify_own_check.md).
"""
import copy
import types

import torch
import torch.nn.functional as F
from tensorpar.testing import WorkerPool, random_model
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan
from tensorpar.verify import compare_to_reference
from tests.families import config, FAMILIES

def job(ctx, model_type, fault, dtype, sp=False):
    cfg = config(model_type)
    ref = random_model(cfg)
    ref = ref.to(dtype)
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, ctx.tp.size, sequence_parallel=sp), ctx.tp)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    if fault:
        nl = cfg.num_hidden_layers
        m = par.model.layers[nl - 1].self_attn.o_proj if fault == "attn" else par.model.layers[nl-1].mlp.down_proj
        m.forward = types.MethodType(lambda self, x: F.linear(x, self.weight), m)
    rep = compare_to_reference(ref, par, ctx.tp, ids, train=True)
    return [(d.name, d.kind, d.max_abs, d.tol, d.ok) for d in rep.diffs]

def show(tag, r):
    bad = [x for x in r if not x[4]]
    own = [x for x in r if "(own)" in x[1]]
    worst = max(own, key=lambda x: x[2] / max(x[3], 1e-30))
    print(tag, "fails:", len(bad), bad[:2], "| worst own ratio %.3g" % (worst[2] / max(worst[3], 1e-30)), worst[:2], flush=True)

if __name__ == "__main__":
    import sys
    tp = int(sys.argv[1])
    pool = WorkerPool(tp, collective_timeout_s=60)
    try:
        for dt in [torch.float32, torch.bfloat16]:
            for mt in FAMILIES:
                show(f"{mt} {dt} tp{tp}", pool.run(job, mt, None, dt)[0])
            show(f"mistral sp {dt} tp{tp}", pool.run(job, "mistral", None, dt, True)[0])
        for fault in ["attn", "mlp"]:
            show(f"llama bf16 fault {fault}", pool.run(job, "llama", fault, torch.bfloat16)[0])
    finally:
        pool.close()
