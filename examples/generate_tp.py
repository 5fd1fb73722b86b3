"""The README's Python example, complete: generate with a model sharded over the ranks of torchrun.

    torchrun --standalone --nproc-per-node 2 examples/generate_tp.py               # SmolLM2-135M (fetched once)
    torchrun --standalone --nproc-per-node 2 examples/generate_tp.py path/to/model     # any supported HF folder

CI runs it under torchrun on a tiny random model (tests/cli/test_examples.py), and checks that the code
between the markers below is the README's "Using it from Python" block, word for word.
"""
# --- README example begins
import sys

from transformers import AutoTokenizer

from tensorpar.parallel import ParallelConfig, init_parallel
from tensorpar.hf.load import build_parallel_model
from tensorpar.generate import SamplingConfig, generate_tokens
from tensorpar.hub import resolve_model

folder = resolve_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2")  # or any HF-format folder
ctx = init_parallel(ParallelConfig(tp=2))            # under torchrun: rank, world size, store from its environment
model, plan = build_parallel_model(folder, ctx.tp, device=ctx.device)  # meta init, plan, each rank reads its slices
tok = AutoTokenizer.from_pretrained(folder)
ids = tok(["The capital of France is"], return_tensors="pt")["input_ids"].to(ctx.device)  # [b, s], same on all ranks
res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=16), eos_token_id=tok.eos_token_id)
if ctx.rank == 0:
    print(plan)                                      # module name -> style, head and vocab splits
    print(tok.decode(res.tokens[0], skip_special_tokens=True))
ctx.destroy()
# --- README example ends
