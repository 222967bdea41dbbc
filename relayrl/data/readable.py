"""What makes a sample readable in the run's sample files (samples.jsonl, eval_samples.jsonl)."""

from __future__ import annotations

from relayrl.v1 import common_pb2


def cut(text: str, max_chars: int) -> str:
    """``text``, or its last ``max_chars`` characters after an ellipsis."""
    return text if len(text) <= max_chars else "…" + text[-max_chars:]


def finish_name(reason: int) -> str:
    """ "stop", "length", "abort" or "unspecified"."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
