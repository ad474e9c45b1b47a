"""What the scheduler side reads from a vLLM ``Request`` beyond its token ids: multimodal hashes, token count,
LoRA adapter name. Read by attribute name with defaults, so tests can drive the connector with plain objects and
no vLLM installed, and a vLLM without one of these attributes reads as "none"."""

from __future__ import annotations

from typing import Any

__all__ = ["mm_hashes", "num_tokens", "lora_name"]


def mm_hashes(request: Any) -> list[str]:
    """The request's multimodal inputs' hashes (they enter its key chain's root)."""
    out = []
    for f in getattr(request, "mm_features", None) or ():
        h = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if h is not None:
            out.append(str(h))
    return out


def num_tokens(request: Any) -> int:
    """The request's tokens so far (vLLM's Request.num_tokens: prompt and output)."""
    n = getattr(request, "num_tokens", None)
    return int(n) if n is not None else len(getattr(request, "all_token_ids", None) or ())


def lora_name(request: Any) -> str | None:
    lora = getattr(request, "lora_request", None)
    return getattr(lora, "lora_name", None) if lora is not None else None
