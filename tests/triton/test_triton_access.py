"""Triton as another uid (65534, in group 4242), as it runs beside tensorshmd in a Pod: it opens
segments by name read-write, so it maps them only when the daemon runs with --shm-group 4242
(segments 0660 in that group); without it the feeder's register (at the inference) is refused,
naming the fix."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tempfile

import numpy as np
import pytest

import tensorshm
import tritonclient.http as httpclient
from tensorshm.triton import TritonFeeder

from conftest import Daemon, TritonServer, triton_venv, write_models
from test_triton import consume, produce

OTHER_UID = 65534
GROUP = 4242


@pytest.fixture(scope="module")
def other_uid_triton():
    if os.geteuid() != 0:
        pytest.skip("needs root to run Triton as another uid")
    work = pathlib.Path(tempfile.mkdtemp(prefix="tsm-triton-uid-"))
    os.chmod(work, 0o755)  # the server's uid reads the models and its backend directory
    server = TritonServer(triton_venv(), write_models(work / "models"), work,
                          user=(OTHER_UID, [GROUP]))
    server.start()
    yield server
    server.stop()
    shutil.rmtree(work)


def test_shm_group_lets_triton_of_another_uid_map_the_segments(other_uid_triton):
    daemon = Daemon("triton-group", extra_args=("--shm-group", str(GROUP)))
    try:
        produce(daemon, "x", seed=7)
        with tensorshm.connect(daemon.socket) as client, \
                httpclient.InferenceServerClient(other_uid_triton.http_url) as triton, \
                TritonFeeder(triton, client) as feed:
            with client.get("x") as x:
                mode = os.stat(f"/dev/shm{x.segment_place()['shm_name']}")
                assert (stat.S_IMODE(mode.st_mode), mode.st_gid) == (0o660, GROUP)
                y = client.create(x.shape, x.dtype)
                feed.infer("affine", [feed.input("x", x)], [feed.output("y", y)])
                y.publish("y")
        consume(daemon, "y", seed=7)
    finally:
        assert daemon.stop() == 0


def test_without_shm_group_the_register_is_refused_naming_the_option(other_uid_triton):
    daemon = Daemon("triton-nogroup")
    try:
        with tensorshm.connect(daemon.socket) as client, \
                httpclient.InferenceServerClient(other_uid_triton.http_url) as triton, \
                TritonFeeder(triton, client) as feed:
            client.put("x", np.ones(64, np.float32))
            with client.get("x") as x:
                with pytest.raises(tensorshm.FailedPreconditionError,
                                   match=r"Unable to open shared memory region.*--shm-group GROUP"):
                    feed.infer("affine", [feed.input("x", x)])
            assert feed.regions == []
    finally:
        assert daemon.stop() == 0
