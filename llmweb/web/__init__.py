"""The edges a visitor reaches over HTTP:

  identity.py   who is asking and which owner they act for (browser tokens, logins, API callers)
  ui.py         the Gradio page: its layout and the wiring of its events
  panels/       the page's event handlers, one module per panel (see panels/__init__.py)
  formatting.py what the page shows, as pure functions (Markdown, HTML, messages, plot tables)
  accounts.py   login accounts and the users file; throttle.py the login back-off
  api/          the OpenAI-compatible API, one module per endpoint family (see api/__init__.py)
  page_assets.py  Gradio's page file with a frontend bug fixed, served in front of Gradio's own

Transport only: who is calling, reading bounded input, showing results, and turning domain
errors into messages (gr.Error, HTTP status). Policy lives in chat/, engine/, retrieval/ and
store/. It may import everything below it, and the runtime; never the CLI.
"""
