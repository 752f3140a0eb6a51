"""One rank's radix tree, root at the top: one box per node in the colour of its tiers, with its first tokens,
its length and its lock (`tree_drawing` takes a snapshot, `draw_tree` draws one, `plot_tree` sizes a figure;
`tree_caption`, the caption line of a tree of one rank in this process)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ...config import CacheConfig
from ...provenance import machine
from .style import BOTH_TIERS_COLOR, TIER_COLORS, add_caption, caption_line, flags_beyond_defaults

NODE_COLORS = {"device": TIER_COLORS["device"], "device+host": BOTH_TIERS_COLOR, "host": TIER_COLORS["host"]}
NODE_LEGEND = {
    "device": "device only (L1): evicting deletes it",
    "device+host": "device + host copy (L1 + L2): evicting keeps the host copy",
    "host": "host only (L2): loaded back before use",
}
TREE_LEAF_WIDTH, TREE_LEVEL_HEIGHT = 2.3, 1.05  # inches per leaf and per level of a tree drawing


@dataclass(frozen=True)
class TreeDrawing:
    """What `draw_tree` draws, taken from a tree at one moment (the tree itself keeps changing): per node its
    position (x in leaves, y = -depth), label, tier state and lock count."""

    nodes: tuple[tuple[float, float, str, str, int], ...]  # x, y, label, state, lock_ref
    edges: tuple[tuple[float, float, float, float], ...]  # parent x, y, child x, y
    leaves: int
    depth: int
    root_x: float


def tree_drawing(tree, first_tokens: int = 3) -> TreeDrawing:
    """The tree as it is now: one box per node with its first tokens, its length, its tier and its lock."""
    positions, leaves = {}, [0]

    def place(node, depth: int) -> float:
        children = sorted(node.children.values(), key=lambda n: n.key)
        if children:
            x = sum(place(c, depth + 1) for c in children) / len(children)
        else:
            x, leaves[0] = leaves[0], leaves[0] + 1
        positions[node.id] = (x, -depth)
        return x

    place(tree.root, 0)
    nodes, edges = [], []
    for node in tree.nodes():
        (x, y), (px, py) = positions[node.id], positions[node.parent.id]
        edges.append((px, py, x, y))
        state = "host" if node.evicted else ("device+host" if node.backuped else "device")
        head = " ".join(map(str, node.key[:first_tokens])) + (" …" if len(node.key) > first_tokens else "")
        label = f"{head}\n{len(node.key)} tokens · {state}"
        label += f"\nlocked (lock_ref {node.lock_ref})" if node.lock_ref else ""
        nodes.append((x, y, label, state, node.lock_ref))
    depth = -min((y for _, y in positions.values()), default=0)
    return TreeDrawing(tuple(nodes), tuple(edges), max(leaves[0], 1), int(depth), positions[tree.root.id][0])


def tree_figsize(drawing: TreeDrawing, legend: bool = True) -> tuple[float, float]:
    """A canvas sized to the tree: TREE_LEAF_WIDTH per leaf, TREE_LEVEL_HEIGHT per level, room for the title
    and the legend."""
    return max(TREE_LEAF_WIDTH * drawing.leaves, 4.2 if legend else 2.5), TREE_LEVEL_HEIGHT * (drawing.depth + 1) + (
        1.9 if legend else 0.8
    )


def draw_tree(ax, tree, title: str = "", legend: bool = True) -> None:
    """The radix tree (or a `tree_drawing` of it), root at the top: one box per node, coloured by tier
    (NODE_COLORS); its first tokens, its length, its tier, and its lock count (a bold edge while locked)."""
    drawing = tree if isinstance(tree, TreeDrawing) else tree_drawing(tree)
    for px, py, x, y in drawing.edges:
        ax.plot([px, x], [py, y], color="0.6", lw=1.2, zorder=1)
    ax.annotate("root", (drawing.root_x, 0), ha="center", va="center", fontsize=10)
    for x, y, label, state, lock_ref in drawing.nodes:
        text = "black" if state == "host" else "white"  # white on orange is hard to read
        box = {"boxstyle": "round,pad=0.35", "fc": NODE_COLORS[state], "ec": "black", "lw": 3 if lock_ref else 0.6}
        ax.annotate(label, (x, y), ha="center", va="center", fontsize=9.5, color=text, bbox=box, zorder=2)
    ax.set_xlim(-0.55, drawing.leaves - 0.45)
    ax.set_ylim(-drawing.depth - 0.5, 0.35)
    ax.set_title(title, fontsize=10.5)
    ax.axis("off")
    if legend:
        ax.legend(handles=tree_legend(), fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, 0), frameon=False)


def tree_legend() -> list[Patch]:
    """The tree drawings' legend: the three tier states and the bold edge of a locked node."""
    handles = [Patch(fc=NODE_COLORS[state], ec="none", label=text) for state, text in NODE_LEGEND.items()]
    return [*handles, Patch(fc="white", ec="black", lw=3, label="bold edge: locked (lock_ref > 0), not evictable")]


def plot_tree(tree, title: str = "", legend: bool = True, *, caption: str):
    """A figure sized to the tree with `draw_tree` in it and the caption line `caption` (`tree_caption`) under it,
    for a notebook to show."""
    drawing = tree if isinstance(tree, TreeDrawing) else tree_drawing(tree)
    fig, ax = plt.subplots(figsize=tree_figsize(drawing, legend))
    draw_tree(ax, drawing, title, legend)
    fig.tight_layout()
    add_caption(fig, caption)
    return fig


def tree_caption(cache: CacheConfig, workload: str) -> str:
    """The caption line of a tree of one rank in this process (teach.tour.OneRank): `workload`, in words."""
    flags = " ".join(flags_beyond_defaults({"cache": dataclasses.asdict(cache)}))
    return caption_line(workload, flags, machine())
