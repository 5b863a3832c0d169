"""The proxy's logs: one INFO line per call (an observer), as text or JSON lines.

Whatever a log line holds may come from a caller (the path, its request id) or hold a
server's URL: every message and field is shown with its control characters escaped, so
one line cannot pass for two (a ``%0a`` in a path), and with the credentials of any URL
in it redacted.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from typing import TYPE_CHECKING, Any

import orjson

from .. import CallView, LegView, PDObserver
from ..handoff import CALL_RECORD
from ..wire import redact_url

if TYPE_CHECKING:
    from .. import PDTrace

logger = logging.getLogger("pdclient.serve")

CALL_FIELDS = "pd_call"
"""The LogRecord attribute holding a call line's fields as they are (JSON lines show them as
keys, ``shown``)."""

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: each can end a
# line, or rewrite it on a terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A text line's value is quoted when it holds what would end it or fake another key=value.
_NEEDS_QUOTES = re.compile(r'[\s="]')


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shown(text: str) -> str:
    """``text`` as a log line may show it: URL credentials redacted, control characters escaped."""
    text = redact_url(text)
    return text if text.isprintable() else _CONTROL.sub(_escaped, text)


def _text_value(value: object) -> str:
    """One ``key=value`` pair's value, quoted (logfmt) unless it is all printable, without
    spaces, quotes or ``=``: so it can neither end the line nor pass for another pair."""
    text = redact_url(str(value))
    if text and text.isprintable() and not _NEEDS_QUOTES.search(text):
        return text
    quoted = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + _CONTROL.sub(_escaped, quoted) + '"'


class CallLog(PDObserver):
    """Logs each finished call once: request id, endpoints, the legs' times and the outcome."""

    def on_first_byte(self, call: CallView) -> None:
        call.data[self] = time.perf_counter()

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        if leg.name == "decode":
            call.data[(self, "status")] = status

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        first_byte = call.data.get(self)
        now = time.perf_counter()
        fields: dict[str, Any] = {
            "request_id": call.request_id,
            "leg_request_id": call.leg_request_id,
            "method": call.request.method,
            "path": call.request.url.path,
            "route": call.route,
            "outcome": trace.outcome.value,
            "decode_status": call.data.get((self, "status")),
            "prefill_url": trace.prefill_url,
            "decode_url": trace.decode_url,
            "prefill_ms": _ms(trace.prefill_ms),
            "prefill_attempts": trace.prefill_attempts or None,
            "decode_headers_ms": _ms(trace.decode_headers_ms),
            "decode_first_byte_ms": _ms(trace.decode_first_byte_ms),
            "ttft_ms": None if first_byte is None else _ms((first_byte - call.started) * 1000),
            "total_ms": _ms((now - call.started) * 1000),
            "forwarded_tokens": trace.forwarded_tokens,
            "remote_prefill_reason": trace.remote_prefill_reason,
            "conversation": trace.conversation,
            "cache_source": trace.cache_source,
            "cached_tokens": trace.cached_tokens,
            "dispatch": trace.dispatch,
            "ids_skipped": trace.ids_skipped,
            "fallback": trace.fallback,
            "failed_leg": trace.failed_leg,
            "error": trace.error,
        }
        given = {k: v for k, v in fields.items() if v is not None}
        logger.info("call %s", _CallText(given), extra={CALL_FIELDS: given})


class _CallText:
    """A call line's ``key=value`` text, made only when a formatter shows the message: a JSON
    line shows the fields instead (making both was ~2 % of the proxy's CPU per call, in process)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def __str__(self) -> str:
        return " ".join(f"{k}={_text_value(v)}" for k, v in self._fields.items())


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class _Formatter(logging.Formatter):
    """A ``logging.Formatter`` that renders each second's time stamp once: a busy proxy logs
    a line per call, and ``time.strftime`` on every line was a tenth of the line's cost."""

    _second: tuple[int, str | None, str] = (-1, None, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second, fmt, stamp = self._second
        if second != int(record.created) or fmt != datefmt:
            second = int(record.created)
            stamp = time.strftime(datefmt or self.default_time_format, self.converter(record.created))
            self._second = (second, datefmt, stamp)  # one assignment: formatters may be shared by threads
        return stamp if datefmt or not self.default_msec_format else self.default_msec_format % (stamp, record.msecs)


class TextFormatter(_Formatter):
    """``logging.Formatter`` whose messages are ``shown``: a traceback keeps its lines, a
    message is one line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = shown(record.message)
        if message is not record.message:  # most messages need nothing escaped: no copy then
            record = copy.copy(record)  # the record itself is shared with other handlers
            record.message = message
        return super().formatMessage(record)


class JSONFormatter(_Formatter):
    """One JSON object per line: time, level, logger, message, and a call line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
        }
        fields = getattr(record, CALL_FIELDS, None)
        if fields is not None:
            entry["message"] = "call"
            entry.update({k: shown(v) if isinstance(v, str) else v for k, v in fields.items() if v is not None})
        else:
            entry["message"] = shown(record.getMessage())
        if record.exc_info:
            entry["exception"] = redact_url(self.formatException(record.exc_info))
        return orjson.dumps(entry, default=str).decode()


class WithoutLibraryCallLines(logging.Filter):
    """Drops the library's own record of how a call ended (a warning for a degraded answer,
    an info for a refused or failed call): in the proxy, ``CallLog``'s line says it, with
    the outcome, the fallback and the error, so each call is one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, CALL_RECORD, False)


def logging_config(log_format: str, level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the proxy and uvicorn (uvicorn's ``log_config``)."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JSONFormatter"}
        if log_format == "json"
        else {"()": f"{__name__}.TextFormatter", "fmt": "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"}
    )
    level = level.upper()
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "filters": {"one_line_per_call": {"()": f"{__name__}.WithoutLibraryCallLines"}},
        "handlers": {"default": handler},
        "loggers": {
            "pdclient": {"handlers": ["default"], "level": level, "propagate": False, "filters": ["one_line_per_call"]},
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
