"""`carpool serve`: an OpenAI-compatible HTTP server over LLMEngine.

Layout: `options` (flags -> ServerOptions), `protocol` (request models, errors), `async_engine`
(the engine loop and per-request groups), `serving` (the shared request path: prepare off the
event loop, submit, stream or collect), `completions` and `chat` (one module per endpoint),
`app` (routes, middleware, lifespan), `launch` (the process: uvicorn beside the engine loop on
the main thread), `metrics` (Prometheus). This __init__ stays light so that `carpool --help`
does not import FastAPI.
"""
