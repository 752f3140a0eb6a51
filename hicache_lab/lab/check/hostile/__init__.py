"""Hostile input: what an adversarial user runs and what the lab must answer. The judge (`judge`), what the
cases share (`common`), one file per class (`c01_foreign_model` ... `c10_preflight`, judge.CLASSES names them),
every case gathered (`cases`), and `soak --hostile` (`command`)."""
