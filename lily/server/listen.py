"""The server's listening sockets, bound before the model loads: a busy port or a host that does not
resolve fails in a second with one line, not after minutes of loading. uvicorn is handed the bound
sockets and starts listening on them once the model is ready."""

from __future__ import annotations

import socket

from lily.cli import UserError


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) TCP sockets for every address `host` resolves to, as asyncio would
    bind them; UserError naming the address and the reason when any cannot be had."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve this address ({e.strerror})") from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                shown = f"[{address[0]}]:{address[1]}" if family == socket.AF_INET6 else f"{address[0]}:{address[1]}"
                raise UserError(f"cannot listen on {shown}: {e.strerror or e}") from None
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"
