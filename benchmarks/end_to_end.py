"""``python benchmarks/end_to_end.py ...`` = ``burstc bench ...``: the benchmark ships in the package
(:mod:`burstc.bench.end_to_end`) so that it runs from an installed burstc; this script is kept for the commands
quoted in the README and the results."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from burstc.bench.end_to_end import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
