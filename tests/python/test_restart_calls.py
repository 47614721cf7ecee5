"""Calls ride through a daemon restart, and connect has a deadline on every wait (issue 21)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorshm
from conftest import Daemon, sigstop, wait_for
from waits import listen_backlog, unread_socket_bytes


# Tensors outlive the daemon: recovered after a SIGKILL, kept after a clean stop.
KEEP = ("--recovery-grace", "10", "--keep-segments")


def restart(daemon: Daemon, how: int) -> Daemon:
    """Stops `daemon` with `how` and starts one on the same socket and prefix, serving."""
    daemon.process.send_signal(how)
    daemon.process.wait(timeout=20)
    daemon.log.close()
    if os.path.exists(daemon.socket):
        os.unlink(daemon.socket)  # a killed daemon's socket file: the new one's shows it serves
    return Daemon("ride", socket=daemon.socket, prefix=daemon.prefix, extra_args=KEEP)


def test_stat_and_get_ride_through_a_sigkill_and_a_clean_restart():
    daemon = Daemon("ride", extra_args=KEEP)
    client = None
    try:
        client = tensorshm.connect(daemon.socket, client_name="rider")
        client.put("ride/x", np.full(4096, 0x3C, np.uint8)).release()
        stop = threading.Event()
        calls = [0]
        failures: list[BaseException] = []

        def loop() -> None:
            while not stop.is_set():
                try:
                    client.stat()
                    with client.get("ride/x", timeout=5) as t:
                        assert np.from_dlpack(t)[-1] == 0x3C
                except BaseException as e:  # noqa: BLE001 - counted, reported below
                    failures.append(e)
                calls[0] += 2

        def calls_go_on() -> bool:
            before = calls[0]
            return wait_for(lambda: calls[0] >= before + 20, timeout=20)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        assert calls_go_on()
        first = client.daemon_instance
        daemon = restart(daemon, signal.SIGKILL)
        assert calls_go_on()
        second = client.daemon_instance
        daemon = restart(daemon, signal.SIGTERM)
        assert calls_go_on()
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert len({first, second, client.daemon_instance}) == 3
        print(f"{calls[0]} calls across a SIGKILL and a SIGTERM restart, {len(failures)} failed")
        assert failures == [], failures[:3]
    finally:
        if client is not None:
            client.close()
        daemon.remove()  # and its kept segments


def test_publish_in_flight_at_the_kill_says_its_fate_is_unknown():
    daemon = Daemon("fate", extra_args=KEEP)
    client = None
    try:
        client = tensorshm.connect(daemon.socket, client_name="publisher")
        # The segment is mapped already: what is in flight at the kill is the publish itself.
        client.put("fate/warm", np.zeros(1024, np.float32)).release()
        w = client.create((1024,), "float32")
        np.from_dlpack(w)[:] = 1.0
        sigstop(daemon.process.pid)  # the publish is sent and waits for a reply
        box: dict = {}
        unread = unread_socket_bytes()

        def publish() -> None:
            try:
                w.publish("fate/x")
            except BaseException as e:  # noqa: BLE001 - checked below
                box["error"] = e

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        # The request is sent: it lies unread in the stopped daemon's socket.
        assert wait_for(lambda: unread_socket_bytes() > unread, timeout=10)
        daemon = restart(daemon, signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive()
        error = box.get("error")
        assert isinstance(error, tensorshm.ConnectionError), error
        assert isinstance(error, ConnectionError)
        assert error.code == 14
        assert "fate unknown" in str(error) and "fate/x" in str(error), str(error)
        print(f"publish in flight: {error}")
        assert client.stat()["sessions"] >= 1  # the client goes on, on a new session
    finally:
        if client is not None:
            client.close()
        daemon.remove()  # and its kept segments


def test_connect_to_a_stopped_daemon_fails_by_its_timeout():
    daemon = Daemon("stopped")
    try:
        sigstop(daemon.process.pid)
        start = time.monotonic()
        with pytest.raises(tensorshm.ConnectionError) as info:
            tensorshm.connect(daemon.socket, timeout=1)
        took = time.monotonic() - start
        assert took < 3, took
        assert daemon.socket in str(info.value)
        print(f"connect to a stopped daemon failed after {took:.2f} s: {info.value}")
    finally:
        daemon.process.send_signal(signal.SIGCONT)
        daemon.stop()


def test_connect_without_a_socket_file_fails_at_once_naming_the_path(tmp_path):
    path = str(tmp_path / "no-such.sock")
    start = time.monotonic()
    with pytest.raises(tensorshm.ConnectionError, match="no socket file") as info:
        tensorshm.connect(path, timeout=10)
    assert time.monotonic() - start < 2
    assert path in str(info.value)


CONNECT_STOPPED = """
import sys, time, tensorshm
print("connecting", flush=True)
start = time.monotonic()
try:
    tensorshm.connect(sys.argv[1], timeout=60)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.2f} s", flush=True)
    sys.exit(3)
"""


def test_ctrl_c_interrupts_a_connect():
    daemon = Daemon("ctrlc")
    try:
        sigstop(daemon.process.pid)
        child = subprocess.Popen([sys.executable, "-c", CONNECT_STOPPED, daemon.socket],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "connecting"
        # In the wait for the session to open: its connection queued in the stopped daemon.
        assert wait_for(lambda: listen_backlog(daemon.socket) > 0, timeout=10)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=20)
        assert time.monotonic() - sent < 3
        assert child.returncode == 3, (out, err)
        assert "interrupted" in out
    finally:
        daemon.process.send_signal(signal.SIGCONT)
        daemon.stop()


def test_session_id_and_repr_show_the_sessions_number_not_its_token(tmp_path):
    daemon = Daemon("token")
    try:
        with tensorshm.connect(daemon.socket, client_name="token") as client:
            own = [s for s in client.sessions() if s["own"]]
            assert len(own) == 1
            # The daemon's number, as tensorshmctl sessions shows it; the secret token is 128
            # random bits in hex.
            assert client.session_id == str(own[0]["session_id"])
            assert client.session_id.isdigit() and len(client.session_id) < 20
            assert f"session_id='{client.session_id}'" in repr(client)
            assert re.search("[0-9a-f]{32}", repr(client)) is None, repr(client)
    finally:
        daemon.stop()
