"""bench/client_cache/report.py RESULTS.tsv: the markdown table of bench/client_cache/run.

Reads the lines bench.mjs and bench.py print (lang variant round ops/s ops secs, and
"# lang text" settings lines).  Per language: the median ops/s of each variant over
the rounds, and each ratio as the median of the per-round ratios (a round runs the
three variants back to back, so load drift from other work on the machine hits
them alike), with the lowest and highest round in parentheses.
"""

import statistics
import sys
from collections import defaultdict

LANGS = {"node": "Node", "python": "Python"}
VARIANTS = ("cached", "database", "redis")


def fmt_ops(x: float) -> str:
    return f"{x:,.0f}".replace(",", " ")


def fmt_ratio(xs: list) -> str:
    m = statistics.median(xs)
    digits = 0 if m >= 20 else 1
    return f"{m:.{digits}f}x ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> None:
    ops = defaultdict(dict)          # (lang, variant) -> {round: ops/s}
    notes = defaultdict(list)
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("# "):
                lang, _, text = line[2:].partition("\t")
                notes[lang].append(text)
                continue
            if not line.strip():
                continue
            lang, variant, rnd, rate = line.split("\t")[:4]
            ops[(lang, variant)][int(rnd)] = float(rate)

    print("| client | cached replay | database replay | Redis GET "
          "| cached / Redis GET | cached / database |")
    print("|---|---:|---:|---:|---:|---:|")
    for lang, title in LANGS.items():
        if not ops.get((lang, "cached")):
            continue
        rounds = sorted(set.intersection(*(set(ops[(lang, v)]) for v in VARIANTS)))
        med = {v: statistics.median(ops[(lang, v)][r] for r in rounds) for v in VARIANTS}
        c = ops[(lang, "cached")]
        per_redis = [c[r] / ops[(lang, "redis")][r] for r in rounds]
        per_db = [c[r] / ops[(lang, "database")][r] for r in rounds]
        print(f"| {title} | {fmt_ops(med['cached'])} ops/s | {fmt_ops(med['database'])} ops/s "
              f"| {fmt_ops(med['redis'])} ops/s | {fmt_ratio(per_redis)} | {fmt_ratio(per_db)} |")
    print()
    c = ops.get(("python", "cached"), {})
    sync = ops.get(("python", "redis_sync"), {})
    rounds = sorted(set(c) & set(sync))
    if rounds:
        print(f"Python's blocking redis client, for orientation (an ASGI app cannot wait on it "
              f"without stalling its event loop): {fmt_ops(statistics.median(sync[r] for r in rounds))} "
              f"ops/s; cached / it: {fmt_ratio([c[r] / sync[r] for r in rounds])}.")
        print()
    print("Medians over the rounds; each ratio is the median of the per-round ratios, "
          "lowest and highest round in parentheses.")
    print()
    for lang, texts in notes.items():
        for text in texts:
            print(f"- {LANGS.get(lang, lang.capitalize())}: {text}")


if __name__ == "__main__":
    main()
