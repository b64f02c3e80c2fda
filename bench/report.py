"""The run's results for people: a table on the terminal, and a PNG chart (matplotlib)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.results import BenchResult, Latency, ModeResult


def _pair(lat: Latency | None, *names: str) -> str:
    if lat is None or lat.n == 0:
        return "-"
    return " / ".join(_ms(getattr(lat, name)) for name in names)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(result: BenchResult) -> str:
    """Figures as rows, modes as columns; then CPU by process, then the goals."""
    modes = result.modes
    rows: list[tuple[str, Callable[[ModeResult], str]]] = [
        ("text p50 / p90 / p99, idle (ms)", lambda m: _pair(m.text.idle, *_P3)),
        ("text p50 / p90 / p99, loaded (ms)", lambda m: _pair(m.text.loaded, *_P3)),
        ("text loaded / idle, p50 | p99", lambda m: f"{_num(m.text.ratio_p50)} | "
                                                    f"{_num(m.text.ratio_p99)}"),
        ("engine holds text, idle p50 / p99 (ms)", lambda m: _pair(m.engine_hold.text_idle,
                                                                    *_P2)),
        ("engine holds text, loaded p50 / p99", lambda m: _pair(m.engine_hold.text_loaded, *_P2)),
        ("engine holds image, loaded p50 / p99", lambda m: _pair(m.engine_hold.image_loaded,
                                                                 *_P2)),
        ("  exact handoff, text idle p50 / p99", lambda m: _pair(m.engine_hold.exact_text_idle,
                                                                 *_P2)),
        ("  exact handoff, text loaded p50 / p99",
         lambda m: _pair(m.engine_hold.exact_text_loaded, *_P2)),
        ("  exact handoff, image loaded p50 / p99",
         lambda m: _pair(m.engine_hold.exact_image_loaded, *_P2)),
        ("image latency p50 / p99, loaded (ms)", lambda m: _pair(m.image.latency, *_P2)),
            ("images/s, loaded (offered)", lambda m: f"{_num(m.image.images_per_s)} "
                                                 f"({m.image.offered_images_per_s:g})"),
        ("other processes' CPU, loaded (cores)", lambda m: _num(m.cpu.others_cores_loaded)),
    ]
    sizes = [p.image_size for p in modes[0].probe] if modes else []
    rows += [(f"probe wait p50 / p99, {size} px (ms)", _probe_cell(i, "wait"))
             for i, size in enumerate(sizes)]
    rows += [(f"  executor no-op wait, {size} px", _probe_cell(i, "executor_wait"))
             for i, size in enumerate(sizes)]
    rows += [(f"  probe loops' images/s, {size} px", _probe_cell(i, "images_per_s"))
             for i, size in enumerate(sizes)]
    rows.append(("errors", lambda m: ", ".join(f"{k} {v}" for k, v in m.errors.items()) or "0"))
    width = max(len(label) for label, _ in rows)
    cells = [[cell(mode) for mode in modes] for _, cell in rows]
    col = max([len(mode.mode) for mode in modes] + [len(c) for row in cells for c in row]) + 2
    lines = [f"{'':<{width}}" + "".join(f"{mode.mode:>{col}}" for mode in modes)]
    for (label, _), row in zip(rows, cells, strict=True):
        lines.append(f"{label:<{width}}" + "".join(f"{c:>{col}}" for c in row))
    lines += ["", cpu_table(modes), "", goals_text(result), "",
              f"load average at start / end: {_load(result.machine.load_avg_start)} / "
              f"{_load(result.machine.load_avg_end)} ({result.machine.cpus} CPUs), "
              f"run took {result.duration_s:.0f} s"]
    return "\n".join(lines)


def _probe_cell(index: int, figure: str) -> Callable[[ModeResult], str]:
    def cell(mode: ModeResult) -> str:
        value = getattr(mode.probe[index], figure) if index < len(mode.probe) else None
        return _num(value) if figure == "images_per_s" else _pair(value, *_P2)

    return cell


_P3 = ("p50_ms", "p90_ms", "p99_ms")
_P2 = ("p50_ms", "p99_ms")


def _load(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def cpu_table(modes: list[ModeResult]) -> str:
    lines = ["CPU ms by process       per text request   per image   per request"]
    for mode in modes:
        for process in mode.cpu.per_request_s:
            lines.append(
                f"{mode.mode + ' ' + process:<24}"
                f"{_ms_of(mode.cpu.text_request_s.get(process)):>16}"
                f"{_ms_of(mode.cpu.image_s.get(process)):>12}"
                f"{_ms_of(mode.cpu.per_request_s.get(process)):>14}"
            )
    return "\n".join(lines)


def _ms_of(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def goals_text(result: BenchResult) -> str:
    lines = ["goals (issue 5)"]
    for goal in result.goals:
        verdict = {True: "met", False: "MISSED", None: "not judged"}[goal.met]
        lines.append(f"  {goal.description}: {_num(goal.value, 3)} "
                     f"(target {goal.target:g}) {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the chart

_COLOURS = {"shared": "tab:red", "split": "tab:orange", "mmlane": "tab:blue"}


def chart(result: BenchResult, path: Path) -> None:
    """Latency against offered image load per mode, throughput, and the probe wait."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4), layout="constrained")
    text_ax, image_ax, rate_ax, probe_ax = axes
    for mode in result.modes:
        colour = _COLOURS.get(mode.mode, "black")
        sweep = [p for p in mode.phases if p.kind in ("idle", "load")]
        load = [p.offered_images_per_s for p in sweep]
        for ax, attr, points in ((text_ax, "text", sweep), (image_ax, "image", sweep[1:])):
            xs = [p.offered_images_per_s for p in points]
            ax.plot(xs, [getattr(p, attr).p99_ms for p in points], "-o", color=colour,
                    label=f"{mode.mode} p99")
            ax.plot(xs, [getattr(p, attr).p50_ms for p in points], "--", marker=".",
                    color=colour, alpha=0.7, label=f"{mode.mode} p50")
        rate_ax.plot(load[1:], [p.images_per_s for p in sweep[1:]], "-o", color=colour,
                     label=mode.mode)
        probe_ax.plot([p.image_size for p in mode.probe],
                      [p.wait.p50_ms for p in mode.probe], "-o", color=colour,
                      label=f"{mode.mode} p50")
        probe_ax.plot([p.image_size for p in mode.probe],
                      [p.wait.p99_ms for p in mode.probe], ":", marker="^",
                      color=colour, label=f"{mode.mode} p99")
    offered = sorted({p.offered_images_per_s for m in result.modes for p in m.phases
                      if p.kind == "load"})
    rate_ax.plot(offered, offered, color="grey", lw=0.8, label="offered")
    text_ax.set(title="Text request latency", xlabel="offered image load (images/s)",
                ylabel="ms (log)", yscale="log")
    image_ax.set(title="Image request latency", xlabel="offered image load (images/s)",
                 ylabel="ms (log)", yscale="log")
    rate_ax.set(title="Images finished per second", xlabel="offered image load (images/s)",
                ylabel="images/s")
    probe_ax.set(title=f"Tokenizer-probe added wait\n({result.settings.probe_loops} closed "
                 "image loops)", xlabel="probe loops' image size (px)", ylabel="ms (symlog)")
    probe_ax.set_yscale("symlog", linthresh=0.1)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    machine = result.machine
    settings = result.settings
    fig.suptitle(
        f"python -m bench: {machine.cpus} CPUs, load average {_load(machine.load_avg_start)}, "
        f"text {settings.text_rate:g}/s, images {'/'.join(settings.image_sizes)}"
        f" x{settings.images_per_request} per request"
        + (f", serve args '{' '.join(settings.serve_args)}'" if settings.serve_args else ""),
        fontsize=10,
    )
    fig.savefig(path, dpi=80)
    plt.close(fig)
