"""Collective fingerprints: a debug mode in which skipped, reordered or mismatched collectives and divergent
inputs across tp ranks become named errors instead of silently wrong results or a collective timeout.

With fingerprints on for a :class:`~tensorpar.comm.Group` (:func:`enable`, or ``TENSORPAR_CHECK_COLLECTIVES=1``
read by :func:`enable_from_env`), every collective of that group records ``(sequence number, op, elements,
element size, call site)`` into a running BLAKE2b hash held by the group (``group.counter.fingerprint``; no
module state). The call site is the qualified name of the module that issued the collective
(``model.layers.3.mlp.down_proj``; forward hooks on every module of the ``model`` given to :func:`enable`), with
`` backward`` appended for a collective of tensorpar's autograd collectives run in backward; outside any module,
the autograd node running it (``backward (_ColumnLinearsBackward)``) or the calling function
(``tensorpar/generate/__init__.py:generate_tokens``).

Two comparisons, both through the process group's key-value store (not a collective: a rank blocked in a
collective the others did not issue cannot block them), as JSON (nothing read back is unpickled):

* before every ``sync_every``-th collective (default every one), each rank posts that collective's record and
  its running hash and waits for the others' (at most ``timeout_s``). Ranks that are about to issue different
  collectives (another op, size or call site: a reordered layer) or that parted earlier are named before the
  collective runs: ``tp ranks are about to issue different collectives: #N: rank 0: all_reduce of 64 elements x
  4 bytes in model.layers.0.mlp; rank 1: ... in model.layers.1.mlp``. While it waits, a rank reads where the
  others are (each rank posts its position before every wait): a rank that skipped a collective is at a later
  point of its program (the end of the step, or a collective of the next one) and is named at once, ``rank 1 is
  at the end of step 1 after 3 collectives, rank 0 at collective #4 (all_reduce ... in model.layers.1.mlp)``,
  without waiting for any timeout;
* :func:`check` (call it once per step: a decode step, a training step) compares, at step 0 and every ``every``
  steps, the hashes and the inputs the caller names (prompt token ids, the training batch, the sampling seed),
  and names the divergent input or the first differing collective.

Cost: nothing when fingerprints are off (one ``is None`` test per collective). On: one hash update per collective
(a few microseconds), and per synchronised collective a few store round trips (tens to hundreds of microseconds
on one host); ``sync_every=0`` keeps only the per-step comparison. The per-collective comparisons take turns
between two store slots per rank; the per-step keys older than two checks are deleted.

The store side channel (posting, waiting, naming the ranks that parted) is in :mod:`.store`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from tensorpar.comm import Group
from tensorpar.fingerprint.store import (CollectiveMismatch, _describe, _forget, _prefix, _sides, _store,
                                         _sync_collective, _wait)


ENV = "TENSORPAR_CHECK_COLLECTIVES"


_COMM_DIR = os.path.join("tensorpar", "comm")  # the package tensorpar/comm/: every frame of a collective


_HERE = os.path.join("tensorpar", "fingerprint")  # the package tensorpar/fingerprint/


@dataclass(eq=False)
class Fingerprint:
    """The running record of one group's collectives.

    Attributes:
        every: compare at step 0 and every ``every`` steps (>= 1).
        timeout_s: how long a comparison waits for the other ranks before naming those that did not arrive.
        sync_every: compare before every ``sync_every``-th collective (0: only in :func:`check`).
        group: the group it records.
        seq: collectives recorded so far.
        digest: BLAKE2b (16 bytes) of every record so far, chained.
        log: records ``(seq, op, elements, element_size, site)`` since the last check that agreed.
        steps: :func:`check` calls so far.
        step_seqs: ``seq`` at each :func:`check` call (where this rank's steps ended).
        session: which :func:`enable` of this group this is (every rank counts the same), so that the store
            keys of an earlier session on the same process group are never read as this one's.
        sites: the stack of modules running now (qualified names; forward hooks push and pop).
        hooks: the hook handles on the model (removed by :func:`disable`).
        unsynced: > 0 inside :func:`unsynced` (collectives recorded and hashed, not compared one by one).
        prefix: the store keys' prefix (group, its first global rank, session).
        slots_seen: the per-collective slots that every rank has written once (read without a presence check).
    """

    every: int = 50
    timeout_s: float = 60.0
    sync_every: int = 1
    group: Any = None
    seq: int = 0
    digest: bytes = b""
    log: list = field(default_factory=list)
    steps: int = 0
    step_seqs: list = field(default_factory=list)
    session: int = 0
    sites: list = field(default_factory=list)
    hooks: list = field(default_factory=list)
    unsynced: int = 0
    prefix: str = ""
    slots_seen: set = field(default_factory=set)

    def site(self) -> str:
        """Where the collective being recorded comes from (see the module docstring)."""
        if self.sites:
            return self.sites[-1]
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward ({node.name()})"
        f = sys._getframe(1)
        while f is not None and (os.path.dirname(f.f_code.co_filename).endswith(_COMM_DIR)
                                 or os.path.dirname(f.f_code.co_filename).endswith(_HERE)):
            f = f.f_back
        if f is None:
            return "?"
        path = f.f_code.co_filename
        i = path.rfind("tensorpar" + os.sep)
        return f"{path[i:] if i >= 0 else os.path.basename(path)}:{f.f_code.co_name}"

    def record(self, kind: str, numel: int, element_size: int) -> None:
        """Called by every collective of the group (:meth:`tensorpar.comm.CommCounter.record`), before it runs."""
        self.seq += 1
        rec = (self.seq, kind, int(numel), int(element_size), self.site())
        self.digest = hashlib.blake2b(self.digest + repr(rec).encode(), digest_size=16).digest()
        self.log.append(rec)
        if (self.sync_every and not self.unsynced and self.seq % self.sync_every == 0 and self.group is not None
                and self.group.size > 1):
            _sync_collective(self, rec)


def enable(group: Group, every: int = 50, *, timeout_s: float = 60.0, model: torch.nn.Module | None = None,
           sync_every: int = 1) -> Fingerprint:
    """Switch fingerprints on for ``group`` (every rank must do the same); returns the :class:`Fingerprint`.

    ``timeout_s``: how long a comparison waits for the other ranks (keep it below the collective timeout, so that
    a rank names the ones that did not arrive). ``model``: the module whose submodules' qualified names are the
    call sites (forward pre-hooks and hooks on every submodule, removed by :func:`disable`); without it the
    call site is the calling function. ``sync_every``: compare before every ``sync_every``-th collective (1:
    every collective, so that a reordered or skipped one is named before it runs; 0: only in :func:`check`).

    Raises ValueError for ``every`` < 1, a ``timeout_s`` that is not positive, or a negative ``sync_every``."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"fingerprint check interval every={every!r} must be a positive integer (steps)")
    if not timeout_s > 0:
        raise ValueError(f"fingerprint check timeout_s={timeout_s!r} must be a positive number of seconds")
    if not isinstance(sync_every, int) or sync_every < 0:
        raise ValueError(f"fingerprint sync_every={sync_every!r} must be 0 (per step only) or a positive integer "
                         f"(collectives)")
    disable(group)
    session = getattr(group.counter, "fingerprint_sessions", 0) + 1
    group.counter.fingerprint_sessions = session
    fp = Fingerprint(every=every, timeout_s=float(timeout_s), sync_every=sync_every, group=group, session=session,
                     prefix=_prefix(group, session) if group.size > 1 else "")
    if model is not None:
        for name, mod in model.named_modules():
            fp.hooks.append(mod.register_forward_pre_hook(_push(fp, name or type(mod).__name__)))
            fp.hooks.append(mod.register_forward_hook(_pop(fp), always_call=True))
    group.counter.fingerprint = fp
    return fp


@contextlib.contextmanager
def unsynced(group: Group) -> Iterator[None]:
    """Inside the block, the group's collectives are recorded and hashed (compared at the next :func:`check`) but
    not compared one by one: for a collective that a rank may wait in for as long as it likes (a server's ranks
    waiting for the next request's broadcast), where the per-collective comparison's ``timeout_s`` would end an
    idle run. A no-op when fingerprints are off."""
    fp = getattr(group.counter, "fingerprint", None)
    if fp is None:
        yield
        return
    fp.unsynced += 1
    try:
        yield
    finally:
        fp.unsynced -= 1


def _push(fp: Fingerprint, name: str):
    def hook(mod, args):
        fp.sites.append(name)
    return hook


def _pop(fp: Fingerprint):
    def hook(mod, args, out):
        if fp.sites:
            fp.sites.pop()
    return hook


def disable(group: Group) -> None:
    """Switch fingerprints off for ``group`` (its records and model hooks are dropped); a no-op when off."""
    fp = getattr(group.counter, "fingerprint", None)
    if fp is not None:
        for h in fp.hooks:
            h.remove()
        fp.hooks.clear()
    group.counter.fingerprint = None


def enable_from_env(group: Group, every: int = 50, *, model: torch.nn.Module | None = None) -> Fingerprint | None:
    """:func:`enable` when ``TENSORPAR_CHECK_COLLECTIVES`` is ``1`` (``0`` or unset: off). Raises ValueError for
    another value."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"{ENV}={v!r}: use 1 (check collectives) or 0 / unset (off)")
    return enable(group, every, model=model) if v == "1" else None


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


def check(group: Group, inputs: dict[str, Any] | None = None, *, force: bool = False) -> bool:
    """Compare fingerprints (and ``inputs``) across the ranks of ``group``; a no-op when fingerprints are off.

    Args:
        group: the group (fingerprints switched on by :func:`enable` on every rank).
        inputs: named inputs that must be identical on every rank (``{"prompt": ids, "seed": 0}``).
        force: compare now, whatever the step.

    Returns True when a comparison ran (step 0, every ``every`` steps, or ``force``), False otherwise.
    Communication: no collective; one exchange through the process group's store when it compares (a second one,
    with the records since the last check, when hashes differ), waiting at most ``timeout_s``; with
    ``sync_every`` on, one store write per call (this rank's position) otherwise.

    Raises:
        CollectiveMismatch: an input differs (its name and the ranks on each side), the collective records
            differ (the first differing collective: sequence number, what each rank issued, the ranks), or another
            rank is at another point of its program (where each rank is).
    """
    fp = getattr(group.counter, "fingerprint", None)
    if fp is None:
        return False
    step = fp.steps
    here = {"at": "step", "done": fp.seq, "steps": step, "rec": list(fp.log[-1]) if fp.log else None}
    fp.steps += 1
    fp.step_seqs.append(fp.seq)
    if group.size == 1:
        return False
    if not (force or step % fp.every == 0):
        if fp.sync_every:  # where this rank is, for a peer waiting at a collective it will not reach
            _store().set(f"{fp.prefix}/pos/{group.rank}", json.dumps(here))
        return False
    here["inputs"] = {k: input_hash(v) for k, v in sorted((inputs or {}).items())}
    here["digest"] = fp.digest.hex()
    every = _wait(fp, f"s/{step}/hash", here)
    if step >= 2 * fp.every:  # every rank has read the keys of two checks ago (it posted the next ones after)
        _forget(fp, f"s/{step - 2 * fp.every}/hash")
        _forget(fp, f"s/{step - 2 * fp.every}/log")
    for k in here["inputs"]:
        vals = [e["inputs"].get(k) for e in every]
        if len(set(vals)) > 1:
            raise CollectiveMismatch(f"input {k!r} differs across {group.name} ranks at step {step}: "
                                     f"{_sides(vals)} were given different values")
    if len({(e["done"], e["digest"]) for e in every}) == 1:
        fp.log.clear()
        return True
    logs = [[tuple(r) for r in e["log"]] for e in _wait(fp, f"s/{step}/log", dict(here, log=fp.log))]
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
                             f"({_sides([(e['done'], e['digest']) for e in every])}) before the last agreed check")
