"""The call tag (``k3tail.ops.fault.call_tag``, DESIGN §9): on the peer kind (the Lamport all-reduce,
the exchange barrier) the tag is the only thing that tells two calls apart, so two different calls
(another layer, another M, another sequence number inside the documented period) must not share one.

Pure host arithmetic: no kernel runs.
"""

from __future__ import annotations

import random

from k3tail.ops.fault import call_tag, layer_salt

SENTINEL32 = 0x80000000
_SEQ_BITS, _M_BITS = 17, 14  # the tag's documented fields (call_tag's docstring)


def test_tags_are_int32_and_never_the_sentinel():
    rng = random.Random()
    for _ in range(20000):
        seq, M, layer = rng.randrange(1 << 40), rng.randrange(1, 1 << 30), rng.randrange(1 << 20)
        t = call_tag(seq, M, layer_salt(layer))
        assert 0 <= t < (1 << 31) and t != SENTINEL32


def test_layer_salt_pinned():
    """The layer salt's values (a refactor must keep them: peers of two builds would disagree)."""
    assert [layer_salt(i) for i in (0, 1, 2, 3, 61)] == [0, 1042007858, 1770755366, 1424297303, 1404316718]


def test_small_m_tag_is_the_documented_formula():
    """Below 2^14 tokens the tag is ``((seq mod 2^17) << 14 | M) ^ salt`` exactly."""
    rng = random.Random()
    for _ in range(5000):
        seq, M, layer = rng.randrange(1 << 20), rng.randrange(1, 1 << _M_BITS), rng.randrange(1, 200)
        s = layer_salt(layer)
        assert call_tag(seq, M, s) == ((((seq % (1 << _SEQ_BITS)) << _M_BITS) | M) ^ s) & 0x7FFFFFFF


def test_no_structural_collision_between_layers_and_large_m():
    """Layer X at M's high part k1 against layer Y at high part k2, same sequence number and low bits:
    equal tags only for the same call.  (With one hash for the layer and M's high bits, X = k2 and
    Y = k1 collided for every sequence number: the XORs cancel.)  Fixed points: among random 31-bit tags
    an unrelated coincidence has odds of about 2^-31 a pair, so fresh draws could fail by chance."""
    for seq, low in ((1, 0), (12345, 100), (99991, 4095)):
        _distinct_tags(seq, low)


def _distinct_tags(seq: int, low: int) -> None:
    seen = {}
    for layer in range(1, 65):
        for high in range(0, 65):
            M = (high << _M_BITS) | low
            if M == 0:
                continue
            t = call_tag(seq, M, layer_salt(layer))
            assert t not in seen, f"layer {layer}, M {M} has the tag of {seen[t]}"
            seen[t] = (layer, M)


def test_same_layer_period():
    """One layer: another sequence number (inside 2^17) or another M gives another tag; the period."""
    s, seq = layer_salt(17), 70001  # fixed: see the test above
    Ms = [1, 2, 16, 64, 4095, 4096, 8192, (1 << _M_BITS) - 1, 1 << _M_BITS, (1 << _M_BITS) + 1, 3 << _M_BITS]
    tags = {call_tag(seq + d, M, s) for d in range(0, 64) for M in Ms}
    assert len(tags) == 64 * len(Ms)
    assert call_tag(seq + (1 << _SEQ_BITS), 7, s) == call_tag(seq, 7, s)  # the documented period
