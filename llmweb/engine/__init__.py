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
  runners/       the local runners: base.py (what both do alike: a slot's sequence, session
                 reuse, the step's timing and stats, the out-of-memory contract), sampling.py (the
                 sampler's rules; numpy and torch back ends), llama_cpp.py (`LlamaRunner`,
                 `llama_engine`), transformers.py (`LocalRunner`, `local_engine`)
  backends.py    `make_engine`: the runner a loaded model's backend calls for
  gguf.py        GGUF files on llama.cpp: loading, re-encoding (LLMWEB_GGUF_REQUANT), the backend init
  server.py      the client of an OpenAI-compatible server: HTTP, probing, its slot map
  remote.py      the runner for such a server (`RemoteRunner`) and `remote_engine`
  kvcache.py, blockcache.py   session KV caches; models.py: model loading; telemetry.py: reading
                 memory figures
  hub.py         fetching a model from the Hugging Face Hub into the models folder (plan, then fetch)

Speaks token ids only: it knows nothing of text, chats, documents or the UI. It may import
`llmweb.config`, `llmweb.errors` and `llmweb.records`, nothing else of llmweb. Only
runners/transformers.py, runners/sampling.py's torch back end, blockcache.py, kvcache.py's
measuring helpers, models.py and telemetry.py touch torch;
request.py, queue.py, waitroom.py, admission.py and scheduler.py never do.
"""
