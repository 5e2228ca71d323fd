"""Reference block hashes for conductor/tests/vllm_hash.rs.

Reads {"cases": [{"algorithm", "seed", "block_size", "tokens", "lora", "cache_salt"}]} as JSON
on stdin ("seed" is PYTHONHASHSEED or null for unset, "lora" is null or {"name", "path"}) and
prints {"vllm_checked": n, "results": [{"root", "digests", "low64"}]} (digests as hex).

The digests come from a transcription of vLLM 0.33's prefix-cache hashing
(vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py) that needs only hashlib, pickle, cbor2
and xxhash. If vLLM itself is importable, every case whose root is reproducible is also run
through vLLM's own request block hasher on a real `Request`, and the two must agree.
"""

import hashlib
import json
import os
import pickle
import sys

try:
    import cbor2
    import xxhash
except ImportError as exc:  # the Rust test turns this into a failure with this message
    sys.exit(f"vllm_hash.py needs the cbor2 and xxhash packages ({exc}); pip install cbor2 xxhash")

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
MASK64 = (1 << 64) - 1


def sha256(obj):
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_pickle(obj):
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj):
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FNS = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}


def transcription(case):
    """vLLM's init_none_hash + get_request_block_hasher, without vLLM."""
    hash_fn = HASH_FNS[case["algorithm"]]
    seed = case["seed"]
    if seed is None:
        if case["algorithm"].startswith("xxhash"):
            raise ValueError("xxhash roots are random per process without PYTHONHASHSEED")
        seed = DEFAULT_NONE_HASH_SEED
    root = hash_fn(seed)
    tokens, size = case["tokens"], case["block_size"]
    lora, salt = case["lora"], case["cache_salt"]
    digests, parent = [], root
    for start in range(0, len(tokens) - size + 1, size):
        keys = []
        if lora is not None:
            keys.append(("lora", lora["name"], lora["path"]))
        if start == 0 and salt:
            keys.append(("cache_salt", salt))
        extra = tuple(keys) if keys else None
        parent = hash_fn((parent, tuple(tokens[start : start + size]), extra))
        digests.append(parent)
    return root, digests


def with_vllm(case):
    """The same hashes from vLLM's own code on a real Request."""
    if case["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(case["algorithm"])
    kcu.init_none_hash(hash_fn)
    lora = case["lora"]
    request = Request(
        request_id="kvfs-conductor-test",
        prompt_token_ids=list(case["tokens"]),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=None if lora is None else LoRARequest(lora["name"], 1, lora["path"]),
        cache_salt=case["cache_salt"],
        block_hasher=kcu.get_request_block_hasher(case["block_size"], hash_fn),
    )
    low64 = [kcu.maybe_convert_block_hash(h) for h in request.block_hashes]
    return kcu.NONE_HASH, list(request.block_hashes), low64


def main():
    cases = json.load(sys.stdin)["cases"]
    try:
        import vllm  # noqa: F401

        have_vllm = True
    except ImportError:
        have_vllm = False
    results, checked = [], 0
    for i, case in enumerate(cases):
        root, digests = transcription(case)
        low64 = [int.from_bytes(d, "big") & MASK64 for d in digests]
        if have_vllm:
            v_root, v_digests, v_low64 = with_vllm(case)
            assert v_root == root, f"case {i}: NONE_HASH differs from vLLM"
            assert v_digests == digests, f"case {i}: block hashes differ from vLLM"
            assert v_low64 == low64, f"case {i}: event ints differ from vLLM"
            checked += 1
        results.append(
            {"root": root.hex(), "digests": [d.hex() for d in digests], "low64": low64}
        )
    json.dump({"vllm_checked": checked, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
