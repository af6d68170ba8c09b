"""Token log-probabilities in the two shapes OpenAI gives them: chat's `content` list and the
legacy completions' parallel lists."""

from loramux import TokenLogprob

# JSON has no -infinity; a token the sampling filters ruled out gets this (as vLLM does).
FLOOR = -9999.0


def _text(token_bytes: bytes) -> str:
    return token_bytes.decode("utf-8", errors="replace")


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def chat(entries: list[TokenLogprob], alternatives: int) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs}, ...]}, `alternatives` per token."""
    return {
        "content": [
            {
                "token": _text(e.token_bytes),
                "logprob": _value(e.logprob),
                "bytes": list(e.token_bytes),
                "top_logprobs": [
                    {
                        "token": _text(alt.token_bytes),
                        "logprob": _value(alt.logprob),
                        "bytes": list(alt.token_bytes),
                    }
                    for alt in e.top[:alternatives]
                ],
            }
            for e in entries
        ]
    }


def text(entries: list[TokenLogprob], alternatives: int, offset: int) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets count from `offset`, the
    characters of this choice's text sent before these tokens."""
    tokens = [_text(e.token_bytes) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_value(e.logprob) for e in entries],
        "top_logprobs": [
            {_text(alt.token_bytes): _value(alt.logprob) for alt in e.top[:alternatives]} for e in entries
        ],
        "text_offset": offsets,
    }
