"""Writes conversations_sample.json beside it: the conversation file the lab ships (docs/workloads.md), 16
conversations of 2 to 4 turns under 4 system prompts, so that clients share a prefix from round 0.

    python data/conversations_sample.py

Conversation k under each system prompt has 2 + k % 3 turns, and its answers grow with the turn, so that an
--output-length above 16 gives them different lengths. tests/runs/test_workload_files.py checks that the
committed file is what this writes."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE = Path(__file__).with_suffix(".json")
SYSTEMS = {  # each assistant's system prompt, and what its users ask about
    "cooking": (
        "You are a patient cooking assistant. Answer in short numbered steps, give quantities in grams, and name "
        "any common allergen before anything else.",
        ("a mushroom risotto", "bread without yeast", "a lentil soup", "a lemon tart"),
    ),
    "travel": (
        "You are a travel planner for trains in Europe. Prefer night trains, give times in 24-hour form, and say "
        "when a reservation is required.",
        ("Vienna to Rome", "Paris to Berlin", "Zurich to Prague", "Madrid to Lisbon"),
    ),
    "code": (
        "You are a code reviewer for Python. Point to the line, explain the risk in one sentence, and suggest the "
        "smallest change that removes it.",
        ("a cache without a size limit", "a retry loop without a delay", "a mutable default", "a bare except"),
    ),
    "support": (
        "You are a support agent for a home router. Ask for the model first, never ask for passwords, and end "
        "with one thing the user can check.",
        ("a slow wifi at night", "a router that reboots", "a printer that drops off", "a guest network"),
    ),
}
QUESTIONS = ("How do I start with {}?", "What goes wrong most often with {}?", "Can you make {} simpler?",
             "How long does {} take, honestly?")  # fmt: skip
STEPS = ("Read the whole plan first.", "Prepare what you need.", "Do one change at a time.",
         "Check the result before going on.")  # fmt: skip


def records() -> list[dict]:
    """The sample's records, in ShareGPT's format with a `system` prompt each."""
    made = []
    for name, (system, topics) in SYSTEMS.items():
        for k, topic in enumerate(topics):
            turns = []
            for t in range(2 + k % 3):
                turns.append({"from": "human", "value": QUESTIONS[t].format(topic)})
                steps = " ".join(f"{s + 1}. {STEPS[(k + s) % len(STEPS)]}" for s in range(t + 1))
                turns.append({"from": "gpt", "value": f"For {topic}: {steps}"})
            made.append({"id": f"{name}-{k}", "system": system, "conversations": turns})
    return made


def text() -> str:
    """The file's text: a record a line, so that a diff of it reads as one."""
    return "[\n" + ",\n".join(json.dumps(record) for record in records()) + "\n]\n"


if __name__ == "__main__":
    SAMPLE.write_text(text())
    print(f"wrote {SAMPLE}")
