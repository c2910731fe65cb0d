"""llmweb: a Gradio app for long chat sessions with a local LLM, inside hard token and memory limits.

Importing the package loads nothing heavy; docs/architecture.md has the module map.
"""

__version__ = "0.3.0"  # the same as pyproject.toml (tests/test_packaging.py)
