"""The chat: a turn from the user's text to a stored, measured reply.

Where things are, in reading order:
  tokens.py     chat templates and token counting
  context.py    the token `Budget` (every change to it is one of its methods) and the pure
                planner that fits every prompt section into it
  turn.py       the turn pipeline every path shares: the engine request with its sampling and
                OOM retry, streaming with stop strings and cancel, stats, notes; the events
                (Started, Queued, Progress, Delta, Finished)
  session.py    the stateful `Chat`: send, regenerate, continue_reply, edit over one snapshot of
                the stored chat; its lifecycle (versions, undo, delete, import) and facts panel
  stateless.py  the stateless API path: a client's messages fitted into the budget
  settings.py   what a turn runs with (a chat's own settings over the configuration's), the checks
  document_plan.py  whole-document tasks, the pure part: which messages ask for one, the pieces,
                the prompts, the fold, the stats record
  document_task.py  whole-document tasks, the run: map and fold steps at background priority, the
                per-piece cache (store/pieces.py), progress, cancel
  memory.py     the summariser and the background folds (and warming the KV cache after one)
  fold.py       what a fold makes of turns (grounded summary, new facts) for both paths, and how
                many turns fit one summary prompt
  recall.py     recall of earlier turns that left the window: per-chat indexes and the choice
  summary.py    the rolling summary's prompts, when to fold, cleaning the model's text
  facts.py      the user's facts kept verbatim, grounding a summary in its turns

It may import the engine, retrieval and the store (below it) and config/errors/records; never the
web layer, the CLI or the runtime that wires it. It raises domain errors; turning them into
messages for a page or an exit code is the edges' job.
"""
