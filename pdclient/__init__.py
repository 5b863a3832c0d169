"""pdclient: drop-in openai clients for prefill/decode disaggregated vLLM serving.

A chat or completions call runs a prefill call on a prefill server and a (streamed)
decode call on a decode server, and forwards the prefill's prompt token ids so the
decode server does not render and tokenize the prompt a second time. The map of the
code: docs/ARCHITECTURE.md.
"""

from ._client import AsyncPDChatClient, PDChatClient
from ._conversations import ConversationSettings
from ._discovery import DiscoverySettings
from ._endpoints import BreakerSettings
from ._errors import PDConfigError, PDError, PDSetupError
from ._health import HealthSettings
from ._load import LoadAware, ScrapeSettings
from ._observe import CallView, LegView, PDObserver
from ._options import PDOptions
from ._prefix_index import CacheAware
from ._retry import RetrySettings
from ._routing import RouteDecision, RouteRequest, RoutingPolicy
from ._trace import Outcome, PDTrace
from ._transport import AsyncPDTransport, PDTransport

__version__ = "0.2.0"

__all__ = [
    "AsyncPDChatClient",
    "AsyncPDTransport",
    "BreakerSettings",
    "CacheAware",
    "CallView",
    "ConversationSettings",
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
