"""A free local TCP port, for a listener that must not take a fixed default another server may hold."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on now (the OS's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
