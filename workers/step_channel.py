"""The step channel: a replica's plans to its worker and the results back over one TCP
connection, instead of one Ray actor call per step.

A Ray call costs each step CPU at both ends (gRPC and task-queue threads) and wall time
between one step and the next, CPU that the HTTP server and the workers need too on a small
host. Over this channel a step is one frame each way, several times cheaper at both ends
(benchmarks/bench_step_channel.py measures both). Ray still starts, places, watches and kills the
worker; only the per-step traffic moves here. No ray import: the worker actor owns a
`StepServer`, the replica one `StepClient` per rank.

Frames are (kind: u8, length: u32 little-endian, payload). The client's first frame is
HELLO with the server's token (random, handed to the driver in the worker's start info
over Ray), so nothing else that reaches the port can drive the worker. Then PLAN frames
go down; each gets exactly one RESULT (the step's bytes) or ERROR (the worker's exception
with its traceback) back, in order. One thread of the worker accepts the driver, reads a
plan, executes it and replies: no hand-over between threads in a step. Step N+1's plan
waits in the socket's buffer while step N runs; one bigger than the buffer holds the
driver's send until the worker reads it (the replica sends with its lock released).
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Sequence

HELLO, PLAN, RESULT, ERROR = 1, 2, 3, 4
_HEADER = struct.Struct("<BI")
_MAX_FRAME = 1 << 31  # a frame's length field; a plan or result past 2 GiB is a bug
_BUFFER_BYTES = 4 << 20  # socket buffers asked for (the kernel may cap them)
_TOKEN_BYTES = 16
_HELLO_BYTES = _HEADER.size + _TOKEN_BYTES
HELLO_TIMEOUT_S = 10.0  # a connection's time to send its hello
MAX_PENDING = 32  # connections waiting for their hello at once


class StepChannelError(ConnectionError):
    """The worker's end of the channel went away (the worker died) or broke the protocol."""


class StepTimeout(TimeoutError):
    """No result within the step timeout: the worker hangs (or is far too slow)."""


class WorkerStepError(RuntimeError):
    """The worker raised while executing a step; the message carries its traceback."""


def _send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    header = _HEADER.pack(kind, len(payload))
    if len(payload) < 64 << 10:
        sock.sendall(header + payload)  # one syscall, one segment
    else:
        sock.sendall(header)
        sock.sendall(payload)  # no copy of a large payload


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise StepChannelError("the worker died or shut down: it closed its step channel")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if kind not in (HELLO, PLAN, RESULT, ERROR) or length >= _MAX_FRAME:
        raise StepChannelError(f"malformed step-channel frame (kind {kind}, length {length})")
    return kind, _recv_exact(sock, length) if length else b""


# A peer whose host vanishes (power, network) sends no FIN: without keepalive a driver waiting for
# a result would learn of it only at the step timeout. Probes after KEEPALIVE[0] s idle, every
# KEEPALIVE[1] s, KEEPALIVE[2] unanswered: the connection fails ~11 s after the host went.
KEEPALIVE = (5, 2, 3)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _BUFFER_BYTES)
        except OSError:  # capped or refused: the default buffers work, plans just wait longer
            pass


class StepServer:
    """The worker's end: listens on `host`, serves one driver connection at a time.

    `execute(plan_bytes) -> result_bytes` runs on the step thread, which first calls
    `on_thread_start()` (an accelerator worker binds its device there: torch's current
    device is per thread)."""

    def __init__(self, execute: Callable[[bytes], bytes], host: str,
                 on_thread_start: Callable[[], None] | None = None) -> None:
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self._execute = execute
        self._on_thread_start = on_thread_start
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._closed = False
        self._conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, name="raylm-step", daemon=True)
        self._thread.start()

    def describe(self) -> dict:
        """What the driver needs to connect (the token is a secret: keep it out of stats)."""
        return {"host": self.host, "port": self.port, "token": self.token.hex()}

    def _serve(self) -> None:
        """The step thread: accept the driver, then read a plan, execute it, reply; again."""
        if self._on_thread_start is not None:
            self._on_thread_start()
        while not self._closed:
            conn = self._accept_driver()
            if conn is None:
                return  # closed
            _tune(conn)
            self._conn = conn
            try:
                self._steps(conn)
            except (OSError, StepChannelError):
                pass  # the driver went away (or broke the protocol): wait for the next one
            conn.close()

    def _accept_driver(self) -> socket.socket | None:
        """The first connection whose hello carries the token (None once closed). Connections
        wait for their hello side by side, each at most HELLO_TIMEOUT_S and MAX_PENDING at a
        time: one that connects and stays silent does not hold the driver's out."""
        pending: dict[socket.socket, tuple[float, bytearray]] = {}
        try:
            while not self._closed:
                now = time.monotonic()
                for c, (deadline, _) in list(pending.items()):
                    if deadline <= now:
                        c.close()
                        del pending[c]
                wait = min((d for d, _ in pending.values()), default=now + 1.0) - now
                try:
                    ready = _readable([self._listener, *pending], wait)
                except (OSError, ValueError):
                    return None  # the listener was closed under us
                for s in ready:
                    if s is not self._listener and s not in pending:  # dropped above as the oldest
                        continue
                    if s is self._listener:
                        try:
                            conn, _ = self._listener.accept()
                        except OSError:
                            if self._closed:
                                return None
                            continue
                        if len(pending) >= MAX_PENDING:  # drop the oldest silent one
                            oldest = min(pending, key=lambda c: pending[c][0])
                            oldest.close()
                            del pending[oldest]
                        conn.setblocking(False)
                        pending[conn] = (time.monotonic() + HELLO_TIMEOUT_S, bytearray())
                        continue
                    buf = pending[s][1]
                    try:
                        chunk = s.recv(_HELLO_BYTES - len(buf))  # the hello only: plans may follow it
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    buf += chunk
                    if chunk and len(buf) < _HELLO_BYTES:
                        continue
                    del pending[s]
                    if chunk and self._is_hello(bytes(buf)):
                        s.setblocking(True)
                        return s
                    s.close()
            return None
        finally:
            for c in pending:
                c.close()

    def _is_hello(self, frame: bytes) -> bool:
        kind, length = _HEADER.unpack_from(frame)
        return kind == HELLO and length == len(self.token) and secrets.compare_digest(frame[_HEADER.size:], self.token)

    def _steps(self, conn: socket.socket) -> None:
        while True:
            kind, payload = _recv_frame(conn)
            if kind != PLAN:
                raise StepChannelError(f"expected a plan frame, got kind {kind}")
            try:
                kind, out = RESULT, self._execute(payload)
            except BaseException as e:  # the driver decides what a failed step means
                kind, out = ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc()}".encode()
            _send_frame(conn, kind, out)

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, drop the connection, and wait (bounded) for a running step to end."""
        self._closed = True
        for s in (self._listener, self._conn):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._thread.join(timeout)


class StepClient:
    """The driver's end of one rank's channel."""

    def __init__(self, host: str, port: int, token: str, timeout: float = 30.0) -> None:
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
            _tune(self._sock)
            _send_frame(self._sock, HELLO, bytes.fromhex(token))
        except OSError as e:
            raise StepChannelError(f"cannot connect to the worker's step channel at {host}:{port}: {e}") from e
        self.address = f"{host}:{port}"

    def fileno(self) -> int:
        return self._sock.fileno()

    def getsockopt(self, level: int, option: int) -> int:
        return self._sock.getsockopt(level, option)

    def send(self, plan: bytes, timeout: float) -> None:
        try:
            self._sock.settimeout(timeout)
            _send_frame(self._sock, PLAN, plan)
        except TimeoutError as e:
            raise StepTimeout(f"the worker at {self.address} took no plan for {timeout:.0f} s") from e
        except OSError as e:
            raise StepChannelError(f"the worker at {self.address} died: its step channel broke ({e})") from e

    def recv(self, timeout: float) -> bytes:
        """The next step's result; raises WorkerStepError, StepTimeout or StepChannelError."""
        try:
            self._sock.settimeout(max(timeout, 1e-3))
            kind, payload = _recv_frame(self._sock)
        except StepChannelError:
            raise
        except TimeoutError as e:
            raise StepTimeout(f"the worker at {self.address} returned no step result within {timeout:.0f} s") from e
        except OSError as e:
            raise StepChannelError(f"the worker at {self.address} died: its step channel broke ({e})") from e
        if kind == ERROR:
            raise WorkerStepError(payload.decode(errors="replace"))
        if kind != RESULT:
            raise StepChannelError(f"expected a result frame from {self.address}, got kind {kind}")
        return payload

    def close(self) -> None:
        self._sock.close()


def _readable(items: Sequence, timeout: float) -> list:
    """Those of `items` (sockets, clients: anything with fileno()) readable, closed or failed
    within `timeout` seconds. poll, not select: an engine process serving a flood of HTTP
    connections has descriptors past select's 1,024."""
    poller, by_fd = select.poll(), {}
    for item in items:
        fd = item.fileno()
        by_fd[fd] = item
        poller.register(fd, select.POLLIN | select.POLLPRI)
    return [by_fd[fd] for fd, _ in poller.poll(max(timeout, 0.0) * 1000) if fd in by_fd]


def collect(clients: Sequence[StepClient], timeout: float, result_rank: int = 0) -> bytes:
    """Each rank's result of the oldest step in flight; returns `result_rank`'s. Whichever rank
    answers first is read first, so a rank that failed raises without waiting for the
    others; ranks still silent at the deadline raise StepTimeout."""
    if len(clients) == 1:
        return clients[0].recv(timeout)
    deadline = time.monotonic() + timeout
    pending, data = list(clients), b""
    while pending:
        left = deadline - time.monotonic()
        ready = _readable(pending, left) if left > 0 else []
        if not ready:
            raise StepTimeout(f"{len(pending)} of {len(clients)} ranks returned no step result within {timeout:.0f} s")
        for c in ready:
            value = c.recv(max(deadline - time.monotonic(), 1.0))
            if c is clients[result_rank]:
                data = value
            pending.remove(c)
    return data
