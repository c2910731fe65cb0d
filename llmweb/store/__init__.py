"""Persistence: conversations, turns, versions, summaries, facts and stats in one SQLite file,
behind the `Store` facade (db.py, which maps the parts: connection, schema, models, owners,
conversations, versions, facts, search, exchange). Every query takes the owner; another owner's
id is the same `NotFound` as a missing one.

It may import config/errors/records only.
"""
