"""`kvshare serve`: the reference engine behind the OpenAI-compatible server, attached to a pool or not."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvshare.httpguard.limits import add_flags as add_http_limit_flags

log = logging.getLogger(__name__)


def check_hybrid_chunk(model: str, chunk_tokens: int) -> None:
    """A hybrid model's state is stored at chunk ends, which must fall on its linear layers' blocks."""
    from kvshare.engine.hybrid import STATE_BLOCK
    from kvshare.hf.config import ModelConfig

    if ModelConfig.from_dir(model).linear is not None and chunk_tokens % STATE_BLOCK:
        raise ValueError(f"--chunk-tokens {chunk_tokens}: a hybrid model's chunks must be a multiple of "
                         f"{STATE_BLOCK} tokens (the linear-attention layers' block); try "
                         f"{max(STATE_BLOCK, chunk_tokens // STATE_BLOCK * STATE_BLOCK)}")


def register(cli) -> None:
    serve = cli.command("serve", "run the reference engine behind an OpenAI-compatible HTTP server")
    serve.add_argument("--model", required=True, help="Hugging Face model folder (config.json, weights, tokenizer)")
    serve.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                       help="auto: the folder's safetensors; dummy: seeded random weights")
    serve.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="default: float32 on cpu, bfloat16 on cuda")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000,
                       help="port to listen on (default: %(default)s, which is also `kvshare route`'s: behind a "
                            "router, run the replicas on other ports, e.g. 8001 and 8002)")
    serve.add_argument("--pool", default="none", help="the pool's socket path, or none (cache OFF)")
    serve.add_argument("--chunk-tokens", type=int, default=256, help="pool chunk size (a multiple of --block-size)")
    serve.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=True,
                       help="hash every loaded chunk on the host (up to 16 threads, while the copies run) and "
                            "recompute on a mismatch; --no-verify-checksums trusts the pool's bytes")
    serve.add_argument("--l2-promotion", choices=("decide", "always"), default="decide",
                       help="a pool with an L2 tier: decide = promote a prefix from L2 only where the cost model, fed "
                            "with this replica's measured prefill times and the pool's L2 rate, says it beats "
                            "recompute; always = every LOOKUP promotes (default: %(default)s)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    serve.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                       help="the KV cache's dtype: auto = the model's (--dtype); fp8 = e4m3 with per-tensor scales "
                            "(the checkpoint's self_attn.k_scale/v_scale, else 1.0): half the bytes to keep and move; "
                            "fp8 and other replicas never share pool chunks (default: %(default)s)")
    serve.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto",
                       help="auto = triton on CUDA (a paged-attention kernel reading the KV cache in place: prefill "
                            "tails after a prefix hit and decode), torch elsewhere (each context gathered, then "
                            "SDPA) (default: %(default)s)")
    serve.add_argument("--linear-attention-backend", choices=("auto", "fla", "torch"), default="auto",
                       help="hybrid models' Gated DeltaNet prefill: auto = flash-linear-attention's kernels on CUDA "
                            "when the fla-core package is installed, else the torch form (default: %(default)s)")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run decode steps eagerly instead of as CUDA graphs captured at start (one per "
                            "batch size 1, 2, 4, ... up to --max-num-seqs; they need the triton backend)")
    serve.add_argument("--load-waves", type=int, default=2, metavar="N",
                       help="load a pool hit in N layer waves, each layer's attention running as soon as its layer "
                            "has landed, so the prompt's new tokens compute while the rest loads; 1 loads it whole "
                            "first (default: %(default)s: on an H200 a 128k bf16 hit 21 ms sooner than 1, fp8 within "
                            "noise, 3 no better; see docs/architecture.md)")
    serve.add_argument("--register-piece", default="16GiB",
                       help="CUDA: register the pool's arena for DMA in pieces of at most this size, in the "
                            "background; a transfer waits only for its own pieces (default: %(default)s)")
    serve.add_argument("--register-threads", type=int, default=4,
                       help="CUDA: threads registering arena pieces (default: %(default)s)")
    serve.add_argument("--register-ahead", action=argparse.BooleanOptionalAction, default=True,
                       help="CUDA: register every piece from the start; --no-register-ahead registers only the "
                            "pieces transfers touch, when they first do (default: on)")
    serve.add_argument("--stream-priority", choices=("normal", "high"), default="normal",
                       help="CUDA: priority of the pool transfers' side streams; high lets stores that overlap a "
                            "long prefill run ahead of its kernels (on the H200 they kept up at normal too) "
                            "(default: %(default)s)")
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None,
                      help="KV cache size in blocks (default: from --kv-cache-memory)")
    size.add_argument("--kv-cache-memory", default=None,
                      help="KV cache size, e.g. 4GiB (default: on cpu, four --max-model-len sequences' worth, at most "
                           "2GiB; on cuda, the free GPU memory less what a longest prefill needs)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus answer, in tokens (default: the model's max_position_embeddings)")
    serve.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per chunk of prefill's token-wise work")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send and /v1/models lists (default: the model folder's name)")
    serve.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    serve.add_argument("--model-id", default="",
                       help="a name for these exact weights (e.g. a repository revision), added to the model identity "
                            "that decides which replicas share KV; the weights' bytes are always hashed too "
                            "(default: none)")
    serve.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads; pin both arms of a benchmark (default: torch's choice, one per core)")
    serve.add_argument("--max-stop-strings", type=int, default=16, metavar="N",
                       help="most stop strings one request may send (default: %(default)s)")
    serve.add_argument("--max-stop-chars", type=int, default=256, metavar="N",
                       help="longest stop string, in characters (default: %(default)s)")
    serve.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                       help="most likely tokens a request may ask logprobs of per position (completions' logprobs, "
                            "chat's top_logprobs; default: %(default)s)")
    serve.add_argument("--max-prompts", type=int, default=256, metavar="N",
                       help="prompts in one batch /v1/completions request, each an engine request (default: "
                            "%(default)s)")
    add_http_limit_flags(serve)
    serve.set_defaults(run=run_serve)


def engine_config(args: argparse.Namespace):
    from kvshare.engine.config import EngineConfig
    from kvshare.hf.config import default_dtype
    from kvshare.units import parse_size

    dtype = args.dtype or default_dtype(args.device)
    return EngineConfig(
        model=args.model, load_format=args.load_format, device=args.device, dtype=dtype, block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk, max_num_seqs=args.max_num_seqs,
        seed=args.seed, served_model_name=args.served_model_name, model_id=args.model_id,
        kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
        linear_attention_backend=args.linear_attention_backend,
        enforce_eager=args.enforce_eager,
    )


def connector_config(args: argparse.Namespace):
    """The pool connector's settings from the flags; raises ValueError on a bad size or thread count."""
    from kvshare.connector import ConnectorConfig
    from kvshare.units import parse_size

    piece = parse_size(args.register_piece)
    if piece <= 0 or args.register_threads < 1:
        raise ValueError("--register-piece must be positive and --register-threads >= 1")
    if args.load_waves < 1:
        raise ValueError(f"--load-waves must be >= 1 (1 loads a hit whole before the forward), got {args.load_waves}")
    return ConnectorConfig(address=args.pool, chunk_tokens=args.chunk_tokens, verify_checksums=args.verify_checksums,
                           register_piece=piece, register_threads=args.register_threads,
                           register_ahead=args.register_ahead, l2_promotion=args.l2_promotion,
                           load_waves=args.load_waves, stream_priority=args.stream_priority)


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from kvshare.engine.engine import Engine
    from kvshare.hf.tokenizer import Tokenizer
    from kvshare.httpguard.limits import from_args as http_limits_from_args
    from kvshare.httpguard.serve import reserve_port
    from kvshare.serve.app import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        # Read at the first CUDA allocation, so set before the engine exists. A long prefill allocates large, varying
        # temporaries beside a KV cache that fills the GPU; the H200 measurements (docs/results/h200, up to 136 of
        # 139 GiB at 256k) ran with expandable segments, so the server runs the same way unless told otherwise.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.chunk_tokens % args.block_size:
        log.error("--chunk-tokens %d is not a multiple of --block-size %d", args.chunk_tokens, args.block_size)
        return 2
    try:
        limits, http_limits = request_limits(args), http_limits_from_args(args)
        connector = connector_config(args) if args.pool != "none" else None
        check_model_folder(args.model)
        check_hybrid_chunk(args.model, args.chunk_tokens)
        config = engine_config(args)  # flags the engine refuses (e.g. a backend this machine cannot run) fail here
        # Bound before the model loads (seconds to minutes): a busy port fails now, and "serving on" is never logged
        # for a port this server does not hold.
        sock = reserve_port(args.host, args.port)
    except (ValueError, OSError) as error:
        print(f"kvshare serve: {error}", file=sys.stderr)
        return 2
    warn_if_pool_absent(args.pool)
    try:
        tokenizer = Tokenizer.from_dir(args.model)
        engine = Engine(config)
    except (ValueError, OSError) as error:
        sock.close()
        print(f"kvshare serve: cannot load the model in {args.model}: {error}", file=sys.stderr)
        return 2
    if connector is not None:
        from kvshare.engine.pool_connector import PoolConnector

        engine.set_connector(PoolConnector.for_engine(engine, connector))
    try:
        serve(engine, tokenizer, host=args.host, port=args.port, model_name=engine.model_name,
              is_alive=engine.is_alive, connector_stats=lambda: engine.connector.stats if engine.connector else None,
              engine_load=engine.load, limits=limits, http_limits=http_limits, sock=sock)
    finally:
        engine.shutdown()
    return 0


def check_model_folder(model: str) -> None:
    """A missing or foreign --model is one line naming the fix, not a traceback from deep in the loader."""
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model folder {model} not found: pass a Hugging Face model folder (config.json, weights, "
                         f"tokenizer.json), or make one with `kvshare make-model --preset small --out {model}`")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{model} has no config.json: --model takes a Hugging Face model folder")


def warn_if_pool_absent(pool: str) -> None:
    """The replica serves without a pool (cache OFF) and attaches when the pool appears; say so once, with the two
    ways out, since a typo in --pool would otherwise only show as no pool hits."""
    path = pool.removeprefix("unix:")
    if pool == "none" or pool.startswith("tcp://") or os.path.exists(path):
        return
    log.warning("pool socket %s not found: serving with the cache OFF until `kvshare pool serve --socket %s` runs "
                "(or pass --pool none to run without a pool)", path, path)


def request_limits(args: argparse.Namespace):
    from kvshare.serve.validation import RequestLimits

    if args.max_stop_strings < 0 or args.max_stop_chars < 1:
        raise ValueError("--max-stop-strings must be >= 0 and --max-stop-chars >= 1")
    if args.max_logprobs < 0 or args.max_prompts < 1:
        raise ValueError("--max-logprobs must be >= 0 and --max-prompts >= 1")
    return RequestLimits(max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                         max_logprobs=args.max_logprobs, max_prompts=args.max_prompts)
