"""The console report of ``tensorpar plan --calibrate`` (:func:`print_calibration`)."""
from __future__ import annotations


def print_calibration(result) -> None:
    """Print a :class:`~tensorpar.planner.calibrate.Calibration` as ``tensorpar plan --calibrate`` shows it: the
    matmul rates, copy bandwidth, all-reduce fits per backend, the AdamW step and the pipeline's link."""
    from tensorpar.planner.report import console

    con = console()
    con.print(f"[bold]matmul[/bold] on {result.backend}:")
    for m in result.matmul:
        con.print(f"  n={m['n']:>5} {m['dtype']}: {m['tflops']:.3f} TFLOP/s")
    con.print(f"[bold]memory bandwidth[/bold] (copy, read + write): {result.device['hbm_gbps']:.1f} GB/s")
    c = result.collective
    con.print(f"[bold]all-reduce[/bold] on {result.device['local_link_label']}: "
              f"latency {c['latency_us']:.1f} us, bandwidth {c['bandwidth_gbps']:.2f} GB/s")
    for s in c["samples"]:
        con.print(f"  {s['bytes']:>9} B: {s['seconds'] * 1e6:9.1f} us")
    shm = c.get("by_backend", {}).get("shm")
    if shm:
        con.print(f"[bold]all-reduce[/bold] over tensorpar's shared-memory collectives (2 processes, not in the device "
                  f"file's link): latency {shm['latency_us']:.1f} us, bandwidth {shm['bandwidth_gbps']:.2f} GB/s")
    con.print(f"[bold]AdamW step[/bold] (torch, fp32): {result.device['optimizer_ns_per_param']:.2f} ns per parameter")
    pipe = result.pipeline
    if pipe:
        con.print(f"[bold]pipeline[/bold] (2 gloo processes): send/recv latency {pipe['p2p_latency_us']:.1f} us, "
                  f"bandwidth {pipe['p2p_bandwidth_gbps']:.2f} GB/s (0: not resolved); CPU of one send or "
                  f"receive of the 1F1B schedule {pipe['pipeline_p2p_op_cpu_us'] / 1e3:.2f} ms "
                  f"({pipe['pipeline_p2p_op_cpu_shared_us'] / 1e3:.2f} ms with {pipe['pipeline_shared_ranks']} ranks "
                  f"on the cores)")
    con.print("NVLink and inter-node links: not measured (the device file leaves them 0 and plans every group "
              "on the local link). Save the 'device' object of --calibrate --json to a file and plan with "
              "--device-file FILE (its peak is the measured matmul rate, matmul_efficiency 1).")
