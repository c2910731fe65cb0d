"""Domain errors. Each carries one sentence fit to show a user as it is.

They become `gr.Error` in web/ui.py and an exit message in cli/main.py, nowhere else.
"""


class LlmwebError(Exception):
    """Base class: str(error) is the message for the user."""


class ConfigError(LlmwebError):
    """A setting has a value we cannot use."""


class InputError(LlmwebError):
    """The user's message or file cannot be used as given (empty, too long, wrong type...)."""


class BusyError(LlmwebError):
    """The generation queue is full."""


class AdmissionError(LlmwebError):
    """A request's predicted memory does not fit, even after waiting and evicting caches."""


class OutOfMemory(LlmwebError):
    """The device ran out of memory and the reduced retry failed too."""


class Cancelled(LlmwebError):
    """The request was cancelled (stop button, disconnect)."""


class TimedOut(LlmwebError):
    """The request ran past its time limit."""


class EngineStopped(LlmwebError):
    """The model's process stopped (crashed, killed) while serving; the request was not answered."""


class DownloadError(LlmwebError):
    """A model could not be fetched from the Hub: offline, refused (gated, missing, too big, no safe
    weights) or stopped midway (the bytes so far are kept and the same fetch resumes). `choices`: the
    (file name, size) pairs to pick from when the error is about which file (a GGUF repo)."""

    def __init__(self, message: str, choices: tuple[tuple[str, int], ...] = ()):
        super().__init__(message)
        self.choices = choices
