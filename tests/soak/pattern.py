"""The soak's tensor contents: every byte derived from the tensor's name and a seed it carries.

A soak tensor is a 1-D uint8 array of 64 B to 16 MiB. Its first 32 bytes are a header (four
little-endian uint64: magic, seed, length, crc32 of the name); every other byte is a pattern of
the seed and the name's crc (64-bit words of a multiplicative sequence, mixed), so a consumer that
knows only the name it asked for checks every byte: the header must say this name and this
length, and the rest must be the pattern of the header's seed. A tensor served under another
name, truncated, torn, or overwritten in any byte fails the check.
"""

from __future__ import annotations

import zlib

import numpy as np

MAGIC = 0x314B414F534D5354  # b"TSMSOAK1" little-endian
HEADER_BYTES = 32
MIN_BYTES = 64
MAX_BYTES = 16 << 20
_MULT = np.uint64(0x9E3779B97F4A7C15)


def name_crc(name: str) -> int:
    return zlib.crc32(name.encode())


def expected(name: str, seed: int, length: int) -> np.ndarray:
    """The bytes a tensor of `length` bytes named `name` with `seed` holds."""
    words = np.arange((length + 7) // 8, dtype=np.uint64)
    words *= _MULT
    words += np.uint64((seed ^ (name_crc(name) << 32)) & 0xFFFFFFFFFFFFFFFF)
    words ^= words >> np.uint64(29)
    data = words.view(np.uint8)[:length]
    data[:HEADER_BYTES] = np.array([MAGIC, seed, length, name_crc(name)],
                                   dtype="<u8").view(np.uint8)
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
    want = expected(name, seed, length)
    if np.array_equal(data, want):
        return None
    wrong = np.flatnonzero(data != want)
    return int(wrong.size), (f"{wrong.size} of {length} bytes wrong (seed {seed:#x}), first at offset "
            f"{int(wrong[0])}: {int(data[wrong[0]])} != {int(want[wrong[0]])}")
