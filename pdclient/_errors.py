"""Exceptions raised by pdclient.

    Exception
    ├── PDError                      base of everything pdclient raises itself
    │   ├── PDConfigError (ValueError)   bad constructor or per-call settings, raised at once
    │   ├── PDSetupError                 preparing or starting a local prefill+decode pair
    │   └── PDHandoffError               the P/D handoff could not be completed, with no fallback
    └── (openai.APIError family)     failures of either leg seen through the openai SDK

A leg that answers with an HTTP error status is handed back to the openai SDK as that
response, so callers see the usual ``openai.APIStatusError`` subclasses, with the leg
named in the ``x-pd-failed-leg`` response header.
"""

from __future__ import annotations


class PDError(Exception):
    """Base class of the exceptions pdclient raises itself."""


class PDConfigError(PDError, ValueError):
    """A setting is missing or invalid; the message names it."""


class PDSetupError(PDError):
    """A local prefill+decode pair could not be prepared or started; the message names the log."""


class PDHandoffError(PDError):
    """The P/D handoff failed and the failure policy says to raise."""
