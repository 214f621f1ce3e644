"""serving/ingress/tenancy.py: each key's prefix-cache salt, a group's shared one, and a client's
own salt narrowing its key's, never replacing it."""

from __future__ import annotations

from serving.ingress.tenancy import CacheSalts, narrowed
from serving.spec import key_id

A, B, C = "sk-team-a", "sk-team-b", "sk-team-c"
KA, KB, KC = key_id(A), key_id(B), key_id(C)


def salts() -> CacheSalts:
    return CacheSalts((A, B, C))


def test_every_key_has_a_salt_of_its_own_that_its_id_does_not_give_away():
    s = salts()
    a, b = s.salt(KA, True, {}, None), s.salt(KB, True, {}, None)
    assert a and b and a != b
    assert a == s.salt(KA, True, {}, None)  # the same key, the same cache
    assert a == salts().salt(KA, True, {}, None)  # every ingress replica agrees
    assert KA not in a and len(a) == 64 and all(ch in "0123456789abcdef" for ch in a)
    # Another deployment's keys (another secret) do not give the same salt for the same id.
    assert CacheSalts(("sk-elsewhere",)).salt(KA, True, {}, None) is None


def test_a_clients_salt_narrows_its_keys_and_never_reaches_another_keys():
    s = salts()
    a = s.salt(KA, True, {}, None)
    b = s.salt(KB, True, {}, None)
    mine = s.salt(KA, True, {}, "conversation-1")
    assert mine not in (a, b, "conversation-1")
    assert mine == narrowed(a, "conversation-1")
    # Key B sending A's salt (or anything) as its own gets a salt inside B's: never A's.
    assert s.salt(KB, True, {}, a) not in (a, mine)
    assert s.salt(KB, True, {}, "conversation-1") != mine


def test_keys_of_one_group_share_one_salt_and_a_change_of_members_starts_a_new_cache():
    s = salts()
    groups = {KA: "team", KB: "team"}
    shared = s.salt(KA, True, groups, None)
    assert shared == s.salt(KB, True, groups, None) != s.salt(KC, True, groups, None)
    assert shared not in (s.salt(KA, True, {}, None), s.salt(KB, True, {}, None))
    assert s.salt(KA, True, {**groups, KC: "team"}, None) != shared


def test_shared_caches_and_anonymous_requests_pass_the_clients_salt_as_it_came():
    s = salts()
    assert s.salt(KA, False, {}, None) is None
    assert s.salt(KA, False, {}, "mine") == "mine"
    assert s.salt("anonymous", True, {}, None) is None  # auth off: one tenant
    assert s.salt("anonymous", True, {}, "mine") == "mine"
