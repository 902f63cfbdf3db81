import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distpool import DistPool  # noqa: E402

_pools = {}


@pytest.fixture(scope="session")
def pools():
    """pools(R) -> a live gloo DistPool of R ranks, shared by the whole session."""

    def get(world_size: int) -> DistPool:
        pool = _pools.get(world_size)
        if pool is None or pool.broken:
            pool = _pools[world_size] = DistPool(world_size)
        return pool

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
