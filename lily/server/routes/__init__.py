"""The API's routes, one family a file; app.py includes each router."""

from lily.server.routes import chat, completions, responses, status, tokenize

ROUTERS = (chat.router, completions.router, responses.router, tokenize.router, status.router)
