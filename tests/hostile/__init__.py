"""Hostile input: what an adversarial user runs and what the lab must answer. The judge (`judge`), what the
cases share (`common`), one file per class (judge.CLASSES names them): `c01_foreign_model`, `c02_misnamed_pages`,
`c03_damaged_stage`, `c04_hangs`, `c05_orphans`, `c06_mixed_files`, `c07_different_flags`,
`c08_silent_failures`, `c09_blame`, `c10_preflight`, `c11_verdicts`; every case gathered (`cases`), `soak
--hostile` (`command`), and their tests (`test_hostile`, `test_soak_hostile`).

A package of the test tree, not of hicache_lab (it tests the package, which never imports it): pytest imports it
as `hostile` (tests/ has no __init__.py), and `python -m hicache_lab soak --hostile` loads it under that name
from the source checkout it runs in (hicache_lab/lab/check/soak_hostile.py)."""
