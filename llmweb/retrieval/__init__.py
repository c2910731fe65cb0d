"""Documents and search: parsers and chunking (documents.py), the embedder and the on-disk FAISS
index (index.py), the SQLite FTS5 keyword index (keywords.py), fusion and the relevance gate
(hybrid.py), and the owner-scoped document library (library.py).

It may import config/errors/records only: not the engine, the store, the chat or the web layer.
Every read names the owner it acts for (the shared library, or one visitor's private one).
"""
