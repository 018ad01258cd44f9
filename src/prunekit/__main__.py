"""``python -m prunekit ...``: the ``prunekit`` command without its console script (e.g. from a source tree with
``PYTHONPATH=src`` on a machine where the package is not installed). ``python -m prunekit.cli`` works too: run as
``__main__``, cli.py hands the call over to the ``prunekit.cli`` module."""

from prunekit.cli import main

main()
