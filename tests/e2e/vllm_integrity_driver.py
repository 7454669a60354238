"""One vLLM engine (CPU platform) with the integrity checks, through rounds of corrupt-then-request; prints one JSON
line (``INTEGRITY_RESULT {json}``). Used by tests/e2e/test_vllm_integrity.py, one process per engine (an engine start
is about a minute on the 2-core CI machine, so each engine runs every round its configuration allows). From the
repository root, with tests/ on PYTHONPATH (the drivers import the shared vllm_harness):

    # TritonOffloadingSpec: a bit flipped in a host block of the host cache, just before a load reads it
    python tests/e2e/vllm_integrity_driver.py --model M --scenario host --policy recompute
    # TritonTieringOffloadingSpec with an fs tier (and an obj tier): a block file, then an object, changed in place
    python tests/e2e/vllm_integrity_driver.py --model M --scenario tiers --policy fail --tiers '[{"type": "fs", ...}]'

Every prompt's first run is cold (nothing cached): its tokens are those of an engine without offloading, which every
later run of it must give again. A real model's folder (triton_offload.models) as ``--model`` gets real text prompts
(tests/texts.py). Per round: the label, the greedy tokens (and the real model's text), whether they equal the cold
ones, the tokens vLLM reports cached, the finish reason, or the error it raised.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time

from vllm_harness import (
    GPU_BLOCK,
    block_bytes,
    is_real,
    offload_metrics,
    output,
    print_result,
    prompt_ids,
    shutdown,
    tiny_llm,
)

PROMPT_LEN = 200  # 6 full GPU blocks; vLLM always recomputes the last prompt token
RESULT = "INTEGRITY_RESULT"
CONNECTOR = "TritonOffloadingConnector"
SPECS = {
    "host": {"spec_name": "CorruptingSpec", "spec_module_path": "integrity_plugin"},
    "tiers": {"spec_name": "CorruptingTieringSpec", "spec_module_path": "integrity_plugin"},
}


class Rounds:
    def __init__(self, llm, trigger: str, model: str):
        from vllm import SamplingParams

        self.llm, self.trigger, self.model = llm, trigger, model
        self.params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=is_real(model))
        self.cold: dict[int, list[int]] = {}
        self.rounds: list[dict] = []

    def run(self, label: str, seed: int, reset: str | None = "device", corrupt: dict | None = None) -> dict:
        """Runs prompt ``seed`` after emptying the device prefix cache (``reset="device"``) or also the connector's
        CPU cache (``"connector"``), with a corruption order for the next load (``corrupt``)."""
        from vllm.inputs import TokensPrompt

        if reset is not None:
            assert self.llm.reset_prefix_cache(reset_connector=reset == "connector"), "reset_prefix_cache failed"
        if corrupt is not None:
            with open(self.trigger, "w") as f:
                json.dump(corrupt, f)
        ids = prompt_ids(self.model, seed, PROMPT_LEN)
        entry = {"label": label, "prompt": seed}
        try:
            entry |= output(self.llm.generate([TokensPrompt(prompt_token_ids=ids)], self.params, use_tqdm=False)[0])
            if seed not in self.cold:
                self.cold[seed] = entry["tokens"]
            entry["match"] = entry["tokens"] == self.cold[seed]
        except Exception as e:  # a failed request surfaces here in some vLLM versions
            entry |= {"error": f"{type(e).__name__}: {e}"}
        entry["trigger_left"] = os.path.exists(self.trigger)  # an order no load carried out
        self.rounds.append(entry)
        return entry


def tier_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "**", "*.bin"), recursive=True))


def wait_for(predicate, llm, timeout: float = 60) -> bool:
    """Steps the engine (with prompts too short to store a block) until ``predicate()`` or ``timeout``: stores
    cascade to the secondary tiers as the engine steps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tick = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], tick, use_tqdm=False)
        time.sleep(0.05)
    return predicate()


def scramble_file(path: str, offset: int = 0, length: int = 256) -> dict:
    """Overwrites ``length`` bytes of a file in place, keeping its size (what vLLM's fs tier cannot tell from a good
    block): each XORed with 0x55, which changes every fp32 value's exponent there."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytes(b ^ 0x55 for b in f.read(length))
        f.seek(offset)
        f.write(data)
    return {"file": os.path.basename(path), "offset": offset, "length": length, "size": os.path.getsize(path)}


def s3_client(store: dict):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=f"{store.get('scheme', 'http')}://{store['endpoint_override']}",
        aws_access_key_id=store.get("access_key"),
        aws_secret_access_key=store.get("secret_key"),
        region_name=store.get("region") or "us-east-1",
    )


def scenario_host(r: Rounds, args) -> dict:
    """TritonOffloadingSpec: a bit flipped in the second host block of prompt 1 just before it is loaded."""
    r.run("cold", 1, reset=None)
    r.run("intact", 1)  # every block from the host, checked
    r.run("corrupted", 1, corrupt={"block": 1, "byte": 777, "bit": 3})
    r.run("after", 1)  # the failed block's key was dropped: it and what follows are recomputed and stored again
    r.run("healed", 1)  # all from the host again
    return {}


def scenario_tiers(r: Rounds, args) -> dict:
    """TritonTieringOffloadingSpec with an fs tier (and an obj tier): prompt 1's block files changed in place (the
    same size), then one bit of one of prompt 2's objects flipped in the store (its files removed, so the objects are
    what is promoted)."""
    tiers = json.loads(args.tiers)
    fs = next(t for t in tiers if t["type"] == "fs")
    obj = next((t for t in tiers if "store_config" in t), None)
    chunks = 192 // args.block_size
    out = {}
    before = set(tier_files(fs["root_dir"]))
    r.run("cold", 1, reset=None)
    assert wait_for(lambda: len(tier_files(fs["root_dir"])) >= chunks, r.llm), "the fs tier never got the chunks"
    files = sorted(set(tier_files(fs["root_dir"])) - before)
    r.run("from_fs", 1, reset="connector")  # intact: promoted from the files, checked
    out["fs"] = [scramble_file(path) for path in files]  # every chunk of the prompt
    r.run("fs_corrupted", 1, reset="connector")
    r.run("fs_again", 1, reset="connector")
    if obj is not None:
        s3 = s3_client(obj["store_config"])
        bucket = obj["store_config"]["bucket"]

        def objects():
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))

        known, known_files = set(objects()), set(tier_files(fs["root_dir"]))
        r.run("cold2", 2, reset=None)
        assert wait_for(lambda: len(set(objects()) - known) >= chunks, r.llm), "the obj tier never got the chunks"
        assert wait_for(lambda: len(set(tier_files(fs["root_dir"])) - known_files) >= chunks, r.llm)
        for path in set(tier_files(fs["root_dir"])) - known_files:  # only the objects hold prompt 2 now
            os.remove(path)
        key = sorted(set(objects()) - known)[0]
        body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[100] ^= 0x10  # one bit
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
        out["obj"] = {"key": key, "offset": 100, "bit": 4, "size": len(body)}
        r.run("obj_corrupted", 2, reset="connector")
    return out


SCENARIOS = {"host": scenario_host, "tiers": scenario_tiers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--policy", choices=["recompute", "fail"], default="recompute")
    ap.add_argument("--integrity", default="verify")
    ap.add_argument("--tiers", default="[]", help="JSON: secondary_tiers (scenario tiers)")
    ap.add_argument("--block-size", type=int, default=GPU_BLOCK, help="tokens per host block (chunk)")
    args = ap.parse_args(argv)
    from vllm.config import KVTransferConfig

    extra = {
        **SPECS[args.scenario],
        "block_size": args.block_size,
        "cpu_bytes_to_use": max(4 << 20, 32 * block_bytes(args.model)),  # 64 tiny GPU blocks, 32 of the real model
        "integrity": args.integrity,
    }
    if args.scenario == "tiers":
        extra["secondary_tiers"] = json.loads(args.tiers)
    transfer = KVTransferConfig(
        kv_connector=CONNECTOR,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy=args.policy,
    )
    scratch = tempfile.mkdtemp(prefix="integrity_")
    # The workers (vLLM's processes, started below) read the orders from here.
    trigger = os.environ.setdefault("TRITON_OFFLOAD_CORRUPT", os.path.join(scratch, "order"))
    t0 = time.perf_counter()
    llm = tiny_llm(args.model, None, kv_transfer_config=transfer)
    t_start = time.perf_counter()
    rounds = Rounds(llm, trigger, args.model)
    corruptions = SCENARIOS[args.scenario](rounds, args)
    result = {
        "scenario": args.scenario,
        "policy": args.policy,
        "model": "real" if is_real(args.model) else "tiny",
        "rounds": rounds.rounds,
        "corrupted": corruptions,
        "metrics": offload_metrics(llm),
        "seconds": {"startup": round(t_start - t0, 1), "rounds": round(time.perf_counter() - t_start, 1)},
    }
    print_result(RESULT, result)
    shutdown(llm)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
