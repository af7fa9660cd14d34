"""`carpool serve`: an OpenAI-compatible HTTP server over LLMEngine.

Layout: `options` (flags -> ServerOptions), `protocol` (request models, errors),
`engine_client` (the `EngineClient` protocol the server holds), `async_engine` (the in-process
client: the engine loop on a thread, and per-request groups), `engine_process` (the
out-of-process client), `serving` (the shared request path: prepare off the event loop,
submit, stream or collect), `completions` and `chat` (one module per endpoint), `app` (routes,
middleware, lifespan), `launch` (the frontend process: uvicorn on the main thread), `startup`
(what both processes do once started), `metrics` (Prometheus). This __init__ stays light so
that `carpool --help` does not import FastAPI.
"""
