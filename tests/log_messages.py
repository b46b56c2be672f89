"""A logging handler that keeps what it is given, for tests that check what megatron_fsdp logs
inside rank processes (where pytest's caplog does not reach)."""

from __future__ import annotations

import logging


class LogMessages(logging.Handler):
    """Keeps the message of every record at ``level`` or above, in order."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
