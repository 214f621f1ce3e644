"""vLLM's own OpenAI server on the tiny model, with the engine settings the local stack uses:
the baseline `make bench` compares against and the stand-in external provider.

What flows through here: the tiny model's folder, a served name and a port -> the command line
and environment of `python -m vllm.entrypoints.openai.api_server` (local/config.py's model,
tool calling and structured-output settings, so it answers as the stack's engines do).
"""

from __future__ import annotations

import json
import sys

from infra.paths import ROOT
from local.config import (
    HOST,
    LOCAL_CHAT_TEMPLATE,
    LOCAL_STRUCTURED_OUTPUTS,
    LOCAL_TOOL_ENV,
    LOCAL_TOOL_PARSER,
    MAX_MODEL_LEN,
)

PLAIN_VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **LOCAL_TOOL_ENV}


def plain_vllm_argv(model_dir: str, served_name: str, port: int) -> list[str]:
    """The command line of `python -m vllm.entrypoints.openai.api_server` for the tiny model."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--host",
        HOST,
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
        # The same tool calling as the stack's engines (LOCAL_TOOLS), so a plain vLLM server
        # answers tool requests as they do.
        "--tool-call-parser",
        LOCAL_TOOL_PARSER,
        "--enable-auto-tool-choice",
        "--chat-template",
        str(ROOT / LOCAL_CHAT_TEMPLATE),
        "--structured-outputs-config",
        json.dumps(LOCAL_STRUCTURED_OUTPUTS),
    ]
