"""``python -m prunekit ...``: the ``prunekit`` command without its console script (e.g. from a source tree with
``PYTHONPATH=src`` on a machine where the package is not installed). ``python -m prunekit.cli`` would run ``cli.py``
as ``__main__`` beside the ``prunekit.cli`` module its sub-command modules import, a circular import."""

from prunekit.cli import main

main()
