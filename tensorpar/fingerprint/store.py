"""The store side channel of collective fingerprints: how the ranks compare without a collective.

Each rank posts its position and record under keys of the process group's key-value store, as JSON
(:func:`_wait`), and reads the others'; a rank whose posted position shows that it will not come (its program
parted from this one's, :func:`_parted`) is named at once in a :class:`CollectiveMismatch`, a late one after the
timeout. :func:`_sync_collective` is the per-collective comparison that :class:`~tensorpar.fingerprint.
Fingerprint` runs before every ``sync_every``-th collective.
"""
from __future__ import annotations

import bisect
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorpar.comm import Group
    from tensorpar.fingerprint import Fingerprint


class CollectiveMismatch(RuntimeError):
    """tp ranks issued different collectives, or were given different inputs; the message names which and where."""


def _prefix(group: Group, session: int) -> str:
    import torch.distributed as dist
    first = min(dist.get_process_group_ranks(group.pg))  # tells apart groups of the same axis (3D meshes)
    return f"tensorpar-fp/{group.name}/{first}/{session}"


def _store():
    from torch.distributed import distributed_c10d as c10d
    return c10d._get_default_store()


def _describe(rec) -> str:
    if rec is None:
        return "no collective (it skipped one)"
    _, kind, numel, es, site = rec
    return f"{kind} of {numel} elements x {es} bytes in {site}"


def _where(pos: dict) -> str:
    """A rank's position, as posted before a wait, in words."""
    if pos["at"] == "collective":
        return f"collective #{pos['done'] + 1} ({_describe(pos['rec'])}) at step {pos['steps']}"
    last = f" (last: #{pos['rec'][0]} {_describe(pos['rec'])})" if pos.get("rec") else ""
    return f"the end of step {pos['steps']} after {pos['done']} collectives{last}"


def _parted(fp: Fingerprint, here: dict, peer: dict) -> bool:
    """Whether ``peer``'s last posted position cannot lie on this rank's path up to ``here``: the ranks' programs
    parted (a skipped, extra or reordered collective, or a check at another point). A position on the path
    behind ``here`` is a peer still on its way."""
    d, t, a = peer["done"], peer["steps"], peer["at"]
    if d > here["done"] or t > here["steps"]:
        return True
    if (d, t) == (here["done"], here["steps"]):
        return a != here["at"]
    if a == "step":
        return not (t < len(fp.step_seqs) and fp.step_seqs[t] == d)
    return bisect.bisect_right(fp.step_seqs, d) != t  # checks done before its collective #d+1, on this path


def _wait(fp: Fingerprint, key: str, here: dict, *, ring: bool = False) -> list:
    """Post ``here`` (this rank's position and record) under ``key``/rank and return every rank's, waiting at most
    ``fp.timeout_s``. While waiting, raise :class:`CollectiveMismatch` as soon as another rank's position shows
    that it will not come (it is at another point of the program).

    ``ring``: ``key`` is one of two slots used in turn (the per-collective comparisons), which may still hold a
    rank's comparison before last: a value counts once its ``done`` is this one's. No slot is ever deleted (one
    store write and one read per comparison when the ranks arrive together)."""
    group, store = fp.group, _store()
    base = fp.prefix
    value = json.dumps(here)
    store.multi_set([f"{base}/{key}/{group.rank}", f"{base}/pos/{group.rank}"], [value, value])
    keys = [f"{base}/{key}/{r}" for r in range(group.size)]

    def ready() -> list | None:
        if not (ring and key in fp.slots_seen) and not store.check(keys):
            return None
        got = [json.loads(v) for v in store.multi_get(keys)]
        if ring:
            fp.slots_seen.add(key)
            if any(e["done"] != here["done"] for e in got):  # a slot not yet written for this comparison
                return None
        return got

    start = time.monotonic()
    deadline, next_look, pause = start + fp.timeout_s, start + 0.02, 0.0
    while (got := ready()) is None:
        now = time.monotonic()
        if now >= next_look or now >= deadline:
            next_look = now + 0.05
            others = [r for r in range(group.size) if r != group.rank]
            pos = {r: json.loads(store.get(f"{base}/pos/{r}")) for r in others if store.check([f"{base}/pos/{r}"])}
            if (got := ready()) is not None:
                break
            gone = [r for r, p in pos.items() if _parted(fp, here, p)]
            if gone or now >= deadline:
                me = f"rank {group.rank} {'at' if gone else 'is at'} {_where(here)}"
                if gone:
                    there = "; ".join(f"rank {r} is at {_where(pos[r])}" for r in gone)
                    raise CollectiveMismatch(f"{group.name} ranks parted: {there}, {me}; a rank skipped, reordered or "
                                             f"added a collective")
                late = [r for r in others if pos.get(r, {}).get("done") != here["done"]
                        or pos[r].get("steps") != here["steps"] or pos[r].get("at") != here["at"]]
                s_ = "s" if len(late) > 1 else ""
                there = "; ".join(f"rank {r} was last at " + (_where(pos[r]) if r in pos else "no check")
                                  for r in late)
                raise CollectiveMismatch(f"{group.name} rank{s_} {', '.join(map(str, late))} did not arrive within "
                                         f"{fp.timeout_s:g} s: {there}; {me}; the missing rank{s_} "
                                         f"{'are' if s_ else 'is'} blocked in a collective the others did not issue "
                                         f"(a skipped or extra collective) or hung")
        pause = min(0.002, pause * 2 or 0.0001)
        time.sleep(pause)
    return got


def _forget(fp: Fingerprint, key: str) -> None:
    try:
        _store().delete_key(f"{fp.prefix}/{key}/{fp.group.rank}")
    except Exception:  # an old key of this rank that is gone already: nothing to do
        pass


def _sync_collective(fp: Fingerprint, rec) -> None:
    """Compare, across the ranks, the collective about to run (``rec``) and the hash up to it; raise
    :class:`CollectiveMismatch` naming what each rank is about to issue when they differ."""
    here = {"at": "collective", "done": fp.seq - 1, "steps": fp.steps, "rec": list(rec), "digest": fp.digest.hex()}
    # two slots in turn: a rank posting comparison n has seen every rank's n - 1, so no rank still reads n - 2
    every = _wait(fp, f"c/{(fp.seq // fp.sync_every) % 2}", here, ring=True)
    mine = (here["steps"], tuple(rec[1:]), here["digest"])
    if all((e["steps"], tuple(e["rec"][1:]), e["digest"]) == mine for e in every):
        return
    by: dict[str, list[int]] = {}
    for r, e in enumerate(every):
        by.setdefault(f"{_describe(e['rec'])} at step {e['steps']}", []).append(r)
    if len(by) == 1:  # the same collective now, different ones before (sync_every > 1)
        raise CollectiveMismatch(f"{fp.group.name} ranks' collective fingerprints differ before collective #{fp.seq} "
                                 f"({_sides([e['digest'] for e in every])}); a rank skipped, reordered or changed a "
                                 f"collective in the last {fp.sync_every}")
    detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}" for d, rs in by.items())
    raise CollectiveMismatch(f"{fp.group.name} ranks are about to issue different collectives: #{fp.seq} ({detail}); "
                             f"a rank skipped, reordered or changed a collective")


def _sides(values: list) -> str:
    by: dict = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(r)
    return " vs ".join(f"ranks {rs}" if len(rs) > 1 else f"rank {rs[0]}" for rs in by.values())
