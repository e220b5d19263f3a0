"""A small fixed-seed training comparison of the Muon variants (docs/algorithms.md: MuonEq, Muon+,
per-head Newton–Schulz, Turbo-Muon, NAMO, NAMO-D, Dion2) against plain Muon: examples/train_gpt.py (a 3-layer character-level
transformer on its built-in corpus, AdamW for embeddings and norms) for --steps steps with the same
seed, data order and learning rates, each variant only changing the Muon groups' options. Each run
spawns its own muond (CPU backend). Printed: the mean of the last 10 training losses and the
validation loss of each, and the difference from Muon's.

It is evidence that each variant trains through the daemon, not a claim about which is best: one
seed, one small model, untuned learning rates.

    python3 bench/muon_variants_train.py [--binary build/muond] [--steps 300] [--threads 2]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

VARIANTS = {
    "Muon": [],
    "MuonEq (momentum_normalization=row)": ["momentum_normalization=row"],
    "Muon+ (post_normalization=muon_plus)": ["post_normalization=muon_plus"],
    "per-head NS (num_heads=4)": ["num_heads=4"],
    "Turbo-Muon (ns_preconditioner=aol)": ["ns_preconditioner=aol"],
    "NAMO (moment2_method=namo)": ["moment2_method=namo"],
    "NAMO-D (moment2_method=namo_d)": ["moment2_method=namo_d"],
    # Dion2 with the Muon group's lr and decay, its own defaults otherwise (fraction 0.25).
    "Dion2 (optimizer=dion2)": ["optimizer=dion2"],
}


def run(binary, steps, threads, options):
    with tempfile.TemporaryDirectory(prefix="muond-variants-") as tmp:
        out = Path(tmp) / "metrics.json"
        cmd = [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--spawn-daemon", binary,
               "--steps", str(steps), "--no-progress", "--print-every", str(10 * steps), "--sample", "0",
               "--eval-every", "0", "--threads", str(threads), "--metrics-out", str(out)]
        for option in options:
            cmd += ["--muon-option", option]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())["muond"]
    losses = result["losses"]
    return sum(losses[-10:]) / min(10, len(losses)), result["val_loss"], result["mean_step_seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default=str(REPO / "build" / "muond"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", help="comma-separated prefixes of the variants to run (Muon is always run)")
    args = parser.parse_args()
    wanted = [w.strip() for w in args.only.split(",")] if args.only else None
    rows = []
    for name, options in VARIANTS.items():
        if wanted and name != "Muon" and not any(name.startswith(w) for w in wanted):
            continue
        train, val, seconds = run(args.binary, args.steps, args.threads, options)
        rows.append((name, train, val, seconds))
        print(f"{name}: train {train:.4f}, val {val:.4f}, {1000 * seconds:.0f} ms/step", flush=True)
    base_train, base_val = rows[0][1], rows[0][2]
    print(f"\n| variant | train loss (last 10 of {args.steps}) | val loss | val vs Muon | ms/step |")
    print("|---|---|---|---|---|")
    for name, train, val, seconds in rows:
        print(f"| {name} | {train:.4f} | {val:.4f} | {val - base_val:+.4f} | {1000 * seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
