"""The startup line: what this proxy runs, never a secret."""

from __future__ import annotations

from ..fleet import DiscoverySettings
from ..wire import redact_url
from ._proxy import Proxy
from ._readiness import health_probers


def startup_summary(proxy: Proxy) -> str:
    """What this proxy runs, for its startup line: the pools (URLs redacted), the policies,
    the features on; never a secret (the keys are counted, a secret is only said to be set)."""
    config, options = proxy.config, proxy.transport.options

    def on(value: object) -> str:
        return "on" if value else "off"

    def policy(leg: str) -> str:
        chosen = options.policy_for(leg)
        return chosen if isinstance(chosen, str) else type(chosen).__name__

    scraped = [leg for leg in ("prefill", "decode") if options.load_settings_for(leg) is not None]
    fields = {
        "prefill": "[" + ",".join(redact_url(url) for url in options.prefill_urls) + "]",
        "decode": "[" + ",".join(redact_url(url) for url in options.decode_urls) + "]",
        "prefill_routing": policy("prefill"),
        "decode_routing": policy("decode"),
        "on_prefill_failure": redact_url(options.on_prefill_failure),
        "health_checks": on(health_probers(proxy.transport.fleet)),
        "discovery": on(isinstance(options.discovery, DiscoverySettings)),
        "load_signals": ",".join(scraped) or "off",
        "remote_prefill": options.remote_prefill,
        "dispatch": options.dispatch,
        "max_decode_migrations": options.max_decode_migrations,
        "signed_legs": on(options.reuse_secret),
        "allow_call_overrides": on(config.allow_call_overrides),
        "api_keys": len(config.api_keys),
        "forward_api_key": on(config.forward_api_key),
        "upstream_api_key": "set" if config.upstream_api_key else "none",
        "trace_headers": on(config.trace_headers),
        "tenant_header": config.tenant_header or "none",
        "status_requires_api_key": on(config.status_requires_api_key),
        "allowed_origins": ",".join(config.allowed_origins) or "none",
        "otel": on(proxy.tracing),
        "workers": config.workers,
    }
    return " ".join(f"{name}={value}" for name, value in fields.items())
