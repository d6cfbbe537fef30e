"""Reports, history and the regression gate over the results store.

Layout (pure modules first; only `refs`, `plots`, `write` and `commands` touch files or matplotlib):
  metrics.py   what a Result measured, whatever its kind (latency stats, throughput, memory, ...)
  history.py   `accelab history` rows, CSV / JSON export
  regress.py   the regression rule: baseline vs candidate, like with like (no I/O)
  regress_metrics.py  what the gate checks for each kind of run, and the noise of each figure
  pairing.py   like with like: which baseline run meets which candidate run, on which machines
  series.py    plot-ready series: latency CDFs, batch curves, Pareto fronts, load curves, training
  document.py  the report as sections of tables, figures and notes (no HTML, no matplotlib)
  build.py     Results -> a Document: summary, regress, environment, runs; the order of sections
  speedup.py   the speed-up and quality section: each group's reference and the speed-ups over it
  figure_sections.py  the sections that are figures: latency, batch, Pareto, load, training
  plots.py     matplotlib (Agg, no pyplot) figures -> PNG bytes
  render.py    one self-contained HTML file, or markdown with PNGs beside it
  refs.py      REF -> Results: run id (prefix), tag, or a JSON file
  commands.py  `accelab history`, `accelab report`, `accelab regress`
"""
