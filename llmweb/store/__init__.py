"""Persistence: conversations, turns, versions, summaries, facts and stats in one SQLite file,
behind the `Store` facade (db.py). Every query takes the owner; another owner's id is the same
`NotFound` as a missing one.

It may import config/errors/records only.
"""
