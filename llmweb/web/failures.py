"""What a visitor is told when something fails: a domain error's own sentence (`LlmwebError`), or
"Something went wrong (ref N)." for anything else, whose type, message and traceback go to the log
only, under that ref. The UI's toasts (web/panels/base.py `user_errors`) and the API's error
responses (web/api/errors.py) both word failures here, so no exception text, path or setting reaches a
visitor. This module must not decide what is an error or retry anything.
"""

from __future__ import annotations

import logging
import secrets

from llmweb.errors import LlmwebError

log = logging.getLogger("llmweb.web")

SOMETHING_WRONG = "Something went wrong (ref {ref}). The server's log has the details."


def public_message(e: BaseException) -> str:
    """The sentence a visitor may see for `e`; an unexpected error is logged with its traceback."""
    if isinstance(e, LlmwebError):
        return str(e)
    ref = secrets.token_hex(4)
    log.error("unexpected %s (ref %s)", type(e).__name__, ref, exc_info=e)
    return SOMETHING_WRONG.format(ref=ref)
