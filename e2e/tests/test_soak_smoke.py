"""A short run of the soak test (e2e/soak.py): streams with 10% of clients disconnecting mid-stream
must leave no booking behind and no client error. The 10-minute run with the RSS check is
`bash e2e/soak` (not a CI gate)."""
from __future__ import annotations

import soak


def test_short_soak_leaves_no_bookings():
    r = soak.soak(seconds=8, rate=30, abort_fraction=0.1, sample_every=2)
    load = r["load"]
    assert load["aborted"] > 0, "some clients disconnected mid-stream"
    assert load["errors"] == 0
    assert load["statuses"] == {"200": load["completed"]}
    assert r["inflight_after"] == 0


def test_short_adversarial_soak_leaves_good_traffic_and_kvpick_whole():
    """A short e2e/soak_adversarial run: header bombs, CONTINUATION floods, slow TLS handshakes,
    resets mid-body, 32 MiB bodies, random priorities, API floods and a broken engine beside the
    good traffic. kvpick stays up, good traffic sees no error kvpick caused, no booking is left, and
    every hostile connection is closed by kvpick."""
    import soak_adversarial

    r = soak_adversarial.run(seconds=12, rate=20, adversarial=True)
    assert r["kvpick_alive"]
    assert r["good_errors"] == 0, r["load"]
    assert r["bookings_left"] == 0
    attacks = r["attacks"]
    for name in ("header_bomb_64k", "header_bomb_256k", "continuation_flood"):
        assert attacks[name] and "left_open" not in attacks[name], (name, attacks[name])
    assert set(attacks["api_flood"]) == {"PERMISSION_DENIED"}, attacks["api_flood"]
    assert r["good_answered_by_broken_engine"] <= 6, "the broken engine was ejected"
