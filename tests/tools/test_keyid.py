"""tools/keyid.py: API keys on stdin -> the ids the ingress uses."""

from __future__ import annotations

import hashlib
import io

from tools import keyid


def test_key_ids_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-a\n\nsk-b\n"))
    assert keyid.main([]) == 0
    # Derived by hand: "k-" and the first 12 hex digits of the key's SHA-256.
    want = ["k-" + hashlib.sha256(k).hexdigest()[:12] for k in (b"sk-a", b"sk-b")]
    assert capsys.readouterr().out.split() == want
