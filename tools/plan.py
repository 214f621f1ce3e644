"""`python -m tools.plan --stack <name>` (`make plan STACK=<name>`): a stack's capacity plan.

What flows through here: `stacks/Pulumi.<name>.yaml` is read offline (tools.stackfile) and
validated (infra.config.load, which already rejects a model that does not fit its GPUs);
the valid config goes to infra.plan.planning.plan (per model, with cost per model and per
pool first when the stack serves several: infra.plan.model_plans) and its table to stdout. A bad stack file
prints its one-line error to stderr and exits 1. `plan` and `format_plan` are re-exported
here for `make render`.
"""

from __future__ import annotations

import argparse
import sys

from infra.config import ConfigError
from infra.paths import stack_file
from infra.plan.model_plans import format_stack_plan
from infra.plan.planning import Plan, Workload, format_plan, plan
from tools.stackfile import StackFileError, load_offline, read

__all__ = ["Plan", "format_plan", "main", "plan"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.plan",
        description="Capacity plan for a stack: memory per GPU, KV cache, KV transfer time, "
        "decode roofline, GPU count and on-demand cost, and time to serve per role.",
    )
    parser.add_argument("--stack", required=True, help="stack name: stacks/Pulumi.<stack>.yaml")
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="context length the decode roofline assumes (default: maxModelLen)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=Workload.prompt_tokens,
        metavar="TOKENS",
        help="prompt length the scale-out rates assume (default %(default)s)",
    )
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=Workload.output_tokens,
        metavar="TOKENS",
        help="output length the scale-out rates assume (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.output_tokens < 1:
        parser.error("--prompt-tokens and --output-tokens must be positive")
    if args.context is not None and args.context < 1:
        parser.error("--context must be a positive number of tokens")
    try:
        # The plan needs no secret: one the file lacks is stood in for.
        config = load_offline(*read(args.stack), stack_file(args.stack)).config
    except (StackFileError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 1
    print(f"Capacity plan: {stack_file(args.stack)} ({config.environment.value})")
    # Several models (serving.models): cost per model and per pool, then each model's plan.
    print(
        format_stack_plan(config, context_len=args.context, workload=Workload(args.prompt_tokens, args.output_tokens))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
