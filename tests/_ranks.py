"""Run a job at a tp degree: in this process for tp = 1, on a pool of gloo ranks otherwise."""
from tensorpar.parallel import ParallelContext


def run_tp(pools, tp: int, fn, *args):
    if tp == 1:
        return [fn(ParallelContext.single(), *args)]
    return pools(tp).run(fn, *args)
