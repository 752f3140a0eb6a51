"""Hostile input: what an adversarial user runs and what the lab must answer. The judge (`judge`) and the
cases (`cases`)."""
