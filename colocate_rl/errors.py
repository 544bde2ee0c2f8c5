"""An error as one line: of a log, of another error's message, of what the command line prints."""

from __future__ import annotations


def _message_line(e: BaseException) -> str:
    """The first line of an error's message, '' when it has none (a bare ``str(e).splitlines()[0]``
    would raise IndexError there and hide the error it reports)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def error_line(e: BaseException) -> str:
    """``Type: first line of the message``: an error as one line of a log or of another error."""
    return f"{type(e).__name__}: {_message_line(e)}"


def first_line(e: BaseException) -> str:
    """The first line of an error's message, or its type's name when the message is empty."""
    return _message_line(e) or type(e).__name__
