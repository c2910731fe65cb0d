"""The chat: a turn from the user's text to a stored, measured reply.

Owns the token budget and the planner that fits every prompt section into it, the one turn
pipeline that the stateful `Chat` and the stateless API path share, and the chat's memory (the
rolling summary, the user's facts, recall) and whole-document tasks. Which module holds what:
docs/architecture.md, "Where to look".

It may import the engine, retrieval and the store (below it) and config/errors/records; never the
web layer, the CLI or the runtime that wires it. It raises domain errors; turning them into
messages for a page or an exit code is the edges' job.
"""
