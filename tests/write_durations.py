"""Write tests/durations.json from the lines a serial run appended (`make test-durations`).

Each line is ``[nodeid, seconds]`` of one phase (setup, call, teardown); a test's seconds are their sum. Tests under
half a second are left out (the suite counts them 0.1 s). The file only orders the work of a parallel run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(lines_path: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for line in Path(lines_path).read_text(encoding="utf-8").splitlines():
        nodeid, duration = json.loads(line)
        seconds[nodeid] += duration
    kept = {nodeid: round(s, 1) for nodeid, s in sorted(seconds.items()) if s >= 0.5}
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{out}: {len(kept)} tests, {sum(kept.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
