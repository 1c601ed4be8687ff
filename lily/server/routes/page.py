"""GET /: the chat page, and GET /chat/<asset> for its script and style sheet. The files ship in the
package (lily/server/chat_page/): no build step, nothing fetched from elsewhere, works offline. The page
itself is open (it asks for the API key when the server wants one); the API it calls is not."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

from lily.server.errors import APIError

router = APIRouter()

ASSETS = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/", *(f"/chat/{name}" for name in ASSETS))  # what the API key guard leaves open


def _read(name: str) -> bytes:
    return resources.files("lily.server").joinpath("chat_page", name).read_bytes()


def _no_cache(body: bytes, media_type: str) -> Response:
    # revalidated each load, so a newer lily's page is never mixed with an older script
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def chat_page():
    return _no_cache(_read("index.html"), "text/html; charset=utf-8")


@router.get("/chat/{name}", include_in_schema=False)
async def chat_asset(name: str):
    if name not in ASSETS:
        raise APIError(404, f"no such file: /chat/{name}")
    return _no_cache(_read(name), ASSETS[name])
