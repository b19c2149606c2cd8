"""What `kvshare advise` reports: every option's time per prompt length, the break-even lengths, the expected TTFT at
the observed hit rates, the placement answer for a session mix; as Markdown, JSON and a plot."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvshare.advise.calibrate import Inputs
from kvshare.costmodel import CostModel, PrefillCurve, SessionKind, mix_gain, session_estimate


class LengthRow(msgspec.Struct):
    tokens: int
    recompute_s: float
    pool_s: float  # a full-prefix pool hit
    l2_s: float  # a full-prefix L2 hit (nothing in the pool)
    best: str


class SessionRow(msgspec.Struct):
    context: int
    turns: int
    user_tokens: int
    answer_tokens: int
    weight: float
    policy: str
    off_s: float
    on_s: float
    gain: float


class Report(msgspec.Struct):
    command: str
    inputs: Inputs
    curve: PrefillCurve
    fit: list[tuple[int, int, float, float]]  # (new, cached, measured s, model s) per prefill sample
    lengths: list[LengthRow]
    break_even_pool: list[int]
    break_even_l2: list[int]
    expected: dict[int, float]  # tokens -> expected TTFT at the hit rates (empty without them)
    sessions: list[SessionRow]
    mix_gain: dict[str, float]  # policy -> the mix's gain


def build(inputs: Inputs, lengths: list[int], max_tokens: int, sessions: list[SessionKind], policies: list[str],
          replicas: int, decode_s_per_token: float, command: str) -> Report:
    model = CostModel(inputs.rates())
    curve = model.rates.prefill
    rows = []
    for n in lengths:
        hit = model.hit_tokens(n)
        seconds = {"recompute": model.recompute(n), "pool": model.pool(n, hit), "l2": model.l2(n, hit)}
        best = min(seconds, key=seconds.get) if hit else "recompute"
        rows.append(LengthRow(n, seconds["recompute"], seconds["pool"], seconds["l2"], best))
    expected = {}
    if inputs.pool_hit_rate is not None:
        p_pool = inputs.pool_hit_rate
        p_l2 = (1 - p_pool) * (inputs.l2_hit_rate or 0.0)
        for row in rows:
            l2_or_not = min(row.l2_s, row.recompute_s)  # the decision takes L2 only where it pays
            expected[row.tokens] = p_pool * row.pool_s + p_l2 * l2_or_not + (1 - p_pool - p_l2) * row.recompute_s
    session_rows, gains = [], {}
    for policy in policies:
        estimates = [session_estimate(model, kind, policy, replicas, decode_s_per_token) for kind in sessions]
        session_rows += [SessionRow(e.kind.context, e.kind.turns, e.kind.user_tokens, e.kind.answer_tokens,
                                    e.kind.weight, policy, e.off_s, e.on_s, e.gain) for e in estimates]
        if estimates:
            gains[policy] = mix_gain(estimates)
    fit = [(new, cached, seconds, curve.seconds(new, cached)) for new, cached, seconds in inputs.prefill]
    return Report(command, inputs, curve, fit, rows, model.break_even("pool", max_tokens),
                  model.break_even("l2", max_tokens), expected, session_rows, gains)


def _tokens(n: int) -> str:
    return f"{n / 1024:g}k" if n >= 1024 and n % 256 == 0 else str(n)


def markdown(r: Report, plot_name: str = "") -> str:
    i = r.inputs
    lines = ["# kvshare advise: load or recompute", "", f"Command: `{r.command}`", "", "## Inputs", "",
             "| input | value | source |", "| --- | --- | --- |"]

    def source(name: str) -> str:
        return i.sources.get(name, "given")

    lines += [
        f"| KV bytes per token | {i.kv_bytes_per_token:,.0f} | {source('kv_bytes_per_token')} |",
        f"| pool -> engine load | {i.load_gb_s:g} GB/s | {source('load_gb_s')} |",
        f"| L2 -> pool promotion | {i.l2_gb_s:g} GB/s | {source('l2_gb_s')} |",
        f"| pool hit fixed cost | {i.pool_fixed_s * 1e3:.1f} ms | {source('pool_fixed_s')} |",
        f"| L2 promotion fixed cost | {i.l2_fixed_s * 1e3:.1f} ms | {source('l2_fixed_s')} |",
        f"| chunk | {i.chunk_tokens} tokens | {source('chunk_tokens')} |",
        f"| prefill samples | {len(i.prefill)} | {source('prefill')} |",
    ]
    if i.pool_hit_rate is not None:
        lines.append(f"| pool hit rate (tokens) | {i.pool_hit_rate:.1%} | {source('pool_hit_rate')} |")
    if i.l2_hit_rate is not None:
        lines.append(f"| L2 share of pool misses (chunks) | {i.l2_hit_rate:.1%} | {source('l2_hit_rate')} |")
    c = r.curve
    lines += ["", "Prefill curve fitted to the samples: seconds = "
              f"{c.fixed_s:.4g} + {c.per_token_s:.4g} x new + {c.per_pair_s:.4g} x ((cached + new)^2 - cached^2)", "",
              "| prefill sample (new tokens, cached) | measured s | model s | error |", "| --- | --- | --- | --- |"]
    for new, cached, measured, model in r.fit:
        lines.append(f"| {_tokens(new)}, {cached} | {measured:.3f} | {model:.3f} | {model / measured - 1:+.1%} |")
    lines += ["", "## Per prompt length (a full-prefix hit: every whole chunk but the last token)", "",
              "| prompt | recompute s | pool hit s | L2 hit s | fastest |" + (" expected s |" if r.expected else ""),
              "| --- | --- | --- | --- | --- |" + (" --- |" if r.expected else "")]
    for row in r.lengths:
        extra = f" {r.expected[row.tokens]:.3f} |" if r.expected else ""
        lines.append(f"| {_tokens(row.tokens)} | {row.recompute_s:.3f} | {row.pool_s:.3f} | {row.l2_s:.3f} | "
                     f"{row.best} |{extra}")
    lines += ["", "## Break-even lengths", "",
              f"- pool hit vs recompute: {_points(r.break_even_pool)}",
              f"- L2 hit vs recompute: {_points(r.break_even_l2)}"]
    if r.expected:
        lines.append("- expected: TTFT at the hit rates above, taking L2 only where it pays")
    if r.sessions:
        lines += ["", "## Placement: sessions under a router policy", "",
                  "| context | turns | user / answer tokens | weight | policy | OFF s | ON s | ON gain |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in r.sessions:
            lines.append(f"| {_tokens(s.context)} | {s.turns} | {s.user_tokens} / {s.answer_tokens} | {s.weight:g} | "
                         f"{s.policy} | {s.off_s:.2f} | {s.on_s:.2f} | {s.gain:.0%} |")
        lines += [""] + [f"- the mix under `{policy}`: expected gain {gain:.0%}" for policy, gain in r.mix_gain.items()]
    if plot_name:
        lines += ["", f"![{plot_name}]({plot_name})"]
    return "\n".join(lines) + "\n"


def _points(points: list[int]) -> str:
    if not points:
        return "none in range (the same option is fastest at every length)"
    return ", ".join(f"{_tokens(p)} tokens" if _tokens(p) == str(p) else f"{_tokens(p)} tokens ({p:,})"
                     for p in points)


def plot(r: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row.tokens for row in r.lengths]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(tokens, [row.recompute_s for row in r.lengths], "o-", label="recompute")
    ax.plot(tokens, [row.pool_s for row in r.lengths], "s-", label="pool hit")
    ax.plot(tokens, [row.l2_s for row in r.lengths], "^-", label="L2 hit")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    for name, points, color in (("pool", r.break_even_pool, "tab:orange"), ("L2", r.break_even_l2, "tab:green")):
        for point in (p for p in points if tokens[0] <= p <= tokens[-1]):
            ax.axvline(point, color=color, linestyle=":", linewidth=1)
            ax.annotate(f"{name} break-even {_tokens(point)}", (point, low), rotation=90, fontsize=8,
                        va="bottom", ha="right", color=color)
    ax.set_ylim(low, high)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s (model)")
    ax.set_title("load or recompute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
