"""The API's routes, one family a file; app.py includes each router."""

from lily.server.routes import chat, completions, page, responses, status, tokenize

ROUTERS = (chat.router, completions.router, responses.router, tokenize.router, status.router, page.router)
