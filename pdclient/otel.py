"""OpenTelemetry spans for P/D calls: ``instrument(client, tracer_provider=...)``.

Needs the ``otel`` extra (``pip install 'pdclient[otel]'``); importing ``pdclient``
itself never imports OpenTelemetry.
"""

from ._otel import instrument

__all__ = ["instrument"]
