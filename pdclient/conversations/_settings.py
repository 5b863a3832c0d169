"""How conversations are remembered and when ``remote_prefill="auto"`` skips the prefill: ``ConversationSettings``."""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import PDConfigError


@dataclass(frozen=True)
class ConversationSettings:
    """How conversations are remembered and when ``auto`` skips the remote prefill."""

    max_decode_stall_share: float = 0.1
    """``auto``: a call goes decode-only only if the decode server's running streams would
    wait at most this share of their answer's time while it computes the call's uncached
    tokens (``costs.RouteCosts``). A stall of S ms on an answer that streams for D ms (its
    first token to its last) adds S/D to its time per output token, so the default keeps the
    stalled streams' TPOT within ~10 % of what it was, on any machine: D is learnt per decode
    endpoint from the answers streamed there (``costs.CostModel.answer_ms``; 1.5 s until
    then, a 150 ms budget). On the CPU pair, ~40-token answers at ~44 ms a token (AVX-512)
    give ~170 ms, at ~128 ms a token (AVX2, float32) ~500 ms; a GPU's 500-token answers at
    ~15 ms a token ~750 ms. 0 sends no call decode-only while streams run."""
    max_decode_stall_ms: float | None = None
    """``auto``: a fixed budget in ms instead of the share (None: the share decides): the
    most a decode-only call may make the decode's running streams wait."""
    threshold_tokens: int | None = None
    """``auto``: when set, a call with at least this many estimated uncached tokens is a
    handoff whatever the costs say (the fixed rule vllm-router's and llm-d's deciders use)."""
    max_uncached_ratio: float = 0.7
    """``auto``: a call with at least this fraction of its prompt uncached is a handoff
    (Dynamo's default ratio): a conversation's first turn, whose prefix is nowhere."""
    block_size: int = 128
    """The decode servers' KV block size. vLLM's CPU default; GPU servers default to 16.
    Too large only counts a few more tokens as uncached."""
    max_conversations: int = 10_000
    """LRU bound of the memory (under 400 bytes an entry)."""
    ratio_warmup: int = 8
    """Server counts to learn from before the learned chars-per-token ratio is used as it
    is; until then with a margin (25 % more tokens)."""
    initial_chars_per_token: float = 2.0
    """The ratio before the first server count: low, so tokens are over-estimated."""
    ratio_window: int = 64
    """A tenant's learned ratio is over its this many most recent samples."""
    overhead_tokens_per_message: int = 8
    """Template tokens per message (role markers, separators) added to every estimate."""
    unseen_history_tokens: int = 2048
    """Of a call's history that this memory did not see answered (turns another replica or
    worker answered, or turns made up), at most this many tokens count as cached on the
    call's word alone: the most such a call can put on a decode server's prefill if the
    history is not there (made up, or evicted). Enough for a conversation's first follow-up
    through another replica after a ~1,000-token first turn; 0 trusts none of it (a process
    then hands off the first follow-up it sees of a conversation another one answered)."""
    warm_prefill: bool = True
    """A decode-only call by ``auto`` also sends its prompt to the prefill server, off the
    caller's path, so a later P/D turn prefills only what is new (``fleet._warm``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.warm_prefill, bool):
            raise PDConfigError(f"conversations.warm_prefill must be a bool, got {self.warm_prefill!r}")
        if self.threshold_tokens is not None:
            value = self.threshold_tokens
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PDConfigError(f"conversations.threshold_tokens must be an int >= 0 or None, got {value!r}")
        stall = self.max_decode_stall_ms
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, int | float) or not 0 <= stall < float("inf")
        ):
            raise PDConfigError(
                f"conversations.max_decode_stall_ms must be a finite number >= 0 or None, got {stall!r}"
            )
        share = self.max_decode_stall_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise PDConfigError(f"conversations.max_decode_stall_share must be in [0, 1], got {share!r}")
        for name in ("ratio_warmup", "overhead_tokens_per_message", "unseen_history_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PDConfigError(f"conversations.{name} must be an int >= 0, got {value!r}")
        for name in ("block_size", "max_conversations", "ratio_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PDConfigError(f"conversations.{name} must be an int >= 1, got {value!r}")
        ratio = self.max_uncached_ratio
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0.0 < ratio <= 1.0:
            raise PDConfigError(f"conversations.max_uncached_ratio must be in (0, 1], got {ratio!r}")
        initial = self.initial_chars_per_token
        if not isinstance(initial, int | float) or isinstance(initial, bool) or not initial > 0:
            raise PDConfigError(f"conversations.initial_chars_per_token must be > 0, got {initial!r}")

    def stall_budget_ms(self, answer_ms: float) -> float:
        """What a decode-only call may make the decode's running streams wait, whose answers
        stream for ``answer_ms``: the fixed budget when one is set, else the share of it."""
        if self.max_decode_stall_ms is not None:
            return float(self.max_decode_stall_ms)
        return self.max_decode_stall_share * answer_ms
