"""Subprocess used by tests/train/test_train_checkpoint.py: saves checkpoints until killed, or under a file-size limit.

    python -m tests._ckpt_writer loop ROOT       save step 1 (small), print SAVED, then steps 2, 3, ... (large)
    python -m tests._ckpt_writer limit ROOT MB    save step 1 (small), then step 2 (large) with files capped at MB

The weight saved at step k is filled with the value k, so a loaded checkpoint can be checked whole.
"""
import resource
import signal
import sys

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.train.checkpoint import CheckpointError, save_checkpoint


def state(out_features: int, step: int):
    m = nn.Linear(1024, out_features)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 1024)).sum().backward()
    opt.step()
    with torch.no_grad():
        m.weight.fill_(step)
    return list(m.named_parameters()), opt


def save(root, step, out_features):
    named, opt = state(out_features, step)
    return save_checkpoint(root, named_params=named, optimizer=opt, tp=Group.single(), step=step,
                           state={"filled_with": step}, keep=2)


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    save(root, 1, 8)
    print("SAVED", flush=True)
    if mode == "loop":
        for step in range(2, 10_000):
            save(root, step, 4096)            # 16 MB weight + 32 MB of moments per save
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG, like a full disk
        limit = int(sys.argv[3]) << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            save(root, 2, 4096)
        except CheckpointError as e:
            print("CHECKPOINT_ERROR", e, flush=True)
            sys.exit(3)
