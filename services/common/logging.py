"""structlog set up once per entry point: JSON lines on stderr.

Events are stable snake_case names with fields; ``service`` is bound for the
whole process, ``run_id``/``step``/``weight_version`` where they are known
(``structlog.contextvars.bound_contextvars``).
"""

from __future__ import annotations

import logging
import sys

import structlog


class DiskErrorsDropLines:
    """A log stream where a line the disk refuses (full, read-only) is not raised into the code that logged it:
    a service whose log file's disk fills up goes on working; such lines are lost, or written late from the
    stream's buffer once the disk takes them."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> None:
        try:
            self._stream.write(text)
        except OSError:
            pass

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            pass


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per line: ranks share a log file
        logger_factory=structlog.WriteLoggerFactory(
            file=DiskErrorsDropLines(sys.stderr)),  # type: ignore[arg-type]  # a TextIO in the stub; write+flush used
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()
