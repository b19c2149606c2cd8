"""The Inputs of one `kvshare advise` run, put together from a saved file, measurements and flags (in that order: a
later source overrides an earlier one), each value's source recorded; and the session-mix flag."""

from __future__ import annotations

import argparse

import msgspec

from kvshare.advise import calibrate
from kvshare.advise.calibrate import Inputs
from kvshare.costmodel import SessionKind


class AdviseError(Exception):
    """Inputs missing or malformed; the message says which flag supplies them."""


def gather_inputs(args: argparse.Namespace) -> Inputs:
    from kvshare.bench.workload import parse_lengths

    values: dict = msgspec.structs.asdict(calibrate.load_inputs(args.inputs)) if args.inputs else {}
    sources: dict[str, str] = dict(values.pop("sources", {}))

    def put(name: str, value, source: str) -> None:
        if value is not None:
            values[name], sources[name] = value, source

    if args.replica:
        lengths = [n for _, n in parse_lengths(args.calibrate_lengths)]
        put("prefill", calibrate.calibrate_prefill(args.replica, lengths, args.calibrate_repeats),
            f"calibrated against {args.replica} ({args.calibrate_repeats} per length, median TTFT)")
        put("load_gb_s", calibrate.load_rate_from_metrics(args.replica), f"{args.replica}/metrics")
    if args.prefill:
        put("prefill", _prefill_samples(args.prefill), "--prefill")
    if args.model_dir:
        put("kv_bytes_per_token", calibrate.kv_bytes_per_token(args.model_dir), f"{args.model_dir}/config.json")
    if args.pool:
        figures = calibrate.pool_figures(args.pool)
        put("l2_gb_s", figures.l2_gb_s, f"pool STATS ({args.pool})")
        put("pool_hit_rate", figures.pool_hit_rate, f"pool STATS ({args.pool})")
        put("l2_hit_rate", figures.l2_hit_rate, f"pool STATS ({args.pool})")
    if args.l2_bench:
        put("l2_gb_s", calibrate.l2_rate_from_bench(args.l2_bench), str(args.l2_bench))
    put("kv_bytes_per_token", args.kv_bytes_per_token, "--kv-bytes-per-token")
    put("load_gb_s", args.load_gb_s, "--load-gb-s")
    put("l2_gb_s", args.l2_gb_s, "--l2-gb-s")
    put("pool_fixed_s", None if args.pool_fixed_ms is None else args.pool_fixed_ms / 1e3, "--pool-fixed-ms")
    put("l2_fixed_s", None if args.l2_fixed_ms is None else args.l2_fixed_ms / 1e3, "--l2-fixed-ms")
    put("chunk_tokens", args.chunk_tokens, "--chunk-tokens")
    missing = [flag for name, flag in (("prefill", "--replica or --prefill"),
                                       ("kv_bytes_per_token", "--model-dir or --kv-bytes-per-token"),
                                       ("load_gb_s", "--load-gb-s (or a --replica that has loaded from its pool)"),
                                       ("l2_gb_s", "--l2-gb-s, --pool or --l2-bench")) if values.get(name) is None]
    if missing:
        raise AdviseError("missing inputs: give " + "; ".join(missing))
    values["sources"] = sources
    return msgspec.convert(values, Inputs)


def _prefill_samples(text: str) -> list[tuple[int, int, float]]:
    from kvshare.bench.workload import parse_lengths

    samples = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        length, sep, seconds = item.partition(":")
        try:
            samples.append((parse_lengths(length)[0][1], 0, float(seconds)))
        except ValueError:
            raise AdviseError(f"--prefill item {item!r} is not LENGTH:SECONDS (e.g. 32k:4.932)") from None
        if not sep or samples[-1][2] <= 0:
            raise AdviseError(f"--prefill item {item!r} needs positive seconds after ':'")
    return samples


def parse_sessions(text: str) -> list[SessionKind]:
    from kvshare.bench.workload import parse_lengths

    kinds = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        try:
            if len(fields) not in (4, 5):
                raise ValueError
            context = parse_lengths(fields[0])[0][1]
            turns, user, answer = (int(f) for f in fields[1:4])
            weight = float(fields[4]) if len(fields) == 5 else 1.0
            if turns < 1 or user < 0 or answer < 0 or weight <= 0:
                raise ValueError
        except ValueError:
            raise AdviseError(f"--sessions item {item!r} is not CONTEXT:TURNS:USER:ANSWER[:WEIGHT] with positive "
                              "numbers (e.g. 32k:6:256:32:3)") from None
        kinds.append(SessionKind(context, turns, user, answer, weight))
    return kinds
