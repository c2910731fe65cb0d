"""The chat: a turn from the user's text to a stored, measured reply.

Owns: chat templates and token counting (tokens.py), the token budget and the pure planner that
fits every prompt section into it (context.py), the rolling summary (summary.py), the user's facts
(facts.py), the stateful `Chat` (session.py) and the stateless API path (stateless.py).

It may import the engine, retrieval and the store (below it) and config/errors/records; never the
web layer, the CLI or the runtime that wires it. It raises domain errors; turning them into
messages for a page or an exit code is the edges' job.
"""
