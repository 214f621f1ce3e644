"""What a request's prompt holds: one prompt, or several answered apart.

What flows through here: a completion body's `prompt` (OpenAI's and vLLM's forms: a string, a
list of token ids, a list of strings, a list of token-id lists) -> how many prompts it is. The
front door's limits and migration and the decode server's P/D hop all read it.
"""

from __future__ import annotations

from typing import Any


def prompt_count(prompt: Any) -> int:
    """A string or a list of token ids is one prompt; a list of strings or of token-id lists
    is one each."""
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1
