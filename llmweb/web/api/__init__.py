"""The OpenAI-compatible API, one module per endpoint family, each with its wire shapes beside it:

  routes.py     api_routes(runtime): every route under /v1, and the 404 / 405 for any other path
  chat.py       POST /v1/chat/completions: the turn (stateful or stateless) and its response
  chat_wire.py  chat completions' wire format as pure functions: request checks, responses, chunks, stop strings
  models.py     GET /v1/models and a request's `model`: the listing, and a switch for those who may
  embeddings.py POST /v1/embeddings: the server's embedder, per-owner limits on requests in flight
  embeddings_wire.py  the embeddings request's checks and response, as pure functions
  passages.py   GET /v1/x_llmweb/passage: a cited source's passage, by the place its citation gives
  common.py     what the families share: the body within its limit, JSON, field checks, Usage, the stream
  errors.py     ApiError, a domain error as an HTTP status, the error response
  keys.py       API keys: LLMWEB_API_KEYS and the hashed keys kept in the users file

Transport only: who is calling is web/identity.py's (`ApiCallers`), the turn the chat path's. This
package imports nothing at import time, so web/identity.py can use its errors and keys.
"""
