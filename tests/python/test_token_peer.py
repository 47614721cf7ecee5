"""What a client supplies is bounded, its session is its own, and broadcast tensors are views
(issue 22)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import tensorshm


def test_a_client_name_of_256_bytes_is_kept_and_257_are_refused_naming_the_field(daemon):
    name = "n" * 256
    with tensorshm.connect(daemon.socket, client_name=name) as client:
        own = [s for s in client.sessions() if s["own"]]
        assert [s["client_name"] for s in own] == [name]
    with pytest.raises(tensorshm.InvalidArgumentError,
                       match=r"open\.client_name: 257 bytes; at most 256") as refused:
        tensorshm.connect(daemon.socket, client_name="n" * 257)
    assert isinstance(refused.value, ValueError)
    with pytest.raises(tensorshm.InvalidArgumentError, match=r"open\.client_name: 2000000 bytes"):
        tensorshm.connect(daemon.socket, client_name="x" * 2_000_000)


def test_repr_and_session_id_never_show_the_token(client):
    # The token is 128 random bits in hex; what a client shows is the daemon's session number.
    assert client.session_id.isdigit()
    assert re.search("[0-9a-f]{32}", repr(client)) is None, repr(client)
    assert re.search("[0-9a-f]{32}", str(client.sessions())) is None


def test_a_broadcast_tensor_is_published_as_one_element_and_read_as_a_view(client):
    # Shape [2^40] with stride 0: legal, and its buffer holds one float32.
    w = client.create((2**40,), "float32", strides=(0,))
    # Every element is the one element (a write to all 2^40 of them would take numpy hours).
    np.from_dlpack(w)[0] = 7.5
    w.publish("broadcast/ones", replace=True)
    with client.get("broadcast/ones") as t:
        assert t.shape == (2**40,)
        assert t.strides == (0,)
        assert t.nbytes == 4  # the storage it spans, not the 4 TiB it describes
        view = np.from_dlpack(t)
        assert view.shape == (2**40,) and view.strides == (0,)
        assert view[0] == view[2**40 - 1] == 7.5
        # A consumer that copies it materializes every element: it checks the logical size
        # first (here 4 TiB), as the README's rule says.
        assert view.size * view.itemsize == 2**42
    client.delete("broadcast/ones")


def test_a_broadcast_tensor_whose_logical_size_overflows_int64_is_refused(client):
    with pytest.raises(tensorshm.InvalidArgumentError,
                       match=r"logical size \(element count x element size\) overflows int64"):
        client.create((2**62,), "float32", strides=(0,))
