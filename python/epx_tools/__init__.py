"""Tools around epx, kept out of the installed package: the Python benchmark (``python -m epx_tools.bench``), its
plots (``python -m epx_tools.plot``, ``python -m epx_tools.bench_plot``) and the CPU reference over numpy arrays
that the tests use as their oracle (``epx_tools.reference``). Importing this package imports nothing else; the
bench and the reference need the compiled epx, the plots only the standard library (and matplotlib to draw PNGs).
Run from a checkout with python/ (and <build>/python for the bench and the reference) on PYTHONPATH.
"""
