"""``python -m prunekit.spdnn``: the ``prunekit spdnn`` commands (the entry point torchrun starts per rank)."""

import prunekit.cli  # noqa: F401  (mounts the sub-apps; importing cli_spdnn first would be circular)
from prunekit.cli_spdnn import app

if __name__ == "__main__":
    app(prog_name="prunekit spdnn")
