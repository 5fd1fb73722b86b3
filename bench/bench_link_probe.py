"""Why a small gloo all-reduce between two namespace hosts costs milliseconds (issue 23.5): ``bench/link_probe.py``
on two ranks over loopback (one host, ``torchrun --standalone``) and across two namespace hosts
(:mod:`tensorpar.nshosts`, needs root) with no rate cap and at 1 and 10 Gbit/s, optionally each rank pinned to a
core (``--pin``) or at SCHED_FIFO priority (``--fifo``, a few seconds), and the tbf queue's statistics after.

    sudo .venv/bin/python bench/bench_link_probe.py [--configs lo,none,1gbit,10gbit] [--rounds 2]

Writes ``bench/results/link_probe.{json,md}`` (``--out``) with the load averages.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_model  # noqa: E402

from tensorpar.nshosts import NamespaceHosts  # noqa: E402

JOB = str(ROOT / "bench" / "link_probe.py")


def env(**kw) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **kw)


def run_config(config: str, flags: list[str], calls: int) -> dict:
    """One probe: ``config`` "lo" (loopback, one host) or a namespace link rate ("none": no cap)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "probe.json")
        cmd = [JOB, "--calls", str(calls), "--out", out, *flags]
        tc = ""
        if config == "lo":
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", *cmd], capture_output=True, text=True, env=env(GLOO_SOCKET_IFNAME="lo"),
                               timeout=600)
            res = [(r.returncode, r.stdout, r.stderr)]
        else:
            with NamespaceHosts(2, None if config == "none" else config) as h:
                res = h.run_torchrun(cmd, nproc=1, timeout_s=600, env=env())
                tc = "\n".join(subprocess.run(["tc", "-n", x.netns, "-s", "qdisc", "show", "dev", "eth0"],
                                              capture_output=True, text=True).stdout for x in h.hosts)
        if any(rc for rc, _, _ in res):
            raise RuntimeError(f"probe {config} {flags} failed: " + " | ".join(e[-2000:] for _, _, e in res))
        data = json.loads(Path(out).read_text())
        data["tc"] = tc
        return data


def table(runs: list[dict]) -> list[str]:
    """One markdown row per (config, flags, mode): medians over rounds of each rank-mean."""
    lines = ["| link | flags | size (B) | mode | inside median (us) | inside mean | net mean (exchange) | "
             "skew mean (waiting for the other rank) | added to a step (us) | run-queue wait per call (us, all "
             "threads / calling thread) | CPU per call (us) | vol. ctx switches per call |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    keys = []
    for r in runs:
        for name in r["summary"]:
            k = (r["config"], " ".join(r["flags"]), name)
            if k not in keys:
                keys.append(k)
    for config, flags, name in keys:
        same = [r for r in runs if r["config"] == config and " ".join(r["flags"]) == flags]
        size, mode = name.split(":")
        if mode == "compute":
            continue

        def med(f):
            vals = [f(r) for r in same if name in r["summary"]]
            vals = [v for v in vals if v == v]
            return statistics.median(vals) if vals else float("nan")

        def both(field):
            return med(lambda r: statistics.fmean(r["summary"][name][f"r{k}"].get(field, float("nan"))
                                                  for k in (0, 1)))
        added = float("nan")
        stepped = mode in ("step", "gather_step", "mesh_step", "mesh_gather_step")
        if stepped and f"{size}:compute" in same[0]["summary"]:
            added = med(lambda r: statistics.fmean(r["summary"][name][f"r{k}"]["wall_per_call"]
                                                   - r["summary"][f"{size}:compute"][f"r{k}"]["wall_per_call"]
                                                   for k in (0, 1)))
        lines.append(f"| {config} | {flags} | {int(size):,} | {mode} | {both('inside_med'):.0f} | "
                     f"{both('inside_mean'):.0f} | {both('net_mean'):.0f} | {both('skew_mean'):.0f} | "
                     f"{'' if added != added else f'{added:.0f}'} | {both('wait_per_call'):.0f} / "
                     f"{both('main_wait_per_call'):.0f} | {both('cpu_per_call'):.0f} | {both('nvcsw_per_call'):.1f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="lo,none,1gbit,10gbit")
    ap.add_argument("--variants", default="plain", help="comma list of plain, pin, fifo, cols=N")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="link_probe")
    args = ap.parse_args(argv)
    def flags_of(v: str) -> list[str]:   # plain, pin, fifo, cols=N (the matmul between two calls of a step)
        return [] if v == "plain" else [f"--{v.split('=')[0]}", *v.split("=")[1:]]
    load_before = os.getloadavg()
    runs = []
    for rnd in range(args.rounds):   # interleaved: load drift hits every configuration
        for config in args.configs.split(","):
            for v in args.variants.split(","):
                r = run_config(config, flags_of(v), args.calls)
                r.update(config=config, flags=flags_of(v), round=rnd, load_after=os.getloadavg()[0])
                runs.append(r)
                print(json.dumps({"config": config, "variant": v, "round": rnd, "load": r["load_after"]}),
                      file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "commit": commit, "rounds": args.rounds, "calls": args.calls,
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "runs": runs}, separators=(",", ":"))
                                                 + "\n")
    sockets = runs[-1]["sockets"][0]
    md = [f"# Where a small gloo all-reduce's time goes: two ranks, loopback and namespace hosts — {meta['date']}", "",
          f"CPU: {meta['cpu']} ({meta['cpus']} cores), commit {commit}; load average before "
          f"{meta['loadavg_before']}, after {meta['loadavg_after']}; per run: "
          + ", ".join(f"{r['config']}{'+' + ' '.join(r['flags']) if r['flags'] else ''} {r['load_after']:.1f}"
                      for r in runs) + ".", "",
          f"`bench/link_probe.py`, {args.calls} calls per mode, {args.rounds} round(s) interleaved, the median over "
          "rounds of the two ranks' mean. Modes: barrier1 (a barrier, then one all-reduce: link_job.py's method), "
          "b2b (back to back), step (a one-row matmul [1, 576] x [576, 3072], then the all-reduce, as decode "
          "alternates them; 'added to a step' = (step - the matmuls alone) / calls), gather_step (the same with an "
          "all-gather), pingpong (gloo send/recv, one round trip), raw (a TCP_NODELAY socket ping-pong in the "
          "calling thread, one round trip), mesh_b2b / mesh_step / mesh_gather_step (b2b / step / gather_step "
          "through tensorpar's TCP mesh, tensorpar/comm/tcp.py: what the leaders of the hierarchical all-reduce "
          "use between hosts). 'net' = exit - the later rank's entry; 'skew' = the later entry - "
          "own entry (one clock: CLOCK_MONOTONIC is shared by the namespaces). Run-queue wait: "
          "/proc/self/task/*/schedstat (time runnable, not running).", ""]
    md += table(runs)
    md += ["", "Per thread of rank 0, first round of each link (threads with > 1 us CPU per call): name, CPU us per "
           "call, run-queue wait us per call, voluntary context switches per call:", ""]
    seen = set()
    for r in runs:
        key = (r["config"], " ".join(r["flags"]))
        if key in seen:
            continue
        seen.add(key)
        for name in r["summary"]:
            if name.endswith((":b2b", ":step")) and name.startswith(str(min(int(n.split(":")[0])
                                                                                for n in r["summary"]))):
                md.append(f"* {key[0]} {key[1]} {name}: " + "; ".join(
                    f"{t[0]} {t[1]:g} / {t[2]:g} / {t[3]:g}" for t in r["summary"][name]["r0"].get("by_thread", [])))
    md += ["", "gloo's connected sockets (rank 0, last run): " + "; ".join(
        f"TCP_NODELAY={s['nodelay']}, srtt {s['rtt_us']} us, ato {s['ato_us']} us" for s in sockets), ""]
    tcs = [r["tc"] for r in runs if r["tc"]]
    if tcs:
        md += ["tbf statistics after the last namespace run (each host's eth0):", "", "```", tcs[-1].strip(), "```",
               ""]
    (args.out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
