"""Collects the ValueError each of several calls raises, to check many mistakes in one launch."""

from __future__ import annotations

from collections.abc import Callable


def value_error_messages(calls: dict[str, Callable[[], object]]) -> dict[str, str | None]:
    """label -> the message of the ValueError its call raised, or None when it raised none."""
    messages: dict[str, str | None] = {}
    for label, call in calls.items():
        try:
            call()
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
    return messages
