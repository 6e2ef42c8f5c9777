"""The FastGen comparison's plots (the blog's figures 2-5): throughput vs latency, effective
throughput vs clients, token latency percentiles."""

from __future__ import annotations

from pathlib import Path

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.served.fastgen_metrics import SLA_GEN_RATES, SLA_PROMPT_TOKENS_PER_S
from perf.common.systems import base_of, color_of, label_of, marker_of, order_key


def _client_axis(ax, clients) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(clients))
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.minorticks_off()
    ax.set_xlabel("Clients")


def make_plots(rows: list[dict], out: Path, token_clients: int, meta: dict,
               relaxed_prompt_tps: float | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({r["system"] for r in rows}, key=order_key)
    by = {s: sorted([r for r in rows if r["system"] == s and r.get("completed")], key=lambda r: r["clients"])
          for s in systems}
    wl = meta.get("workload", {})
    subtitle = (f"{meta.get('model', {}).get('params_m', '?')}M-param Llama (random weights), CPU "
                f"{meta.get('machine', {}).get('cores', '?')} cores; prompt ~N({wl.get('prompt_mean')}, 30%), "
                f"generation ~N({wl.get('gen_mean')}, 30%)")
    files = []

    # 1. Throughput vs latency (FastGen Fig. 2/3)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        xs = [r["throughput_rps"] for r in by[s]]
        ys = [r["mean_latency_s"] for r in by[s]]
        ax.plot(xs, ys, marker=marker_of(s), color=color_of(s), label=label_of(s),
                    linestyle=_style(systems, s))
        for r in by[s]:
            ax.annotate(str(r["clients"]), (r["throughput_rps"], r["mean_latency_s"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3), color=color_of(s))
    ax.set_xlabel("Throughput (requests/s)")
    ax.set_ylabel("Mean end-to-end latency (s)")
    ax.set_title("Throughput vs latency (labels: clients)\n" + subtitle, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "throughput_latency.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(f.name)

    # 2. Effective throughput vs clients (FastGen Fig. 4), one panel per generation SLA; and the
    #    same with the relaxed first-token SLA when it was computed.
    variants = [("", SLA_PROMPT_TOKENS_PER_S, "effective_throughput.png")]
    if relaxed_prompt_tps:
        variants.append(("relaxed_", relaxed_prompt_tps, "effective_throughput_relaxed.png"))
    for prefix, prompt_tps, fname in variants:
        rates = SLA_GEN_RATES
        fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4), sharey=True)
        for ax, rate in zip(axes, rates):
            for s in systems:
                ax.plot([r["clients"] for r in by[s]], [r.get(f"{prefix}effective_rps@{rate:g}", 0.0) for r in by[s]],
                        marker=marker_of(s), color=color_of(s), label=label_of(s), linestyle=_style(systems, s))
            _client_axis(ax, [r["clients"] for s in systems for r in by[s]])
            ax.set_title(f"SLA: prompt {prompt_tps:g} tok/s, generation {rate:g} tok/s", fontsize=9)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("Effective throughput (requests/s)")
        axes[0].legend(fontsize=7)
        what = "FastGen SLA" if not prefix else f"first-token SLA relaxed to prompt/{prompt_tps:g} s"
        fig.suptitle(f"Effective throughput ({what})  -  " + subtitle, fontsize=9)
        fig.tight_layout()
        f = out / fname
        fig.savefig(f, dpi=120)
        plt.close(fig)
        files.append(f.name)

    # 3. Token latency percentiles (FastGen Fig. 5) at one client count, and P95 vs clients
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        pt = next((r for r in by[s] if r["clients"] == token_clients), None)
        if pt is None:
            continue
        vals = [pt["token_latency_p50_s"] * 1e3, pt["token_latency_p90_s"] * 1e3, pt["token_latency_p95_s"] * 1e3]
        xs = [j + i * width for j in range(3)]
        bars = ax1.bar(xs, vals, width, color=color_of(s), label=label_of(s), hatch=_hatch(systems, s),
                       edgecolor="white" if _hatch(systems, s) else None)
        for b, v in zip(bars, vals):
            ax1.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=6,
                         rotation=90)
    ax1.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(3)], ["P50", "P90", "P95"])
    ax1.set_ylabel("Per-token generation latency (ms)")
    ax1.set_title(f"Token latency, {token_clients} clients", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.grid(True, axis="y", alpha=0.3)
    for s in systems:
        ax2.plot([r["clients"] for r in by[s]], [r["token_latency_p95_s"] * 1e3 for r in by[s]],
                 marker=marker_of(s), color=color_of(s), label=label_of(s),
                    linestyle=_style(systems, s))
    _client_axis(ax2, [r["clients"] for s in systems for r in by[s]])
    ax2.set_yscale("log")
    ax2.set_ylabel("P95 per-token latency (ms)")
    ax2.set_title("P95 token latency vs clients", fontsize=9)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    f = out / "token_latency.png"
    fig.savefig(f, dpi=120)
    plt.close(fig)
    files.append(f.name)
    return files


def _family(systems, s):
    return [x for x in systems if base_of(x) == base_of(s)]


def _variants(systems, s) -> bool:
    return len(_family(systems, s)) > 1


def _variant_index(systems, s) -> int:
    return sorted(_family(systems, s), key=order_key).index(s)


def _style(systems, s) -> str:
    return ["-", "--", ":", "-."][_variant_index(systems, s) % 4]


def _hatch(systems, s) -> str | None:
    return [None, "//", "..", "xx"][_variant_index(systems, s) % 4]
