"""GPU service regression that separates the transfer from the kernels: one prompt, three ways on one GPU.

    PYTHONPATH=/tmp/site:. python3 experiments/h200_regression.py --out $OUT

ON (engine B loads the prefix that engine A stored in the pool), LOCAL (B again: the same prefix from its own prefix
cache - the same attention kernels as ON, no transfer) and OFF (engine C, no cache: whole-sequence attention). The
prompt is k*256 + 1 tokens so ON and LOCAL both reuse exactly k*256 tokens and compute the same 1-token tail; then
ON == LOCAL bit for bit iff the loaded KV is byte-identical, while ON vs OFF shows the kernels' bf16 differences.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, generate
from kvshare.engine.make_model import make_model
from kvshare.engine.pool_connector import PoolConnector
from kvshare.pool.testing import start_pool


def engine_with_logits(model: str, device: str, dtype: str) -> tuple[Engine, list]:
    engine = Engine(EngineConfig(model=model, load_format="dummy", device=device, dtype=dtype,
                                 kv_cache_memory=6 << 30, max_model_len=16384))
    logits: list = []
    original = engine.runner.prefill

    def prefill_keeping_logits(seq, **kwargs):  # the runner's keyword arguments: layer waits, staged inputs
        result = original(seq, **kwargs)
        logits.append(result.float().cpu())  # a copy for the comparison; the engine samples from its own tensor
        return result

    engine.runner.prefill = prefill_keeping_logits
    return engine, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--pool-size", default="8GiB")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/regression"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(make_model(args.preset, Path(tempfile.mkdtemp()) / args.preset))
    (a, _), (b, b_logits), (c, c_logits) = (engine_with_logits(model, args.device, args.dtype) for _ in range(3))
    vocab = a.model_config.vocab_size
    generator = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(3, vocab, (args.chunks * 256 + 1,), generator=generator).tolist())
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    rows = {}
    with start_pool(args.pool_size, check_integrity=False) as (address, _):
        for engine in (a, b):
            engine.set_connector(PoolConnector.for_engine(engine, ConnectorConfig(address=address)))
        generate(a, [GenerationRequest("store", prompt, sampling)])
        a.connector.core.flush(60)
        for name, engine, logits in (("on", b, b_logits), ("local", b, b_logits), ("off", c, c_logits)):
            (result,) = generate(engine, [GenerationRequest(name, prompt, sampling)])
            usage = result.finished.usage
            rows[name] = dict(tokens=result.token_ids, logits=logits[-1], pool_hit=usage.pool_hit_tokens,
                              local_hit=usage.local_hit_tokens)
    summary = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", preset=args.preset,
                   dtype=args.dtype, prompt_tokens=len(prompt))
    for name, row in rows.items():
        summary[f"{name}_hits"] = dict(pool=row["pool_hit"], local=row["local_hit"])
    for x, y in (("on", "local"), ("on", "off"), ("local", "off")):
        lx, ly = rows[x]["logits"], rows[y]["logits"]
        agree = sum(p == q for p, q in zip(rows[x]["tokens"], rows[y]["tokens"]))
        summary[f"{x}_vs_{y}"] = dict(logits_bitwise_equal=bool(torch.equal(lx, ly)),
                                     first_token_logit_max_abs_diff=float((lx - ly).abs().max()),
                                     greedy_tokens_agree=f"{agree}/{len(rows[x]['tokens'])}")
    (out / "regression.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    for engine in (a, b, c):
        if engine.connector is not None:
            engine.connector.close()
        engine.shutdown()


if __name__ == "__main__":
    main()
