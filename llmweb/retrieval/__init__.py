"""Documents and search: parsers (parsers.py) and chunking (chunking.py), the embedder (embedder.py), the
on-disk generations of an index with their locks and atomic writes (storage.py), search and
ingestion over one index (index.py), the SQLite FTS5 keyword index (keywords.py), fusion and the
relevance gate (hybrid.py), and the owner-scoped document library (library.py: every check of an
upload's owner is there).

It may import config/errors/records only: not the engine, the store, the chat or the web layer.
Every read names the owner it acts for (the shared library, or one visitor's private one).
"""
