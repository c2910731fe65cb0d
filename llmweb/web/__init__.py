"""The edges a visitor reaches over HTTP: the Gradio UI (ui.py, formatting.py), login accounts and
API keys (accounts.py), and the OpenAI-compatible API (api.py, api_wire.py).

Transport only: who is calling, reading bounded input, showing results, and turning domain
errors into messages (gr.Error, HTTP status). Policy lives in chat/, engine/, retrieval/ and
store/. It may import everything below it, and the runtime; never the CLI.
"""
