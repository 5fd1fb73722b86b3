"""Start N local ranks through torch's elastic launcher, or run in place under torchrun.

``tensorpar generate --tp 2`` calls :func:`run_ranks`, which starts the ranks with
``torch.distributed.launcher.api.elastic_launch`` (the machinery of torchrun) on loopback.
When the process already is a torchrun worker (``TORCHELASTIC_RUN_ID`` or ``RANK`` in the
environment), the function runs directly: ``torchrun --nnodes M --nproc-per-node N -m
tensorpar generate ...`` is the multi-machine path, unchanged.
"""
from __future__ import annotations

import os
import sys
import uuid
from typing import Any, Callable


def under_torchrun() -> bool:
    """True inside a process started by torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def rank0_print(*args, **kwargs) -> None:
    """Print from global rank 0 only (reads ``RANK``; prints everything outside a launch)."""
    if int(os.environ.get("RANK", "0")) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def run_ranks(fn: Callable[..., Any], nproc: int, *args) -> int:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return a process exit code (0 = all ranks succeeded).

    ``fn`` must be a top-level function (it is pickled to spawned processes). Under torchrun it is
    called once, in this process. A failing rank stops all others; its error is printed.
    """
    if under_torchrun() or nproc == 1 and "RANK" not in os.environ:
        if not under_torchrun():
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        rc = fn(*args)
        return int(rc or 0)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tensorpar.testing import free_port

    port = free_port()
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                       rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                       monitor_interval=0.1, start_method="spawn")
    try:
        results = elastic_launch(cfg, fn)(*args)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()))
        msg = first.message if isinstance(first.message, str) else first.message.get("message", str(first.message))
        print(f"tensorpar: rank {first.local_rank} failed: {msg.strip().splitlines()[-1] if msg else e}",
              file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, SignalException):  # the agent stops every rank before this is raised
        print("tensorpar: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    return max(int(r or 0) for r in results.values())
