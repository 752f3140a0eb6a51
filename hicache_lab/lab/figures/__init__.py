"""The figures: how each family is drawn (`plots`), and `python -m hicache_lab figures`, which regenerates
figures/ from live runs (`regenerate`)."""
