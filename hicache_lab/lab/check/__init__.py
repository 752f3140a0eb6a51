"""What shows the lab is right: faults bound into a run (`faults`), every known failure broken and fixed
(`zoo`), random worlds (`soak`), every completion timing of a few copies (`exhaustive`), hostile input
(`hostile/`)."""
