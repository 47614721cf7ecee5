"""The soak's tensor contents: every byte derived from the tensor's name and a seed it carries.

A soak tensor is a 1-D uint8 array of 64 B to 16 MiB. Its first 32 bytes are a header (four
little-endian uint64: magic, seed, length, crc32 of the name); every other byte is a pattern of
the seed and the name's crc (64-bit words of an odd-multiplier sequence), so a consumer that
knows only the name it asked for checks every byte: the header must say this name and this
length, and the rest must be the pattern of the header's seed. A tensor served under another
name, truncated, torn, or overwritten in any byte fails the check.
"""

from __future__ import annotations

import collections
import zlib

import numpy as np

MAGIC = 0x314B414F534D5354  # b"TSMSOAK1" little-endian
HEADER_BYTES = 32
MIN_BYTES = 64
MAX_BYTES = 16 << 20
_MASK = (1 << 64) - 1
_MULT = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def name_crc(name: str) -> int:
    return zlib.crc32(name.encode())


def expected(name: str, seed: int, length: int) -> np.ndarray:
    """The bytes a tensor of `length` bytes named `name` with `seed` holds."""
    # Words of an odd-multiplier sequence from a base that mixes the seed and the name
    # (splitmix64): another seed or name changes nearly every byte.
    words = np.arange((length + 7) // 8, dtype=np.uint64)
    words *= _MULT
    words += np.uint64(_splitmix64(seed ^ (name_crc(name) << 32)))
    words ^= words >> np.uint64(29)
    data = words.view(np.uint8)[:length]
    data[:HEADER_BYTES] = np.array([MAGIC, seed, length, name_crc(name)],
                                   dtype="<u8").view(np.uint8)
    return data


# A consumer reads the same version of a name many times before it is replaced: the expected
# bytes of the latest versions are kept (least recently used first out, 64 MiB at most).
_CACHE: collections.OrderedDict[tuple[str, int, int], np.ndarray] = collections.OrderedDict()
_CACHE_BYTES = 64 << 20


def _expected_cached(name: str, seed: int, length: int) -> np.ndarray:
    key = (name, seed, length)
    data = _CACHE.get(key)
    if data is not None:
        _CACHE.move_to_end(key)
        return data
    data = expected(name, seed, length)
    _CACHE[key] = data
    while sum(v.size for v in _CACHE.values()) > _CACHE_BYTES and len(_CACHE) > 1:
        _CACHE.popitem(last=False)
    return data


def check(name: str, data: np.ndarray) -> tuple[int, str] | None:
    """None if `data` (uint8, 1-D) is a soak tensor named `name`, else (how many bytes are wrong,
    what is wrong). A bad header counts every byte as wrong."""
    length = int(data.size)
    if length < HEADER_BYTES:
        return length, f"{length} bytes: shorter than the {HEADER_BYTES}-byte header"
    magic, seed, said_length, crc = (int(v) for v in data[:HEADER_BYTES].view("<u8"))
    if magic != MAGIC:
        return length, f"magic {magic:#x} != {MAGIC:#x}"
    if said_length != length:
        return length, f"header says {said_length} bytes, the tensor has {length}"
    if crc != name_crc(name):
        return length, f"header names crc {crc:#x}, {name!r} is {name_crc(name):#x}"
    want = _expected_cached(name, seed, length)
    if np.array_equal(data, want):
        return None
    wrong = np.flatnonzero(data != want)
    return int(wrong.size), (f"{wrong.size} of {length} bytes wrong (seed {seed:#x}), first at offset "
            f"{int(wrong[0])}: {int(data[wrong[0]])} != {int(want[wrong[0]])}")
