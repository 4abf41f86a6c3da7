#!/usr/bin/env python3
"""Refreshes the committed seed inputs of one fuzz target from its grown corpus.

    python3 fuzz/pick_seeds.py TARGET [--max 100]

The corpus a fuzz run grows (fuzz/corpus/TARGET, ignored by git) holds thousands of inputs; the
repository keeps at most --max of them in fuzz/seeds/TARGET, the ones that cover the most of what
the whole corpus covers. The target's libFuzzer binary replays fuzz/seeds/TARGET and
fuzz/corpus/TARGET once in merge mode (-merge_control_file), which records the coverage features
of every input; then, greedily, the input adding the most coverage not yet covered is kept
(first new edges, then new features; ties: the smaller one), until --max inputs are kept or nothing adds coverage. Inputs named
`seed_*` (hand-made or generated seeds, e.g. e2e/kv_events/make_fixtures.py's) are always kept and
counted first. Kept inputs are named by the SHA-1 of their bytes, as libFuzzer names them.

Prints how much of the corpus's coverage (features and edges) the kept seeds reach. Builds the
target first (cargo fuzz build, RUSTC_BOOTSTRAP=1, as fuzz/run.sh does).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
REPO = FUZZ.parent


def host_triple() -> str:
    out = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True).stdout
    return next(l.split(": ", 1)[1] for l in out.splitlines() if l.startswith("host: "))


def coverage(binary: Path, dirs: list[Path]) -> tuple[list[Path], dict[int, set[int]], dict[int, set[int]]]:
    """Runs the merge pass; returns the inputs and, per input index, its features and edges."""
    with tempfile.TemporaryDirectory() as tmp:
        control = Path(tmp) / "control"
        out = Path(tmp) / "out"
        out.mkdir()
        subprocess.run(
            [str(binary), "-merge=1", f"-merge_control_file={control}", "-max_len=65536",
             "-rss_limit_mb=2048", str(out), *map(str, dirs)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        lines = control.read_text().splitlines()
    n = int(lines[0])
    inputs = [Path(p) for p in lines[2:2 + n]]
    features: dict[int, set[int]] = {}
    edges: dict[int, set[int]] = {}
    for line in lines[2 + n:]:
        kind, _, rest = line.partition(" ")
        idx, _, values = rest.partition(" ")
        if kind == "FT":
            features[int(idx)] = set(map(int, values.split()))
        elif kind == "COV":
            edges[int(idx)] = set(map(int, values.split()))
    return inputs, features, edges


def pick(inputs: list[Path], features: dict[int, set[int]], edges: dict[int, set[int]],
         limit: int) -> list[int]:
    """Greedy maximum coverage: `seed_*` inputs first, then, until `limit`, the input adding the
    most edges not yet covered, then the most features (hit-count buckets of edges), then the
    smaller one."""
    named = [i for i, p in enumerate(inputs) if p.name.startswith("seed_")]
    chosen = list(named)
    got_edges: set[int] = set().union(*(edges.get(i, set()) for i in named))
    got_features: set[int] = set().union(*(features.get(i, set()) for i in named))
    rest = [i for i in range(len(inputs)) if i not in set(named)]
    size = {i: inputs[i].stat().st_size for i in rest}

    def gain(i: int) -> tuple[int, int, int]:
        return (len(edges.get(i, set()) - got_edges),
                len(features.get(i, set()) - got_features), -size[i])

    while len(chosen) < limit and rest:
        best = max(rest, key=gain)
        if gain(best)[:2] == (0, 0):
            break
        chosen.append(best)
        got_edges |= edges.get(best, set())
        got_features |= features.get(best, set())
        rest.remove(best)
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--max", type=int, default=100, help="most seeds kept (default 100)")
    args = ap.parse_args()
    seeds = FUZZ / "seeds" / args.target
    corpus = FUZZ / "corpus" / args.target
    seeds.mkdir(parents=True, exist_ok=True)
    corpus.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RUSTC_BOOTSTRAP": "1"}
    subprocess.run(["cargo", "fuzz", "build", args.target], cwd=REPO, env=env, check=True)
    binary = FUZZ / "target" / host_triple() / "release" / args.target
    inputs, features, edges = coverage(binary, [seeds, corpus])
    chosen = pick(inputs, features, edges, args.max)
    # Read every kept input before touching the seed directory (some come from it).
    kept = {(p.name if p.name.startswith("seed_") else hashlib.sha1(data).hexdigest()): data
            for p, data in ((inputs[i], inputs[i].read_bytes()) for i in chosen)}
    for old in seeds.iterdir():
        if old.name not in kept:
            old.unlink()
    for name, data in kept.items():
        (seeds / name).write_bytes(data)
    all_ft = set().union(*features.values()) if features else set()
    all_cov = set().union(*edges.values()) if edges else set()
    got_ft = set().union(*(features.get(i, set()) for i in chosen))
    got_cov = set().union(*(edges.get(i, set()) for i in chosen))
    print(f"{args.target}: kept {len(kept)} of {len(inputs)} inputs in {seeds.relative_to(REPO)}: "
          f"{len(got_ft)}/{len(all_ft)} features, {len(got_cov)}/{len(all_cov)} edges "
          f"of the corpus")
    return 0


if __name__ == "__main__":
    sys.exit(main())
