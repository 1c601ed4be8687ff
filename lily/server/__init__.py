"""`lily serve`: the OpenAI-compatible HTTP server.

A request's path, file by file:
  guard.py        GuardMiddleware (request id, API key, body limit, metrics, one log line), before any
                  routing; request_ids.py makes or echoes x-request-id
  protocol.py     the request body, validated by its pydantic model (which is also the OpenAPI schema);
                  errors.py turns any refusal into one OpenAI-shaped line, 400 naming the field
  routes/         one API family a file: chat.py, completions.py, responses.py, tokenize.py,
                  status.py (health, models, metrics); each reaches the server through context.py
  chat_prompt.py  messages + tools -> prompt text through the checkpoint's chat template
                  (lily/tokenizer.py), then token ids
  validation.py   the model name, the rules between fields, valid text, the context-length check
  generations.py  the body's sampling and stop settings -> lily.engine GenerationRequests (n choices); the
                  fields it leaves out from generation_config.py (the checkpoint's generation_config.json)
  output_rules.py response_format, or vLLM's structured_outputs / guided_*, -> the request's one OutputRule
  structured.py   that rule / tool_choice -> a grammar (lily.engine.constraints) the output follows
  streaming.py    lily.engine.worker's bounded queue (429 with Retry-After when full), the generations' events,
                  SSE
  lily/engine/    generation.py runs it on the backend (prefix cache, sampling.py, stop strings) and
                  emits text deltas back to the event loop
  chat_parsing.py deltas -> reasoning_content / content / tool_calls, streamed or collected
  responses_api.py the Responses API as a chat request, and its output items and stream events
  logprobs.py, usage.py  the answer's log-probabilities and usage (and the log line's counts)
  metrics.py      counters for GET /metrics; openapi.py the published schema
app.py puts them together (create_app); main.py holds the command line (add_arguments / run) and the
--demo checkpoint cache.
"""
