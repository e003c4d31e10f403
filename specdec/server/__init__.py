"""`specdec serve`: an OpenAI-compatible HTTP server with continuous batching and load-aware speculation.

scheduler.py  the decode thread: continuous batching, batched verification with ragged acceptance
policy.py     when and how much to speculate as the batch fills (off, on, batch-threshold, cost)
metrics.py    Prometheus text for /metrics
app.py        the FastAPI app (imported lazily: FastAPI and uvicorn are the optional `serve` extra)
frontend.py   the app in a process of its own, talking to the engine's scheduler over a pipe
bench.py      `specdec bench-serve`: load generator, latency/throughput report per policy
cli.py        the two commands' arguments and entry points
"""
