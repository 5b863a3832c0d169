"""OpenTelemetry in the proxy: ``pdclient.otel.OTelObserver`` on every call, configured as
OpenTelemetry's own tools configure a process, from the standard ``OTEL_*`` environment.

Two ways, both standard:

- ``opentelemetry-instrument pdclient serve ...`` (``opentelemetry-distro`` and an
  exporter installed): the distro configures the SDK before the proxy starts; the proxy
  finds a tracer provider set and records its spans there.
- ``pdclient serve`` alone, with ``OTEL_TRACES_EXPORTER`` or an OTLP endpoint in the
  environment and ``opentelemetry-sdk`` installed: the proxy configures the SDK from that
  environment itself, as the distro would (exporters, sampler, resource, ``OTEL_BSP_*``).

``--otel auto`` (the default) does either when the environment or a configured provider
asks for traces, ``on`` always adds the observer, ``off`` never does.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

from .. import PDConfigError, PDObserver

logger = logging.getLogger("pdclient.serve")

FLUSH_MILLIS = 5_000
"""How long the shutdown waits for the last spans to be exported."""


def tracing_requested(environ: Mapping[str, str]) -> bool:
    """Whether the ``OTEL_*`` environment asks this process to export traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


class Tracing:
    """The proxy's tracing, once ``--otel`` turned it on: its observer, and the flush at shutdown."""

    def __init__(self, observer: PDObserver, trace: Any) -> None:
        self.observer = observer
        self._trace = trace

    def flush(self) -> None:
        """Export the spans still queued: a process that ends by its signal runs no atexit hook."""
        provider = self._trace.get_tracer_provider()
        force_flush = getattr(provider, "force_flush", None)
        if force_flush is not None:
            force_flush(FLUSH_MILLIS)


def tracing(mode: str, environ: Mapping[str, str]) -> Tracing | None:
    """The proxy's tracing for ``--otel mode``, the SDK configured from ``environ`` when it
    asks for traces and no tracer provider is set; None when off."""
    if mode == "off":
        return None
    try:
        trace = importlib.import_module("opentelemetry.trace")
    except ImportError:
        if mode == "on":
            raise PDConfigError("otel=on needs OpenTelemetry: pip install 'pdclient[otel]' opentelemetry-sdk") from None
        return None
    configured = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    requested = tracing_requested(environ)
    if mode == "auto" and not (configured or requested):
        return None
    if requested and not configured:
        _configure_sdk(environ)
    from ..otel import OTelObserver

    return Tracing(OTelObserver(), trace)


def _configure_sdk(environ: Mapping[str, str]) -> None:
    """The SDK set up from the environment by its own configurator, the one
    ``opentelemetry-distro`` runs under ``opentelemetry-instrument``: the SDK has no public
    entry point for it."""
    try:
        from opentelemetry.sdk._configuration import _OTelSDKConfigurator
    except ImportError:
        logger.warning(
            "the OTEL_* environment asks for traces, but opentelemetry-sdk is not installed: "
            "pip install opentelemetry-sdk (and an exporter), or run under opentelemetry-instrument"
        )
        return
    # The distro's default: an OTLP endpoint alone means OTLP traces.
    names = [] if environ.get("OTEL_TRACES_EXPORTER") else ["otlp"]
    try:
        _OTelSDKConfigurator().configure(trace_exporter_names=names)  # type: ignore[no-untyped-call]
    except (RuntimeError, ValueError) as exc:  # an exporter named that no installed package provides
        raise PDConfigError(
            f"OpenTelemetry from the OTEL_* environment: {exc} (pip install opentelemetry-exporter-otlp, "
            "or set OTEL_TRACES_EXPORTER)"
        ) from None


__all__ = ["Tracing", "tracing", "tracing_requested"]
