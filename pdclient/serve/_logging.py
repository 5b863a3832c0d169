"""The proxy's logs: one INFO line per call (an observer), as text or JSON lines."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import orjson

from .. import CallView, LegView, PDObserver

if TYPE_CHECKING:
    from .. import PDTrace

logger = logging.getLogger("pdclient.serve")

CALL_FIELDS = "pd_call"
"""The LogRecord attribute holding a call line's fields (JSON lines show them as keys)."""


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
            "ids_skipped": trace.ids_skipped,
            "fallback": trace.fallback,
            "failed_leg": trace.failed_leg,
            "error": trace.error,
        }
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        logger.info("call %s", text, extra={CALL_FIELDS: fields})


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class JSONFormatter(logging.Formatter):
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
            entry.update({k: v for k, v in fields.items() if v is not None})
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def logging_config(log_format: str, level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the proxy and uvicorn (uvicorn's ``log_config``)."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JSONFormatter"}
        if log_format == "json"
        else {"format": "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"}
    )
    level = level.upper()
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"default": handler},
        "loggers": {
            "pdclient": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
