"""Exceptions raised by pdclient.

    Exception
    ├── PDError                      base of everything pdclient raises itself
    │   ├── PDConfigError (ValueError)   a bad argument, raised at once, naming it
    │   └── PDSetupError                 preparing or starting a local prefill+decode pair
    └── (openai.APIError family)     failures of either leg, seen through the openai SDK

A call never raises a pdclient exception: a leg that answers with an HTTP error status
is handed back to the openai SDK as that response (the leg named in the
``x-pd-failed-leg`` header), a request that cannot take a P/D handoff is a 400 naming
why, and a pool with no admitted endpoint a 503 naming each member; the SDK turns them
into its usual ``openai.APIStatusError`` subclasses, and transport failures into
``openai.APIConnectionError``. A missing optional extra is an ``ImportError`` naming the
extra to install (``pip install 'pdclient[otel]'``).
"""

from __future__ import annotations


class PDError(Exception):
    """Base class of the exceptions pdclient raises itself."""


class PDConfigError(PDError, ValueError):
    """A setting is missing or invalid; the message names it."""


class PDSetupError(PDError):
    """A local prefill+decode pair could not be prepared or started; the message names the log."""
