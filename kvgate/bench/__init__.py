"""What backs `kvgate bench`: the engine and sampler on their own (engine.py, sampler.py), the
serving path through a running gateway (serve.py with datasets.py, metrics.py, plots.py), and
`make bench`'s side-by-side comparisons (compare.py with procs.py, baseline.py, report.py)."""
