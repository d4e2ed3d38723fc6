"""The step channel (workers/step_channel.py) on its own: framing, order, errors, timeouts,
the hello token, and collecting several ranks. No Ray: a StepServer in this process."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from workers.step_channel import StepChannelError, StepClient, StepServer, StepTimeout, WorkerStepError, collect


def _server(execute, **kw) -> StepServer:
    return StepServer(execute, "127.0.0.1", **kw)


def _client(server: StepServer, token: str | None = None) -> StepClient:
    d = server.describe()
    return StepClient(d["host"], d["port"], token or d["token"], timeout=5)


def test_pipelined_plans_come_back_in_order_each_with_its_own_result():
    server = _server(lambda b: b[::-1])
    try:
        c = _client(server)
        plans = [bytes([i]) * (i + 1) + b"|" + str(i).encode() for i in range(5)]
        for p in plans:  # all sent before any result is read, as the replica's pipeline does
            c.send(p, timeout=5)
        assert [c.recv(timeout=5) for _ in plans] == [p[::-1] for p in plans]
        c.close()
    finally:
        server.close()


def test_plans_larger_than_the_socket_buffers_round_trip_while_a_step_runs():
    gate = threading.Event()

    def execute(b):
        gate.wait(5)  # the first step is still running while the next plans are sent
        return b[-8:] + len(b).to_bytes(8, "little")

    server = _server(execute)
    try:
        c = _client(server)
        plans = [bytes([i % 251 for i in range(n)]) for n in (3 << 20, 5 << 20, 1)]
        sender = threading.Thread(target=lambda: [c.send(p, timeout=10) for p in plans])
        sender.start()
        time.sleep(0.2)
        gate.set()
        assert [c.recv(timeout=10) for _ in plans] == [p[-8:] + len(p).to_bytes(8, "little") for p in plans]
        sender.join(5)
        assert not sender.is_alive()
    finally:
        server.close()


def test_a_step_that_raises_comes_back_as_an_error_naming_it_and_the_worker_serves_on():
    def execute(b):
        if b == b"bad":
            raise ValueError("slot 7 is not free")
        return b"ok:" + b

    server = _server(execute)
    try:
        c = _client(server)
        c.send(b"bad", timeout=5)
        c.send(b"next", timeout=5)
        with pytest.raises(WorkerStepError, match="ValueError: slot 7 is not free") as e:
            c.recv(timeout=5)
        assert "Traceback" in str(e.value)
        assert c.recv(timeout=5) == b"ok:next"
    finally:
        server.close()


def test_no_result_within_the_timeout_raises_step_timeout():
    release = threading.Event()
    server = _server(lambda b: release.wait(10) and b)
    try:
        c = _client(server)
        c.send(b"x", timeout=5)
        t0 = time.monotonic()
        with pytest.raises(StepTimeout, match="no step result within"):
            c.recv(timeout=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        release.set()
        server.close()


def test_a_worker_that_goes_away_is_a_channel_error_at_once():
    server = _server(lambda b: b)
    c = _client(server)
    c.send(b"x", timeout=5)
    assert c.recv(timeout=5) == b"x"
    server.close()
    t0 = time.monotonic()
    with pytest.raises(StepChannelError, match="died"):
        c.send(b"y", timeout=5)
        c.recv(timeout=30)
    assert time.monotonic() - t0 < 5


def test_a_client_with_the_wrong_token_is_dropped_and_the_right_one_still_served():
    seen = []
    server = _server(lambda b: seen.append(b) or b)
    try:
        intruder = _client(server, token="00" * 16)
        intruder.send(b"intruder", timeout=5)
        with pytest.raises(StepChannelError):
            intruder.recv(timeout=5)
        c = _client(server)
        c.send(b"driver", timeout=5)
        assert c.recv(timeout=5) == b"driver"
        assert seen == [b"driver"]  # the intruder's plan never ran
    finally:
        server.close()


def test_connections_that_never_finish_their_hello_do_not_hold_the_driver_out():
    server = _server(lambda b: b)
    silent = [socket.create_connection((server.host, server.port)) for _ in range(3)]
    half = socket.create_connection((server.host, server.port))
    half.sendall(bytes([1]) + (16).to_bytes(4, "little") + b"\0" * 5)  # a hello cut short
    try:
        time.sleep(0.2)  # the step thread has them all pending before the driver comes
        t0 = time.monotonic()
        c = _client(server)
        c.send(b"driver", timeout=5)
        assert c.recv(timeout=5) == b"driver"
        assert time.monotonic() - t0 < 2  # not the 10 s a silent connection may take to say hello
    finally:
        for s in (*silent, half):
            s.close()
        server.close()


def test_the_driver_end_probes_an_idle_connection_so_a_vanished_host_fails_it():
    server = _server(lambda b: b)
    try:
        c = _client(server)
        assert c.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            idle, interval, count = (c.getsockopt(socket.IPPROTO_TCP, getattr(socket, n))
                                     for n in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"))
            assert idle + interval * count < 30  # well inside the default 120 s step timeout
    finally:
        server.close()


def test_the_channel_works_with_descriptors_past_selects_limit():
    """An engine process in an HTTP flood holds thousands of sockets; a worker restarted then
    gets channel descriptors past 1,024, where select() cannot wait on them."""
    import os
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"the descriptor limit here is {soft}")
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        servers = [_server(lambda b, i=i: b + bytes([i])) for i in range(2)]
        clients = [_client(s) for s in servers]
        assert min(c.fileno() for c in clients) > 1024
        for c in clients:
            c.send(b"plan", timeout=5)
        assert collect(clients, timeout=5) == b"plan\x00"
        for s in servers:
            s.close()
    finally:
        for fd in filler:
            os.close(fd)


def test_steps_run_on_the_thread_that_on_thread_start_prepared():
    prepared, ran = [], []
    server = _server(lambda b: ran.append(threading.get_ident()) or b,
                     on_thread_start=lambda: prepared.append(threading.get_ident()))
    try:
        c = _client(server)
        for p in (b"a", b"b"):
            c.send(p, timeout=5)
            c.recv(timeout=5)
        assert len(prepared) == 1 and ran == prepared * 2
        assert prepared[0] != threading.get_ident()
    finally:
        server.close()


def test_collect_returns_rank_zeros_result_once_every_rank_answered():
    servers = [_server(lambda b: b"rank0:" + b), _server(lambda b: b"")]
    try:
        clients = [_client(s) for s in servers]
        for step in (b"1", b"2"):
            for c in clients:
                c.send(step, timeout=5)
        assert collect(clients, timeout=5) == b"rank0:1"
        assert collect(clients, timeout=5) == b"rank0:2"
    finally:
        for s in servers:
            s.close()


def test_collect_raises_a_failed_rank_without_waiting_for_a_slow_one():
    release = threading.Event()

    def fail(b):
        raise RuntimeError("rank 1 lost its device")

    servers = [_server(lambda b: release.wait(10) and b), _server(fail)]
    try:
        clients = [_client(s) for s in servers]
        for c in clients:
            c.send(b"x", timeout=5)
        t0 = time.monotonic()
        with pytest.raises(WorkerStepError, match="rank 1 lost its device"):
            collect(clients, timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        for s in servers:
            s.close()


def test_collect_names_how_many_ranks_stayed_silent_past_the_timeout():
    release = threading.Event()
    servers = [_server(lambda b: b"done"), _server(lambda b: release.wait(10) and b)]
    try:
        clients = [_client(s) for s in servers]
        for c in clients:
            c.send(b"x", timeout=5)
        with pytest.raises(StepTimeout, match="1 of 2 ranks returned no step result"):
            collect(clients, timeout=0.5)
    finally:
        release.set()
        for s in servers:
            s.close()
