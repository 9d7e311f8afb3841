"""Local networking helpers shared by the training launcher, the serving tooling and the tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it; a race with another
    process binding it before the caller does is possible but rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
