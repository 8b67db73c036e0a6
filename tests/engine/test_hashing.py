"""Chained block keys (DESIGN.md "Blocks and keys")."""

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.engine.core.hashing import ROOT_PARENT_KEY, block_keys, make_namespace

REPO_ROOT = Path(__file__).resolve().parents[2]
NS = make_namespace("llama-test", None)
B = 4


def test_one_key_per_full_block_partial_tail_unkeyed():
    assert block_keys([], B, NS) == []
    assert block_keys([1, 2, 3], B, NS) == []
    keys = block_keys(list(range(11)), B, NS)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert keys == block_keys(list(range(8)), B, NS)  # the tail does not change full keys


def test_rule_matches_spec_literally():
    tokens = [5, -1, 70000, 2**31 - 1]
    expected = hashlib.sha256(ROOT_PARENT_KEY + struct.pack("<4i", *tokens) + NS).digest()
    assert ROOT_PARENT_KEY == bytes(32)
    assert block_keys(tokens, B, NS) == [expected]
    nxt = hashlib.sha256(expected + struct.pack("<4i", 1, 2, 3, 4) + NS).digest()
    assert block_keys(tokens + [1, 2, 3, 4], B, NS)[1] == nxt


def test_prefix_sharing_gives_equal_leading_keys():
    a = block_keys(list(range(16)) + [100, 101, 102, 103], B, NS)
    b = block_keys(list(range(16)) + [200, 201, 202, 203, 7], B, NS)
    assert a[:4] == b[:4] and a[4] != b[4]


def test_changed_token_changes_keys_from_its_block_on():
    base = list(range(20))
    changed = list(base)
    changed[9] = 999  # block 2
    ka, kb = block_keys(base, B, NS), block_keys(changed, B, NS)
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:]))


def test_same_tokens_in_other_position_differ():
    keys = block_keys([1, 2, 3, 4] * 3, B, NS)
    assert len(set(keys)) == 3


@pytest.mark.parametrize("other", [make_namespace("llama-test", "tenant-a"),
                                   make_namespace("llama-test", ""),
                                   make_namespace("other-model", None)])
def test_namespace_changes_all_keys(other):
    tokens = list(range(12))
    assert set(block_keys(tokens, B, NS)).isdisjoint(block_keys(tokens, B, other))


def test_namespace_is_unambiguous():
    assert make_namespace("ab", "c") != make_namespace("a", "bc")
    assert make_namespace("a", None) != make_namespace("a", "")
    assert make_namespace("a", "x") == make_namespace("a", "x")


def test_invalid_inputs():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, NS)
    with pytest.raises(ValueError):
        block_keys([2**31, 0, 0, 0], B, NS)


def test_keys_stable_across_processes():
    tokens = list(range(1000, 1037))
    code = ("from pdcluster.engine.core.hashing import block_keys, make_namespace;"
            f"print(','.join(k.hex() for k in block_keys({tokens!r}, {B}, "
            "make_namespace('llama-test', 'salt'))))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    here = block_keys(tokens, B, make_namespace("llama-test", "salt"))
    assert out.split(",") == [k.hex() for k in here]
