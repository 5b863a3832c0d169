"""pdclient: drop-in openai clients for prefill/decode disaggregated vLLM serving.

A chat or completions call runs a prefill call on a prefill server and a (streamed)
decode call on a decode server, and forwards the prefill's prompt token ids so the
decode server does not render and tokenize the prompt a second time. The map of the
code: docs/ARCHITECTURE.md.
"""

from ._client import AsyncPDChatClient, PDChatClient
from ._errors import PDConfigError, PDError, PDSetupError
from ._observe import CallView, LegView, PDObserver
from ._options import PDOptions
from ._trace import CostDecision, Outcome, PDTrace
from .conversations import ConversationSettings
from .fleet import DiscoverySettings, HealthSettings, ScrapeSettings
from .pools import BreakerSettings, RetrySettings
from .routing import CacheAware, LoadAware, RouteDecision, RouteRequest, RoutingPolicy
from .transport import AsyncPDTransport, PDTransport

__version__ = "0.2.0"

__all__ = [
    "AsyncPDChatClient",
    "AsyncPDTransport",
    "BreakerSettings",
    "CacheAware",
    "CallView",
    "ConversationSettings",
    "CostDecision",
    "DiscoverySettings",
    "HealthSettings",
    "LegView",
    "LoadAware",
    "Outcome",
    "PDChatClient",
    "PDConfigError",
    "PDError",
    "PDObserver",
    "PDOptions",
    "PDSetupError",
    "PDTrace",
    "PDTransport",
    "RetrySettings",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "ScrapeSettings",
    "__version__",
]
