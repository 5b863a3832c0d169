"""pdclient's vLLM plugin: reuse forwarded prompt ids, return them from a prefill, guard the channel, catch drift.

Loaded by vLLM from the ``vllm.general_plugins`` entry point ``pdclient_reuse`` in every
vLLM process (API server, engine core, workers); ``VLLM_PLUGINS`` allowlists it by that
name. Independent parts, each described where it lives:

- reuse (``_reuse.py``): on vLLM 0.20 - 0.26, honor ``kv_transfer_params["prompt_token_ids"]``
  on the chat path as vLLM 0.27+ does natively; on 0.27+ do nothing.
- prompt ids (``_prompt_ids.py``): a prefill whose ``kv_transfer_params`` ask for
  ``return_prompt_token_ids`` returns the prompt's ids in the ``kv_transfer_params`` of its
  answer, on every route (Responses and Messages included), on every supported vLLM.
- guard (``_guard.py``, ``wire/_signing.py``): with ``PDCLIENT_REUSE_SECRET`` set, 403 for any
  request that carries ``kv_transfer_params`` without a valid ``X-PDClient-Signature``
  (spec v2: an HMAC of the whole request, with expiry and nonce).
- drift check (``_verify.py``): with ``PDCLIENT_REUSE_VERIFY_RATE`` > 0, re-render a sample of
  reused prompts in the background and count mismatches on /metrics.
- NIXL on CPU (``_nixl_cpu.py``), for small CPU hosts: with ``PDCLIENT_NIXL_PROGRESS_DELAY_US``
  > 0, NIXL's progress thread sleeps that long between rounds instead of spinning a core;
  with ``PDCLIENT_NIXL_KV_CPUS`` (a CPU list), vLLM's NIXL worker keeps its thread there
  instead of moving it to the machine's last core.
- idle wait (``_idle_wait.py``): with ``PDCLIENT_IDLE_WAIT_MS`` > 0, an engine whose only work
  is waiting for remote KV (a push-mode decode registered before its prefill ran) waits on
  its input queue between steps, up to that long, instead of stepping every millisecond.
- push reclaim (``_push_reclaim.py``): with ``PDCLIENT_PUSH_RECLAIM_GRACE_S`` > 0, on vLLM 0.32,
  a push-mode decode aborted while waiting for its KV frees its blocks once the prefill
  server's lease plus that grace has passed with no WRITE, instead of never.
- stale write (``_stale_write.py``): with ``PDCLIENT_PUSH_REFUSE_STALE_WRITE=1``, on vLLM 0.32, a
  push-mode prefill server posts no WRITE for a request whose lease ended or whose push
  completed (its blocks may belong to another request by then).
- push fail (``_push_fail.py``): with ``PDCLIENT_PUSH_FAIL_NOTIFY=1`` on both servers, on vLLM 0.32,
  a push-mode prefill server that posts no WRITE for a registered decode (a failed
  submission, a refused stale WRITE, a registration after its request was let go) tells
  the decode (``PUSH_FAIL``), which fails the request's KV load instead of waiting.

With none of these variables set on vLLM 0.27+, the plugin changes nothing for a request
that does not ask for its prompt ids.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._signing import DEFAULT_MAX_AGE, SIGNATURE_HEADER, signature, verify

__all__ = ["SIGNATURE_HEADER", "register", "signature", "verify"]
__version__ = "0.2.0"

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

SECRET_ENV = "PDCLIENT_REUSE_SECRET"
VERIFY_RATE_ENV = "PDCLIENT_REUSE_VERIFY_RATE"
MAX_AGE_ENV = "PDCLIENT_REUSE_MAX_AGE"
NIXL_DELAY_ENV = "PDCLIENT_NIXL_PROGRESS_DELAY_US"
NIXL_KV_CPUS_ENV = "PDCLIENT_NIXL_KV_CPUS"
IDLE_WAIT_ENV = "PDCLIENT_IDLE_WAIT_MS"
PUSH_RECLAIM_ENV = "PDCLIENT_PUSH_RECLAIM_GRACE_S"
STALE_WRITE_ENV = "PDCLIENT_PUSH_REFUSE_STALE_WRITE"
PUSH_FAIL_ENV = "PDCLIENT_PUSH_FAIL_NOTIFY"

# The oldest vLLM whose chat seams this plugin knows (renderers/base.py with
# BaseRenderer.render_chat_async, and a chat renderer class with preprocess_chat).
MIN_VLLM = (0, 20)
# The first vLLM with native reuse (vllm-project/vllm#48145).
NATIVE_VLLM = (0, 27)

# The vLLM releases whose push-mode connector and scheduler the push fixes were read
# against and tested on: the seams they wrap are private and change between releases.
PUSH_FIXES_VLLM = ((0, 32),)

# Where the chat renderer class lives, newest first: ``OnlineRenderer`` from 0.26 on,
# ``OpenAIServingRender`` in 0.20. Both have ``preprocess_chat`` (the text path) and
# ``_make_request_with_harmony`` (gpt-oss), the two places vLLM 0.27+ reads the ids.
CHAT_SEAMS = (
    ("vllm.renderers.online_renderer", "OnlineRenderer"),
    ("vllm.entrypoints.serve.render.serving", "OpenAIServingRender"),
)


@dataclass
class State:
    """What ``register()`` did in this process (read by tests and the startup log)."""

    registered: bool = False
    vllm_version: str | None = None
    applied: dict[str, str] = field(default_factory=dict)


STATE = State()
_lock = threading.Lock()


def register() -> None:
    """vLLM plugin entry point. Idempotent; never raises (vLLM does not catch it)."""
    with _lock:
        if STATE.registered:
            return
        STATE.registered = True
        try:
            _register()
            _log_when_configured(
                "pdclient_reuse %s on vLLM %s: %s",
                __version__,
                STATE.vllm_version,
                "; ".join(f"{part}: {what}" for part, what in STATE.applied.items()),
            )
        except Exception:
            logger.exception(
                "pdclient_reuse: not applied (unexpected error); applied before it: %s", STATE.applied or "nothing"
            )


def _log_when_configured(msg: str, *args: Any) -> None:
    """Log at INFO now, or right after vLLM configures logging if it has not yet.

    vLLM 0.32 configures its loggers only once its CLI arguments are parsed, and loads
    plugins while building the parser: an INFO line logged from register() would be
    dropped. So the line waits for ``vllm.logger.configure_logging`` (0.20 - 0.26 configure
    logging at import, and the line goes out at once).
    """
    if logging.getLogger("vllm").handlers:
        logger.info(msg, *args)
        return
    try:
        import vllm.logger as vllm_logger

        configure = vllm_logger.configure_logging
    except (ImportError, AttributeError):
        logger.info(msg, *args)
        return

    def configure_logging(*c_args: Any, **c_kwargs: Any) -> Any:
        vllm_logger.configure_logging = configure  # one-shot
        result = configure(*c_args, **c_kwargs)
        logger.info(msg, *args)
        return result

    vllm_logger.configure_logging = configure_logging


def _register() -> None:
    import vllm  # lazily: importing this package must not import vLLM

    STATE.vllm_version = version = getattr(vllm, "__version__", "unknown")
    applied = STATE.applied
    rate = _verify_rate()
    secret = os.environ.get(SECRET_ENV) or None

    seam = _find_chat_seam()
    if seam is None:
        applied["reuse"] = "skipped (no known chat renderer class in this vLLM)"
    elif seam[2]:
        applied["reuse"] = "native (vLLM has _reused_prompt_token_ids), not patched"
    elif _version_tuple(version) < MIN_VLLM:
        applied["reuse"] = f"skipped (vLLM older than {'.'.join(map(str, MIN_VLLM))})"
    elif _version_tuple(version) >= NATIVE_VLLM:
        # Native reuse is expected but its function moved: patching on top could apply
        # the ids twice or not at all. Say so rather than guess.
        applied["reuse"] = "skipped (vLLM 0.27+ without _reused_prompt_token_ids: seam changed, not patching)"
    else:
        applied["reuse"] = _apply_reuse(seam[1])

    applied["prompt ids"] = _apply_prompt_ids()

    if rate <= 0:
        applied["drift check"] = f"off ({VERIFY_RATE_ENV} unset or 0)"
    elif seam is None:
        applied["drift check"] = "skipped (no chat renderer seam)"
    else:
        applied["drift check"] = _apply_verify(seam[1], rate)

    if secret is None and rate <= 0:
        applied["guard"] = f"off ({SECRET_ENV} unset)"
    else:
        from . import _guard

        max_age = _max_age()
        _guard.install(secret, max_age)
        applied["guard"] = (
            f"on ({SECRET_ENV} set: kv_transfer_params need a valid {SIGNATURE_HEADER} v2, max_age {max_age:g} s)"
            if secret
            else f"off ({SECRET_ENV} unset; middleware only records X-Request-Id for the drift check)"
        )

    from . import _nixl_cpu

    delay_us = _nixl_delay_us()
    applied["nixl progress"] = (
        _nixl_cpu.slow_progress_thread(delay_us) if delay_us > 0 else f"off ({NIXL_DELAY_ENV} unset or 0)"
    )
    kv_cpus = _nixl_kv_cpus()
    applied["nixl kv cpus"] = _nixl_cpu.keep_kv_thread_on(kv_cpus) if kv_cpus else f"off ({NIXL_KV_CPUS_ENV} unset)"

    from . import _idle_wait

    idle_wait_ms = _idle_wait_ms()
    applied["idle wait"] = (
        _idle_wait.wait_when_idle(idle_wait_ms / 1000) if idle_wait_ms > 0 else f"off ({IDLE_WAIT_ENV} unset or 0)"
    )

    grace_s = _push_reclaim_grace_s()
    if grace_s <= 0:
        applied["push reclaim"] = f"off ({PUSH_RECLAIM_ENV} unset or 0)"
    elif _version_tuple(version) not in PUSH_FIXES_VLLM:
        applied["push reclaim"] = f"skipped (checked on vLLM {_versions(PUSH_FIXES_VLLM)} only)"
    else:
        from . import _push_reclaim

        applied["push reclaim"] = _push_reclaim.install(grace_s)

    push_fixes = (("stale write", STALE_WRITE_ENV, "_stale_write"), ("push fail", PUSH_FAIL_ENV, "_push_fail"))
    for fix, env, module in push_fixes:
        if not _flag(env):
            applied[fix] = f"off ({env} unset or 0)"
        elif _version_tuple(version) not in PUSH_FIXES_VLLM:
            applied[fix] = f"skipped (checked on vLLM {_versions(PUSH_FIXES_VLLM)} only)"
        else:
            applied[fix] = importlib.import_module(f".{module}", __name__).install()


def _find_chat_seam() -> tuple[Any, type, bool] | None:
    """(module, chat renderer class, has native reuse) for this vLLM, or None."""
    for module_name, class_name in CHAT_SEAMS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is not None and hasattr(cls, "preprocess_chat"):
            return module, cls, callable(getattr(module, "_reused_prompt_token_ids", None))
    return None


def _apply_reuse(cls: type) -> str:
    from vllm.inputs import tokens_input
    from vllm.renderers.base import BaseRenderer

    from . import _reuse

    if not hasattr(BaseRenderer, "render_chat_async"):
        return "skipped (BaseRenderer.render_chat_async missing)"
    _patch(BaseRenderer, "render_chat_async", lambda f: _reuse.wrap_render_chat_async(f, tokens_input))
    _patch(cls, "preprocess_chat", _reuse.wrap_preprocess_chat)
    harmony = hasattr(cls, "_make_request_with_harmony")
    if harmony:
        _patch(cls, "_make_request_with_harmony", lambda f: _reuse.wrap_make_request_with_harmony(f, tokens_input))
    return f"patched {cls.__name__}.preprocess_chat{' and Harmony path' if harmony else ''} (vLLM < 0.27 has no reuse)"


def _apply_prompt_ids() -> str:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return "skipped (no vllm.v1.core.sched.scheduler.Scheduler in this vLLM)"
    if not callable(getattr(Scheduler, "_connector_finished", None)):
        return "skipped (Scheduler._connector_finished missing: seam changed)"
    from . import _prompt_ids

    _patch(Scheduler, "_connector_finished", _prompt_ids.wrap_connector_finished, layer="prompt ids")
    return f"on (kv_transfer_params.{_prompt_ids.FLAG} adds {_prompt_ids.KEY} to the prefill's kv_transfer_params)"


def _apply_verify(cls: type, rate: float) -> str:
    from . import _verify

    _patch(cls, "preprocess_chat", lambda f: _verify.wrap_preprocess_chat(f, rate), layer="verify")
    return f"on for {rate:g} of reused chat prompts (Harmony path not checked)"


def _patch(owner: type, name: str, wrap: Any, layer: str = "reuse") -> None:
    """Replace ``owner.name`` by ``wrap(original)`` once per layer (idempotent across reloads)."""
    current = getattr(owner, name)
    layers = getattr(current, "__pdclient_layers__", frozenset())
    if layer in layers:
        return
    wrapped = wrap(current)
    wrapped.__pdclient_layers__ = layers | {layer}
    setattr(owner, name, wrapped)


def _verify_rate() -> float:
    return _setting(VERIFY_RATE_ENV, _rate, 0.0)


def _max_age() -> float:
    return _setting(MAX_AGE_ENV, _seconds, float(DEFAULT_MAX_AGE))


def _nixl_delay_us() -> int:
    return _setting(NIXL_DELAY_ENV, _microseconds, 0)


def _idle_wait_ms() -> float:
    return _setting(IDLE_WAIT_ENV, _milliseconds, 0.0)


def _push_reclaim_grace_s() -> float:
    return _setting(PUSH_RECLAIM_ENV, _grace_seconds, 0.0)


def _flag(name: str) -> bool:
    return _setting(name, _bool, False)


def _nixl_kv_cpus() -> set[int]:
    return _setting(NIXL_KV_CPUS_ENV, _cpu_list, set())


_T = TypeVar("_T")


def _setting(name: str, parse: Callable[[str], _T], off: _T) -> _T:
    """The variable ``name`` parsed, or ``off`` when it is unset or invalid (said in the log)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return off
    try:
        return parse(raw)
    except ValueError as why:
        logger.warning("pdclient_reuse: ignoring %s=%r (%s)", name, raw, why)
        return off


def _rate(raw: str) -> float:
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError("not a number in 0..1") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError("not in 0..1")
    return rate


def _seconds(raw: str) -> float:
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError("not a number of seconds") from None
    if not 0 < seconds < 86400 * 366:
        raise ValueError("not a positive number of seconds under a year")
    return seconds


def _bool(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("not 0 or 1")
    return raw == "1"


def _grace_seconds(raw: str) -> float:
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError("not a number of seconds") from None
    if not 0 <= seconds <= 3600:
        raise ValueError("not in 0..3600 s")
    return seconds


def _microseconds(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("not a whole number of microseconds")
    return int(raw)


def _milliseconds(raw: str) -> float:
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError("not a number of milliseconds") from None
    if not 0 <= ms <= 1000:
        raise ValueError("not in 0..1000 ms")
    return ms


def _cpu_list(raw: str) -> set[int]:
    from ._nixl_cpu import parse_cpu_list

    try:
        return parse_cpu_list(raw)
    except ValueError:
        raise ValueError("not a CPU list like 0 or 0-3,8") from None


def _versions(versions: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join(".".join(map(str, v)) for v in versions)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (999,)  # unparseable (a source build): trust feature detection
