#!/usr/bin/python3
"""bench/perf_attr.py PERF_DATA [FRAME ...]: where a backend's CPU time goes.

Reads `perf script` of a `perf record -g` of PostgreSQL backends and prints
  - the top self-time symbols;
  - for each FRAME (default: the extension's entry points), the share of all
    samples with FRAME on the stack and how that splits over FRAME's direct
    callees (the frame right below it), so "idem_claim 27%: probe 21%,
    fingerprint 3%, ..." reads straight off.
Used by bench/profile."""
import collections
import subprocess
import sys

DEFAULT_FRAMES = ["idem_claim", "idem_finish", "claim_once", "idem_store_probe",
                  "idem_store_begin", "idem_sweep_batch_run", "sweep_chunk",
                  "ExecMakeTableFunctionResult", "standard_ExecutorStart",
                  "standard_ExecutorRun", "ExecInitFunctionScan", "CommitTransaction"]


def stacks(path):
    out = subprocess.run(["perf", "script", "-i", path, "-F", "ip,sym"],
                         capture_output=True, text=True).stdout
    for block in out.split("\n\n"):
        syms = []
        for line in block.strip().split("\n"):
            parts = line.strip().split(None, 1)
            if parts:
                syms.append(parts[1] if len(parts) > 1 else "[unknown]")
        if syms:
            yield syms          # leaf first


def main():
    path = sys.argv[1]
    frames = sys.argv[2:] or DEFAULT_FRAMES
    all_stacks = list(stacks(path))
    total = len(all_stacks)
    if not total:
        print("no samples")
        return
    self_time = collections.Counter(s[0] for s in all_stacks)
    print("samples: %d" % total)
    print("top self time:")
    for sym, n in self_time.most_common(20):
        print("  %5.1f%%  %s" % (100.0 * n / total, sym))
    for frame in frames:
        on = 0
        callees = collections.Counter()
        for s in all_stacks:
            for i, sym in enumerate(s):
                if sym == frame or sym.startswith(frame + "+"):
                    on += 1
                    callees[s[i - 1] if i > 0 else "(self)"] += 1
                    break
        if not on:
            continue
        print("%s: %.1f%% of samples; its direct callees:" % (frame, 100.0 * on / total))
        for sym, n in callees.most_common(10):
            if 100.0 * n / total >= 0.2:
                print("  %5.1f%%  %s" % (100.0 * n / total, sym))


if __name__ == "__main__":
    main()
