"""HTTP on raw sockets, so a test can cut a request anywhere and close a connection exactly when it
chooses (a client that leaves), plus readers for what came back."""

from __future__ import annotations

import socket


def raw_post(port: int, body: bytes, path: str = "/v1/chat/completions", send_bytes: int | None = None,
             headers: dict[str, str] | None = None) -> socket.socket:
    """An HTTP/1.1 POST on a raw socket; `send_bytes` of the body only."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    s.sendall(head + body[:len(body) if send_bytes is None else send_bytes])
    return s


def read_until(s: socket.socket, marker: bytes, count: int = 1) -> bytes:
    """Read until `marker` arrived `count` times (or the server closed)."""
    data = b""
    while data.count(marker) < count:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def sse_lines(raw: bytes) -> list[str]:
    """The data lines of a chunked SSE response read off a raw socket."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    return [ln for ln in body.decode("utf-8", "replace").split("\n") if ln.startswith("data: ")]
