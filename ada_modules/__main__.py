"""``python -m ada_modules`` is the ``ada`` command."""

from ada_modules.cli import main

main()
