"""Render a PNG preview of the main dashboard panels from a real run.

    python -m dashboards.preview [--out PATH] [--batches N]
    python -m dashboards.preview --from-data .cache/demo-run/preview/panels.json   # `make preview`

Starts the two-process push harness, serves P's and D's metrics front ends, starts a
real Prometheus scraping both (1 s) with our rules, drives batches of pushes (each
batch's stats observed and scraped, then a few idle scrapes), then runs each selected
panel's own queries (from the generated dashboard, variables filled in as Grafana
would) through `query_range`/`query` and draws them with matplotlib in the dashboard's
layout order. Takes about two minutes.

`make demo` renders its own run's preview under `.cache/demo-run/preview/` and saves the
query results beside it (`panels.json`); `--from-data` renders saved results without a
run: `make preview` refreshes the tracked `dashboards/preview/` copy from the last demo's.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from connector import vocabulary as V
from dashboards import panels, promrun
from harness.poll import wait_until

OUT = Path(__file__).resolve().parent / "preview" / "nixl-push-handshakes.png"
DATA_NAME = "panels.json"  # the query results saved beside a rendered preview (`make demo`)
SOURCE_KEY = "_source"  # in saved query results: what the run was, for the title
JOB = "vllm"
STEP_S = 1.0
RATE_INTERVAL = "10s"
# Scrapes (1 s apart) between batches, and idle ones before the first and after the last.
SCRAPES_BETWEEN = 4
SCRAPES_IDLE = 8

STATS = ("D->P handshakes that were notification-only", "Full D->P handshakes",
         "Descriptor registrations saved", "Descriptors saved",
         "Share of D's TTFT spent waiting for KV (range)")
CHARTS = ("Mean TTFT by stage (range)", "Mean TTFT on D: waiting for KV, then D's own work",
          "D: wait for KV p50 / p95 / p99 by outcome", "P: prefill done -> WRITE posted p50 / p95 / p99",
          "Handshakes/s by direction and flavor", "Handshake latency p50 / p95 / p99 by flavor",
          "Descriptors saved/s", "Descriptors registered vs saved (range)",
          "Executor queue wait p50 / p95 / p99", "Per-phase latency p95",
          "KV pushes/s: started / completed / failed", "PUSH_REG notifications/s",
          "NIXL transfers/s and failures/s", "NIXL transfer and post time p50 / p99",
          "Mean client TTFT and leg latency (range)", "Client TTFT p50 / p95 / p99")


def _legend(fmt: str, labels: dict[str, str]) -> str:
    if fmt in ("", "__auto"):
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _fmt(value: float, unit: str, decimals: int | None = None) -> str:
    if math.isnan(value):
        return "NaN"
    if decimals is not None and unit not in ("percentunit", "s"):
        return f"{value:.{decimals}f}"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    if unit.startswith("suffix:"):
        return f"{value:.3g}{unit.split(':', 1)[1]}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def _idle(prom: promrun.PrometheusServer, instances: list[str], scrapes: int) -> None:
    """Let Prometheus scrape every target `scrapes` more times (the charts' idle stretches)."""
    for _ in range(scrapes):
        prom.wait_scraped_after(JOB, instances, time.time())


def _drive(h: Any, fronts: dict[str, Any], prom: promrun.PrometheusServer, instances: list[str],
           batches: int) -> None:
    """Batches of pushes: each one's stats observed into the front ends and scraped."""
    sizes = [4, 2, 6, 3, 5, 4, 2, 6, 4, 3, 5, 4]
    completed, expected = 0, 0

    def observed() -> bool:
        nonlocal completed
        for name, fe in fronts.items():
            stats = h.stats(name)
            fe.observe(stats)
            completed += sum(sum(d.get(V.StatKey.PUSHES_COMPLETED, [])) for d in stats)
        return completed >= expected

    for i in range(batches):
        report = h.push(sizes[i % len(sizes)])
        if not report.ok:
            raise RuntimeError(f"push batch {i} failed: {report}")
        expected += sizes[i % len(sizes)]
        wait_until(observed, f"stats of push batch {i} ({expected} pushes completed)", 30, 0.2,
                   last=lambda: completed)
        _idle(prom, instances, SCRAPES_BETWEEN)


def collect(batches: int = 10) -> dict[str, Any]:
    """Run harness + Prometheus; return every selected panel's query results."""
    from harness import PushHarness

    out: dict[str, Any] = {}
    with PushHarness.pd(connector="fork") as h:
        fronts = {name: h.frontend(name) for name in ("P", "D")}
        try:
            instances = [f"127.0.0.1:{fe.serve()}" for fe in fronts.values()]
            with promrun.PrometheusServer([promrun.scrape_job(JOB, instances)],
                                          rule_files=[promrun.RULES_PATH],
                                          workdir=tempfile.mkdtemp(prefix="preview-prom-")) as prom:
                prom.wait_for(f'min(count_over_time(up{{job="{JOB}"}}[1m]))', lambda v: (v or 0) >= 3,
                              what="three scrapes of both front ends")
                start = time.time()
                _idle(prom, instances, SCRAPES_IDLE)
                _drive(h, fronts, prom, instances, batches)
                _idle(prom, instances, SCRAPES_IDLE)
                end = max(prom.wait_scraped_after(JOB, instances, time.time()).values())
                out = query_panels(prom, start, end)
        finally:
            for fe in fronts.values():
                fe.close()
    return out


def query_panels(prom: promrun.PrometheusServer, start: float, end: float, job: str = JOB,
                 model_name: str = "tiny-llama") -> dict[str, Any]:
    """Every selected panel's own queries over [start, end], as `render` wants them."""
    by_title = {p["title"]: p for p in panels.iter_panels(panels.build_dashboard())}
    values = {"job": job, "model_name": model_name, "instance": ".*", "engine": "0",
              "__rate_interval": RATE_INTERVAL, "__range": f"{math.ceil(end - start)}s",
              "__interval": f"{STEP_S:g}s"}
    out: dict[str, Any] = {}
    for title in STATS + CHARTS:
        panel = by_title[title]
        results = []
        for t in panel["targets"]:
            expr = promrun.fill_variables(t["expr"], values)
            if t.get("instant"):
                data = prom.query(expr, at=end)
            else:
                data = prom.query_range(expr, start, end, STEP_S)
            results.append((t["legendFormat"], data))
        out[title] = {"panel": panel, "results": results}
    out["_window"] = (start, end)
    return out


def render(data: dict[str, Any], path: Path, source: str | None = None) -> Path:
    """Draw the panels of `data` (`query_panels`' results) into `path`; `source` names the
    run in the title (default: the one saved in `data`, else a harness run)."""
    import matplotlib

    source = source or data.get(SOURCE_KEY) or "a real P/D push run"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = data["_window"]
    fig = plt.figure(figsize=(16, 4 + 3 * ((len(CHARTS) + 1) // 2)), dpi=100, facecolor="#111217")
    rows = (len(CHARTS) + 1) // 2
    # Stats share the first line equally; charts take half a line each.
    cols = 2 * len(STATS)
    grid = fig.add_gridspec(1 + rows, cols, height_ratios=[0.55] + [1] * rows,
                            hspace=0.55, wspace=0.3, left=0.05, right=0.98, top=0.93, bottom=0.03)
    fig.suptitle(f"{panels.DASHBOARD_TITLE} - preview from {source} "
                 f"({time.strftime('%Y-%m-%d %H:%M', time.localtime(end))}, {end - start:.0f} s window)",
                 color="white", fontsize=16)
    text_kw = {"color": "#ccccdc"}

    for i, title in enumerate(STATS):
        ax = fig.add_subplot(grid[0, 2 * i:2 * i + 2])
        panel = data[title]["panel"]
        defaults = panel["fieldConfig"]["defaults"]
        series = data[title]["results"][0][1]
        if series:
            value = float(series[0]["value"][1])
            steps = defaults["thresholds"]["steps"]
            color = steps[0]["color"]
            for step in steps[1:]:
                if value >= step["value"]:
                    color = step["color"]
            label = _fmt(value, defaults["unit"], defaults.get("decimals"))
        else:
            color, label = "grey", defaults.get("noValue", "No data")
        palette = {"green": "#1a7f37", "red": "#c4162a", "blue": "#1f60c4", "grey": "#3d3f46",
                   "orange": "#ff780a"}
        ax.set_facecolor(palette.get(color, color))
        ax.text(0.5, 0.42, label, ha="center", va="center", fontsize=26, color="white", weight="bold",
                transform=ax.transAxes)
        ax.set_title(textwrap.fill(title, 40), fontsize=10, loc="left", **text_kw)
        ax.set_xticks([])
        ax.set_yticks([])

    for i, title in enumerate(CHARTS):
        half = cols // 2
        ax = fig.add_subplot(grid[1 + i // 2, (i % 2) * half:(i % 2 + 1) * half])
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2f3239")
        ax.tick_params(colors="#9fa7b3", labelsize=9)
        ax.grid(color="#2f3239", linewidth=0.6)
        panel = data[title]["panel"]
        unit = panel["fieldConfig"]["defaults"]["unit"]
        ax.set_title(title, fontsize=12, loc="left", **text_kw)
        drawn = 0
        if panel["type"] == "bargauge":
            bars = [(_legend(fmt, s["metric"]), float(s["value"][1]))
                    for fmt, series in data[title]["results"] for s in series]
            bars = [b for b in bars if b[1] > 0] or bars
            ax.barh(range(len(bars)), [b[1] for b in bars], color="#73bf69", height=0.45)
            ax.set_yticks([])
            top = max((b[1] for b in bars), default=0.0)
            for y, (name, v) in enumerate(bars):  # (names above the bars: they are long)
                ax.text(0, y - 0.26, name, va="bottom", ha="left", color="#ccccdc", fontsize=9)
                ax.text(v, y, " " + _fmt(v, unit, panel["fieldConfig"]["defaults"].get("decimals")),
                        va="center", color="white", fontsize=10)
            if top > 0:
                ax.set_xlim(0, top * 1.18)
            ax.set_ylim(len(bars) - 0.5, -0.9)  # first bar on top, room for its name
            drawn = len(bars)
        else:
            for fmt, series in data[title]["results"]:
                for s in series:
                    ts = [float(t) - start for t, _ in s["values"]]
                    ys = [float(v) for _, v in s["values"]]
                    scale = 1e3 if unit == "s" else 1.0
                    ax.plot(ts, [y * scale for y in ys], linewidth=1.6, label=_legend(fmt, s["metric"]))
                    drawn += 1
            ax.set_xlim(0, end - start)
            ax.set_xlabel("seconds into the run", color="#9fa7b3", fontsize=9)
            ylabel = {"s": "ms", "percentunit": "share"}.get(unit, unit.removeprefix("suffix:").strip())
            ax.set_ylabel(ylabel, color="#9fa7b3", fontsize=9)
            ax.set_ylim(bottom=0)
            if drawn:
                legend = ax.legend(fontsize=8, loc="upper right", facecolor="#181b1f", edgecolor="#2f3239")
                for text in legend.get_texts():
                    text.set_color("#ccccdc")
        if not drawn:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", color="#9fa7b3", fontsize=14,
                    transform=ax.transAxes)

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, facecolor=fig.get_facecolor())
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.preview", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--batches", type=int, default=10,
                        help=f"push batches, {SCRAPES_BETWEEN} scrapes apart")
    parser.add_argument("--save-data", type=Path, help="also write the query results as JSON")
    parser.add_argument("--from-data", type=Path, help="render saved query results, no run")
    args = parser.parse_args(argv)
    if args.from_data:
        data = json.loads(args.from_data.read_text())
    else:
        data = collect(batches=args.batches)
        if args.save_data:
            args.save_data.write_text(json.dumps(data))
    print(f"wrote {render(data, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
