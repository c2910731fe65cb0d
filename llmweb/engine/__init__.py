"""The engine: one owner of the model, fed by a fair queue.

Where things are, in reading order:
  request.py     the request and its events (`GenerationRequest`, `Handle`, `Tokens`, ...), a
                 request's `Slot` in the batch, the `Runner` protocol, `EngineLimits`
  queue.py       the waiting requests: round-robin between owners, a cap per owner, background last
  waitroom.py    each waiting request's estimated wait (the work ahead over the measured throughput),
                 which bounds the queue (`max_wait_s`) and is shown with its position
  admission.py   memory: admission by predicted bytes (`predict_bytes`), giving way after an OOM
                 or a refused prompt (retry once with the fallback), the idle allocator release
  scheduler.py   `Engine`: the one worker thread, its loop schedule -> run -> postprocess, cancel,
                 time limits
  local.py       the local transformers runner and its factory `local_engine`
  remote.py      the runner for an OpenAI-compatible server and `remote_engine`
  kvcache.py, blockcache.py   session KV caches; models.py: model loading; telemetry.py: reading
                 memory figures

Speaks token ids only: it knows nothing of text, chats, documents or the UI. It may import
`llmweb.config`, `llmweb.errors` and `llmweb.records`, nothing else of llmweb. Only local.py,
blockcache.py, kvcache.py's measuring helpers, models.py and telemetry.py touch torch;
request.py, queue.py, waitroom.py, admission.py and scheduler.py never do.
"""
