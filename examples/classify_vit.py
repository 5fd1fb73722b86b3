"""Classify an image with a vision transformer sharded over ``--tp`` local ranks (tensor parallelism).

    PYTHONPATH=. python examples/classify_vit.py --tp 3                       # tiny random-weight ViT
    PYTHONPATH=. python examples/classify_vit.py --tp 2 --model dinov2 --image photo.png
    PYTHONPATH=. python examples/classify_vit.py --tp 4 --model /path/to/vit-folder   # ViT/DINOv2 classifier

``--model`` is ``vit``, ``dinov2`` or ``siglip`` (a small random-weight classifier, 5 heads, built identically on
every rank from ``--seed``) or a Hugging Face folder of a ``ViTForImageClassification`` /
``Dinov2ForImageClassification`` / ``SiglipForImageClassification`` (config.json + safetensors; each rank loads
it with transformers, then keeps only its slices). The image is ``--image`` or, by default, matplotlib's logo
when matplotlib is installed, else a synthetic gradient; it is resized to the model's ``image_size`` and
normalised with mean = std = 0.5 per channel (the model's own image processor is not applied).

Each rank runs the whole encoder on its heads and MLP slice; the logits ``[1, num_labels]`` are replicated.
Rank 0 prints the top-5 classes and, for the random-weight models, the largest difference from the unsharded
model's logits.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch


def tiny_config(name: str, image_size: int = 32):
    """A small random-weight classifier config: 5 heads (uneven at tp = 2, 3, 4), 10 labels."""
    import transformers as T
    common = dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=5, image_size=image_size,
                  patch_size=8, num_labels=10)
    if name == "vit":
        return T.ViTConfig(intermediate_size=88, **common)
    if name == "dinov2":
        return T.Dinov2Config(mlp_ratio=2, **common)
    if name == "siglip":   # SiglipForImageClassification runs only the vision tower
        vision = {k: v for k, v in common.items() if k != "num_labels"}
        return T.SiglipConfig(vision_config=dict(intermediate_size=88, **vision), num_labels=10,
                              text_config=dict(hidden_size=40, num_hidden_layers=1, num_attention_heads=5,
                                               intermediate_size=88, vocab_size=37, bos_token_id=0,
                                               eos_token_id=1, pad_token_id=1))
    raise ValueError(f"--model {name!r}: expected 'vit', 'dinov2', 'siglip' or a model folder")


def load_image(path: str | None, size: int) -> torch.Tensor:
    """``[1, 3, size, size]`` pixels normalised to [-1, 1] from ``path`` (or matplotlib's logo, or a gradient)."""
    from PIL import Image
    if path is None:
        try:
            import matplotlib
            path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "images", "matplotlib_large.png")
        except ImportError:
            path = None
    if path is not None:
        img = Image.open(path).convert("RGB").resize((size, size))
        import numpy as np
        x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 255.0      # [3, size, size]
    else:
        g = torch.linspace(0, 1, size)
        x = torch.stack([g.view(1, -1).expand(size, size), g.view(-1, 1).expand(size, size),
                         torch.full((size, size), 0.5)])
    return ((x - 0.5) / 0.5).unsqueeze(0)


def classify(ctx, model_spec: str, image: str | None, seed: int = 0, check: bool = True):
    """Shard the classifier over ``ctx.tp`` and classify one image; returns ``(logits, max |diff|)`` (the
    difference from the unsharded model, random-weight models with ``check`` only, else None)."""
    from transformers import AutoConfig, AutoModelForImageClassification

    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan

    tp = ctx.tp
    if os.path.isdir(model_spec):
        # transformers renames these checkpoints' keys on load (attention.attention.query -> attention.q_proj),
        # which tensorpar.hf.load.load_sharded does not do yet: each rank loads the full model and keeps its slices
        model = AutoModelForImageClassification.from_pretrained(model_spec).to(ctx.device)
        config = model.config
        parallelize(model, make_plan(config, tp.size), tp)
        ref = None
    else:
        config = tiny_config(model_spec)
        plan = make_plan(config, tp.size)
        torch.manual_seed(seed)                           # the same full weights on every rank
        ref = AutoModelForImageClassification.from_config(config).eval()
        model = parallelize(copy.deepcopy(ref), plan, tp)
    size = getattr(config, "vision_config", config).image_size
    size = size if isinstance(size, int) else size[0]
    pixels = load_image(image, size).to(ctx.device)
    with torch.no_grad():
        logits = model.eval()(pixel_values=pixels).logits                 # [1, num_labels], same on every rank
        diff = (logits - ref(pixel_values=pixels).logits).abs().max().item() if (ref is not None and check) else None
    return logits, diff


def _rank_main(args) -> int:
    from tensorpar.launch import rank0_print
    from tensorpar.parallel import ParallelConfig, init_parallel

    ctx = init_parallel(ParallelConfig(tp=int(os.environ.get("WORLD_SIZE", "1"))))
    try:
        logits, diff = classify(ctx, args.model, args.image, args.seed)
        p = logits.softmax(-1)[0]
        top = p.topk(min(5, p.numel()))
        rank0_print(f"[tp={ctx.tp.size}] top-5 classes: " + ", ".join(
            f"{int(i)} ({float(v):.3f})" for v, i in zip(top.values, top.indices)))
        if diff is not None:
            rank0_print(f"max |logit difference| from the unsharded model: {diff:.3g}")
    finally:
        ctx.destroy()
    return 0


def main(argv=None) -> int:
    from tensorpar.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit", help="'vit', 'dinov2', 'siglip' (tiny random weights) or a model folder")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--image", default=None, help="image file (default: matplotlib's logo or a gradient)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tp < 1:
        print(f"classify_vit: error: --tp must be a positive integer, got {args.tp}", file=sys.stderr)
        return 2
    try:   # validate in the launching process, before any rank starts
        from transformers import AutoConfig

        from tensorpar.hf.plan import make_plan
        make_plan(AutoConfig.from_pretrained(args.model) if os.path.isdir(args.model) else tiny_config(args.model),
                  args.tp)
        if args.image is not None and not os.path.isfile(args.image):
            raise ValueError(f"--image {args.image!r}: no such file")
    except (ValueError, OSError) as e:
        print(f"classify_vit: error: {e}", file=sys.stderr)
        return 2
    return run_ranks(_rank_main, args.tp, args)


if __name__ == "__main__":
    sys.exit(main())
