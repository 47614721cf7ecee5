"""Arrays for the round-trip tests: every dtype numpy and ml_dtypes can express through DLPack,
in several layouts, built deterministically so that separate processes agree on them."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]
ML_DTYPES = ["bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
             "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
             "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "int4", "uint4", "int2", "uint2",
             "int1", "uint1", "complex32"]
ALL_DTYPES = NUMPY_DTYPES + [d for d in ML_DTYPES if hasattr(ml_dtypes, d)]

LAYOUTS = ["0d", "empty", "c", "fortran", "strided", "reversed"]


def np_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def make(dtype: str, layout: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(abs(hash((dtype, layout, seed))) % 2**32)
    dt = np_dtype(dtype)
    base_shape = {"0d": (), "empty": (0, 5)}.get(layout, (6, 10))
    if dtype == "bool":
        base = rng.random(base_shape) > 0.5
    elif dt.kind in "iu" or dtype in ("int4", "uint4", "int2", "uint2", "int1", "uint1"):
        if dtype in NUMPY_DTYPES:
            info = np.iinfo(dt)
            base = rng.integers(info.min, info.max, base_shape, dtype=dt, endpoint=True)
        else:
            info = ml_dtypes.iinfo(dt)
            base = rng.integers(int(info.min), int(info.max) + 1, base_shape).astype(dt)
    elif dtype.startswith("complex"):
        values = rng.standard_normal(base_shape) + 1j * rng.standard_normal(base_shape)
        base = values.astype(dt)
    else:
        base = np.abs(rng.standard_normal(base_shape)).astype(dt)
        if dtype != "float8_e8m0fnu":
            base = (rng.standard_normal(base_shape)).astype(dt)
    base = np.asarray(base)  # 0-d results come back as numpy scalars
    if layout == "fortran":
        return np.asfortranarray(base)
    if layout == "strided":
        return base[::2, 1::3]
    if layout == "reversed":
        return base[::-1, ::-2]
    return base


def digest(array: np.ndarray) -> str:
    """dtype, shape and the bytes of the values in logical order."""
    data = np.ascontiguousarray(array).tobytes()
    return f"{array.dtype.name}|{array.shape}|{hashlib.sha256(data).hexdigest()}"
