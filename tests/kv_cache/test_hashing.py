"""Chained block hashing: what each hash depends on, and determinism across processes."""
import json
import subprocess
import sys

import pytest

from kvserve.kv_cache.utils import (
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
)
from kvserve.request import Request

PROMPT = list(range(100, 123))  # 23 tokens


def _hashes(prompt, hash_block_size=4, algo="sha256", **kwargs):
    hasher = get_request_block_hasher(hash_block_size, get_hash_fn_by_name(algo))
    return Request("r", prompt, block_hasher=hasher, **kwargs).block_hashes


def test_one_hash_per_complete_unit_after_any_appends():
    hasher = get_request_block_hasher(4, get_hash_fn_by_name("sha256"))
    request = Request("r", PROMPT[:6], block_hasher=hasher)
    assert len(request.block_hashes) == 1
    for token in PROMPT[6:]:
        request.append_output_token_ids(token)
        assert len(request.block_hashes) == request.num_tokens // 4
    request.append_output_token_ids([1, 2, 3, 4, 5])
    assert len(request.block_hashes) == request.num_tokens // 4
    # Appending token by token gives the same chain as hashing the whole sequence at once.
    assert request.block_hashes == _hashes(request.all_token_ids)


def test_chain_matches_hash_block_tokens():
    fn = get_hash_fn_by_name("sha256")
    expected, parent = [], None
    for start in range(0, 20, 4):
        parent = hash_block_tokens(fn, parent, PROMPT[start:start + 4])
        expected.append(parent)
    assert _hashes(PROMPT) == expected
    assert hash_block_tokens(fn, None, PROMPT[:4]) == hash_block_tokens(fn, init_none_hash(fn), PROMPT[:4])


@pytest.mark.parametrize("changed_token", [0, 5, 11, 19])
def test_changing_a_token_changes_every_hash_from_its_unit_on(changed_token):
    base = _hashes(PROMPT)
    changed = list(PROMPT)
    changed[changed_token] += 1
    other = _hashes(changed)
    unit = changed_token // 4
    assert other[:unit] == base[:unit]
    assert all(a != b for a, b in zip(other[unit:], base[unit:]))


def test_salt_and_lora_change_every_hash():
    base = _hashes(PROMPT)
    salted = _hashes(PROMPT, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(base, salted))
    assert salted == _hashes(PROMPT, cache_salt="tenant-a")
    assert salted != _hashes(PROMPT, cache_salt="tenant-b")

    hasher = get_request_block_hasher(4, get_hash_fn_by_name("sha256"))
    request = Request("r", [], block_hasher=hasher)
    request.lora_name = "adapter"
    request.append_output_token_ids(PROMPT)
    assert all(a != b for a, b in zip(base, request.block_hashes))


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "builtin"])
def test_every_algorithm_is_chained_and_distinguishes_content(algo):
    hashes = _hashes(PROMPT, algo=algo)
    assert len(set(hashes)) == len(hashes) == 5
    assert hashes == _hashes(PROMPT, algo=algo)
    assert _hashes(PROMPT[:8], algo=algo) == hashes[:2]


def test_unknown_algorithm_is_rejected():
    with pytest.raises(ValueError, match="unknown"):
        get_hash_fn_by_name("md5")


def test_sha256_hashes_are_identical_in_another_process():
    code = ("import json; from kvserve.kv_cache.utils import get_request_block_hasher, get_hash_fn_by_name;"
            "from kvserve.request import Request;"
            f"r = Request('x', {PROMPT!r}, block_hasher=get_request_block_hasher(4, get_hash_fn_by_name('sha256')),"
            " cache_salt='s');"
            "print(json.dumps([h.hex() for h in r.block_hashes]))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}  # no PYTHONHASHSEED: a random salt for hash()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert json.loads(out.stdout) == [h.hex() for h in _hashes(PROMPT, cache_salt="s")]


def test_group_id_round_trips_and_separates_groups():
    block_hash = _hashes(PROMPT)[0]
    key0 = make_block_hash_with_group_id(block_hash, 0)
    key7 = make_block_hash_with_group_id(block_hash, 7)
    assert key0 != key7
    assert get_block_hash(key7) == block_hash and get_group_id(key7) == 7
    assert BlockHashWithGroupId(b"plain bytes") == b"plain bytes"


def test_coarse_view_takes_the_last_fine_hash_of_each_block():
    fine = _hashes(PROMPT, hash_block_size=2)  # 11 units
    coarse = BlockHashListWithBlockSize(fine, hash_block_size=2, block_size=4)
    assert len(coarse) == 5
    assert list(coarse) == [fine[1], fine[3], fine[5], fine[7], fine[9]]
    assert coarse[-1] == fine[9]
