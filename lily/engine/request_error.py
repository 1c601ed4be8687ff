"""RequestError: a generation that cannot go on for a reason of the request's own making."""

from __future__ import annotations


class RequestError(ValueError):
    """The request cannot go on for a reason of its own (the grammar engine gave up on its schema, its masks
    leave no token to draw): the worker ends that request alone with Failed(message, 400, param), the client gets
    a 400 naming `param` (an error event once its stream has started), and the server goes on."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
