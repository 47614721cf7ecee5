"""Round trips between separate producer and consumer processes for every dtype numpy and
ml_dtypes can express, 0-d, empty, C, Fortran, strided and reversed inputs."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest

import tensorshm
from cases import ALL_DTYPES, LAYOUTS, digest, make
from conftest import run_python, wait_for

HERE = pathlib.Path(__file__).parent

PRODUCER = """
import json, sys
sys.path.insert(0, sys.argv[2])
import tensorshm
from cases import ALL_DTYPES, LAYOUTS, digest, make
client = tensorshm.connect(sys.argv[1])
out = {}
for dtype in ALL_DTYPES:
    for layout in LAYOUTS:
        array = make(dtype, layout)
        t = client.put(f"rt/{dtype}/{layout}", array)
        out[f"{dtype}/{layout}"] = digest(array)
print(json.dumps(out))
"""

CONSUMER = """
import json, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
import tensorshm
from cases import ALL_DTYPES, LAYOUTS, digest
client = tensorshm.connect(sys.argv[1])
out = {}
for dtype in ALL_DTYPES:
    for layout in LAYOUTS:
        t = client.get(f"rt/{dtype}/{layout}")
        view = tensorshm.to_numpy(t)
        assert not view.flags.writeable
        out[f"{dtype}/{layout}"] = digest(view)
        del view, t
print(json.dumps(out))
"""


def test_every_dtype_and_layout_round_trips_across_processes(daemon, client):
    produced = run_python(PRODUCER, daemon.socket, str(HERE))
    assert produced.returncode == 0, produced.stderr
    consumed = run_python(CONSUMER, daemon.socket, str(HERE))
    assert consumed.returncode == 0, consumed.stderr
    expected = json.loads(produced.stdout)
    got = json.loads(consumed.stdout)
    assert len(expected) == len(ALL_DTYPES) * len(LAYOUTS)
    for key, value in expected.items():
        assert got[key] == value, key
    # The consumers' leases ended with their processes.
    assert wait_for(lambda: client.stat()["leases"] == 0)


@pytest.mark.parametrize("dtype", ["float32", "int64", "complex128", "bool", "uint16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_dlpack_consumer_sees_the_values(client, dtype, layout):
    array = make(dtype, layout, seed=1)
    client.put(f"np/{dtype}/{layout}", array, replace=True)
    got = np.from_dlpack(client.get(f"np/{dtype}/{layout}"))
    np.testing.assert_array_equal(got, array)
    assert got.dtype == array.dtype


def test_ml_dtypes_values_survive(client):
    array = np.array([0.5, -1.25, 3.0], dtype=ml_dtypes.bfloat16)
    client.put("ml/bf16", array)
    t = client.get("ml/bf16")
    assert t.dtype == "bfloat16"
    np.testing.assert_array_equal(tensorshm.to_numpy(t), array)
    nibbles = np.array([-8, -1, 0, 7], dtype=ml_dtypes.int4)
    client.put("ml/int4", nibbles)
    t4 = client.get("ml/int4")
    assert t4.subbyte_padded and t4.nbytes == 4
    np.testing.assert_array_equal(tensorshm.to_numpy(t4), nibbles)


def test_dtypes_without_a_dlpack_code_are_refused_by_name(client):
    if not hasattr(ml_dtypes, "bcomplex32"):
        pytest.skip("this ml_dtypes has no bcomplex32")
    with pytest.raises(tensorshm.InvalidArgumentError, match="bcomplex32"):
        client.put("bad/bcomplex", np.zeros(3, dtype=ml_dtypes.bcomplex32))
