"""`python -m tools.keyid < keys.txt`: the key id of each API key (one a line on stdin).

What flows through here: API keys on stdin -> `k-` + 12 hex of each key's SHA-256
(serving.spec.key_id, what the ingress computes) on stdout, for `serving.limits.keys` in a
stack file and for reading the per-key usage metrics. Keys come on stdin so they stay out
of shell history and process lists; the ids are safe to commit.
"""

from __future__ import annotations

import sys

from serving.spec import key_id


def main(argv: list[str] | None = None) -> int:
    for line in sys.stdin:
        if line.strip():
            print(key_id(line.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
