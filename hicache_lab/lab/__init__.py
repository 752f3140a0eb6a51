"""Lab tooling: what exists to teach or to test (the tour, exercises, bug zoo, soak, exhaustive check, figures,
plots, SGLang side by side, presets). Only `hicache_lab.__main__` imports it; nothing in the core does."""
