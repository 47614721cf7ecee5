"""A pool holds what it says: puts that add up to at most 98% of an empty pool all succeed,
whatever their sizes, and Stat's largest_free_bytes says how large the next one may be."""
import random

import numpy as np
import pytest

import tensorshm
from conftest import Daemon

MiB = 1 << 20
PAGE = 4096


def fill(pool: str, segment: str, sizes: list[int], name: str) -> dict:
    """Puts a tensor of each of `sizes` bytes (kept published) into a fresh daemon's pool of
    `pool` bytes grown by segments of at most `segment`; returns Stat after the last put."""
    d = Daemon(name, host_pool=pool, extra_args=("--segment-size", segment))
    try:
        c = tensorshm.connect(d.socket, client_name="fill")
        for i, nbytes in enumerate(sizes):
            data = np.full(nbytes, i % 251, dtype=np.uint8)
            try:
                c.put(f"fill/{i}", data).release()
            except tensorshm.ResourceExhaustedError as e:
                pytest.fail(f"put {i} of {len(sizes)} ({nbytes} bytes, {sum(sizes[:i])} put "
                            f"before it) refused: {e}")
        # Every tensor still holds its own bytes (no two were placed over each other).
        for i, nbytes in enumerate(sizes):
            t = c.get(f"fill/{i}")
            view = np.from_dlpack(t)
            assert view.nbytes == nbytes
            assert view[0] == i % 251 and view[-1] == i % 251
            t.release()
        stat = c.stat()
        c.close()
        return stat
    finally:
        assert d.stop() == 0


def pages(nbytes: int) -> int:
    return (nbytes + PAGE - 1) // PAGE * PAGE


def test_five_puts_of_200_MiB_fill_a_1_GiB_pool():
    stat = fill("1Gi", "256Mi", [200 * MiB] * 5, "fill-1g")
    pool = stat["pools"][0]
    assert stat["tensors"] == 5
    assert pool["used_bytes"] == 1000 * MiB
    # What is left is one block: the pool kept no end of a segment it could not use.
    assert pool["largest_free_bytes"] == 24 * MiB, pool


def test_three_puts_of_20_MiB_fill_a_64_MiB_pool():
    stat = fill("64Mi", "256Mi", [20 * MiB] * 3, "fill-64m")
    pool = stat["pools"][0]
    assert pool["used_bytes"] == 60 * MiB
    assert pool["largest_free_bytes"] == 4 * MiB, pool


@pytest.mark.parametrize("seed", range(6))
def test_a_random_mix_up_to_98_percent_fits(seed):
    rng = random.Random(seed)
    capacity = 256 * MiB
    # Sizes from one page to a quarter of the pool, spread over the orders of magnitude
    # (log-uniform), until the next would pass 98% of the pool (pages counted).
    sizes: list[int] = []
    total = 0
    while True:
        nbytes = int(2 ** rng.uniform(12, 26)) + rng.randrange(PAGE)
        if total + pages(nbytes) > capacity * 98 // 100:
            break
        sizes.append(nbytes)
        total += pages(nbytes)
    # Segments of 32 MiB (the pool grows by many) or of the whole pool.
    segment = "32Mi" if seed % 2 == 0 else "256Mi"
    stat = fill("256Mi", segment, sizes, f"fill-mix{seed}")
    pool = stat["pools"][0]
    assert stat["tensors"] == len(sizes)
    assert pool["used_bytes"] == total
    assert pool["largest_free_bytes"] <= capacity - total
