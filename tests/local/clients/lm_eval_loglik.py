"""lm-evaluation-harness's `local-completions` model computing log-likelihoods: run in
.venv-clients by tests/local/test_clients_e2e.py, which compares the servers' answers.

What flows through here: targets (name, OpenAI base URL, model, key), the tiny model's
tokenizer directory -> for each target, lm-eval's API model (`LocalCompletionsAPI`, as
`--model local-completions` builds it) with the Hugging Face tokenizer from that directory
-> `loglikelihood` on a handful of (context, continuation) pairs, no task and no data set
(nothing is downloaded): each pair one /completions request with echo, logprobs 1 and
max_tokens 1, sent as token ids (lm-eval's default) and as text (`tokenized_requests=False`)
-> one `RESULT <json>` line: {target: {"tokens"|"text": [[log-likelihood, is_greedy], ...]}}.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

# (context, continuation): the continuation's leading space belongs to it, as lm-eval asks.
PAIRS = [
    ("The sea is", " blue"),
    ("Disaggregated serving splits prefill and decode", " across two engines."),
    ("One, two,", " three"),
    ("", "Hello there"),  # an empty context: lm-eval conditions on the prefix token
    ("Question: what colour is the sky? Answer:", " The sky is blue."),
    ("a b c d e f", " g h i"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target",
        nargs=4,
        action="append",
        metavar=("NAME", "BASE_URL", "MODEL", "KEY"),
        required=True,
        help="a server to score on (BASE_URL is …/v1)",
    )
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer directory")
    parser.add_argument("--check", action="store_true", help="load lm-eval's model and tokenizer only")
    return parser.parse_args(argv)


def _model(base_url: str, model: str, key: str, tokenizer: str, tokenized: bool) -> Any:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=f"{base_url}/completions",
        model=model,
        tokenizer_backend="huggingface",
        tokenizer=tokenizer,
        tokenized_requests=tokenized,
        header={"Authorization": f"Bearer {key}"},
        max_retries=1,  # an error is an answer here: no retry hides it
        max_length=1024,  # the tiny model's context
        timeout=180,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)]
    out: dict[str, Any] = {}
    for name, base_url, model, key in args.target:
        out[name] = {}
        for mode, tokenized in (("tokens", True), ("text", False)):
            lm = _model(base_url, model, key, args.tokenizer, tokenized)
            if args.check:
                out[name][mode] = lm.tok_encode(PAIRS[0][0])
                continue
            out[name][mode] = [[float(ll), bool(greedy)] for ll, greedy in lm.loglikelihood(requests)]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("RESULT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
