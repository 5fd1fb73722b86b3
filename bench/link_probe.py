"""Where a small gloo all-reduce's time goes between two ranks (issue 23.5's diagnosis; a torchrun job, 2 ranks,
driven by ``bench/bench_link_probe.py``). Rank 0 writes ``--out`` (JSON) and prints a summary.

For each message size, ``--calls`` calls of each mode, every call's entry and exit time recorded on both ranks
(``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process of this machine, namespace hosts included, so
the two ranks' times compare directly):

* ``barrier1``: a barrier, then one all-reduce (``bench/link_job.py``'s method);
* ``b2b``: all-reduces back to back;
* ``step``: one 1-thread one-row matmul (``[1, h] x [h, cols]``, about the weights a tp = 2 rank of SmolLM2 reads
  between two decode collectives), then one all-reduce, as a decode step alternates them; and ``compute`` the
  same matmuls without the all-reduce (what a call adds to a step: ``(step - compute) / calls``);
* ``gather_step``: the same with an all-gather of the payload (``--tp-comm int8``'s exchange);
* ``pingpong``: gloo send/recv back to back (a round trip);
* ``raw``: a plain TCP socket (TCP_NODELAY) ping-pong between the ranks' addresses in the calling thread: the
  network path without gloo's threads (a round trip);
* ``mesh_b2b`` / ``mesh_step`` / ``mesh_gather_step``: ``b2b`` / ``step`` / ``gather_step`` through
  :class:`tensorpar.comm.tcp.TcpMesh` (what the hierarchical all-reduce's leaders use across hosts for messages up
  to its ``max_bytes``), built once over the two ranks.

Per call and rank: ``inside`` (exit - entry), ``net`` (exit - the later rank's entry: the exchange itself) and
``skew`` (the later entry - own entry: waiting for the other rank). Per mode and rank, from
``/proc/self/task/*/schedstat`` before and after: CPU time and run-queue wait (time runnable but not running) of the
calling thread and of all the process's threads, per call; context switches (``getrusage``). Also gloo's
connected sockets' options (TCP_NODELAY) and ``TCP_INFO`` (the kernel's smoothed RTT and delayed-ACK timeout).
``--pin``: each rank (and the threads it starts) on its own core. ``--fifo``: SCHED_FIFO priority 1 for the rank
(and its threads; a diagnosis of scheduling delay: a few seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import struct
import time

import torch
import torch.distributed as dist


def sched_threads() -> dict:
    """``{tid: (cpu ns, run-queue wait ns, timeslices, voluntary switches, name)}`` of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                vals = tuple(int(v) for v in f.read().split())
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                vol = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
            out[int(tid)] = (*vals, vol, name)
        except (OSError, StopIteration):
            pass
    return out


def per_thread(before: dict, after: dict, main_tid: int, calls: int) -> list:
    """Threads that ran: ``[name, cpu us per call, run-queue wait us per call, voluntary switches per call]``."""
    rows = []
    for tid, a in sorted(after.items()):
        b = before.get(tid, (0, 0, 0, 0, a[4]))
        cpu = (a[0] - b[0]) / calls / 1e3
        if cpu > 1:
            rows.append(["main" if tid == main_tid else a[4], round(cpu, 1), round((a[1] - b[1]) / calls / 1e3, 1),
                         round((a[3] - b[3]) / calls, 2)])
    return rows


def sched_delta(before: dict, after: dict, main_tid: int) -> dict:
    def tot(d, keys):
        return [sum(d.get(k, (0, 0, 0))[i] for k in keys) for i in range(3)]
    keys = set(before) | set(after)
    a, b = tot(after, keys), tot(before, keys)
    am, bm = tot(after, [main_tid]), tot(before, [main_tid])
    return {"cpu_ns": a[0] - b[0], "wait_ns": a[1] - b[1], "slices": a[2] - b[2],
            "main_cpu_ns": am[0] - bm[0], "main_wait_ns": am[1] - bm[1], "main_slices": am[2] - bm[2],
            "threads": len(after)}


def gloo_sockets() -> list[dict]:
    """TCP_NODELAY and TCP_INFO (rtt, rttvar, ato in us) of this process's connected TCP sockets."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue   # listening
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
            u32 = struct.unpack_from("<17I", info, 8)   # rto ato snd_mss rcv_mss ... rtt(15) rttvar(16)
            out.append({"fd": int(fd), "peer": str(peer[:2]), "nodelay": s.getsockopt(socket.IPPROTO_TCP,
                                                                                     socket.TCP_NODELAY),
                        "rtt_us": u32[15], "rttvar_us": u32[16], "ato_us": u32[1], "rto_us": u32[0]})
        finally:
            os.close(s.detach())
    return out


class Recorder:
    def __init__(self, main_tid: int):
        self.main_tid, self.modes = main_tid, {}

    def run(self, name: str, calls: int, body, warm: int = 5):
        for i in range(warm):
            body(i, None)
        dist.barrier()
        s0, r0, c0 = sched_threads(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        times = []
        for i in range(calls):
            body(i, times)
        wall = time.perf_counter() - c0
        s1, r1 = sched_threads(), resource.getrusage(resource.RUSAGE_SELF)
        self.modes[name] = {"times": times, "wall_s": wall, "calls": calls, "sched": sched_delta(s0, s1, self.main_tid),
                            "threads": per_thread(s0, s1, self.main_tid, calls),
                            "nvcsw": r1.ru_nvcsw - r0.ru_nvcsw, "nivcsw": r1.ru_nivcsw - r0.ru_nivcsw}


def raw_pingpong(rank: int, store, calls: int, nbytes: int) -> list:
    """Plain TCP ping-pong (TCP_NODELAY) between the ranks in this thread: [(entry, exit)] of each round trip."""
    payload = bytes(nbytes)
    addr = socket.gethostbyname(socket.gethostname()) if os.environ.get("GLOO_SOCKET_IFNAME") != "lo" \
        else "127.0.0.1"
    if rank == 0:
        srv = socket.socket()
        srv.bind((addr, 0))
        srv.listen(1)
        store.set(f"probe_raw_{nbytes}", f"{addr}:{srv.getsockname()[1]}")
        conn, _ = srv.accept()
        srv.close()
    else:
        host, port = store.get(f"probe_raw_{nbytes}").decode().rsplit(":", 1)
        conn = socket.create_connection((host, int(port)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)

    def recv_all():
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += conn.recv_into(view[got:])

    out = []
    for i in range(calls + 5):
        t0 = time.perf_counter()
        if rank == 0:
            conn.sendall(payload)
            recv_all()
        else:
            recv_all()
            conn.sendall(payload)
        if i >= 5:
            out.append((t0, time.perf_counter()))
    conn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2304,65536")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--cols", type=int, default=3072, help="matmul columns between two calls of a step")
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--fifo", action="store_true")
    ap.add_argument("--modes", default="barrier1,b2b,compute,step,gather_step,pingpong,raw,mesh_b2b,mesh_step,"
                                      "mesh_gather_step")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    if args.fifo:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    main_tid = __import__("threading").get_native_id()
    rec = Recorder(main_tid)
    modes = args.modes.split(",")
    mesh = None
    if any(m.startswith("mesh_") for m in modes):
        from tensorpar.comm import Group
        from tensorpar.comm.tcp import TcpMesh
        mesh, err = TcpMesh.build(Group.from_pg(dist.group.WORLD, name="probe"), timeout_s=60.0)
        if mesh is None:
            raise SystemExit(f"link_probe: the TCP mesh did not connect: {err}")
    w = torch.randn(args.hidden, args.cols) * 0.01
    x = torch.randn(1, args.hidden)
    result = {"rank": rank, "sizes": {}, "args": vars(args)}
    for size in map(int, args.sizes.split(",")):
        t = torch.ones(size // 4)
        out_g = [torch.empty_like(t) for _ in range(2)]
        res = {}

        def timed(fn):
            def body(i, times):
                t0 = time.perf_counter()
                fn()
                if times is not None:
                    times.append((t0, time.perf_counter()))
            return body

        def stepped(fn):
            def body(i, times):
                torch.mm(x, w)
                if fn is None:
                    if times is not None:
                        times.append((0.0, 0.0))
                    return
                t0 = time.perf_counter()
                fn()
                if times is not None:
                    times.append((t0, time.perf_counter()))
            return body

        def barrier1(i, times):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if times is not None:
                times.append((t0, time.perf_counter()))

        def pingpong():
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        table = {"barrier1": barrier1, "b2b": timed(lambda: dist.all_reduce(t)), "compute": stepped(None),
                 "step": stepped(lambda: dist.all_reduce(t)),
                 "gather_step": stepped(lambda: dist.all_gather(out_g, t)), "pingpong": timed(pingpong)}
        if mesh is not None:
            if t.numel() * 4 > mesh.max_bytes:
                raise SystemExit(f"link_probe: size {size} is over the TCP mesh's max_bytes {mesh.max_bytes}")
            table.update({"mesh_b2b": timed(lambda: mesh.all_reduce(t)),
                          "mesh_step": stepped(lambda: mesh.all_reduce(t)),
                          "mesh_gather_step": stepped(lambda: mesh.all_gather(t, 0, [t.numel()] * 2))})
        for m in modes:
            if m in table:
                rec.run(f"{size}:{m}", args.calls, table[m])
        if "raw" in modes:
            s0 = sched_threads()
            rec.modes[f"{size}:raw"] = {"times": raw_pingpong(rank, dist.distributed_c10d._get_default_store(),
                                                              args.calls, size), "calls": args.calls,
                                        "sched": sched_delta(s0, sched_threads(), main_tid)}
            dist.barrier()
        result["sizes"][size] = res
    result["modes"] = rec.modes
    result["sockets"] = gloo_sockets()
    result["loadavg"] = os.getloadavg()
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(summarize(gathered), f, indent=1)
        print(json.dumps(summarize(gathered)["summary"], indent=1))
    dist.destroy_process_group()


def summarize(ranks: list[dict]) -> dict:
    """Per mode: medians and means over calls, per rank and both, in microseconds."""
    summ = {}
    for name in ranks[0]["modes"]:
        per = [r["modes"][name] for r in ranks]
        calls = per[0]["calls"]
        row = {}
        if not name.endswith((":compute",)):
            t0s = [[a for a, _ in p["times"]] for p in per]
            t1s = [[b for _, b in p["times"]] for p in per]
            for k in range(2):
                inside = [(t1s[k][i] - t0s[k][i]) * 1e6 for i in range(calls)]
                later = [max(t0s[0][i], t0s[1][i]) for i in range(calls)]
                net = [(t1s[k][i] - later[i]) * 1e6 for i in range(calls)]
                skew = [(later[i] - t0s[k][i]) * 1e6 for i in range(calls)]
                row[f"r{k}"] = {"inside_med": statistics.median(inside), "inside_mean": statistics.fmean(inside),
                                "inside_p90": sorted(inside)[int(0.9 * calls)],
                                "net_med": statistics.median(net), "net_mean": statistics.fmean(net),
                                "skew_mean": statistics.fmean(skew)}
        for k in range(2):
            s = per[k]["sched"]
            row.setdefault(f"r{k}", {}).update(
                {"wall_per_call": per[k].get("wall_s", float("nan")) / calls * 1e6,
                 "cpu_per_call": s["cpu_ns"] / calls / 1e3, "wait_per_call": s["wait_ns"] / calls / 1e3,
                 "main_wait_per_call": s["main_wait_ns"] / calls / 1e3, "slices_per_call": s["slices"] / calls,
                 "nvcsw_per_call": per[k].get("nvcsw", 0) / calls, "nivcsw_per_call": per[k].get("nivcsw", 0) / calls,
                 "threads": s["threads"]})
        summ[name] = {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in row.items()}
        for k in range(2):
            summ[name][f"r{k}"]["by_thread"] = per[k].get("threads", [])
    return {"summary": summ, "sockets": [r["sockets"] for r in ranks], "loadavg": [r["loadavg"] for r in ranks],
            "args": {k: v for k, v in ranks[0]["args"].items() if k != "out"}}


if __name__ == "__main__":
    main()
