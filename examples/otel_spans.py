"""OpenTelemetry spans for P/D calls (``pip install 'pdclient[otel]'``, plus an SDK to export).

``OTelObserver`` adds a ``pdclient.chat`` span per call with ``pdclient.prefill`` and
``pdclient.decode`` children and the PDTrace fields as attributes. With the official openai
instrumentation also on, each call is still one ``chat <model>`` generation span, with the
pdclient spans under it. (``instrument(client)`` returns an instrumented copy of an existing
client, the same way.)
"""

from __future__ import annotations

from _pair import pd_pair
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdclient import PDChatClient
from pdclient.otel import OTelObserver


def main() -> None:
    exporter = InMemorySpanExporter()  # use an OTLP exporter to send them to your backend
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with pd_pair() as pair:
        client = PDChatClient(
            prefill_base_url=pair.prefill_urls,
            decode_base_url=pair.decode_urls,
            api_key="EMPTY",
            observers=[OTelObserver(tracer_provider=provider)],
        )
        client.chat.completions.create(
            model=pair.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
        )
    for span in sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0):
        ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
        indent = "  " if span.name != "pdclient.chat" else ""
        print(f"{indent}{span.name:<16} {ms:8.1f} ms")
        if span.name == "pdclient.chat":
            for key, value in (span.attributes or {}).items():
                print(f"    {key} = {value}")


if __name__ == "__main__":
    main()
