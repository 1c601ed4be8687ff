"""The request id every answer carries in its x-request-id header (the OpenAI SDKs read it, and it ties
a client's report to the server's log line): the client's own, when it sent a sane one, else a new one."""

from __future__ import annotations

import re
import uuid

HEADER = "x-request-id"
_SANE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # printable, no spaces: safe in a header and a log line


def request_id(headers: dict[str, str]) -> str:
    """The client's x-request-id when it is short printable ASCII, else a fresh one."""
    given = headers.get(HEADER, "")
    return given if _SANE.fullmatch(given) else "req_" + uuid.uuid4().hex
