"""`lily serve`: the OpenAI-compatible HTTP server.

A request's path, file by file:
  guard.py        GuardMiddleware (API key, body limit, metrics, one log line), then app.py's route
  protocol.py     the request body, validated by its pydantic model (which is also the OpenAPI schema);
                  errors.py turns any refusal into one OpenAI-shaped line, 400 naming the field
  chat_prompt.py  messages + tools -> prompt text through the checkpoint's chat template
                  (lily/tokenizer.py), then token ids
  app.py          the context-length check, then lily.engine.worker's bounded queue (429 when full)
  lily/engine/    generation.py runs it on the backend (prefix cache, sampling.py, stop strings) and
                  emits text deltas back to the event loop
  chat_parsing.py deltas -> reasoning_content / content / tool_calls, streamed or collected
  responses_api.py the Responses API as a chat request, and its output items and stream events
  metrics.py      counters for GET /metrics
main.py holds the command line (add_arguments / run) and the --demo checkpoint cache.
"""
