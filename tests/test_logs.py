"""No log line carries a conversation's full id: an id with the owner's browser token opens
the chat, and logs are read by more people than that. Read from the source, every logging call's
arguments: a bare `conv_id` / `conversation_id` is refused; `log_id(conv_id)` (chat/memory.py) is
what a log line names a chat by."""

from __future__ import annotations

import ast
from pathlib import Path

from llmweb.chat.memory import log_id

PKG = Path(__file__).resolve().parent.parent / "llmweb"
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
ID_NAMES = {"conv_id", "conversation_id"}


def test_no_logging_call_passes_a_conversation_id_as_is():
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in LOG_METHODS or not isinstance(node.func.value, ast.Name):
                continue
            if node.func.value.id not in {"log", "logger", "logging"}:
                continue
            for arg in node.args[1:]:
                if isinstance(arg, ast.Name) and arg.id in ID_NAMES:
                    found.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert found == []


def test_a_log_id_is_short_stable_and_not_the_id():
    cid = "0f3c9a4e5b6d7e8f9a0b1c2d3e4f5a6b"
    assert log_id(cid) == log_id(cid) and cid not in log_id(cid) and cid[:8] not in log_id(cid)
    assert len(log_id(cid)) == len("chat-") + 8 and log_id(cid) != log_id(cid + "x")
