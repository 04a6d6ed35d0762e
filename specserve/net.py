"""Network checks made before the model loads, so a taken port is reported at once."""
from __future__ import annotations

import errno
import socket

from specserve.errors import ArgumentError, PortInUseError


def check_port_free(host: str, port: int) -> None:
    """Raises PortInUseError when nothing could listen on host:port (bound the way uvicorn
    binds: SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ArgumentError(f"host {host!r} is not an address of this machine: {error.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortInUseError(f"port {port} on {host} is already in use by another process; "
                                     "stop it or pick another with --port") from None
            raise PortInUseError(f"cannot listen on {host}:{port}: {error.strerror}") from None
