"""What shows the lab is right: faults bound into a run (`faults`), every known failure broken and fixed (`zoo`,
its entries in `zoo_entries`, what each run showed in `zoo_symptoms`), random worlds (`soak`, what it does to a
running case in `soak_signals`, its results folder in `soak_results`), every completion timing of a few copies
(`exhaustive`), the lab's cache against SGLang's own (`compare`, its command in `compare_cli`, deliberate changes
it must catch in `mutants`), SGLang's releases over a set of worlds (`releases`), and `soak --hostile`
(`soak_hostile`), which runs the hostile-input suite of a source checkout (tests/hostile/)."""
