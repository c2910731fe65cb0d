"""`python -m llmweb ...`: serve, replay (main.py), ingest and search (docs.py), user (user.py), models (models.py);
`bench` and `capacity` register from llmweb.bench. The top layer: it may import everything, and
nothing imports it but `llmweb.__main__` and app.py.
"""
