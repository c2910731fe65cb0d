"""The engine: one owner of the model, fed by a fair queue.

Owns: the request and its events (`GenerationRequest`, `Handle`, `Tokens`, ...), the `Runner`
protocol, the scheduler loop with admission by predicted memory, cancel, time limits and OOM
recovery (scheduler.py), the local transformers runner and its factory (local.py), the remote
runner for an OpenAI-compatible server (remote.py), session KV caches (kvcache.py,
blockcache.py), model loading (models.py) and memory telemetry (telemetry.py).

Speaks token ids only: it knows nothing of text, chats, documents or the UI. It may import
`llmweb.config`, `llmweb.errors` and `llmweb.records`, nothing else of llmweb. Only local.py,
blockcache.py, kvcache.py's measuring helpers, models.py and telemetry.py touch torch;
scheduler.py never does.
"""
