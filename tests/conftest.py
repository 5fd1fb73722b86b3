"""Shared fixtures: one pool of gloo ranks per world size, started once per test session."""
import pytest

from tensorpar.testing import WorkerPool


@pytest.fixture(scope="session")
def pools():
    made: dict[int, WorkerPool] = {}

    def get(n: int) -> WorkerPool:
        if n not in made:
            made[n] = WorkerPool(n, collective_timeout_s=60.0)
        return made[n]

    yield get
    for p in made.values():
        p.close()
