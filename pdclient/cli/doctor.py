"""`pdclient doctor`: can this prefill/decode pair do a token-reusing handoff?

Every check talks to the servers the way PDChatClient does (the wire contract in
docs/ARCHITECTURE.md),
with plain httpx, so a failure points at the servers and not at the client:

1. both endpoints answer ``GET /models`` and serve the same model;
2. the prefill leg returns ``prompt_token_ids`` and ``kv_transfer_params`` (which KV
   connector, if any);
3. a full handoff completes and gives the decode server's own greedy answer;
4. the decode server took the prompt's KV from its connector, not from recomputing it
   (``vllm:external_prefix_cache_hits`` on its ``/metrics``);
5. the decode server honors forwarded ids: a decode call whose messages differ from the
   forwarded ids answers the ids' prompt.

The probe prompts carry a random tag so neither server's prefix cache has seen them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import secrets
import time
from typing import Any

import httpx

from ..wire import PREFILL_KV_TRANSFER_PARAMS
from ._common import add_pair_arguments, open_pair, seconds

_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_ANSWER_TOKENS = 12


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None
    """True passed, False failed, None could not be told."""
    detail: str


@dataclasses.dataclass
class DoctorReport:
    prefill_url: str
    decode_url: str
    model: str | None = None
    checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def can_reuse_tokens(self) -> bool:
        """True only when every check passed: decode reuses the prefill's ids and its KV."""
        return bool(self.checks) and all(c.ok is True for c in self.checks)

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    def table(self) -> str:
        mark = {True: "ok", False: "FAIL", None: "?"}
        width = max(len(c.name) for c in self.checks) if self.checks else 10
        lines = [
            f"pdclient doctor  prefill={self.prefill_url}  decode={self.decode_url}  model={self.model or '?'}",
            f"  {'check':<{width}}  {'result':<6}  detail",
        ]
        lines += [f"  {c.name:<{width}}  {mark[c.ok]:<6}  {c.detail}" for c in self.checks]
        if self.can_reuse_tokens:
            lines.append("verdict: the pair can do a token-reusing P/D handoff")
        elif any(c.ok is False for c in self.checks):
            lines.append("verdict: NO token-reusing P/D handoff with this pair (see FAIL above)")
        else:
            lines.append("verdict: could not confirm a token-reusing P/D handoff (see ? above)")
        return "\n".join(lines)


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _root(url: str) -> str:
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _error_text(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return f"{type(exc).__name__}: {exc}"


class _Doctor:
    def __init__(self, http: httpx.Client, prefill: str, decode: str) -> None:
        self.http = http
        self.prefill = prefill
        self.decode = decode

    def models(self, base: str) -> list[str]:
        r = self.http.get(f"{base}/models")
        r.raise_for_status()
        return [m["id"] for m in r.json()["data"]]

    def chat(self, base: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(f"{base}/chat/completions", json=body)
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def external_hits(self) -> float | None:
        """Prompt tokens the decode server has taken from its KV connector so far."""
        try:
            r = self.http.get(f"{_root(self.decode)}/metrics")
            r.raise_for_status()
        except httpx.HTTPError:
            return None
        values = [float(m) for m in re.findall(rf"^{re.escape(_EXTERNAL_HITS)}(?:{{[^}}]*}})? (\S+)$", r.text, re.M)]
        return sum(values) if values else None

    def prefill_metric_families(self) -> str:
        try:
            return self.http.get(f"{_root(self.prefill)}/metrics").text
        except httpx.HTTPError:
            return ""


def _connector_name(kv: dict[str, Any], prefill_metrics: str) -> str:
    # The prefill's kv_transfer_params do not name the connector; its metrics do for NIXL.
    if "vllm:nixl_" in prefill_metrics:
        return "NixlConnector"
    if {"remote_engine_id", "remote_block_ids"} <= kv.keys():
        return "a NIXL-style pull connector"
    return "an unnamed connector"


def run_doctor(
    prefill_url: str,
    decode_url: str,
    model: str | None = None,
    *,
    api_key: str | None = None,
    timeout: float = 120.0,
) -> DoctorReport:
    """Probe a prefill/decode pair; see the module docstring for the checks."""
    prefill, decode = _v1(prefill_url), _v1(decode_url)
    report = DoctorReport(prefill, decode)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, headers=headers) as http:
        _diagnose(_Doctor(http, prefill, decode), report, model)
    return report


def _diagnose(doc: _Doctor, report: DoctorReport, model: str | None) -> None:
    served: dict[str, list[str]] = {}
    for role, base in (("prefill", doc.prefill), ("decode", doc.decode)):
        try:
            served[role] = doc.models(base)
            report.add(f"{role} endpoint", True, f"answers, serves {', '.join(served[role]) or 'no model'}")
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            report.add(f"{role} endpoint", False, f"GET {base}/models failed: {_error_text(exc)}")
    if len(served) < 2:
        return

    common = [m for m in served["prefill"] if m in served["decode"]]
    if model is None and common:
        model = common[0]
    report.model = model
    if model is None or model not in common:
        wanted = f"{model!r}" if model else "a common model"
        report.add(
            "same model",
            False,
            f"{wanted} is not served by both (prefill {served['prefill']}, decode {served['decode']})",
        )
        return
    report.add("same model", True, model)

    tag = secrets.token_hex(3)
    question_a = f"[{tag}] What is the capital of France? Answer in one sentence."
    question_b = f"[{tag}] Name three colors of the rainbow."

    def body(question: str, **extra: Any) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": _ANSWER_TOKENS,
            "temperature": 0,
            **extra,
        }

    # 2. The prefill leg, exactly as PDChatClient sends it.
    try:
        pre = doc.chat(
            doc.prefill,
            body(question_a, max_tokens=1, return_token_ids=True, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS)),
        )
    except (httpx.HTTPError, ValueError) as exc:
        report.add("prefill leg", False, f"POST {doc.prefill}/chat/completions failed: {_error_text(exc)}")
        return
    ids = pre.get("prompt_token_ids")
    if not (isinstance(ids, list) and ids):
        report.add(
            "prefill returns prompt ids",
            False,
            "no prompt_token_ids in the response (vLLM too old to honor return_token_ids?)",
        )
        return
    report.add("prefill returns prompt ids", True, f"{len(ids)} prompt_token_ids")
    kv = pre.get("kv_transfer_params")
    if isinstance(kv, dict) and kv:
        name = _connector_name(kv, doc.prefill_metric_families())
        report.add("prefill KV connector", True, f"{name}: kv_transfer_params with {', '.join(sorted(kv))}")
    else:
        report.add("prefill KV connector", False, "kv_transfer_params is null: the prefill server has no KV connector")
        kv = {}

    # 3+4. The decode leg: the prefill's kv_transfer_params plus its ids. Run before any
    # plain call on question A, so the decode's own prefix cache cannot hold this prompt.
    hits_before = doc.external_hits()
    t0 = time.perf_counter()
    try:
        handoff = doc.chat(doc.decode, body(question_a, kv_transfer_params={**kv, "prompt_token_ids": ids}))
    except (httpx.HTTPError, ValueError) as exc:
        report.add("handoff completes", False, f"decode leg failed: {_error_text(exc)}")
        return
    handoff_ms = (time.perf_counter() - t0) * 1000
    handoff_text = handoff["choices"][0]["message"]["content"]
    hits_after = doc.external_hits()

    try:
        own_a = doc.chat(doc.decode, body(question_a))["choices"][0]["message"]["content"]
        own_b = doc.chat(doc.decode, body(question_b))["choices"][0]["message"]["content"]
    except (httpx.HTTPError, ValueError) as exc:
        report.add("handoff completes", False, f"plain decode call failed: {_error_text(exc)}")
        return
    if handoff_text == own_a:
        report.add("handoff completes", True, f"decode answered in {handoff_ms:.0f} ms, same text as decode alone")
    else:
        report.add("handoff completes", False, f"answer differs from decode alone: {handoff_text!r} vs {own_a!r}")

    if hits_before is None or hits_after is None:
        report.add("decode pulled the KV", None, f"cannot tell: no {_EXTERNAL_HITS} on the decode /metrics")
    elif hits_after > hits_before:
        report.add(
            "decode pulled the KV", True, f"{hits_after - hits_before:.0f} prompt tokens came from the KV connector"
        )
    else:
        report.add("decode pulled the KV", False, "0 prompt tokens from a KV connector: decode recomputed the prompt")

    # 5. Messages say B, forwarded ids say A: whose answer comes back?
    if own_a == own_b:
        report.add("decode honors forwarded ids", None, "cannot tell: the two probe prompts gave the same answer")
        return
    try:
        probe = doc.chat(doc.decode, body(question_b, kv_transfer_params={"prompt_token_ids": ids}))
    except (httpx.HTTPError, ValueError) as exc:
        report.add("decode honors forwarded ids", False, f"decode rejected forwarded ids: {_error_text(exc)}")
        return
    probe_text = probe["choices"][0]["message"]["content"]
    if probe_text == own_a:
        report.add("decode honors forwarded ids", True, "answer followed the forwarded ids, not the messages")
    elif probe_text == own_b:
        report.add("decode honors forwarded ids", False, "answer followed the messages: decode re-tokenizes the prompt")
    else:
        report.add("decode honors forwarded ids", None, f"cannot tell: answer matches neither probe ({probe_text!r})")


def register(commands: Any) -> None:
    """Add the `doctor` subcommand to the `pdclient` parser's subparsers."""
    doctor = commands.add_parser(
        "doctor",
        help="check that a prefill/decode pair can do a token-reusing handoff",
        description="Probe a prefill and a decode server the way PDChatClient uses them and print one table. "
        "Exit code 0 only when the pair can do a token-reusing P/D handoff.",
    )
    add_pair_arguments(doctor)
    doctor.add_argument(
        "--timeout", type=seconds("--timeout"), default=120.0, help="seconds per HTTP request (default: 120)"
    )
    doctor.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_pair(args) as (prefill, decode, model):
        report = run_doctor(prefill, decode, model, api_key=args.api_key, timeout=args.timeout)
    print(report.table())
    return 0 if report.can_reuse_tokens else 1
