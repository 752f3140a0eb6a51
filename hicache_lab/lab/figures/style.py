"""What every figure shares: one colour per cache tier, the colours of everything else, the axes of a rate by
round (`rate_by_round`), the caption line (`caption_line`, `runs_caption`: the workload, the configuration and the
machine) and `save_figure`, which puts that line under every figure the lab writes."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterable
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.legend import Legend
from matplotlib.ticker import MaxNLocator

from ...args import FIELD_FLAGS
from ...config import RunConfig

# One colour per tier in every figure: the tier's share of a hit, a run whose deepest tier it is, a tree node
# that lives there. Nothing else is drawn in these three colours; other series take OTHER_COLORS.
TIER_COLORS = {"device": "#4c72b0", "host": "#dd8452", "storage": "#55a868"}
BOTH_TIERS_COLOR = "#8172b3"  # a tree node on the device with a host copy
OTHER_COLORS = ("#333333", "#c44e52", "#937860", "#8c8c8c", "#da8bc3", "#ccb974")
DPI, FORMATS = 120, ("png", "pdf", "svg")  # where savefig.dpi is not set (`figures --dpi` sets it); the suffixes
SEPARATOR, CAPTION_STYLE = "  ·  ", {"fontsize": 7.5, "color": "0.3"}  # between a caption line's parts; its look
UNSHOWN = {"cache.storage_dir", "cache.mooncake_master", "cache.mooncake_metadata_url"}  # one machine's paths
WORKLOAD_FILES = {"trace_file": "Mooncake trace", "conversation_file": "conversations", "requests_file": "requests"}
IN_WORDS = {"num_clients", "num_rounds", "request_length", "sub_question_input_length", "output_length", "seed"}


def rate_by_round(ax, ylabel: str = "", bottom: float = 0) -> None:
    """`ax` as a rate (%) by round: whole rounds on x, `bottom` to 100 on y, a light grid."""
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_ylim(bottom, 100)
    ax.grid(alpha=0.3)


def caption_line(workload: str, configuration: str, machine: str) -> str:
    """A figure's caption line: what ran, with which flags, on what."""
    return SEPARATOR.join((f"workload: {workload}", f"configuration: {configuration}", f"machine: {machine}"))


def runs_caption(summaries: Iterable[dict], machine: str = "") -> str:
    """The caption line of a figure of these runs (their `summary.json`s, or `{"config": dataclasses.asdict(a
    RunConfig)}`): their workload, the flags beyond the defaults that all of them share (what differs between
    them, the figure's legend or titles say) and the machine (each summary's provenance names it)."""
    summaries = list(summaries)  # read twice: a generator would give the machines nothing
    configs = [json.loads(json.dumps(s["config"])) for s in summaries]
    flags = [flags_beyond_defaults({k: v for k, v in c.items() if k != "workload"}) for c in configs]
    shared = " ".join(flag for flag in flags[0] if all(flag in other for other in flags[1:])) or "the defaults"
    machine = machine or " / ".join(dict.fromkeys(s.get("provenance", {}).get("machine", "?") for s in summaries))
    return caption_line(
        " / ".join(dict.fromkeys(map(_workload_words, (c["workload"] for c in configs)))), shared, machine
    )


def _workload_words(w: dict) -> str:
    """A run's workload (its config's `workload` section) in a few words, then the flags of the rest."""
    words = f"{w['num_clients']} clients × {w['num_rounds']} rounds, {w['request_length']}-token openings, "
    words += f"{w['sub_question_input_length']}-token follow-ups, {w['output_length']}-token answers"
    for name, what in WORKLOAD_FILES.items():  # a workload from a file: its name
        words = f"{what} {Path(w.pop(name)).name}" if w.get(name) else words
    more = flags_beyond_defaults({"workload": {k: v for k, v in w.items() if k not in IN_WORDS}})
    return " ".join([f"{words}, seed {w['seed']}", *more])


def flags_beyond_defaults(config: dict) -> list[str]:
    """The `run` flags that give `config` (sections of a RunConfig as `summary.json` holds them) where it differs
    from the defaults, but for one machine's paths; a switch bare, layer counts comma-separated, a list repeated."""
    default, flags = json.loads(json.dumps(dataclasses.asdict(RunConfig()))), []
    for section, values in config.items():
        for name, value in values.items() if isinstance(values, dict) else [("", values)]:
            field = f"{section}.{name}" if name else section
            flag = None if field in UNSHOWN else FIELD_FLAGS.get(field)
            if not flag or value == (default[section].get(name) if name else default[section]):
                continue
            if isinstance(value, list) and all(isinstance(v, int) for v in value):
                value = ",".join(map(str, value))
            shown = [f"{v:g}" if isinstance(v, float) else v for v in (value if isinstance(value, list) else [value])]
            flags += [flag] if isinstance(value, bool) else [f"{flag} {v}" for v in shown]
    return flags


def add_caption(fig, text: str) -> None:
    """`text` under everything `fig` draws, from its left edge, wrapped to its width: a figure written with
    bbox_inches="tight" (`save_figure`; a notebook's inline figures) grows to hold it. The figure's layout is
    done first and then kept, its legends pinned where they are: the grown figure moves nothing."""
    fig.draw_without_rendering()  # lays the figure out: what it draws is where it will be
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    for legend in fig.findobj(Legend):  # else a figure's legend follows its (grown) lower edge
        box = legend.get_window_extent(renderer).transformed(fig.transFigure.inverted())
        legend.set_bbox_to_anchor(box, transform=fig.transFigure)
        legend.set_loc("center")
    box = fig.get_tightbbox(renderer)  # inches
    line = fig.text(0, 0, text, **CAPTION_STYLE)
    width = line.get_window_extent(renderer).width / fig.dpi
    if width > box.width:
        line.set_text(_wrapped(text, max(20, int(len(text) * box.width / width * 0.97))))
    line.set_position((box.x0 / fig.get_figwidth(), (box.y0 - 0.08) / fig.get_figheight()))
    line.set_verticalalignment("top")


def _wrapped(text: str, chars: int) -> str:
    """`text` in lines of at most `chars` characters, broken between its parts (SEPARATOR) where they fit."""
    lines = []
    for part in text.split(SEPARATOR):
        if lines and len(lines[-1]) + len(SEPARATOR) + len(part) <= chars:
            lines[-1] += SEPARATOR + part
        else:
            lines += textwrap.wrap(part, chars)
    return "\n".join(lines)


def save_figure(fig, path: Path, text: str, layout: bool = True) -> None:
    """Lay `fig` out (tight; `layout=False` where the figure laid itself out), put the caption line `text` under
    it, write it to `path` (its folder made if missing; the suffix picks the format) at matplotlib's savefig.dpi
    where set, else DPI, and close it. Fonts are embedded as TrueType (Type 42): what publishers ask of a PDF."""
    if layout:
        fig.tight_layout()
    add_caption(fig, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    dpi = plt.rcParams["savefig.dpi"]
    with plt.rc_context({"pdf.fonttype": 42, "ps.fonttype": 42}):
        fig.savefig(path, dpi=DPI if dpi == "figure" else dpi, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
