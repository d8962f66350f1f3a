"""One free-port helper for everything that must hand a port number to another process."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago: bound to port 0, then released.

    Only for a port number another process will bind (a gateway's `listen.port`, a
    `--port` flag); there is a small window in which someone else can take it. A server
    in this process should bind port 0 itself and keep the socket instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
