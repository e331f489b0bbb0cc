"""CPU time of ``ada --help`` and ``ada --version``, and of what they cost before they were lazy.

"before" builds the full LightningCLI parser (imports torch, Lightning and every registered
package), which is what ``ada --help`` did until the top-level help stopped importing Lightning;
``ada fit --help`` still does it. Each figure is the median child-process CPU time (user + sys)
of ``--repeats`` fresh interpreters, measured in this one run.

    python bench/cli_startup.py            # 5 repeats
    python bench/cli_startup.py --quick    # 1 repeat
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

CASES = {
    "ada --help": "from ada_modules.cli import main; main(['--help'])",
    "ada --version": "from ada_modules.cli import main; main(['--version'])",
    "before: full parser --help": (
        "import contextlib, importlib, io\n"
        "from ada_modules import cli\n"
        "for package in cli._REGISTERED_PACKAGES: importlib.import_module(package)\n"
        "from ada_modules.ada_cli import AdaCLI\n"
        "with contextlib.suppress(SystemExit):\n"
        "    AdaCLI(subclass_mode_model=True, subclass_mode_data=True, args=['--help'])\n"
    ),
}


def child_cpu_seconds(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--out", type=Path, default=None, help="also write cli_startup.json here")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    results = {
        name: statistics.median(child_cpu_seconds(code) for _ in range(repeats))
        for name, code in CASES.items()
    }
    print(f"| command | CPU s (median of {repeats}) |\n|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.2f} |")
    before = results["before: full parser --help"]
    print(f"\n`ada --help` uses {before / results['ada --help']:.0f}x less CPU than before.")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cli_startup.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
