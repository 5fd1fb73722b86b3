"""Collective fingerprints: a debug mode in which skipped, reordered or mismatched collectives and divergent
inputs across tp ranks become named errors instead of silently wrong results.

With fingerprints on for a :class:`~tensorpar.comm.Group` (:func:`enable`, or ``TENSORPAR_CHECK_COLLECTIVES=1``
read by :func:`enable_from_env`), every collective of that group records ``(sequence number, op, elements,
element size)`` into a running BLAKE2b hash held by the group (``group.counter.fingerprint``; no module state).
:func:`check` (call it once per step: a decode step, a training step) compares, at step 0 and every ``every``
steps, the hashes of all ranks of the group and the hashes of the inputs the caller names (prompt token ids,
the training batch, the sampling seed). On a difference it raises :class:`CollectiveMismatch` naming the
divergent input and the ranks on each side, or the first collective (sequence number, op, shape summary) at
which the ranks' records part, with the ranks involved.

Ranks exchange fingerprints through the process group's key-value store, not through a collective, with a
timeout (``timeout_s``, below the collective timeout): a rank that skipped a collective reaches the check while
its peers wait in the collective it skipped, and it names them (the peers then fail with the collective's own
timeout error, :class:`~tensorpar.comm.CollectiveError`). Cost per collective: one small hash update (about a
microsecond); per check: one store set and wait (and a second one, with the records since the last check,
only when hashes differ). Keys of old checks are deleted.

Limits: the element count stands in for the shape, and the element size for the dtype; two collectives of the
same kind and size swapped are not told apart; a rank that skips a collective in the middle of a step can pair
its next collective with the skipped one and hang both sides in that collective (the collective timeout
names it) before any check.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorpar.comm import Group

ENV = "TENSORPAR_CHECK_COLLECTIVES"


class CollectiveMismatch(RuntimeError):
    """tp ranks issued different collectives, or were given different inputs; the message names which and where."""


@dataclass
class Fingerprint:
    """The running record of one group's collectives.

    Attributes:
        every: compare at step 0 and every ``every`` steps (>= 1).
        seq: collectives recorded so far.
        digest: BLAKE2b (16 bytes) of every record so far, chained.
        log: records ``(seq, op, elements, element_size)`` since the last check that agreed.
        steps: :func:`check` calls so far.
        timeout_s: how long a check waits for the other ranks before naming those that did not arrive.
        session: which :func:`enable` of this group this is (every rank counts the same), so that the store
            keys of an earlier session on the same process group are never read as this one's.
    """

    every: int = 50
    timeout_s: float = 60.0
    seq: int = 0
    digest: bytes = b""
    log: list = field(default_factory=list)
    steps: int = 0
    session: int = 0

    def record(self, kind: str, numel: int, element_size: int) -> None:
        """Called by every collective of the group (:meth:`tensorpar.comm.CommCounter.record`)."""
        self.seq += 1
        rec = (self.seq, kind, int(numel), int(element_size))
        self.digest = hashlib.blake2b(self.digest + repr(rec).encode(), digest_size=16).digest()
        self.log.append(rec)


def enable(group: Group, every: int = 50, *, timeout_s: float = 60.0) -> Fingerprint:
    """Switch fingerprints on for ``group`` (every rank must do the same); returns the :class:`Fingerprint`.

    ``timeout_s``: how long a check waits for the other ranks (keep it below the collective timeout, so that
    the rank that reached the check names the ones that did not). Raises ValueError for ``every`` < 1 or a
    ``timeout_s`` that is not positive."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"fingerprint check interval every={every!r} must be a positive integer (steps)")
    if not timeout_s > 0:
        raise ValueError(f"fingerprint check timeout_s={timeout_s!r} must be a positive number of seconds")
    session = getattr(group.counter, "fingerprint_sessions", 0) + 1
    group.counter.fingerprint_sessions = session
    fp = Fingerprint(every=every, timeout_s=float(timeout_s), session=session)
    group.counter.fingerprint = fp
    return fp


def disable(group: Group) -> None:
    """Switch fingerprints off for ``group`` (its records are dropped); a no-op when they are off."""
    group.counter.fingerprint = None


def enable_from_env(group: Group, every: int = 50) -> Fingerprint | None:
    """:func:`enable` when ``TENSORPAR_CHECK_COLLECTIVES`` is ``1`` (``0`` or unset: off). Raises ValueError for
    another value."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"{ENV}={v!r}: use 1 (check collectives) or 0 / unset (off)")
    return enable(group, every) if v == "1" else None


def input_hash(x: Any) -> str:
    """A short hash of an input: a tensor (its dtype, shape and bytes), or anything with a stable ``repr``."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(x).encode())
    return h.hexdigest()


def _store_key(group: Group, session: int, step: int, phase: str, rank: int) -> str:
    import torch.distributed as dist
    first = min(dist.get_process_group_ranks(group.pg))  # tells apart groups of the same axis (3D meshes)
    return f"tensorpar-fp/{group.name}/{first}/{session}/{step}/{phase}/{rank}"


def _exchange(obj, group: Group, fp: "Fingerprint", step: int, phase: str) -> list:
    """Every rank's ``obj`` through the process group's store (not a collective: a rank that is stuck in a
    collective the others did not issue cannot block it forever). Raises CollectiveMismatch naming the ranks
    that did not arrive within ``fp.timeout_s``."""
    import json
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    keys = [_store_key(group, fp.session, step, phase, r) for r in range(group.size)]
    store.set(keys[group.rank], json.dumps(obj))  # JSON: nothing read back is unpickled
    try:
        store.wait(keys, timedelta(seconds=fp.timeout_s))
    except Exception:  # the store's timeout (DistStoreError / RuntimeError, by torch version)
        here = [r for r in range(group.size) if store.check([keys[r]])]
        gone = [r for r in range(group.size) if r not in here]
        last = ", ".join(f"#{r[0]} {_describe(r)}" for r in fp.log[-3:]) or "none since the last check"
        raise CollectiveMismatch(
            f"{group.name} rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} did not reach the collective "
            f"check at step {step} within {fp.timeout_s:g} s, while rank{'s' if len(here) > 1 else ''} "
            f"{', '.join(map(str, here))} did after {fp.seq} collectives (last here: {last}); the missing ranks are "
            f"blocked in a collective the others did not issue (a skipped or extra collective) or hung") from None
    out = [json.loads(store.get(k)) for k in keys]
    if step >= 2 * fp.every:  # every rank has read the keys of two checks ago (it posted the next ones after)
        try:
            store.delete_key(_store_key(group, fp.session, step - 2 * fp.every, phase, group.rank))
        except Exception:
            pass
    return out


def _sides(values: list) -> str:
    by: dict = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(r)
    return " vs ".join(f"ranks {rs}" if len(rs) > 1 else f"rank {rs[0]}" for rs in by.values())


def _describe(rec) -> str:
    if rec is None:
        return "no collective (it skipped one)"
    seq, kind, numel, es = rec
    return f"{kind} of {numel} elements x {es} bytes"


def check(group: Group, inputs: dict[str, Any] | None = None, *, force: bool = False) -> bool:
    """Compare fingerprints (and ``inputs``) across the ranks of ``group``; a no-op when fingerprints are off.

    Args:
        group: the group (fingerprints switched on by :func:`enable` on every rank).
        inputs: named inputs that must be identical on every rank (``{"prompt": ids, "seed": 0}``).
        force: compare now, whatever the step.

    Returns True when a comparison ran (step 0, every ``every`` steps, or ``force``), False otherwise.
    Communication: no collective; one exchange through the process group's store when it compares (a second one,
    with the records since the last check, when hashes differ), waiting at most ``timeout_s``.

    Raises:
        CollectiveMismatch: an input differs (its name and the ranks on each side), or the collective records
            differ (the first differing collective: sequence number, what each rank issued, the ranks).
    """
    fp = getattr(group.counter, "fingerprint", None)
    if fp is None:
        return False
    step = fp.steps
    fp.steps += 1
    if group.size == 1 or not (force or step % fp.every == 0):
        return False
    hashes = {k: input_hash(v) for k, v in sorted((inputs or {}).items())}
    mine = (fp.seq, fp.digest.hex(), hashes)
    every = _exchange(mine, group, fp, step, "hash")
    for k in hashes:
        vals = [e[2].get(k) for e in every]
        if len(set(vals)) > 1:
            raise CollectiveMismatch(f"input {k!r} differs across {group.name} ranks at step {step}: "
                                     f"{_sides(vals)} were given different values")
    if len({(e[0], e[1]) for e in every}) == 1:
        fp.log.clear()
        return True
    logs = [[tuple(r) for r in x] for x in _exchange(fp.log, group, fp, step, "log")]
    n = max(len(x) for x in logs)
    for i in range(n):
        recs = [x[i] if i < len(x) else None for x in logs]
        if len({None if r is None else r[1:] for r in recs}) > 1:
            seq = next(r[0] for r in recs if r is not None)
            by: dict[str, list[int]] = {}
            for rank, r in enumerate(recs):
                by.setdefault(_describe(r), []).append(rank)
            detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}" for d, rs in by.items())
            raise CollectiveMismatch(f"{group.name} ranks issued different collectives at step {step}: collective "
                                     f"#{seq} differs ({detail}); a rank skipped, reordered or changed a "
                                     f"collective")
    raise CollectiveMismatch(f"{group.name} ranks' collective fingerprints differ at step {step} "
                             f"({_sides([(e[0], e[1]) for e in every])}) before the last agreed check")
