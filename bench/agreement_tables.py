"""The tables of bench/agreement_cost.py's results, read back from its CSV with pandas: the benchmark prints them
at the end of its report, and notebook 05 shows them (`sections`: each table with its caption, in order). Every
cell is a median [min-max]: over repeats (part 1) or blocks (parts 2 and 3)."""

from __future__ import annotations

import pandas as pd

HEADER = "the tables of agreement_cost.csv, as notebook 05 shows them:"  # the benchmark prints them under it


def _cell(s: pd.Series, digits: int) -> str:
    """'median [min-max]' of one group."""
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]"


def _spread(frame: pd.DataFrame, index: list[str], column: str, digits: int) -> pd.DataFrame:
    """Median [min-max] of `value` over repeats/blocks, rows `index`, one column per `column` value."""
    stats = frame.groupby([*index, column])["value"].agg(["median", "min", "max"])
    return stats.apply(_cell, axis=1, digits=digits).unstack(column).fillna("")


def _stage(rank: int, pp: int) -> str:
    """A stage's name in the tables: stage 0, the last stage, or stage N between."""
    return "stage 0" if rank == 0 else ("last stage" if rank == pp - 1 else f"stage {rank}")


def part1_table(results: pd.DataFrame) -> pd.DataFrame:
    """Mean scheduler step (ms) per stage and the mean of the stages, median [min-max] over repeats."""
    steps = results[(results.part == "step_time") & (results.metric == "mean_step_ms_common")].copy()
    mean = steps.groupby(["variant", "repeat"], as_index=False)["value"].mean().assign(rank=-1)
    frame = pd.concat([steps, mean])
    frame["stage"] = [("mean of stages" if r < 0 else _stage(r, steps["rank"].max() + 1)) for r in frame["rank"]]
    table = _spread(frame, ["variant"], "stage", 2)
    modes = [m for m in ("sync=off", "sync=legacy", "sync=fixed") if m in table.index]
    stages = sorted(set(frame["stage"]) - {"mean of stages"}, key=lambda s: s == "last stage")
    table = table.loc[modes, [*stages, "mean of stages"]]
    by_repeat = mean.pivot(index="repeat", columns="variant", values="value")
    for other in ("sync=legacy", "sync=off"):
        if {"sync=fixed", other} <= set(by_repeat.columns):
            ratios = by_repeat["sync=fixed"] / by_repeat[other]
            table.loc["sync=fixed", f"fixed/{other[5:]}, per repeat"] = ", ".join(f"{r:.2f}" for r in ratios)
    table.index = [v.replace("sync=", "--sync ") for v in table.index]
    return table.fillna("")


def pipeline_tables(results: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Part 2: (pipeline step ms and its excess over none, per scenario; each stage's us in the agreement)."""
    pipe = results[results.part == "pipeline"]
    step = pipe[(pipe.metric == "step_ms") & (pipe["rank"] == pipe.pp - 1)]
    none = step[step.variant == "none"].set_index(["pp", "scenario", "repeat"])["value"]
    extra = step.assign(
        value=step["value"].values - none.loc[list(zip(step.pp, step.scenario, step.repeat, strict=True))].values
    )
    table = pd.concat(
        [
            _spread(step, ["pp", "variant"], "scenario", 2).add_suffix(": step (ms)"),
            _spread(extra[extra.variant != "none"], ["pp", "variant"], "scenario", 2).add_suffix(": over none (ms)"),
        ],
        axis=1,
    ).fillna("")
    order = ["none", "relay", "barrier", "all_reduce"]
    table = table.reindex(sorted(table.index, key=lambda k: (k[0], order.index(k[1]))))
    table = table[[c for s in ("equal", "slow_last") for c in table.columns if c.startswith(s)]]
    agree = pipe[(pipe.metric == "agree_us_per_step") & (pipe.scenario == "equal") & (pipe.variant != "none")]
    stages = _spread(agree.assign(rank=agree["rank"].map(lambda r: f"stage {r}")), ["pp", "variant"], "rank", 0)
    stages = stages.reindex(sorted(stages.index, key=lambda k: (k[0], order.index(k[1])))).fillna("")
    return table, stages


def part3_table(results: pd.DataFrame) -> pd.DataFrame:
    """Part 3, rank 0: one 2-element all-reduce against two 1-element ones (us per step), and their ratio."""
    attn = results[(results.part == "attn_agreement") & (results["rank"] == 0)]
    table = _spread(attn, ["pp"], "variant", 0)
    medians = attn.groupby(["pp", "variant"])["value"].median().unstack("variant")
    table["two/one"] = (medians["separate_2x1"] / medians["combined_1x2"]).map("{:.2f}".format)
    return table.rename(columns={"combined_1x2": "one 2-element (us)", "separate_2x1": "two 1-element (us)"})


PART1_SKIPPED = (
    "Part 1 is not in these results: skipped (--skip-step-time), as it runs the lab's scheduler 3 modes x 4 "
    "repeats,\nabout 3 minutes on 2 cores. The figure draws only what was measured."
)


def sections(results: pd.DataFrame) -> list[tuple[str, pd.DataFrame | None]]:
    """(caption, table) for each part the results hold, in order; for a missing part 1, its caption alone (None)
    says why it is not there."""
    found: list[tuple[str, pd.DataFrame | None]] = []
    if (results.part == "step_time").any():
        found.append(
            ("Part 1, the lab's scheduler: mean step time (ms), median [min-max] over repeats", part1_table(results))
        )
    else:
        found.append((PART1_SKIPPED, None))
    if (results.part == "pipeline").any():
        table, stages = pipeline_tables(results)
        caption = (
            "Part 2, the modelled pipeline: the last stage's step time (ms), median [min-max] over blocks;\n"
            "'over none': the variant's step minus none's in the same block"
        )
        found.append((caption, table))
        found.append(
            ("Part 2, equal stages: each stage's time in the agreement (us per step), median [min-max]", stages)
        )
    if (results.part == "attn_agreement").any():
        found.append(("Part 3, attention group of 2, rank 0: us per step, median [min-max]", part3_table(results)))
    return found


def print_tables(results: pd.DataFrame) -> None:
    """Every section as plain text (the benchmark's report)."""
    for caption, table in sections(results):
        print(caption)
        if table is not None:
            print(table.to_string())
